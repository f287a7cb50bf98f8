"""PRELOAD_LINEAR's tiles searched in the chain: whole few-token forwards.

A few-token forward on Hopper is one chain of dependent launches
(engine/cuda/kernels/), so a GEMM's tiles change how it overlaps the kernels
around it. Timed alone, the GEMMs rank tiles wrongly; in the chain, what
counts is the whole forward (attention-out's 64-column tiles were found
this way). For each shape and projection this
replaces the shipped PRELOAD_LINEAR tile by each of its neighbours (one of
rows, columns, K chunk, K slices or warps halved or doubled, where the
kernel can run it: ``neighbours``), captures the forward in a CUDA graph per
variant and replays every graph in turn from an idle GPU
(engine.cuda.timing.time_in_turn, 25 rounds a line, ``--lines`` lines). It
prints,
per shape, the microseconds of each variant and its ratio against the
shipped tiles (>1: faster), best first, and writes them to ``--out``.

Attention is berth's Triton kernel and the preloading plan is forced on, as
in the chain it is tuned for. Needs a Hopper GPU with Triton.

    python benchmarks/preload_tiles.py [--models bert-base] [--shapes 1x16,1x128]
        [--lines 2] [--out preload_tiles_h200.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine import write_checkpoint  # noqa: E402
from engine.cuda import kernels  # noqa: E402
from engine.cuda.forward import FusedForward  # noqa: E402
from engine.cuda.tiles import PRELOAD_LINEAR, LinearConfig  # noqa: E402
from engine.cuda.timing import captured, time_in_turn  # noqa: E402

SHAPES = {
    "bert-base": [(1, 16), (1, 32), (1, 64), (8, 16), (1, 128)],
    "minilm": [(1, 16), (1, 64), (1, 128)],
}
PROJECTIONS = ("qkv", "out", "ffn_in", "ffn_out")
# Per-block shared memory on the H200 (227 KB); the preloading kernel holds
# its whole weight slice and two x chunks there.
SHARED_BYTES = 232448


def shared_bytes(config: LinearConfig, k: int) -> int:
    """fp16 bytes of shared memory the preloading kernel needs: its weight
    slice and two x chunks (it reads the next chunk while it multiplies)."""
    chunks = k // config.split // config.block_k
    weights = chunks * config.block_n * config.block_k
    return 2 * (weights + min(chunks, 2) * config.block_m * config.block_k)


def neighbours(
    config: LinearConfig, projection: str, k: int, tokens: int
) -> dict[str, LinearConfig]:
    """The tiles one step from ``config`` that the preloading kernel can run
    for ``projection`` over K = ``k`` at ``tokens`` tokens, by name (e.g.
    "block_n x2"): a field halved or doubled (for the projections a
    LayerNorm finishes, attention-out and FFN-out, also K slices doubled
    with the K chunk halved and the reverse: as many chunks a program),
    warps 4 or 8, K slices only for those two projections, no
    more rows than the tokens need, at most PRELOAD_CHUNKS chunks, within
    the shared memory."""
    rows_needed = max(16, 1 << (tokens - 1).bit_length())
    steps: dict[str, LinearConfig] = {}
    for field in ("block_m", "block_n", "block_k", "split", "warps"):
        if field == "split" and projection in ("qkv", "ffn_in"):
            continue  # their bias and activation need the whole sum
        for step, factor in (("x2", 2.0), ("/2", 0.5)):
            value = int(getattr(config, field) * factor)
            steps[f"{projection} {field} {step}"] = config._replace(**{field: value})
    if projection in ("out", "ffn_out"):  # as many chunks, cut otherwise
        for step, split, chunk in (("x2", 2.0, 0.5), ("/2", 0.5, 2.0)):
            steps[f"{projection} split {step}, block_k inverse"] = config._replace(
                split=int(config.split * split), block_k=int(config.block_k * chunk)
            )
    return {
        name: tile
        for name, tile in steps.items()
        if tile.warps in (4, 8)
        and tile.split >= 1
        and all(16 <= b <= 256 for b in (tile.block_m, tile.block_n, tile.block_k))
        and tile.block_m <= rows_needed
        and tile.fits(k)
        and shared_bytes(tile, k) <= SHARED_BYTES
    }


def _row_for(table: list[tuple[int, LinearConfig]], tokens: int) -> int:
    """Index of the table row that serves ``tokens`` tokens."""
    return next(i for i, (limit, _) in enumerate(table) if tokens <= limit)


def bench_shape(
    forward: FusedForward, hidden: int, inner: int, shape: tuple[int, int], lines: int
) -> dict[str, Any]:
    batch, length = shape
    tokens = batch * length
    weight = forward.encoder.embeddings.word.weight
    ids = torch.randint(1000, weight.shape[0], shape, device=weight.device)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=weight.device)
    shipped = {p: list(PRELOAD_LINEAR[(p, hidden)]) for p in PROJECTIONS}
    variants: dict[str, tuple[str, LinearConfig] | None] = {"shipped": None}
    for projection in PROJECTIONS:
        table = shipped[projection]
        config = table[_row_for(table, tokens)][1]
        k = inner if projection == "ffn_out" else hidden
        for name, tile in neighbours(config, projection, k, tokens).items():
            variants[name] = (projection, tile)
    forward.chosen[shape] = "triton"
    graphs, names = [], []
    try:
        for name, change in variants.items():
            for projection, table in shipped.items():
                PRELOAD_LINEAR[(projection, hidden)] = list(table)
            if change is not None:
                projection, tile = change
                table = PRELOAD_LINEAR[(projection, hidden)]
                row = _row_for(table, tokens)
                table[row] = (table[row][0], tile)
            forward.forget_plans()
            forward.preloaded[shape] = True
            with torch.inference_mode():
                try:
                    graphs.append(captured(lambda: forward(ids, lengths)))
                except Exception as exc:  # Triton's resource errors among them
                    print(f"  {name}: cannot run ({type(exc).__name__}: {exc})"[:160])
                    continue
            names.append(name)
    finally:
        for projection, table in shipped.items():
            PRELOAD_LINEAR[(projection, hidden)] = table
        forward.forget_plans()
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(lines):
        for name, ms in zip(names, time_in_turn(graphs), strict=True):
            times[name].append(ms * 1e3)
    base = statistics.median(times["shipped"])
    rows: list[dict[str, Any]] = []
    for name, own in times.items():
        change = variants[name]
        rows.append(
            {
                "variant": name,
                "tile": None if change is None else list(change[1]),
                "us": [round(t, 1) for t in own],
                "x_shipped": round(base / statistics.median(own), 4),
            }
        )
    rows.sort(key=lambda r: -r["x_shipped"])
    return {"batch": batch, "length": length, "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("preload_tiles_gpu.json"))
    parser.add_argument("--models", default="bert-base")
    parser.add_argument("--shapes", default="", help="e.g. 1x16,8x16 (default: all)")
    parser.add_argument("--lines", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available() or kernels.triton is None:
        sys.exit("preload_tiles: needs a CUDA GPU with Triton")
    from engine.cuda.backend import CudaBackend

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_properties(0).name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            entry = write_checkpoint(model, Path(tmp) / model)
            cuda = CudaBackend("cuda:0")
            cuda.load(entry)
            forward = cuda.runner(model).forward
            config = forward.encoder.config
            hidden, inner = config.hidden_size, config.intermediate_size
            if not forward.preload_eligible(16):
                sys.exit("preload_tiles: no preloading plan on this GPU (Hopper)")
            shapes = SHAPES[model]
            if args.shapes:
                shapes = [
                    (int(b), int(n))
                    for b, n in (s.split("x") for s in args.shapes.split(","))
                ]
            result["models"][model] = []
            for shape in shapes:
                print(f"{model} {shape[0]}x{shape[1]}: capturing", flush=True)
                row = bench_shape(forward, hidden, inner, shape, args.lines)
                result["models"][model].append(row)
                print(f"{'variant':26} {'us a forward':>22} {'x shipped':>9}")
                for v in row["variants"]:
                    us = " ".join(f"{t:.1f}" for t in v["us"])
                    print(f"{v['variant']:26} {us:>22} {v['x_shipped']:9.3f}")
            del cuda, forward
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
