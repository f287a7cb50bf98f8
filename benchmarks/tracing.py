"""End-to-end cost of tracing: 100 % sampling to an OTLP receiver vs none.

Starts `berth serve` twice on loopback (the default models, CPU here): once
with no exporter, once exporting every span to an in-process OTLP/gRPC
receiver, and drives each with the same closed-loop load of unique
single-text Embed calls (the response cache never answers). Runs are
interleaved (off, on, off, on ...) so drift hits both alike.

    python -m benchmarks.tracing [--requests 2000] [--concurrency 16] [--rounds 2]

Prints a table and, last, one JSON line with the throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

from tests.chaos.load import run_load
from tests.otlp import Receiver
from tests.stack import Stack


def measure(stack: Stack, requests: int, concurrency: int) -> tuple[float, float]:
    """(requests/s, p99 ms) of one closed-loop run."""
    start = time.perf_counter()
    result = asyncio.run(run_load(stack.gateway, requests, concurrency))
    elapsed = time.perf_counter() - start
    assert result.outcomes["OK"] == requests, result.summary("tracing benchmark")
    return requests / elapsed, result.p(99) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--repository",
        default=os.environ.get("BERTH_MODEL_REPOSITORY", "model_repository"),
    )
    args = parser.parse_args()
    receiver = Receiver().start()
    traced_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    stacks = {
        "no exporter": Stack(Path(args.repository)),
        "100% sampled, OTLP": Stack(Path(args.repository), env=traced_env),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in stacks}
    try:
        for stack in stacks.values():
            stack.wait_serving()
        for stack in stacks.values():  # warm-up, not counted
            measure(stack, 200, args.concurrency)
        for _ in range(args.rounds):
            for name, stack in stacks.items():
                results[name].append(measure(stack, args.requests, args.concurrency))
    finally:
        for stack in stacks.values():
            stack.stop()
        receiver.stop()
    best = {name: max(r[0] for r in runs) for name, runs in results.items()}
    base = best["no exporter"]
    print(
        f"{platform.node()}: {os.cpu_count()} cores; {args.requests} unique "
        f"single-text Embed calls x {args.rounds} rounds, concurrency "
        f"{args.concurrency}; best round"
    )
    print(f"{'tracing':<22}{'req/s':>10}{'p99 ms':>10}{'vs none':>10}")
    for name, runs in results.items():
        rate, p99 = max(runs)
        print(f"{name:<22}{rate:>10.1f}{p99:>10.1f}{rate / base:>10.3f}")
    spans = len(receiver.snapshot())
    print(f"spans received: {spans}")
    print(
        json.dumps(
            {
                "untraced_rps": round(base, 1),
                "traced_rps": round(best["100% sampled, OTLP"], 1),
                "traced_over_untraced": round(best["100% sampled, OTLP"] / base, 3),
                "spans": spans,
            }
        )
    )


if __name__ == "__main__":
    main()
