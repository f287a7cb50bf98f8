"""The batching and fault-tolerance settings: their values and their flags.

Shared by the batcher process and a gateway that batches inline
(``python -m gateway --engines ...``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.config import add_flag


@dataclass
class SchedulerConfig:
    """Batching and fault-tolerance knobs shared by every model of a batcher."""

    token_budget: int = 16384
    max_delay_s: float = 0.005
    capacity: int = 4096
    max_batch: int = 256
    hedge_delay_s: float = 0.050
    hedge_p95: bool = False  # hedge after max(hedge_delay_s, measured p95)
    hedge_ratio: float = 0.1
    batch_timeout_s: float = 30.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    latency_target_s: float = 0.050  # per batch, for the adaptive sizes
    dns_interval_s: float = 5.0  # dns:/// engine names are looked up again


def add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "token-budget", 16384, "max padded tokens per batch")
    add_flag(parser, "max-delay-ms", 5.0, "max wait for a batch to fill")
    add_flag(parser, "queue-capacity", 4096, "max sequences queued per model")
    add_flag(parser, "max-batch", 256, "max rows per batch")
    add_flag(parser, "hedge-delay-ms", 50.0, "send a slow batch to a 2nd engine after")
    add_flag(parser, "hedge-p95", False, "hedge after max(hedge delay, measured p95)")
    add_flag(parser, "hedge-ratio", 0.1, "hedges allowed per batch (token bucket)")
    add_flag(parser, "batch-timeout-s", 30.0, "an engine silent this long has failed")
    add_flag(
        parser, "breaker-failures", 3, "failed batches in a row that open the circuit"
    )
    add_flag(parser, "breaker-cooldown-s", 5.0, "open circuit waits this long to probe")
    add_flag(
        parser, "latency-target-ms", 50.0, "batch latency the adaptive sizes aim at"
    )
    add_flag(
        parser, "dns-interval-s", 5.0, "how often dns:/// engine names are resolved"
    )


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        token_budget=args.token_budget,
        max_delay_s=args.max_delay_ms / 1000,
        capacity=args.queue_capacity,
        max_batch=args.max_batch,
        hedge_delay_s=args.hedge_delay_ms / 1000,
        hedge_p95=args.hedge_p95,
        hedge_ratio=args.hedge_ratio,
        batch_timeout_s=args.batch_timeout_s,
        breaker_failures=args.breaker_failures,
        breaker_cooldown_s=args.breaker_cooldown_s,
        latency_target_s=args.latency_target_ms / 1000,
        dns_interval_s=args.dns_interval_s,
    )
