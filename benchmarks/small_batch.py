"""Small batches on a GPU: dependent launches against classic ones.

At batch 1 a BERT-base forward is ~90 short kernels (2.5-5 us each inside a
CUDA graph), so launch and ramp-up, not math, set its time.
Hopper can launch a kernel while its predecessor still runs (programmatic
dependent launch, engine/cuda/kernels/). This times, in one process, three
CudaBackends on the same random-weight models and inputs:

- classic: every kernel launched the classic way (``pdl=False``), the
  baseline;
- pdl: berth's Triton kernels launched dependent in forwards of up to
  engine.cuda.forward.PDL_MAX_TOKENS tokens, with the small_linear tiles'
  GEMMs (cuBLAS's launch the classic way: a chain breaks at them);
- preload: the default on Hopper: pdl, and each shape of up to 128 tokens
  timed at capture with the preload_linear tiles' GEMMs too (every GEMM berth's,
  its weights read before it waits: one unbroken chain), the faster kept
  (``preloaded`` in the JSON says which);
- pdl-all: the default (preload) with dependent launches at every token
  count (what PDL_MAX_TOKENS rests on).

Attention is berth's Triton kernel in every variant (BERTH_ATTENTION=triton;
the per-shape choice by timing at capture can differ between backends and
blur the comparison).

Per shape: end to end (wire bytes to pinned float32 output, host work
included) and graph-only milliseconds, medians of CUDA-event timings over
rounds that alternate the variants (the card's clocks drift under its power
cap), each variant's ratio against classic, and the largest difference of
its output from classic's.

    python benchmarks/small_batch.py [--out small_batch_h200.json] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine import inputs, time_calls, write_checkpoint  # noqa: E402
from engine import settings as engine_settings  # noqa: E402
from engine.cuda.backend import CudaBackend  # noqa: E402

VARIANTS = ("classic", "pdl", "preload", "pdl-all")
SHAPES = {
    "bert-base": [
        *((1, n) for n in (16, 32, 64, 128, 256, 512)),
        *((8, n) for n in (16, 32, 64, 128)),
    ],
    "minilm": [(1, 128), (1, 256), (8, 32), (8, 128)],
}


def backend(variant: str, entry: Any, shapes: list[tuple[int, int]]) -> CudaBackend:
    cuda = CudaBackend("cuda:0", pdl=variant != "classic")
    cuda.load(entry)
    forward = cuda.runner(entry.name).forward
    if variant == "pdl-all":
        forward.pdl_max_tokens = 1 << 30
    forward.preload = variant != "pdl"
    cuda.warmup(entry.name, shapes)
    return cuda


def _once(cuda: CudaBackend, args: tuple[Any, ...], computes: list[float]) -> None:
    computes.append(cuda.run_bytes(*args)[1][1])


def bench_shape(
    backends: dict[str, CudaBackend], name: str, shape: tuple[int, int], rounds: int
) -> dict[str, Any]:
    batch, length = shape
    ids, lengths = inputs(batch, length, seed=batch * 1000 + length)
    args = (name, ids.tobytes(), lengths.tobytes(), batch, length)
    e2e: dict[str, list[float]] = {v: [] for v in backends}
    graph: dict[str, list[float]] = {v: [] for v in backends}
    for _ in range(rounds):
        for variant, cuda in backends.items():
            computes: list[float] = []
            once = partial(_once, cuda, args, computes)
            e2e[variant].append(statistics.median(time_calls(once, cuda.stream, 0.1)))
            graph[variant].append(statistics.median(computes) * 1e3)
    outputs = {v: cuda.run_bytes(*args)[0].copy() for v, cuda in backends.items()}
    row: dict[str, Any] = {"model": name, "batch": batch, "length": length}
    row["preloaded"] = backends["preload"].runner(name).forward.preloaded[shape]
    for variant in backends:
        key = variant.replace("-", "_")
        row[f"{key}_ms"] = round(statistics.median(e2e[variant]), 4)
        row[f"{key}_graph_ms"] = round(statistics.median(graph[variant]), 4)
        diff = np.abs(outputs[variant] - outputs["classic"]).max()
        row[f"{key}_max_diff"] = float(f"{diff:.3g}")
    return row


def line(row: dict[str, Any]) -> str:
    base = row["classic_ms"]
    cells = [f"{row['model']:9} {row['batch']:5d} {row['length']:5d}"]
    for variant in VARIANTS:
        key = variant.replace("-", "_")
        ms, graph = row[f"{key}_ms"], row[f"{key}_graph_ms"]
        cells.append(f"{ms:7.3f} {graph:7.3f} {base / ms:5.2f}x")
    cells.append(f"{row['pdl_max_diff']:9.2e} {row['preload_max_diff']:9.2e}")
    cells.append("preloaded" if row["preloaded"] else "")
    return " | ".join(cells)


HEADER = (
    f"{'model':9} {'batch':>5} {'len':>5} | "
    + " | ".join(f"{v:>21}" for v in VARIANTS)
    + " | pdl, preload diff"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("small_batch_gpu.json"))
    parser.add_argument("--models", default="bert-base,minilm")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine_settings.use(
        dataclasses.replace(engine_settings.current(), attention="triton")
    )
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_properties(0).name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "rows": [],
    }
    print(
        "per variant: ms end to end, graph ms, end-to-end ratio against classic "
        "(>1: faster); diff: the largest output difference from classic's"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            entry = write_checkpoint(name, Path(tmp) / name)
            shapes = SHAPES[name]
            backends = {v: backend(v, entry, shapes) for v in VARIANTS}
            if not backends["pdl"].runner(name).forward.pdl:
                print("no dependent launches on this GPU (Hopper or later)")
                return
            print(HEADER)
            for shape in shapes:
                result["rows"].append(bench_shape(backends, name, shape, args.rounds))
                print(line(result["rows"][-1]), flush=True)
            del backends
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
