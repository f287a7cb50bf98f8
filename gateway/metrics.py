"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.metrics import LATENCY_BUCKETS, Memo

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
CACHE = Memo(
    Counter(
        "berth_gateway_cache_lookups_total",
        "Response cache lookups per text, by result",
        ["model", "result"],
    )
)
FALLBACKS = Memo(
    Counter(
        "berth_gateway_fallback_texts_total",
        "Texts answered by the CPU fallback, by reason",
        ["model", "reason"],
    )
)
