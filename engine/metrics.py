"""The engine's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.metrics import LATENCY_BUCKETS, Memo

BATCHES = Memo(
    Counter(
        "berth_engine_batches_total",
        "Batches by outcome: ok, failed, invalid (refused unrun)",
        ["model", "outcome"],
    )
)
STAGE_SECONDS = Memo(
    Histogram(
        "berth_engine_stage_seconds",
        "Time per batch in each stage (copy_in, compute, copy_out)",
        ["model", "stage"],
        buckets=LATENCY_BUCKETS,
    )
)
GPU_UTILIZATION = Gauge(
    "berth_engine_gpu_utilization_ratio", "GPU SM utilization (NVML), 0-1"
)
GPU_MEMORY_USED = Gauge(
    "berth_engine_gpu_memory_used_bytes", "GPU memory in use (NVML)"
)
