"""The batcher's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS, RATIO_BUCKETS, Memo

SEQUENCES = Memo(
    Counter(
        "berth_batcher_sequences_total",
        "Sequences answered by the batcher, by outcome",
        ["model", "outcome"],
    )
)
BATCHES = Memo(
    Counter(
        "berth_batcher_batches_total", "Batches sent to engines", ["model", "bucket"]
    )
)
BATCH_SIZE = Memo(
    Histogram(
        "berth_batcher_batch_size",
        "Rows per batch",
        ["model", "bucket"],
        buckets=BATCH_SIZE_BUCKETS,
    )
)
PADDING_RATIO = Memo(
    Histogram(
        "berth_batcher_padded_token_ratio",
        "Real tokens / computed (padded) tokens per batch",
        ["model", "bucket"],
        buckets=RATIO_BUCKETS,
    )
)
QUEUE_WAIT = Memo(
    Histogram(
        "berth_batcher_queue_wait_seconds",
        "Time a sequence waited in its bucket before its batch left",
        ["model", "bucket"],
        buckets=LATENCY_BUCKETS,
    )
)
BATCH_LATENCY = Memo(
    Histogram(
        "berth_batcher_batch_latency_seconds",
        "From sending a batch to its first successful answer",
        ["model", "bucket"],
        buckets=LATENCY_BUCKETS,
    )
)
QUEUE_DEPTH = Memo(
    Gauge("berth_batcher_queue_depth", "Sequences queued, all buckets", ["model"])
)
TARGET_BATCH = Memo(
    Gauge(
        "berth_batcher_target_batch_size",
        "Adaptive target rows per batch",
        ["model", "bucket"],
    )
)
HEDGES = Memo(
    Counter(
        "berth_batcher_hedges_total",
        "Hedged batches: sent to a second engine, and won by it",
        ["model", "event"],
    )
)
RESENDS = Memo(
    Counter(
        "berth_batcher_resends_total",
        "Batches re-sent after their engine failed or was lost",
        ["model"],
    )
)
BREAKER_STATE = Memo(
    Gauge(
        "berth_batcher_breaker_state",
        "Circuit state per model: 0 closed, 1 half-open, 2 open",
        ["model"],
    )
)
ENGINES_HEALTHY = Memo(
    Gauge("berth_batcher_engines_available", "Engines taking batches", ["model"])
)
GPU_UTILIZATION = Memo(
    Gauge(
        "berth_batcher_engine_gpu_utilization_ratio",
        "SM utilization last reported by each engine (0-1)",
        ["engine"],
    )
)
