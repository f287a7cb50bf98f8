"""FP8 against fp16 products at BERT-base's four projection shapes, on a GPU.

What the FP8 engine's speed is made of (issue 5): each projection of a
BERT-base layer (QKV 768 -> 2304, attention output 768 -> 768, FFN in
768 -> 3072, FFN out 3072 -> 768) at several token counts, with its bias in
the product's epilogue:

- ``fp16``: ``F.linear`` (the fp16 engine's product), the baseline;
- ``fp8``: ``torch._scaled_mm``, one scale per tensor, fp16 out (what
  engine/quant.Fp8Linear serves);
- ``fp8 row-wise``: one scale per weight channel and per token, bf16 out;
- ``fp8, e4m3 out``: tensor-wise, the output itself e4m3 (timed without
  the bias), what a product costs when it writes half the bytes;
- ``e4m3 pass``: quantizing the input in a separate pass
  (engine/cuda/kernels/e4m3.py where Triton runs), what a product pays
  when its producer cannot write e4m3 itself;
- ``fp8 + GELU, e4m3 out``: bias, GELU and e4m3 out in cuBLASLt's epilogue
  (engine/cuda/products.py), how the FP8 engine runs FFN-in: compare with
  ``fp8`` plus an ``e4m3 pass`` of the product's output.

Each is 20 calls captured in one CUDA graph, the best of 7 replays (weights
stay in L2 across calls: a floor for few tokens). Prints a table with each
variant's ratio to fp16 and the per-layer sums, and writes
``fp8_gemm_h200.json`` (``--out``; scripts/gpu_run.sh writes it to $OUT).

    python3 benchmarks/fp8_gemm.py [--tokens 128,1024,16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.cuda import kernels  # noqa: E402
from engine.cuda.timing import time_in_graph  # noqa: E402

FP8 = torch.float8_e4m3fn
# (name, out features, in features) of a BERT-base layer's projections.
SHAPES = [("qkv", 2304, 768), ("out", 768, 768), ("ffn_in", 3072, 768)]
SHAPES.append(("ffn_out", 768, 3072))


def products(tokens: int, n: int, k: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) / 20
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen)
    x8, w8 = x.to(FP8), (w * 20).to(FP8)
    one = torch.ones((), device="cuda")
    rows, cols = torch.ones(tokens, 1, device="cuda"), torch.ones(1, n, device="cuda")
    bias_bf16 = bias.bfloat16()

    def scaled(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
        return torch._scaled_mm(x8, w8.t(), scale_a=a, scale_b=b, **kw)  # type: ignore[arg-type]

    return {
        "fp16": lambda: F.linear(x, w, bias),
        "fp8": lambda: scaled(one, one, bias=bias, out_dtype=torch.float16),
        "fp8 row-wise": lambda: scaled(
            rows, cols, bias=bias_bf16, out_dtype=torch.bfloat16
        ),
        "fp8, e4m3 out": lambda: scaled(one, one, scale_result=one, out_dtype=FP8),
        "e4m3 pass": lambda: kernels.quantize_e4m3(x, one),
        "fp8 + GELU, e4m3 out": gelu_e4m3(x8, w8, one, bias),
    }


def gelu_e4m3(
    x8: torch.Tensor, w8: torch.Tensor, one: torch.Tensor, bias: torch.Tensor
) -> Callable[[], object]:
    """The product with bias, GELU and e4m3 out in cuBLASLt's epilogue
    (engine/cuda/products.py), as the FP8 engine's FFN-in runs it."""
    from engine.cuda.products import Fp8EpilogueGemm

    made: list[Fp8EpilogueGemm] = []

    def run() -> torch.Tensor:
        if not made:  # at the first (uncaptured) call: an error is the row's
            made.append(Fp8EpilogueGemm(w8, one, one, bias, one))
        return made[0](x8)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,1024,16384")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/fp8_gemm_h200.json"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm.py needs a CUDA GPU")
    token_counts = [int(t) for t in args.tokens.split(",")]
    rows = []
    for tokens in token_counts:
        for name, n, k in SHAPES:
            row: dict[str, object] = {"tokens": tokens, "projection": name}
            for variant, fn in products(tokens, n, k).items():
                try:
                    row[variant] = round(time_in_graph(fn, 20, 7) * 1000, 2)
                except (RuntimeError, TypeError) as exc:  # a layout this torch lacks
                    row[variant] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(f"{tokens} {name}: {row}", file=sys.stderr, flush=True)
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("us per product (x fp16), bias in the epilogue; weights warm in L2\n")
    variants = [v for v in rows[0] if v not in ("tokens", "projection")]
    print(f"{'tokens':>7} {'projection':<10}" + "".join(f"{v:>20}" for v in variants))
    for tokens in token_counts:
        mine = [r for r in rows if r["tokens"] == tokens]
        total = {"tokens": tokens, "projection": "layer"}
        for v in variants:
            values = [r[v] for r in mine]
            if all(isinstance(x, float) for x in values):
                total[v] = round(sum(values), 2)  # type: ignore[arg-type]
        for row in [*mine, total]:
            cells = []
            for v in variants:
                us, base = row.get(v), row.get("fp16")
                if isinstance(us, float) and isinstance(base, float):
                    cells.append(f"{us:>11.2f} ({base / us:4.2f}x)")
                else:
                    cells.append(f"{'-':>20}")
            print(f"{tokens:>7} {row['projection']:<10}" + "".join(cells))
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "unit": "us per product, best of 7 graph replays of 20 calls",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
