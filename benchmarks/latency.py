"""Where a single request's time goes at low load, hop by hop.

Starts `berth serve` on loopback (tests/stack.py), sends single short texts
one at a time (a pause between calls, so nothing queues), and reads the
stack's own /metrics before and after: the per-stage means that the gateway,
batcher and engine record, and each process's CPU time per request. What is
left between the stages is the gRPC hops and the hand-offs around them.

    python benchmarks/latency.py          # the default repository's minilm
    python benchmarks/latency.py --model bert-base \
        --model-repository build/e2e/bert-base   # scripts/gpu_run.sh builds it
    python benchmarks/latency.py --batcher-mode inline   # no batcher process
    python benchmarks/latency.py --batcher-mode hybrid   # direct when idle
    python benchmarks/latency.py --idle-cpus spin        # idle CPUs never halt
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from benchmarks.serving.stack import metrics_page, running, server_cpu  # noqa: E402
from services.idle import IDLE_CHOICES  # noqa: E402
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc  # noqa: E402
from tests.stack import ROOT, Stack  # noqa: E402

METRIC = re.compile(r"(berth_\w+_seconds)_(sum|count)\{([^}]*)\} (\S+)")
ROLES = ("gateway", "batcher", "engine")

Readings = dict[tuple[str, str, str], float]  # see scrape()
CPU = dict[str, float]  # see cpu_seconds()


def scrape(urls: list[str]) -> Readings:
    """(metric, labels, sum|count) -> value, over every process's /metrics."""
    out: Readings = {}
    for url in urls:
        if (text := metrics_page(url)) is None:
            continue
        for line in text.splitlines():
            if m := METRIC.match(line):
                key = (m.group(1), m.group(3), m.group(2))
                out[key] = out.get(key, 0.0) + float(m.group(4))
    return out


def cpu_seconds(parent: int) -> CPU:
    """CPU seconds so far of each child of ``parent``, by role."""
    out: CPU = {}
    for (role, _), cpu in server_cpu(parent).items():
        if role == "services.idle":  # --idle-cpus spin: they take what is idle
            continue
        role = role if role in ROLES else "?"
        out[role] = out.get(role, 0.0) + cpu
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-repository", type=Path, default=ROOT / "model_repository"
    )
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--pause-ms", type=float, default=2.0)
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument("--batchers", type=int, default=1)
    parser.add_argument(
        "--batcher-mode",
        choices=("service", "inline", "hybrid"),
        default="service",
        help="inline: each gateway batches itself (no batcher process); "
        "hybrid: through the batchers, straight to the engines when idle",
    )
    parser.add_argument("--cpu-affinity", choices=("none", "spread"), default="none")
    parser.add_argument(
        "--grpc-io", choices=("poller", "event-engine"), default="poller"
    )
    parser.add_argument(
        "--idle-cpus",
        choices=IDLE_CHOICES,
        default="sleep",
        help="spin: `berth serve --idle-cpus spin` (idle CPUs never halt)",
    )
    return parser.parse_args()


def measure(
    args: argparse.Namespace, stack: Stack
) -> tuple[list[float], tuple[Readings, Readings], tuple[CPU, CPU]]:
    """The calls' latencies (ms, sorted), the stack's /metrics and its CPU
    seconds by role, before the calls and after."""
    stub = berth_pb2_grpc.BerthStub(grpc.insecure_channel(stack.gateway))

    def call(text: str) -> float:
        began = time.perf_counter()
        stub.Embed(berth_pb2.EmbedRequest(model=args.model, texts=[text]))
        return (time.perf_counter() - began) * 1e3

    for i in range(100):  # warm-up (distinct texts: the cache never answers)
        call(f"warm-up text number {i}")
    before, cpu_before = scrape(stack.metrics), cpu_seconds(stack.proc.pid)
    latencies = []
    for i in range(args.calls):
        latencies.append(call(f"a short text to embed, number {i}"))
        time.sleep(args.pause_ms / 1e3)
    after, cpu_after = scrape(stack.metrics), cpu_seconds(stack.proc.pid)
    return sorted(latencies), (before, after), (cpu_before, cpu_after)


def main() -> None:
    args = parse_args()
    stack = Stack(
        args.model_repository,
        gateways=args.gateways,
        batchers=args.batchers,
        extra_args=[
            *("--batcher-mode", args.batcher_mode),
            *("--cpu-affinity", args.cpu_affinity),
            *("--grpc-io", args.grpc_io),
            *("--idle-cpus", args.idle_cpus),
        ],
    )
    with running(stack, 600):
        latencies, (before, after), (cpu_before, cpu_after) = measure(args, stack)
    batching = {
        "inline": "batching inline",
        "hybrid": f"{args.batchers} batcher(s), direct when idle",
    }.get(args.batcher_mode, f"{args.batchers} batcher(s)")
    print(
        f"{args.model}, {args.calls} sequential single-text Embed calls, "
        f"{args.gateways} gateway(s), {batching}, CPU affinity {args.cpu_affinity}, "
        f"gRPC I/O {args.grpc_io}, idle CPUs {args.idle_cpus}"
    )
    print(f"{'client sees: p50':62} {statistics.median(latencies):8.3f} ms")
    print(f"{'client sees: p90':62} {latencies[int(0.9 * len(latencies))]:8.3f} ms")
    for metric, labels, kind in sorted(after):
        if kind != "sum":
            continue
        count = after[(metric, labels, "count")] - before.get(
            (metric, labels, "count"), 0
        )
        if count > 0:
            total = after[(metric, labels, kind)] - before.get(
                (metric, labels, kind), 0
            )
            name = f"{metric.removeprefix('berth_')}{{{labels}}}"
            print(f"{name[:62]:62} {1e3 * total / count:8.3f} ms mean (n={count:.0f})")
    for role in sorted(cpu_after):
        used = cpu_after[role] - cpu_before.get(role, 0.0)
        print(f"{'CPU per call: ' + role:62} {1e3 * used / args.calls:8.3f} ms")


if __name__ == "__main__":
    main()
