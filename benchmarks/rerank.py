"""Reranking through berth against sentence-transformers' CrossEncoder, in
one run on one machine.

    python benchmarks/rerank.py
    python benchmarks/rerank.py --out benchmarks/results/rerank_cpu.json

The model is a cross-encoder of ms-marco-MiniLM-L-6-v2's shape, made in the
run: all-MiniLM-L6-v2's encoder (from its PyPI package) under a random
one-label BertForSequenceClassification head, saved as sentence-transformers
saves a CrossEncoder. Its scores mean nothing; its cost is a MiniLM-L6
reranker's. Every call is one query against --passages texts (queries from
engine/data/heldout_utterances.txt, passages from heldout_general.txt,
the same pairs for both sides).

- baseline: ``CrossEncoder.predict`` in this process (torch on the CPU,
  its default batch of 32), a call at a time;
- berth: ``berth serve --model ranker=DIR`` as shipped but for its
  response cache (off: every round sends the same pairs), its Rerank called
  a call at a time (latency), then with --concurrency calls in flight
  (throughput).

The sides are measured in turn, --rounds times, baseline first, the stack
kept running throughout; a side's figures are the median of its rounds.
Ratios are berth's over the baseline's. berth's scores are checked against
the baseline's on every pair (max |difference| is reported).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: import berth's packages, not benchmarks/'s
    sys.path[0] = str(ROOT)

from benchmarks.serving.stack import machine  # noqa: E402

DATA = ROOT / "engine" / "data"


def make_cross_encoder(directory: Path) -> Path:
    """all-MiniLM-L6-v2's encoder under a random one-label head, saved with
    its tokenizer as a sentence-transformers CrossEncoder."""
    import torch
    import transformers

    from services.cli.default_models import minilm_checkpoint

    source = minilm_checkpoint()
    config = transformers.BertConfig.from_pretrained(str(source), num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    config.sentence_transformers = {
        "activation_fn": "torch.nn.modules.activation.Sigmoid"
    }
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    encoder = transformers.BertModel.from_pretrained(str(source))
    model.bert.load_state_dict(encoder.state_dict(), strict=False)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(source / name, directory / name)
    return directory


def lines(path: Path, count: int) -> list[str]:
    texts = [t.strip() for t in path.read_text().splitlines() if t.strip()]
    return [texts[i % len(texts)] for i in range(count)]


def baseline_round(model: Any, calls: list[tuple[str, list[str]]]) -> dict[str, Any]:
    latencies, scores = [], []
    start = time.perf_counter()
    for query, passages in calls:
        t0 = time.perf_counter()
        got = model.predict([(query, p) for p in passages], convert_to_numpy=True)
        latencies.append(time.perf_counter() - t0)
        scores.append(np.asarray(got, dtype=np.float64))
    wall = time.perf_counter() - start
    pairs = sum(len(p) for _, p in calls)
    return {"pairs_per_s": pairs / wall, **_percentiles(latencies), "scores": scores}


def berth_round(
    address: str, calls: list[tuple[str, list[str]]], concurrency: int
) -> dict[str, Any]:
    import grpc

    from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)

        def call(item: tuple[str, list[str]]) -> tuple[float, np.ndarray]:
            query, passages = item
            request = berth_pb2.RerankRequest(
                model="ranker", query=query, texts=passages
            )
            t0 = time.perf_counter()
            response = stub.Rerank(request, timeout=120)
            elapsed = time.perf_counter() - t0
            assert not response.degraded, "answered by the CPU fallback"
            return elapsed, np.array([r.score for r in response.results])

        start = time.perf_counter()
        answered = [call(item) for item in calls]
        serial_wall = time.perf_counter() - start
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            loaded = list(pool.map(call, calls))
        loaded_wall = time.perf_counter() - start
    pairs = sum(len(p) for _, p in calls)
    under_load = _percentiles([elapsed for elapsed, _ in loaded])
    return {
        "pairs_per_s": pairs / serial_wall,
        "pairs_per_s_loaded": pairs / loaded_wall,
        **_percentiles([elapsed for elapsed, _ in answered]),
        **{f"{key}_loaded": value for key, value in under_load.items()},
        "scores": [scores for _, scores in answered],
    }


def _percentiles(latencies: list[float]) -> dict[str, float]:
    ms = np.array(latencies) * 1000
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
    }


def median_of(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=24, help="calls per round")
    parser.add_argument("--passages", type=int, default=50, help="texts per call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()

    from sentence_transformers import CrossEncoder

    from tests.stack import Stack, serving

    queries = lines(DATA / "heldout_utterances.txt", args.queries)
    passages = lines(DATA / "heldout_general.txt", args.queries * args.passages)
    calls = [
        (q, passages[i * args.passages : (i + 1) * args.passages])
        for i, q in enumerate(queries)
    ]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="berth-rerank-") as tmp:
        print("making a MiniLM-L6 cross-encoder ...", flush=True)
        checkpoint = make_cross_encoder(Path(tmp) / "ms-marco-shaped")
        baseline = CrossEncoder(str(checkpoint), device="cpu")
        # The rounds send the same pairs: the response cache would answer them.
        stack = Stack(
            Path(tmp) / "repo",
            env={"BERTH_CACHE_ENTRIES": "0"},
            extra_args=["--model", f"ranker={checkpoint}"],
        )
        print(f"starting berth serve on {stack.gateway} ...", flush=True)
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        with serving(stack, timeout=600):
            berth_round(stack.gateway, calls[:4], args.concurrency)  # warm-up
            baseline_round(baseline, calls[:2])
            for n in range(args.rounds):
                theirs.append(baseline_round(baseline, calls))
                ours.append(berth_round(stack.gateway, calls, args.concurrency))
                print(
                    f"round {n + 1}/{args.rounds}: CrossEncoder "
                    f"{theirs[-1]['pairs_per_s']:.0f} pairs/s, berth "
                    f"{ours[-1]['pairs_per_s']:.0f} (one call at a time), "
                    f"{ours[-1]['pairs_per_s_loaded']:.0f} ({args.concurrency} in "
                    "flight)",
                    flush=True,
                )
    report(args, started, ours, theirs)


def report(
    args: argparse.Namespace,
    started: str,
    ours: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
) -> None:
    """The table, and the JSON where --out says."""
    diff = max(
        float(np.abs(a - b).max())
        for r_ours, r_theirs in zip(ours, theirs, strict=True)
        for a, b in zip(r_ours["scores"], r_theirs["scores"], strict=True)
    )
    base = median_of(theirs, "pairs_per_s")
    rows = [
        ("CrossEncoder.predict (baseline)", base, median_of(theirs, "p50_ms"),
         median_of(theirs, "p90_ms")),
        ("berth Rerank, 1 in flight", median_of(ours, "pairs_per_s"),
         median_of(ours, "p50_ms"), median_of(ours, "p90_ms")),
        (f"berth Rerank, {args.concurrency} in flight",
         median_of(ours, "pairs_per_s_loaded"), median_of(ours, "p50_ms_loaded"),
         median_of(ours, "p90_ms_loaded")),
    ]  # fmt: skip
    shape = f"{args.queries} calls of 1 query x {args.passages} texts"
    print(f"\n{shape}, {args.rounds} rounds")
    print(f"{'':36} {'pairs/s':>9} {'ratio':>7} {'p50 ms':>8} {'p90 ms':>8}")
    for name, rate, p50, p90 in rows:
        print(f"{name:36} {rate:9.0f} {rate / base:7.2f} {p50:8.1f} {p90:8.1f}")
    print(f"max |score difference| over every pair: {diff:.1e}")
    if args.out:
        result = {
            "benchmark": "rerank",
            "started": started,
            "machine": machine(),
            "settings": vars(args) | {"out": str(args.out)},
            "max_score_difference": diff,
            "rows": [
                {
                    "system": n,
                    "pairs_per_s": r,
                    "ratio": r / base,
                    "p50_ms": p,
                    "p90_ms": q,
                }
                for n, r, p, q in rows
            ],  # fmt: skip
            "rounds": {
                "baseline": [
                    {k: v for k, v in r.items() if k != "scores"} for r in theirs
                ],
                "berth": [{k: v for k, v in r.items() if k != "scores"} for r in ours],
            },
        }
        args.out.write_text(
            json.dumps(result, indent=2, allow_nan=False, default=str) + "\n"
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
