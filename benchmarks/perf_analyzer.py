"""Triton's perf_analyzer against berth's KServe v2 service, beside berth's
own API measured the same way in the same run.

    python benchmarks/perf_analyzer.py                 # start a stack, run, print
    python benchmarks/perf_analyzer.py --out benchmarks/results/perf_analyzer_cpu.json

One `berth serve` as shipped (the e2e benchmark's stock profile) serves
minilm. At each --concurrency, in turn:

1. berth: berth.v1 ``Embed``, a closed loop of that many single-text calls
   in flight (benchmarks/serving/probes.py, the TLS benchmark's capacity
   probe), for as long as perf_analyzer's measurement below: the baseline;
2. kserve: perf_analyzer (the tritonclient 2.41.1 wheel's binary, installed
   under build/perf_analyzer/ as tests/test_perf_analyzer.py does) over
   KServe ``ModelInfer``, one text a request, ``--concurrency-range`` C,
   ``--measurement-interval`` ms windows until its stability check passes
   (``--stability-percentage``, at most ``--max-trials`` windows);
3. kserve_stream: the same with ``--streaming`` (``ModelStreamInfer``).

Every text is distinct (make_texts, a new tag per run), and at concurrency 1
each request has the next one, so the response cache never answers. At a
higher concurrency perf_analyzer's concurrent requests take their texts from
the data independently and some repeat one another's: the server's own
ModelStatistics are read before and after each perf_analyzer run, and its
cache hits shown beside the figures. The default --stability-percentage of
100 takes perf_analyzer's first three windows within 2× of one another, for
a machine shared with other work. perf_analyzer is a C++ client, the
baseline an asyncio Python one: ratios are each KServe run's figures over
berth.v1's at the same concurrency, client included. The first
concurrency's baseline is preceded by --warmup-s of unmeasured berth.v1
calls (a new stack's first batches of each shape are slow).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: import berth's packages, not benchmarks/'s
    sys.path[0] = str(ROOT)

from benchmarks.serving.probes import ClosedLoop, capacity  # noqa: E402
from benchmarks.serving.stack import PROFILES, machine, target  # noqa: E402
from benchmarks.serving.workload import make_texts  # noqa: E402

MODEL = "minilm"
# perf_analyzer's CSV (-f): its columns of interest, microseconds.
COLUMNS = {
    "Inferences/Second": "throughput",
    "p50 latency": "p50_us",
    "p90 latency": "p90_us",
    "p99 latency": "p99_us",
    "Server Queue": "server_queue_us",
    "Server Compute Input": "server_compute_input_us",
    "Server Compute Infer": "server_compute_infer_us",
    "Server Compute Output": "server_compute_output_us",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1", help="comma-separated")
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms")
    parser.add_argument("--stability-percentage", type=float, default=100.0)
    parser.add_argument("--max-trials", type=int, default=8)
    parser.add_argument("--texts", type=int, default=20000, help="per run")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None, help="JSON result")
    parser.add_argument(
        "--model-repository",
        type=Path,
        default=Path(
            os.environ.get("BERTH_MODEL_REPOSITORY", ROOT / "model_repository")
        ),
    )
    return parser.parse_args(argv)


def server_stats(address: str) -> dict[str, int]:
    """minilm's ModelStatistics counters the runs are checked by."""
    import grpc

    from services.proto.inference import grpc_service_pb2 as pb
    from services.proto.inference import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=10)
    (stats,) = reply.model_stats
    return {
        "success": stats.inference_stats.success.count,
        "fail": stats.inference_stats.fail.count,
        "cache_hit": stats.inference_stats.cache_hit.count,
        "inference_count": stats.inference_count,
    }


def perf_analyzer(
    binary: Path, address: str, concurrency: int, streaming: bool, args: Any
) -> dict[str, Any]:
    """One perf_analyzer run over distinct texts: its CSV row, and what the
    server counted meanwhile."""
    tag = uuid.uuid4().hex[:8]
    texts = [f"{t} {tag}" for t in make_texts(args.texts, seed=concurrency)]
    with tempfile.TemporaryDirectory(prefix="berth-pa-") as folder:
        data, report = Path(folder) / "texts.json", Path(folder) / "report.csv"
        data.write_text(json.dumps({"data": [{"TEXT": [t]} for t in texts]}))
        command = [str(binary), "-m", MODEL, "-i", "grpc", "-u", address]
        command += ["--input-data", str(data), "--shape", "TEXT:1", "-b", "1"]
        command += ["--concurrency-range", str(concurrency)]
        command += ["--measurement-interval", str(args.measurement_interval)]
        command += ["--stability-percentage", str(args.stability_percentage)]
        command += ["--max-trials", str(args.max_trials), "-f", str(report)]
        command += ["--streaming"] if streaming else []
        env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parents[1] / "lib"))
        before = server_stats(address)
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        after = server_stats(address)
        if run.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed:\n{run.stdout}\n{run.stderr}")
        (row,) = csv.DictReader(report.read_text().splitlines())
    result: dict[str, Any] = {"concurrency": concurrency}
    for column, key in COLUMNS.items():
        result[key] = float(row[column])
    result["server"] = {k: after[k] - before[k] for k in after}
    result["command"] = (
        " ".join(["perf_analyzer", *command[1:]])
        .replace(str(data), "texts.json")
        .replace(str(report), "report.csv")
    )
    return result


def baseline(address: str, concurrency: int, seconds: float, warmup_s: float) -> Any:
    """berth.v1 Embed's closed loop at ``concurrency`` for ``seconds``."""
    loop = ClosedLoop(
        model=MODEL,
        seconds=seconds,
        warmup_s=warmup_s,
        concurrency=concurrency,
        connections=1,
        deadline_s=30.0,
        tag=uuid.uuid4().hex[:8],
    )
    return capacity(address, None, make_texts(2000, seed=99), loop)


def ratio(value: float, base: float) -> float | None:
    return round(value / base, 3) if base else None


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| concurrency | client | throughput | p50 | p99 | server queue / compute "
        "input / infer / output | server cache hits | × berth.v1 throughput | "
        "× berth.v1 p50 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        base = row["berth"]
        lines.append(
            f"| {row['concurrency']} | berth.v1 Embed (Python, asyncio) | "
            f"{base['throughput']:.1f}/s | {base['p50_ms']:.2f} ms | "
            f"{base['p99_ms']:.2f} ms | | | 1.00 | 1.00 |"
        )
        for name in ("kserve", "kserve_stream"):
            run = row[name]
            stages = " / ".join(
                f"{run[f'server_{s}_us'] / 1000:.2f}"
                for s in ("queue", "compute_input", "compute_infer", "compute_output")
            )
            label = "perf_analyzer" + (
                " --streaming" if name == "kserve_stream" else ""
            )
            lines.append(
                f"| {row['concurrency']} | {label} | {run['throughput']:.1f}/s | "
                f"{run['p50_us'] / 1000:.2f} ms | {run['p99_us'] / 1000:.2f} ms | "
                f"{stages} ms | {run['server']['cache_hit']} of "
                f"{run['server']['success']} | {run['x_throughput']:.2f} | "
                f"{run['x_p50']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.test_perf_analyzer import CACHE, install

    binary = install(CACHE)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    rows = []
    started = datetime.now(UTC).isoformat(timespec="seconds")
    with target(PROFILES["stock"], args.model_repository, None, "") as stack:
        for concurrency in concurrencies:
            row: dict[str, Any] = {"concurrency": concurrency}
            seconds = 3 * args.measurement_interval / 1000
            warmup_s = args.warmup_s if not rows else 0.0
            row["berth"] = baseline(stack.address, concurrency, seconds, warmup_s)
            for name, streaming in (("kserve", False), ("kserve_stream", True)):
                row[name] = perf_analyzer(
                    binary, stack.address, concurrency, streaming, args
                )
            for name in ("kserve", "kserve_stream"):
                run = row[name]
                run["x_throughput"] = ratio(
                    run["throughput"], row["berth"]["throughput"]
                )
                run["x_p50"] = ratio(run["p50_us"] / 1000, row["berth"]["p50_ms"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = report(rows)
    print(table)
    if args.out:
        result = {
            "benchmark": "perf_analyzer",
            "started": started,
            "machine": machine(),
            "profile": PROFILES["stock"].about,
            "model": MODEL,
            "arguments": {k: str(v) for k, v in vars(args).items()},
            "rows": rows,
            "table": table,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
