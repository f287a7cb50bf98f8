"""Few-token GEMMs on a GPU: berth's Triton ``linear`` against cuBLAS(Lt).

A batch of 1 x 128 tokens multiplies 128 rows by each weight matrix: cuBLAS
covers that with a handful of tiles (a few of the GPU's 132 SMs) plus a
split-K reduction, so each GEMM costs 4-6 us where the weights stream in
about 1. For each model's four projections (QKV; attention output +
residual + LayerNorm; FFN in + GELU; FFN out + residual + LayerNorm) and
token counts M, this times, inside CUDA graphs (20 calls per replay, so the
times are the GPU's, not Python's launch cost):

- cublas_us: what the fused forward runs today (``F.linear`` /
  ``torch._addmm_activation`` with GELU in the epilogue, then berth's Triton
  add + LayerNorm);
- triton_us: ``engine.cuda.kernels.linear`` with the best of a grid of tiles and
  K splits (split-K partials summed by ``add_layer_norm_partials``);
- ratio = cublas / triton (above 1: Triton faster), and the tiles that won.

Then attention at small shapes for several query-block sizes, and the best
tiles per (projection, M) as a table for engine/cuda/tuning/.

    python benchmarks/small_gemm.py --out small_gemm_h200.json
    python benchmarks/small_gemm.py --cold --block-k 64,128,256 --tokens 16,128

``--cold`` gives each call in a graph its own copy of the weights, so every
call streams them from memory as a forward's layers do (one copy stays in
the 50 MB L2 and flatters every kernel); ``--block-k`` widens the grid.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cuda import kernels  # noqa: E402
from engine.cuda.graphs import capturing  # noqa: E402
from engine.cuda.kernels import (  # noqa: E402
    ACT_GELU_TANH,
    ACT_NONE,
    add_layer_norm,
    add_layer_norm_partials,
)
from engine.cuda.tiles import LinearConfig  # noqa: E402
from engine.cuda.timing import replay_ms  # noqa: E402

DIMS = {"bert-base": (768, 3072, 12), "minilm": (384, 1536, 12)}
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
REPEAT = 20


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per call: REPEAT calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        for _ in range(REPEAT):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(replay_ms(graph) * 1e3 / REPEAT for _ in range(7))


def configs(m: int, split_ok: bool, block_ks: tuple[int, ...]) -> list[LinearConfig]:
    out = []
    for bm, bn, split, bk in itertools.product(
        (16, 32, 64, 128),
        (32, 64, 128),
        (1, 2, 3, 4, 6) if split_ok else (1,),
        block_ks,
    ):
        if bm > max(16, 2 * m) or (bm == 128 and bn == 128):
            continue
        if 3 * (bm + bn) * bk * 2 > 200_000:  # shared memory: 3 stages, both tiles
            continue
        warps = 8 if bm * bn >= 128 * 64 else 4
        out.append(LinearConfig(bm, bn, bk, split, warps, 3))
    return out


def projections(
    h: int, inner: int, m: int, cold: bool
) -> dict[str, tuple[Callable[[], object], Callable[[LinearConfig], object], bool]]:
    """name -> (the cuBLAS path, the Triton path given tiles, splits allowed).

    ``cold``: each of a graph's REPEAT calls multiplies its own copy of the
    weights (together past the 50 MB L2), so every call streams them from
    memory as a forward's layers do; otherwise one copy stays in L2."""
    dev, dt = "cuda", torch.float16
    x = torch.randn(m, h, device=dev, dtype=dt)
    mid = torch.randn(m, inner, device=dev, dtype=dt)
    ln_w = torch.ones(h, device=dev, dtype=dt)
    ln_b = torch.zeros(h, device=dev, dtype=dt)

    def weights(n: int, k: int) -> tuple[_Turns, torch.Tensor]:
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        copies = [w.clone() for _ in range(REPEAT)] if cold else [w]
        return _Turns(copies), torch.randn(n, device=dev, dtype=dt) * 0.02

    w_qkv, b_qkv = weights(3 * h, h)
    w_out, b_out = weights(h, h)
    w_in, b_in = weights(inner, h)
    w_ffn, b_ffn = weights(h, inner)

    def split_path(
        inp: torch.Tensor, w: _Turns, b: torch.Tensor
    ) -> Callable[[LinearConfig], object]:
        def run(c: LinearConfig) -> object:
            if c.split == 1:
                y = kernels.linear(inp, w(), b, ACT_NONE, c)
                return add_layer_norm(y, x, ln_w, ln_b, 1e-12)
            part = kernels.linear(inp, w(), None, ACT_NONE, c)
            return add_layer_norm_partials(part, b, x, ln_w, ln_b, 1e-12)

        return run

    return {
        "qkv": (
            lambda: F.linear(x, w_qkv(), b_qkv),
            lambda c: kernels.linear(x, w_qkv(), b_qkv, ACT_NONE, c),
            False,
        ),
        "out+ln": (
            lambda: add_layer_norm(F.linear(x, w_out(), b_out), x, ln_w, ln_b, 1e-12),
            split_path(x, w_out, b_out),
            True,
        ),
        "ffn_in+gelu": (
            lambda: torch._addmm_activation(b_in, x, w_in().t(), use_gelu=True),
            lambda c: kernels.linear(x, w_in(), b_in, ACT_GELU_TANH, c),
            False,
        ),
        "ffn_out+ln": (
            lambda: add_layer_norm(F.linear(mid, w_ffn(), b_ffn), x, ln_w, ln_b, 1e-12),
            split_path(mid, w_ffn, b_ffn),
            True,
        ),
    }


class _Turns:
    """Tensors taken in turn, one per call (``cold`` weights)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._cycle = itertools.cycle(tensors)

    def __call__(self) -> torch.Tensor:
        return next(self._cycle)


def attention_rows() -> list[dict[str, Any]]:
    rows = []
    h, heads = 768, 12
    for batch, length in ((1, 16), (1, 32), (1, 64), (1, 128), (1, 256), (1, 512),
                          (8, 128), (32, 128), (128, 128)):  # fmt: skip
        qkv = torch.randn(batch * length, 3 * h, device="cuda", dtype=torch.float16)
        used = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        row: dict[str, Any] = {"batch": batch, "length": length}
        for bm, bn in itertools.product((16, 32, 64, 128), (64, 128)):
            if bm > max(16, length) or bn > max(64, length):
                continue
            run = partial(
                kernels.attention, qkv, used, batch, length, heads, bm, block_n=bn
            )
            row[f"bm{bm}_bn{bn}_us"] = round(graph_us(run), 2)
        run = partial(kernels.attention, qkv, used, batch, length, heads)
        row["default_us"] = round(graph_us(run), 2)
        rows.append(row)
        print("attention", row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("small_gemm_gpu.json"))
    parser.add_argument("--models", default="bert-base,minilm")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--block-k", default="64", help="K steps to try, e.g. 64,128")
    parser.add_argument(
        "--cold", action="store_true", help="weights streamed from memory each call"
    )
    args = parser.parse_args()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "rows": [],
    }
    block_ks = tuple(map(int, args.block_k.split(",")))
    result["cold"] = args.cold
    began = time.perf_counter()
    print(
        f"{'model':9} {'M':>5} {'projection':12} {'cublas_us':>9} {'triton_us':>9} "
        f"{'ratio':>6}  best tiles (block_m, block_n, block_k, split, warps, stages)"
    )
    for model in args.models.split(","):
        h, inner, _ = DIMS[model]
        for m in map(int, args.tokens.split(",")):
            for name, (base, ours, split_ok) in projections(
                h, inner, m, args.cold
            ).items():
                cublas = graph_us(base)
                timed = {}
                for c in configs(m, split_ok, block_ks):
                    if c.fits(inner if name == "ffn_out+ln" else h):
                        timed[c] = graph_us(partial(ours, c))
                best = min(timed, key=lambda c: timed[c])
                row = {
                    "model": model,
                    "tokens": m,
                    "projection": name,
                    "cublas_us": round(cublas, 2),
                    "triton_us": round(timed[best], 2),
                    "best": list(best),
                }
                result["rows"].append(row)
                print(
                    f"{model:9} {m:5d} {name:12} {cublas:9.2f} {timed[best]:9.2f} "
                    f"{cublas / timed[best]:6.2f}  {tuple(best)}",
                    flush=True,
                )
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["attention"] = attention_rows()
    result["seconds"] = round(time.perf_counter() - began, 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"done in {result['seconds']} s")


if __name__ == "__main__":
    main()
