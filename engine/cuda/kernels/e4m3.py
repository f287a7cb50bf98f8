"""act(x) / scale as e4m3 in one pass: an FP8 product's input where its
producer cannot write e4m3 itself.
"""

from __future__ import annotations

import torch

from engine.cuda.kernels.base import (
    ACT_NONE,
    activate_reference,
    launch_options,
    to_e4m3,
    triton,
    use_triton,
)

if triton is not None:
    from engine.cuda.kernels.base import activate, chain, scaled_e4m3, tl

    @triton.jit
    def _quantize_e4m3_kernel(  # type: ignore[no-untyped-def]
        x_ptr, out_ptr, inv_ptr, n,
        ACT: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # out = e4m3(act(x) / scale), elementwise over n values.
        chain(GDC)
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + at, mask=at < n, other=0.0).to(tl.float32)
        q = scaled_e4m3(activate(x, ACT), inv_ptr)
        tl.store(out_ptr + at, q.to(out_ptr.dtype.element_ty), mask=at < n)


# Values per program of quantize_e4m3.
QUANT_BLOCK = 2048


def quantize_e4m3(
    x: torch.Tensor, inv_scale: torch.Tensor, act: int = ACT_NONE, pdl: bool = False
) -> torch.Tensor:
    """e4m3(act(x) / scale) in one pass (``inv_scale`` = 1 / scale, a device
    scalar, so a CUDA graph keeps reading the current one): the input of an
    FP8 matmul whose producer cannot write e4m3 itself."""
    if not use_triton(x):
        return to_e4m3(activate_reference(x.float(), act), inv_scale)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    _quantize_e4m3_kernel[(triton.cdiv(n, QUANT_BLOCK),)](
        x,
        out,
        inv_scale,
        n,
        ACT=act,
        BLOCK=QUANT_BLOCK,
        num_warps=4,
        **launch_options(pdl),
    )
    return out
