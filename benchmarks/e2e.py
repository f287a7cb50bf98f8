"""End to end: open-loop load over berth's API against offline batching.

    python benchmarks/e2e.py                      # start a stack, run, print
    python benchmarks/e2e.py --out benchmarks/results/e2e_cpu.json

Phases, in one run:

1. offline: the ceiling a user gets with no server at all. The same texts
   the served phase sends, encoded in this process by sentence-transformers
   (``encode``, batched, sorted by length as it does) on the same model.
2. served: `berth serve` on loopback (or --address), driven open-loop:
   single-text Embed calls arrive as a Poisson process at each rate step,
   whatever the answers do, from --clients processes (each a Poisson
   stream of rate/clients). Latency is counted from the scheduled send
   time, so a late client cannot hide queueing (no coordinated omission).
   Every served text is distinct, so the response cache never helps here.
3. cache: texts already served are sent again at one rate: every call is
   a hit that never reaches the batcher; its latency is the hit path.

Rates are given as fractions of the offline throughput (--rates) or in
requests per second (--rps). Each step is bounded by --duration seconds
and --max-requests calls. Texts are a realistic mix: mostly short
assistant-style queries, a long tail of paragraphs (lognormal lengths).

The offline baseline is measured in the run (phase 1) unless
--offline-throughput gives one. A given baseline is labelled as given
wherever it appears: in the JSON ("offline": {"source": "given", ...},
"baseline_given": true, "baseline_note", each profile's
"served_over_offline_against") and on every printed line that quotes it
or a ratio against it ("served/given baseline = ...").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# Short queries: the test suite's utterances, plus slots to vary them.
SLOTS = ["please", "now", "for me", "tomorrow", "tonight", "again", "quickly"]
# Long-tail paragraphs are drawn from these sentences.
PROSE = [
    "The quarterly report shows revenue growing faster than operating costs.",
    "Our support team answers most tickets within four business hours.",
    "Customers on the annual plan can export their data at any time.",
    "The new warehouse in Rotterdam doubles our storage for spare parts.",
    "Please restart the router before calling the help desk again.",
    "Battery life dropped sharply after the latest firmware update.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Shipping to remote islands can take up to three extra weeks.",
    "Refunds are issued to the original payment method within ten days.",
    "The museum is closed on Mondays except during school holidays.",
    "Engineers traced the outage to an expired certificate on the proxy.",
    "Tenants must give sixty days of notice before moving out.",
    "The trail climbs steeply for two miles before reaching the lake.",
    "Most users never change the default privacy settings.",
    "A cold front will bring heavy rain and strong winds by Thursday.",
    "The committee postponed its vote until the audit is complete.",
    "Interest on the savings account is paid monthly.",
    "The flight was delayed because of fog at the destination airport.",
    "Version 2.3 fixes a memory leak in the image uploader.",
    "Children under twelve travel free when accompanied by an adult.",
    "The contract renews automatically unless cancelled in writing.",
    "Our model answers questions about billing, shipping and returns.",
    "Cook the onions slowly until they turn a deep golden brown.",
    "The library lends laptops to students for up to two weeks.",
]


def make_texts(n: int, seed: int) -> list[str]:
    """n distinct texts: lognormal word counts, median ~11, long tail to ~220."""
    from tests.texts import UTTERANCES

    rng = random.Random(seed)
    texts = []
    for i in range(n):
        words = min(220, max(2, round(rng.lognormvariate(math.log(11), 0.9))))
        if words <= 14:
            text = f"{rng.choice(UTTERANCES)} {rng.choice(SLOTS)}"
        else:
            parts: list[str] = []
            while len(parts) < words:
                parts.extend(rng.choice(PROSE).split())
            text = " ".join(parts[:words])
        texts.append(f"{text} {i}")  # a number makes every text distinct
    return texts


def token_lengths(texts: list[str], tokenizer_file: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return np.array([len(e.ids) for e in tokenizer.encode_batch(texts)])


# ---- offline ----------------------------------------------------------------

GIVEN_NOTE = (
    "given on the command line (--offline-throughput), not measured in this run"
)
MEASURED_NOTE = "measured in this run, before any server started"


def baseline(
    given: float | None, checkpoint: Path, texts: list[str], batch_size: int
) -> dict[str, Any]:
    """Phase 1: the offline baseline, measured here on ``texts`` unless one
    is given (--offline-throughput), which is then labelled as given."""
    if given is not None:
        return {
            "source": "given",
            "given": True,
            "throughput": given,
            "note": GIVEN_NOTE,
        }
    return offline(checkpoint, texts, batch_size)


def baseline_label(base: dict[str, Any]) -> str:
    """Which baseline this is, for every line that quotes it or a ratio."""
    if base.get("given"):
        return f"a GIVEN baseline of {base['throughput']:.1f} texts/s, {GIVEN_NOTE}"
    return (
        f"the baseline measured in this run, {base['throughput']:.1f} texts/s "
        f"({base['implementation']}, batch {base['batch_size']}, "
        f"{base['texts']} of the same texts)"
    )


def ratio_name(base: dict[str, Any]) -> str:
    return "served/given baseline" if base.get("given") else "served/offline"


def offline(checkpoint: Path, texts: list[str], batch_size: int) -> dict[str, Any]:
    """sentence-transformers on the same texts, in process: texts per second.

    On a GPU the model runs in fp16, as berth's GPU engine does. Where
    sentence-transformers cannot be imported (the GPU machine has no scipy or
    scikit-learn, which it imports), the same procedure is run with
    transformers directly: sort by length, batch, pad to the longest, mean-
    pool, normalize, copy to the host; the result says which ran.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        encode = _transformers_encoder(checkpoint, device, batch_size)
        implementation = f"transformers, as sentence-transformers does ({exc})"
    else:
        model = SentenceTransformer(str(checkpoint), device=device)
        if device == "cuda":
            model.half()
        model.max_seq_length = 512  # as berth serves; no text here comes near it

        def encode(batch: list[str]) -> None:
            model.encode(batch, batch_size=batch_size, convert_to_numpy=True)

        implementation = "sentence-transformers"
    if device == "cpu":
        encode(texts[:256])  # warm up
    else:  # every batch shape once
        encode(texts[: batch_size * 16])
        torch.cuda.synchronize()
    start = time.perf_counter()
    encode(texts)
    seconds = time.perf_counter() - start
    return {
        "source": "measured",
        "given": False,
        "note": MEASURED_NOTE,
        "implementation": implementation,
        "device": device,
        "dtype": "float16" if device == "cuda" else "float32",
        "texts": len(texts),
        "seconds": round(seconds, 3),
        "throughput": round(len(texts) / seconds, 1),
        "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(),
    }


def _transformers_encoder(checkpoint: Path, device: str, batch_size: int) -> Any:
    import torch
    import transformers

    dtype = torch.float16 if device == "cuda" else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers.AutoModel.from_pretrained(
        str(checkpoint), dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()

    @torch.inference_mode()
    def encode(texts: list[str]) -> np.ndarray:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out: list[np.ndarray] = []
        for start in range(0, len(order), batch_size):
            batch = [texts[i] for i in order[start : start + batch_size]]
            inputs = tokenizer(
                batch,
                padding=True,
                truncation=True,
                max_length=512,
                return_tensors="pt",
            ).to(device)
            hidden = model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            out.append(pooled.cpu().numpy())
        return np.concatenate(out)

    return encode


# ---- the load generator -----------------------------------------------------


@dataclass
class Plan:
    """One client process's share of a step: what to send and when."""

    address: str
    model: str
    texts: list[str]
    offsets: list[float]  # seconds after the common start
    deadline_s: float
    # Send every text once before the start, unmeasured: each gateway process
    # has its own cache, and this client's one channel reaches one of them.
    warm: bool = False
    connections: int = 1
    api: str = "unary"  # "unary": an Embed call each; "stream": berth's Stream
    # The gateways' own addresses (`berth serve --gateway-own-port`), when
    # the connections are spread over them instead of going to ``address``.
    spread: list[str] = field(default_factory=list)
    client: int = 0  # this client's index among the step's clients


def connection_targets(plan: Plan) -> list[str]:
    """Where each of a client's connections goes: all to ``address`` (the
    gateways' shared port, where the kernel hashes each connection to one
    of them), or spread over the gateways' own addresses in turn, client
    after client, as a caller that balances its own connections does (30
    connections over 8 gateways: 3 or 4 each, where the hash gave one
    gateway up to ~1.9x its share)."""
    if not plan.spread:
        return [plan.address] * plan.connections
    first = plan.client * plan.connections
    return [
        plan.spread[(first + j) % len(plan.spread)] for j in range(plan.connections)
    ]


Row = tuple[float, float, float, str]  # offset, latency, send lag, status
# The first message the server gave with each error code.
Examples = dict[str, str]


def client_main(plan: Plan, ready: Any, go: Any, start_at: Any, results: Any) -> None:
    """A client process: one event loop, its channels, open-loop sends.

    It moves messages as berth's services do (`berth serve`'s defaults):
    on uvloop, with gRPC's pollers doing the I/O (a GRPC_EXPERIMENTS or
    BERTH_EVENT_LOOP=asyncio set where e2e.py runs wins). On one machine
    the load generator's CPU is taken from the stack it measures."""
    from services.cli import GRPC_IO
    from services.loop import run

    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_IO["poller"])
    results.put(run(_client(plan, ready, go, start_at)))


async def _client(
    plan: Plan, ready: Any, go: Any, start_at: Any
) -> tuple[list[Row], float, Examples]:
    import grpc

    from services.channels import channel_options
    from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc

    out: list[Row] = []
    examples: Examples = {}
    # Several connections, used in turn: `berth serve --gateways N` runs N
    # processes on one port and the kernel spreads connections, not calls.
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(target, options=options)
        for target in connection_targets(plan)
    ]
    stubs = [berth_pb2_grpc.BerthStub(ch) for ch in channels]
    turn = itertools.cycle(stubs)
    async with contextlib.AsyncExitStack() as stack:
        for ch in channels:
            await stack.enter_async_context(ch)
            await ch.channel_ready()
        stub = stubs[0]
        if plan.warm:
            limit = asyncio.Semaphore(64)

            async def warm(text: str) -> None:
                async with limit:
                    await stub.Embed(
                        berth_pb2.EmbedRequest(model=plan.model, texts=[text]),
                        timeout=plan.deadline_s,
                    )

            await asyncio.gather(*(warm(text) for text in plan.texts))
        ready.put(os.getpid())
        go.wait()  # every client connected: the parent set start_at
        t0 = start_at.value
        cpu0 = time.process_time()

        async def one(text: str, due: float) -> None:
            sent = time.monotonic()
            code = "OK"
            try:
                await next(turn).Embed(
                    berth_pb2.EmbedRequest(model=plan.model, texts=[text]),
                    timeout=plan.deadline_s,
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                examples.setdefault(code, exc.details() or "")
            out.append((due - t0, time.monotonic() - due, sent - due, code))

        if plan.api == "stream":
            await _stream_load(plan, stubs, t0, out, examples)
        else:
            tasks = []
            for text, offset in zip(plan.texts, plan.offsets, strict=True):
                due = t0 + offset
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(text, due)))
            await asyncio.gather(*tasks)
        cpu = time.process_time() - cpu0
    return out, cpu, examples


async def _stream_load(
    plan: Plan, stubs: list[Any], t0: float, out: list[Row], examples: Examples
) -> None:
    """The same arrivals as single-text requests on berth's bidi Stream: one
    stream per connection, each request written at its time, answers matched
    by request_id as they come (out of order).

    Each stream has a writer task of its own: a gRPC stream takes one write
    at a time, and a write waits for its completion, so one sender awaiting
    each write in turn held every connection's requests behind the slowest
    write, and its lag counted as the server's latency."""
    from services.proto.berth.v1 import berth_pb2

    timeout = plan.offsets[-1] + plan.deadline_s + 30 if plan.offsets else None
    calls = [stub.Stream(timeout=timeout) for stub in stubs]
    sent_at: dict[int, tuple[float, float]] = {}  # request_id -> (due, sent)
    Outgoing = tuple[int, float, Any] | None  # (request_id, due, request)

    async def read(call: Any) -> None:
        async for response in call:
            if response.WhichOneof("response") == "embed":
                request_id, code = response.embed.request_id, "OK"
            else:
                request_id, code = response.error.request_id, response.error.code
                examples.setdefault(code, response.error.message)
            due, sent = sent_at.pop(request_id)
            out.append((due - t0, time.monotonic() - due, sent - due, code))

    async def write(call: Any, outbox: asyncio.Queue[Outgoing]) -> None:
        while (item := await outbox.get()) is not None:
            request_id, due, request = item
            sent_at[request_id] = (due, time.monotonic())
            await call.write(request)
        await call.done_writing()

    outboxes: list[asyncio.Queue[Outgoing]] = [asyncio.Queue() for _ in calls]
    readers = [asyncio.create_task(read(call)) for call in calls]
    writers = [
        asyncio.create_task(write(call, outbox))
        for call, outbox in zip(calls, outboxes, strict=True)
    ]
    turn = itertools.cycle(outboxes)
    for request_id, (text, offset) in enumerate(
        zip(plan.texts, plan.offsets, strict=True), start=1
    ):
        due = t0 + offset
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        request = berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(
                model=plan.model, texts=[text], request_id=request_id
            )
        )
        # (Sent when its writer takes it; until then, from its due time: a
        # request the stream ends before is still counted, LOST.)
        sent_at[request_id] = (due, due)
        next(turn).put_nowait((request_id, due, request))
    for outbox in outboxes:
        outbox.put_nowait(None)
    await asyncio.gather(*writers)
    await asyncio.gather(*readers)
    for due, sent in sent_at.values():  # the stream ended without an answer
        out.append((due - t0, time.monotonic() - due, sent - due, "LOST"))


def server_cpu(supervisor_pid: int | None) -> dict[tuple[str, int], float]:
    """CPU seconds used so far by each child of `berth serve`: (role, pid)."""
    if supervisor_pid is None:
        return {}
    from tests.stack import children

    return {
        (argv[2] if len(argv) > 2 else "?", pid): cpu  # python -m ROLE
        for pid, (argv, cpu) in children(supervisor_pid).items()
    }


def cpu_by_role(
    before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]
) -> dict[str, float]:
    """CPU seconds each role used between two server_cpu readings, and the
    busiest gateway process's own ("gateway_busiest"): gateways share the
    port by the kernel's hash of each connection, so with few connections
    one can be saturated while others idle."""
    out: dict[str, float] = {}
    for (role, pid), seconds in after.items():
        used = seconds - before.get((role, pid), 0.0)
        out[role] = round(out.get(role, 0.0) + used, 2)
        if role == "gateway":
            busiest = max(out.get("gateway_busiest", 0.0), used)
            out["gateway_busiest"] = round(busiest, 2)
    return out


@dataclass
class Step:
    """What one rate step measured."""

    name: str
    rate: float
    sent: int = 0
    ok: int = 0
    shed: int = 0
    errors: int = 0
    throughput: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    send_lag_p99_ms: float = 0.0
    # Latency from the actual send, without the client's lateness.
    p50_from_send_ms: float = 0.0
    p99_from_send_ms: float = 0.0
    error_codes: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    # CPU seconds each role used during the step (engine, batcher, ...).
    cpu_s: dict[str, float] = field(default_factory=dict)
    # What the services' /metrics say about the step (`pipeline()`).
    pipeline: dict[str, Any] = field(default_factory=dict)


# (metric, label filter) summed over every process; each step reports the
# difference between a reading before it and one after.
READINGS = {
    "gpu_s": ("berth_engine_stage_seconds_sum", {"stage": "compute"}),
    "engine_batches": ("berth_engine_stage_seconds_count", {"stage": "compute"}),
    "rows": ("berth_batcher_batch_size_sum", {}),
    "batches": ("berth_batcher_batch_size_count", {}),
    "queue_wait_s": ("berth_batcher_queue_wait_seconds_sum", {}),
    "queued": ("berth_batcher_queue_wait_seconds_count", {}),
    "batch_latency_s": ("berth_batcher_batch_latency_seconds_sum", {}),
    "answered": ("berth_batcher_batch_latency_seconds_count", {}),
    "gateway_inference_s": ("berth_gateway_stage_seconds_sum", {"stage": "inference"}),
    "gateway_total_s": ("berth_gateway_stage_seconds_sum", {"stage": "total"}),
    "gateway_requests": ("berth_gateway_stage_seconds_count", {"stage": "total"}),
}


def read_metrics(urls: list[str]) -> dict[str, dict[str, float]]:
    """READINGS summed over each service's /metrics page, by URL (and per
    bucket for the batchers' rows and batches: "rows@32", "batches@32"); a
    page that could not be read or parsed is left out."""
    import http.client
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    pages: dict[str, dict[str, float]] = {}
    for url in urls:
        out: dict[str, float] = {}
        try:
            with urllib.request.urlopen(url, timeout=5) as page:
                text = page.read().decode()
            families = list(text_string_to_metric_families(text))
        except (OSError, ValueError, http.client.HTTPException):
            continue
        for family in families:
            for sample in family.samples:
                for key, (name, labels) in READINGS.items():
                    if sample.name != name or any(
                        sample.labels.get(k) != v for k, v in labels.items()
                    ):
                        continue
                    out[key] = out.get(key, 0.0) + sample.value
                    bucket = sample.labels.get("bucket")
                    if bucket and key in ("rows", "batches"):
                        out[f"{key}@{bucket}"] = (
                            out.get(f"{key}@{bucket}", 0.0) + sample.value
                        )
        pages[url] = out
    return pages


def pipeline(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    wall_s: float,
) -> dict[str, Any]:
    """What the stack did in one step: batches and their rows (per length
    bucket), the share of the step an engine's device spent computing (the
    engines' event-timed compute stage, averaged over the engines that
    computed), mean queue wait and batch latency.

    Only pages read both times count; a page whose counters went down is a
    process restarted during the step, whose whole reading is the step's."""
    d: dict[str, float] = {}
    engines = 0
    for url, now in after.items():
        if url not in before:
            continue
        engines += "engine_batches" in now
        then = before[url]
        if any(now.get(k, 0.0) < v for k, v in then.items()):
            then = {}
        for k, v in now.items():
            d[k] = d.get(k, 0.0) + v - then.get(k, 0.0)
    if not d.get("batches"):
        return {}

    def mean_ms(total: str, count: str) -> float:
        return round(1000 * d.get(total, 0.0) / d[count], 3) if d.get(count) else 0.0

    buckets = sorted(int(k.split("@")[1]) for k in d if k.startswith("batches@"))
    return {
        "batches": int(d["batches"]),
        "rows_per_batch": round(d["rows"] / d["batches"], 2),
        "gpu_busy": (
            round(d.get("gpu_s", 0.0) / wall_s / max(1, engines), 3)
            if wall_s > 0
            else 0.0
        ),
        "gpu_ms_per_batch": mean_ms("gpu_s", "engine_batches"),
        "queue_wait_ms": mean_ms("queue_wait_s", "queued"),
        "batch_latency_ms": mean_ms("batch_latency_s", "answered"),
        "gateway_inference_ms": mean_ms("gateway_inference_s", "gateway_requests"),
        "gateway_total_ms": mean_ms("gateway_total_s", "gateway_requests"),
        "by_bucket": {
            b: {
                "batches": int(d[f"batches@{b}"]),
                "rows_per_batch": round(d[f"rows@{b}"] / d[f"batches@{b}"], 2),
            }
            for b in buckets
            if d.get(f"batches@{b}")
        },
    }


def run_step(
    name: str,
    address: str,
    model: str,
    texts: list[str],
    rate: float,
    clients: int,
    deadline_s: float,
    seed: int,
    supervisor_pid: int | None,
    warm: bool = False,
    connections: int = 1,
    api: str = "unary",
    spread: list[str] | None = None,
    metrics: list[str] | None = None,
) -> Step:
    """Send texts as Poisson arrivals at rate, split over client processes."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in texts:
        t += rng.expovariate(rate)
        offsets.append(t)
    # Each arrival goes to a random client: each sees a Poisson stream too.
    shares: list[tuple[list[str], list[float]]] = [([], []) for _ in range(clients)]
    for text, offset in zip(texts, offsets, strict=True):
        mine = shares[rng.randrange(clients)]
        mine[0].append(text)
        mine[1].append(offset)
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=client_main,
            args=(
                Plan(
                    address,
                    model,
                    s[0],
                    s[1],
                    deadline_s,
                    warm,
                    connections,
                    api,
                    spread or [],
                    client,
                ),
                ready,
                go,
                start_at,
                results,
            ),
        )
        for client, s in enumerate(shares)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    before = server_cpu(supervisor_pid)
    read_before = read_metrics(metrics or [])
    start_at.value = time.monotonic() + 0.2
    go.set()
    answers = [results.get() for _ in procs]
    after = server_cpu(supervisor_pid)
    read_after = read_metrics(metrics or [])
    for p in procs:
        p.join()
    every = [row for rows, _, _ in answers for row in rows]
    step = summarize(name, rate, every)
    # The step's wall time: from the common start to the last answer (not
    # the clients' exit, nor the readings after).
    wall = max((offset + latency for offset, latency, _, _ in every), default=0.0)
    step.cpu_s = cpu_by_role(before, after)
    step.cpu_s["clients"] = round(sum(cpu for _, cpu, _ in answers), 2)
    step.pipeline = pipeline(read_before, read_after, wall)
    if step.pipeline:
        print(f"  {name}: {json.dumps(step.pipeline)}", flush=True)
    for _, _, examples in answers:
        for code, details in examples.items():
            step.error_examples.setdefault(code, details)
    for code, details in step.error_examples.items():
        print(f"  {name}: {code}: {details}", flush=True)
    return step


def summarize(name: str, rate: float, rows: list[Row]) -> Step:
    step = Step(name=name, rate=round(rate, 1), sent=len(rows))
    ok = np.array([lat for _, lat, _, code in rows if code == "OK"])
    for _, _, _, code in rows:
        if code == "RESOURCE_EXHAUSTED":
            step.shed += 1
        elif code != "OK":
            step.errors += 1
            step.error_codes[code] = step.error_codes.get(code, 0) + 1
    step.ok = len(ok)
    if step.ok:
        # From the first scheduled send to the last answer.
        span = max(off + lat for off, lat, _, _ in rows) - min(r[0] for r in rows)
        step.throughput = round(step.ok / span, 1)
        p50, p90, p99 = np.percentile(ok, [50, 90, 99]) * 1000
        step.p50_ms, step.p90_ms, step.p99_ms = (
            round(float(p50), 2),
            round(float(p90), 2),
            round(float(p99), 2),
        )
    step.send_lag_p99_ms = round(
        float(np.percentile([lag for _, _, lag, _ in rows], 99)) * 1000, 2
    )
    if step.ok:
        sent = [lat - lag for _, lat, lag, code in rows if code == "OK"]
        p50, p99 = np.percentile(sent, [50, 99]) * 1000
        step.p50_from_send_ms, step.p99_from_send_ms = round(p50, 2), round(p99, 2)
    return step


# ---- the run ----------------------------------------------------------------


@dataclass
class Profile:
    """One way to start the stack: engines, length buckets, BERTH_* settings."""

    name: str
    about: str
    engines: int = 0  # 0: `berth serve`'s default (1 per GPU, else 1)
    gateways: int = 0  # 0: `berth serve`'s default
    batchers: int = 0  # 0: `berth serve`'s default
    buckets: list[int] | None = None  # None: the repository's own
    env: dict[str, str] = field(default_factory=dict)
    # Gateways also on ports of their own, the load's connections spread
    # over those (connection_targets) instead of sent to the shared port.
    spread: bool = False
    # More `berth serve` flags, e.g. ["--batcher-mode", "inline"].
    serve_args: list[str] = field(default_factory=list)


PROFILES = {
    "stock": Profile(
        "stock",
        "`berth serve` as shipped (CPU: 1 engine per core, 1 gateway; "
        "GPU: 1 engine per GPU, 5 gateways per 8 cores, 1 batcher per 4 gateways, "
        "hybrid batching)",
    ),
    "spread": Profile(
        "spread",
        "as stock, with each gateway also on a port of its own "
        "(--gateway-own-port) and the load's connections spread evenly over "
        "those, as a caller that balances its connections does",
        spread=True,
    ),
    "hybrid": Profile(
        "hybrid",
        "as spread, with `--batcher-mode hybrid` (the GPU default): through the "
        "batchers, but a request that finds its gateway idle goes straight to "
        "the engines",
        spread=True,
        serve_args=["--batcher-mode", "hybrid"],
    ),
    "service": Profile(
        "service",
        "as spread, with `--batcher-mode service` (the CPU default): every "
        "request through the batchers",
        spread=True,
        serve_args=["--batcher-mode", "service"],
    ),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", help="a running gateway (default: start one)")
    parser.add_argument(
        "--spread-over",
        default="",
        help="with --address: the gateways' own addresses (host:port,...; "
        "`berth serve --gateway-own-port`), to spread the connections over",
    )
    parser.add_argument("--model", default="minilm", help="embedding model to call")
    parser.add_argument(
        "--model-repository",
        default=os.environ.get(
            "BERTH_MODEL_REPOSITORY", str(ROOT / "model_repository")
        ),
    )
    parser.add_argument(
        "--profiles",
        default="stock",
        help=f"stacks to start and measure, of {', '.join(PROFILES)}",
    )
    parser.add_argument(
        "--rates",
        default="0.5,0.75,0.9,1.0,1.1",
        help="rate steps as fractions of the offline throughput",
    )
    parser.add_argument("--rps", help="rate steps in requests/s (overrides --rates)")
    parser.add_argument("--duration", type=float, default=10.0, help="s per step")
    parser.add_argument("--max-requests", type=int, default=2000, help="per step")
    parser.add_argument(
        "--clients",
        type=int,
        default=0,
        help="client processes (0: 1 per 2500 rps, at most 1 per 4 cores)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=4,
        help="connections per client process, used in turn (the cache step: 1)",
    )
    parser.add_argument(
        "--api",
        choices=("unary", "stream"),
        default="unary",
        help="single-text Embed calls, or single-text requests on one Stream per "
        "connection (berth's API for high-rate callers)",
    )
    parser.add_argument("--deadline-s", type=float, default=10.0, help="per call")
    parser.add_argument("--batch-size", type=int, default=32, help="offline batch")
    parser.add_argument(
        "--offline-texts",
        type=int,
        default=20000,
        help="texts encoded offline (the first of the served ones)",
    )
    parser.add_argument(
        "--offline-throughput",
        type=float,
        help="skip phase 1 and use this texts/s as the baseline (quick tuning "
        "runs only); the results then say the baseline was given, not measured",
    )
    custom = parser.add_argument_group(
        "a custom profile (measured as 'custom' when any of these is given)"
    )
    custom.add_argument("--engines", type=int, help="engine processes")
    custom.add_argument("--gateways", type=int, help="gateway processes")
    custom.add_argument("--batchers", type=int, help="batcher processes")
    custom.add_argument(
        "--buckets",
        help="length buckets, e.g. 16,32,48,64,512; several sets separated by / "
        "are measured one after another",
    )
    custom.add_argument(
        "--serve-args",
        default="",
        help='more `berth serve` flags, e.g. "--batcher-mode inline --idle-cpus spin"',
    )
    custom.add_argument(
        "--own-ports",
        action="store_true",
        help="connections spread over the gateways' own ports, as the spread profile",
    )
    custom.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="BERTH_X=V",
        help="settings for the stack, e.g. BERTH_MAX_DELAY_MS=2 (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.offline_throughput is not None and args.offline_throughput <= 0:
        parser.error("--offline-throughput must be positive")
    return args


def profiles_of(args: argparse.Namespace) -> list[Profile]:
    if args.address:
        over = (
            f", connections spread over {args.spread_over}" if args.spread_over else ""
        )
        return [Profile("external", f"the gateway at {args.address}{over}")]
    chosen = []
    for name in filter(None, args.profiles.split(",")):
        if name not in PROFILES:
            raise SystemExit(f"unknown profile {name!r}; use {', '.join(PROFILES)}")
        chosen.append(PROFILES[name])
    if (
        args.engines
        or args.gateways
        or args.batchers
        or args.buckets
        or args.env
        or args.own_ports
        or args.serve_args
    ):
        # One custom profile per bucket set ("32,128,512/16,32,64,512": two).
        for buckets in (args.buckets or "").split("/"):
            chosen.append(
                Profile(
                    f"custom {buckets or 'default'}"
                    if "/" in (args.buckets or "")
                    else "custom",
                    "from --engines/--gateways/--batchers/--buckets/--env",
                    engines=args.engines or 0,
                    gateways=args.gateways or 0,
                    batchers=args.batchers or 0,
                    buckets=[int(b) for b in buckets.split(",")] if buckets else None,
                    env=dict(kv.split("=", 1) for kv in args.env),
                    spread=args.own_ports,
                    serve_args=args.serve_args.split(),
                )
            )
    return chosen


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def rebucketed(repository: Path, buckets: list[int], into: Path) -> Path:
    """A copy of the repository with other length buckets, on CPUs and GPUs
    alike (files linked)."""
    from services.repository import load_repository

    for name, entry in load_repository(repository).items():
        source, target = Path(entry.root), into / name
        target.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name != "berth.json":
                (target / path.name).symlink_to(path.resolve())
        entry.checkpoint = str(entry.checkpoint_dir)
        entry.buckets = entry.gpu_buckets = buckets
        (target / "berth.json").write_text(entry.to_json())
    return into


def table(steps: list[Step]) -> str:
    head = (
        f"{'step':<12}{'rate/s':>8}{'sent':>6}{'ok':>6}{'shed':>6}{'err':>5}"
        f"{'tput/s':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'lag99':>8}"
        "  cpu s: engine/batcher/gateway(busiest)/clients"
    )
    lines = [head, "-" * len(head)]
    for s in steps:
        c = s.cpu_s
        cpu = (
            f"{c.get('engine', 0.0):.1f}/{c.get('batcher', 0.0):.1f}/"
            f"{c.get('gateway', 0.0):.1f}({c.get('gateway_busiest', 0.0):.1f})/"
            f"{c.get('clients', 0.0):.1f}"
        )
        lines.append(
            f"{s.name:<12}{s.rate:>8.1f}{s.sent:>6}{s.ok:>6}{s.shed:>6}{s.errors:>5}"
            f"{s.throughput:>8.1f}{s.p50_ms:>9.2f}{s.p90_ms:>9.2f}{s.p99_ms:>9.2f}"
            f"{s.send_lag_p99_ms:>8.2f}  {cpu}"
        )
    return "\n".join(lines)


def serve_and_measure(
    profile: Profile,
    args: argparse.Namespace,
    repository: Path,
    pool: list[str],
    rates: list[float],
) -> list[Step]:
    """Phases 2 and 3 on one stack: the rate steps, then the cache hits."""
    stack = None
    address = args.address
    spread = [a for a in args.spread_over.split(",") if a]
    metrics: list[str] = []
    if address is None:
        from tests.stack import Stack

        served = repository
        if profile.buckets:
            into = Path(tempfile.mkdtemp(prefix="berth-bench-"))
            served = rebucketed(repository, profile.buckets, into)
        import torch

        from services.cli import default_batchers, default_engines, default_gateways

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gateways = profile.gateways or default_gateways(gpus)
        stack = Stack(
            served,
            engines=profile.engines or default_engines(gpus),
            env=profile.env,
            gateways=gateways,
            batchers=profile.batchers or default_batchers(gateways),
            own_ports=profile.spread,
            extra_args=profile.serve_args,
        )
        stack.wait_serving()
        address = stack.gateway
        spread = stack.own_gateways
        metrics = stack.metrics
    pid = stack.proc.pid if stack is not None else None
    steps: list[Step] = []
    try:
        for i, rate in enumerate(rates):
            n = min(args.max_requests, max(1, round(rate * args.duration)))
            texts = pool[i * args.max_requests : i * args.max_requests + n]
            clients = args.clients or max(
                1, min(math.ceil(rate / 2500), (os.cpu_count() or 1) // 4)
            )
            step = run_step(
                f"served {i + 1}",
                address,
                args.model,
                texts,
                rate,
                clients,
                args.deadline_s,
                i,
                pid,
                connections=args.connections,
                api=args.api,
                spread=spread,
                metrics=metrics,
            )
            steps.append(step)
            print(table([step]).splitlines()[-1], flush=True)
        # 3. The cache hit path: step 1's texts, sent once to warm the cache
        # of the gateway process this client reaches, then again at step 1's
        # rate.
        hit = run_step(
            "cache hits",
            address,
            args.model,
            pool[: steps[0].sent],
            rates[0],
            1,
            args.deadline_s,
            99,
            pid,
            warm=True,
            spread=spread,
        )
        steps.append(hit)
        print(table([hit]).splitlines()[-1], flush=True)
    finally:
        if stack is not None:
            stack.stop()
    return steps


def rates_about(args: argparse.Namespace, base: dict[str, Any]) -> str:
    if args.rps:
        return f"rate steps in requests/s (--rps {args.rps})"
    return f"rate steps {args.rates} x the offline throughput: {baseline_label(base)}"


def profile_result(
    profile: Profile, steps: list[Step], base: dict[str, Any]
) -> dict[str, Any]:
    """One profile's steps, its best clean throughput and that over the
    baseline, saying which baseline."""
    clean = [s for s in steps[:-1] if s.ok and (s.shed + s.errors) <= 0.01 * s.sent]
    best = max((s.throughput for s in clean), default=0.0)
    return {
        "profile": asdict(profile),
        "steps": [asdict(s) for s in steps],
        "served_best_throughput": best,
        "served_over_offline": round(best / base["throughput"], 3),
        "served_over_offline_against": baseline_label(base),
    }


def report(base: dict[str, Any], results: dict[str, Any], api: str, rates: str) -> str:
    """The summary printed at the end: the baseline, then each profile's
    table and its ratio, each saying which baseline it is against."""
    lines = [f"\noffline baseline: {baseline_label(base)}", rates]
    for name, result in results.items():
        steps = [Step(**s) for s in result["steps"]]
        hit, first = steps[-1], steps[0]
        profile = result["profile"]
        about = profile["about"] + "".join(
            f" {key}={value}"
            for key in ("engines", "gateways", "batchers", "buckets")
            if (value := profile[key])
        )
        settings = " ".join(f"{k}={v}" for k, v in profile["env"].items())
        lines.append(f"\n== {name}: {about}{' ' + settings if settings else ''}")
        lines.append(table(steps))
        lines.append(
            f"served single-text requests ({api}): "
            f"{result['served_best_throughput']:.1f} "
            f"texts/s (best step with <= 1% shed+errors); {ratio_name(base)} = "
            f"{result['served_over_offline']:.2f}, against {baseline_label(base)}"
        )
        lines.append(
            f"cache hit path at {hit.rate:.0f} req/s: p50 {hit.p50_ms:.2f} ms, "
            f"p99 {hit.p99_ms:.2f} ms (from the actual send: p50 "
            f"{hit.p50_from_send_ms:.2f}, p99 {hit.p99_from_send_ms:.2f}); misses "
            f"at that rate: p50 {first.p50_ms:.2f} ms, p99 {first.p99_ms:.2f} ms"
        )
    return "\n".join(lines)


def document(
    base: dict[str, Any], results: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """The JSON written with --out: ``fields`` (machine, command, ...), the
    baseline and whether it was given, and the profiles' results."""
    return {
        "benchmark": "benchmarks/e2e.py",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **fields,
        "baseline_given": bool(base.get("given")),
        "baseline_note": GIVEN_NOTE if base.get("given") else MEASURED_NOTE,
        "offline": base,
        "profiles": results,
    }


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from services.repository import load_repository

    repository = Path(args.model_repository)
    if not (repository / args.model / "berth.json").exists():
        from services.default_models import build_default_repository

        build_default_repository(repository)
    entry = load_repository(repository)[args.model]
    profiles = profiles_of(args)
    fractions = [float(r) for r in args.rates.split(",")]
    steps_n = len(args.rps.split(",")) if args.rps else len(fractions)
    pool = make_texts(steps_n * args.max_requests, args.seed)
    lengths = token_lengths(pool, entry.tokenizer_file)
    mix = {
        "texts": len(pool),
        "tokens_p50": int(np.percentile(lengths, 50)),
        "tokens_p90": int(np.percentile(lengths, 90)),
        "tokens_p99": int(np.percentile(lengths, 99)),
        "tokens_max": int(lengths.max()),
        "tokens_mean": round(float(lengths.mean()), 1),
    }
    info = machine()
    print(f"machine: {info}", flush=True)
    print(f"text mix: {mix}", flush=True)

    # 1. Offline, before any server runs, so it has the machine to itself.
    base = baseline(
        args.offline_throughput,
        entry.checkpoint_dir,
        pool[: args.offline_texts],
        args.batch_size,
    )
    print(f"offline baseline: {baseline_label(base)}: {base}", flush=True)
    if args.rps:
        rates = [float(r) for r in args.rps.split(",")]
    else:
        rates = [f * base["throughput"] for f in fractions]

    results: dict[str, Any] = {}
    for profile in profiles:
        print(f"\n== {profile.name}: {profile.about}", flush=True)
        steps = serve_and_measure(profile, args, repository, pool, rates)
        key, n = profile.name, 1
        while key in results:  # the same profile twice: each its own entry
            n += 1
            key = f"{profile.name} #{n}"
        results[key] = profile_result(profile, steps, base)

    print(report(base, results, args.api, rates_about(args, base)))
    if args.out:
        out = document(
            base,
            results,
            machine=info,
            command=" ".join(["python", *sys.argv]),
            model=args.model,
            api="berth.v1.Berth/Embed, one text per call"
            if args.api == "unary"
            else "berth.v1.Berth/Stream, one text per request, a stream per "
            f"connection ({args.connections} per client process)",
            rates=rates_about(args, base),
            text_mix=mix,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
