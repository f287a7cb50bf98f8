"""What the kernel modules share: Triton (None without it), launch options,
activations, LayerNorm tiling, e4m3 rounding.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None


# Rows per LayerNorm program on large batches, one warp each. H200, 16384 x
# 768 with the residual added (a probe in CUDA graphs): 2 rows on 2 warps
# 14.0 us, 4 on 4 14.5, 4 rows on 8 warps 19.5, and 12.7 for a plain copy of
# the rows.
LN_ROWS = 2


# float8_e4m3fn's largest finite value.
E4M3_MAX = 448.0


# ``linear``'s activations (a constexpr of the kernel).
ACT_NONE, ACT_GELU_TANH, ACT_GELU_ERF, ACT_RELU = 0, 1, 2, 3


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (
        x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    )


def warps_for(elements: int) -> int:
    return max(1, min(8, elements // 256))


def layer_norm_tiles(rows: int, block: int, per: int | None = None) -> tuple[int, int]:
    """(rows per program, warps) of a LayerNorm kernel over ``rows`` rows of
    ``block`` columns: one row on block / 256 warps at few rows (the batch-1
    chain's best), LN_ROWS rows (or ``per``) on a warp each on
    large batches."""
    per = per or (LN_ROWS if rows >= 2048 else 1)
    return per, per if per > 1 else warps_for(block)


def pdl_available(x: torch.Tensor) -> bool:
    """Whether kernels on x's device can launch dependent (Hopper or later,
    compiled: the interpreter has no grid dependencies)."""
    return (
        triton is not None
        and x.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and hasattr(tl.extra.cuda, "gdc_wait")
    )


def launch_options(pdl: bool) -> dict[str, bool]:
    """A launch's options: with ``pdl``, dependent launch and the programs' wait."""
    return {"GDC": True, "launch_pdl": True} if pdl else {"GDC": False}


def activate_reference(x: torch.Tensor, act: int) -> torch.Tensor:
    if act == ACT_GELU_TANH:
        return F.gelu(x, approximate="tanh")
    if act == ACT_GELU_ERF:
        return F.gelu(x)
    if act == ACT_RELU:
        return F.relu(x)
    return x


def to_e4m3(x: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to ±448 (e4m3fn has no inf: overflow would be NaN),
    in torch ops: what the kernels compute, on any device."""
    scaled = x.float() * inv_scale
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


if triton is not None:

    @triton.jit
    def chain(GDC: tl.constexpr):  # type: ignore[no-untyped-def]
        # Before a kernel reads what any kernel writes: wait for the previous
        # kernel's writes, then let the next kernel launch (no-ops without
        # dependent launch). Kernels read only model weights before it.
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def row_weights(ptr, cols, n_cols):  # type: ignore[no-untyped-def]
        # float32 [BLOCK] of a model weight vector (a bias, a LayerNorm's
        # weight or bias) at cols, 0 past n_cols: loaded before a kernel's
        # wait (no kernel writes weights), off the chain's critical path.
        return tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)

    @triton.jit
    def layer_norm_rows(x, keep, n_cols, eps, w, b):  # type: ignore[no-untyped-def]
        # LayerNorm over the columns of float32 rows x [R, BLOCK] (0 outside
        # keep) with float32 weights w and biases b [BLOCK] (row_weights):
        # every LayerNorm kernel's end.
        mean = tl.sum(x, axis=1) / n_cols
        diff = tl.where(keep, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=1) / n_cols + eps)
        return diff * rstd[:, None] * w[None, :] + b[None, :]

    @triton.jit
    def activate(acc, ACT: tl.constexpr):  # type: ignore[no-untyped-def]
        # ACT_NONE, ACT_GELU_TANH, ACT_GELU_ERF or ACT_RELU of float32 acc.
        if ACT == 1:  # GELU, tanh form: x * sigmoid(2 * sqrt(2/pi) * (x + c x^3))
            inner_x = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
            acc = acc / (1.0 + tl.exp(-inner_x))
        elif ACT == 2:  # GELU, erf form
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif ACT == 3:
            acc = tl.maximum(acc, 0.0)
        return acc

    @triton.jit
    def scaled_e4m3(y, inv_ptr):  # type: ignore[no-untyped-def]
        # float32 y / scale, saturated to e4m3's largest finite value (its
        # float8 type has no inf: an overflow would be NaN); the caller stores
        # it to a float8_e4m3fn tensor, which rounds to nearest even.
        return tl.clamp(y * tl.load(inv_ptr), -448.0, 448.0)
