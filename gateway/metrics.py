"""The gateway's Prometheus metrics and its per-model statistics.

The statistics are what KServe's ModelStatistics reports; calls of every API
count in them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType

from prometheus_client import Counter, Gauge, Histogram

from services.errors import BerthError, InvalidInput, Overloaded, UnknownModel
from services.metrics import LATENCY_BUCKETS, Memo
from services.proto.berth.v1 import berth_pb2

# api: embed, classify, rerank, stream (berth.v1); kserve, kserve_stream (KServe
# v2); http (gateway/http.py)
# outcome: ok, invalid, shed, degraded, failed
REQUESTS = Memo(
    Counter(
        "berth_gateway_requests_total",
        "Requests answered, by model, API and outcome",
        ["model", "api", "outcome"],
    )
)
TEXTS = Memo(Counter("berth_gateway_texts_total", "Texts received", ["model"]))
STAGE_SECONDS = Memo(
    Histogram(
        "berth_gateway_stage_seconds",
        "Per-request time in each stage (tokenize, queue, inference, total)",
        ["model", "stage"],
        buckets=LATENCY_BUCKETS,
    )
)
IN_FLIGHT = Gauge("berth_gateway_requests_in_flight", "Requests being served")
# The gauge reads this count when scraped: a Gauge's inc and dec take its
# lock each (0.5 µs a request on the dev machine); every Tally runs on the
# event loop's thread, so a plain int does.
_in_flight = 0
IN_FLIGHT.set_function(lambda: _in_flight)
CACHE = Memo(
    Counter(
        "berth_gateway_cache_lookups_total",
        "Response cache lookups per text, by result",
        ["model", "result"],
    )
)
# route: batcher; direct (an idle gateway's request, straight to the engines:
# --direct-when-idle); retried (a direct one that failed there and went via
# the batcher, counted as direct too); direct_batcher_down (straight to the
# engines because the batcher was unreachable, or its stream went down with
# the request)
ROUTES = Memo(
    Counter(
        "berth_gateway_routes_total",
        "Requests by the path they took to the engines",
        ["model", "route"],
    )
)
FALLBACKS = Memo(
    Counter(
        "berth_gateway_fallback_texts_total",
        "Texts answered by the CPU fallback, by reason",
        ["model", "reason"],
    )
)

STAGES = ("tokenize", "queue", "inference", "total")


def outcome_of(error: BerthError) -> str:
    """The metrics outcome of a failed request."""
    if isinstance(error, InvalidInput | UnknownModel):
        return "invalid"
    if isinstance(error, Overloaded):
        return "shed"
    return "failed"


class Tally:
    """One request of any API in the request metrics: in flight while the
    block runs, then counted by its outcome: the error that ended it, or,
    once :meth:`answered`, ok or degraded with its stage times. (A request
    cancelled by its caller is not counted.)"""

    def __init__(self, model: str, api: str) -> None:
        self.model, self.api = model, api
        self.timings: berth_pb2.Timings | None = None
        self.degraded = False

    def answered(self, timings: berth_pb2.Timings, degraded: bool) -> None:
        self.timings, self.degraded = timings, degraded

    def __enter__(self) -> Tally:
        global _in_flight
        _in_flight += 1
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        global _in_flight
        _in_flight -= 1
        if isinstance(error, Exception):
            outcome = outcome_of(error) if isinstance(error, BerthError) else "failed"
            count_request(self.model, self.api, outcome)
        elif error is None and self.timings is not None:
            outcome = "degraded" if self.degraded else "ok"
            count_request(self.model, self.api, outcome, self.timings)


def count_request(
    model: str, api: str, outcome: str, timings: berth_pb2.Timings | None = None
) -> None:
    """One finished request of any API (berth's embed, classify, stream;
    KServe's kserve, kserve_stream) by its outcome, and, for one that was
    answered, its stage times (``timings``)."""
    REQUESTS.labels(model, api, outcome).inc()
    if timings is None:
        return
    tokenize, queue, inference, total = _stages(model)
    tokenize.observe(timings.tokenize_us / 1e6)
    queue.observe(timings.queue_us / 1e6)
    inference.observe(timings.inference_us / 1e6)
    total.observe(timings.total_us / 1e6)


# Per model, its STAGE_SECONDS children in STAGES order: looked up as one,
# made at the model's first answered request.
_STAGES: dict[str, tuple[Histogram, ...]] = {}


def _stages(model: str) -> tuple[Histogram, ...]:
    stages = _STAGES.get(model)
    if stages is None:
        stages = _STAGES[model] = tuple(STAGE_SECONDS.labels(model, s) for s in STAGES)
    return stages


@dataclass
class ModelStats:
    """Counts and cumulative durations of one model's inference requests, for
    KServe's ModelStatistics (gateway/kserve.py). Triton's statistics are
    the model's, whatever protocol a request came by, so every API's
    requests belong here: KServe's are recorded by gateway/kserve.py,
    berth's own are to be recorded by Gateway.counted (gateway/service.py).

    A request "executes" when at least one of its texts goes to the batcher;
    one answered wholly from the response cache is a cache hit. As Triton's
    (server docs/protocol/extension_statistics.md): inference and execution
    counts and the compute stages leave cache hits out; success and queue
    count them. Durations are nanoseconds.
    """

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    executions: int = 0
    queue_ns: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    texts: int = 0
    cache_hits: int = 0
    cache_hit_ns: int = 0
    cache_misses: int = 0
    cache_miss_ns: int = 0
    last_ms: int = 0

    def succeeded(
        self, texts: int, timings: berth_pb2.Timings, run_ns: int, output_ns: int
    ) -> None:
        """An answered request: ``run_ns`` until its outputs were computed,
        ``output_ns`` to shape them into the response."""
        total_ns = run_ns + output_ns
        self.success += 1
        self.success_ns += total_ns
        self.last_ms = time.time_ns() // 1_000_000
        if timings.tokenize_us == 0:  # nothing was tokenized: all cached
            self.cache_hits += 1
            self.cache_hit_ns += total_ns
            return
        self.cache_misses += 1
        self.cache_miss_ns += total_ns
        self.executions += 1
        self.texts += texts
        self.output_ns += output_ns
        self.input_ns += timings.tokenize_us * 1000
        self.queue_ns += timings.queue_us * 1000
        self.infer_ns += timings.inference_us * 1000

    def failed(self, ns: int) -> None:
        self.fail += 1
        self.fail_ns += ns
        self.last_ms = time.time_ns() // 1_000_000


# Per model name, shared by every API of this gateway process.
_MODEL_STATS: dict[str, ModelStats] = {}


def model_stats(model: str) -> ModelStats:
    """The statistics of a served model (made at first use)."""
    stats = _MODEL_STATS.get(model)
    if stats is None:
        stats = _MODEL_STATS[model] = ModelStats()
    return stats
