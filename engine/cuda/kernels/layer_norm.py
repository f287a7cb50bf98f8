"""LayerNorm(x + residual) in one pass; with e4m3 output, or with split-K
partials summed in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cuda.kernels.base import (
    launch_options,
    layer_norm_tiles,
    to_e4m3,
    triton,
    use_triton,
)

if triton is not None:
    from engine.cuda.kernels.base import (
        chain,
        layer_norm_rows,
        row_weights,
        scaled_e4m3,
        tl,
    )

    @triton.jit
    def _add_layer_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, q_ptr, inv_ptr, n_rows, n_cols, eps,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
        GDC: tl.constexpr,
    ):  # fmt: skip
        # With QUANT, the normalized rows are also stored as e4m3 (q_ptr), in
        # the scale the next FP8 matmul reads them with (1 / scale at inv_ptr).
        cols = tl.arange(0, BLOCK)
        w, b = row_weights(w_ptr, cols, n_cols), row_weights(b_ptr, cols, n_cols)
        chain(GDC)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        keep = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        x += tl.load(r_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        y = layer_norm_rows(x, keep, n_cols, eps, w, b)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=keep)
        if QUANT:
            q = scaled_e4m3(y, inv_ptr)
            tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _partials_layer_norm_kernel(  # type: ignore[no-untyped-def]
        p_ptr, bias_ptr, r_ptr, w_ptr, b_ptr, out_ptr, n_rows, n_cols, eps,
        SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        cols = tl.arange(0, BLOCK)
        bias = row_weights(bias_ptr, cols, n_cols)
        w, b = row_weights(w_ptr, cols, n_cols), row_weights(b_ptr, cols, n_cols)
        chain(GDC)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        keep = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(r_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        x += bias[None, :]
        for s in tl.static_range(SPLIT):
            x += tl.load(p_ptr + s * n_rows * n_cols + offsets, mask=keep, other=0.0)
        y = layer_norm_rows(x, keep, n_cols, eps, w, b)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=keep)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    rows_per_program: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """LayerNorm(x + residual) over rows of a contiguous [tokens, hidden].

    Several rows per program once there are many: fewer, fuller programs."""
    if not use_triton(x):
        return F.layer_norm(x + residual, x.shape[-1:], weight, bias, eps)
    out = torch.empty_like(x)
    _add_layer_norm(x, residual, weight, bias, eps, out, None, rows_per_program, pdl)
    return out


def add_layer_norm_e4m3(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x + residual), the same rows as e4m3 over ``1 / inv_scale``):
    the residual stream and the next FP8 matmul's input, in one pass."""
    if not use_triton(x):  # both from the float32 rows, as the kernel does
        rows = F.layer_norm(
            x.float() + residual.float(), x.shape[-1:], weight.float(),
            bias.float(), eps,
        )  # fmt: skip
        return rows.to(x.dtype), to_e4m3(rows, inv_scale)
    out = torch.empty_like(x)
    out8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    _add_layer_norm(x, residual, weight, bias, eps, out, (out8, inv_scale), None, pdl)
    return out, out8


def _add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    quant: tuple[torch.Tensor, torch.Tensor] | None,
    rows_per_program: int | None,
    pdl: bool,
) -> None:
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    per, warps = layer_norm_tiles(rows, block, rows_per_program)
    out8, inv = quant if quant is not None else (out, bias)  # unread without QUANT
    _add_layer_norm_kernel[(triton.cdiv(rows, per),)](
        x, residual, weight, bias, out, out8, inv, rows, cols, eps,
        ROWS=per, BLOCK=block, QUANT=quant is not None,
        num_warps=warps, **launch_options(pdl),
    )  # fmt: skip


def add_layer_norm_partials(
    partials: torch.Tensor | None,
    bias: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    pdl: bool = False,
) -> torch.Tensor:
    """LayerNorm(sum(partials) + bias + residual): the end of a split-K linear
    [split, M, N] float32, the residual [M, N], out in the residual's dtype.

    ``partials`` None: LayerNorm(residual + bias), for a product that has
    added the residual itself (cuBLAS with beta = 1)."""
    if partials is None:
        partials = residual.new_empty((0, *residual.shape), dtype=torch.float32)
    if not use_triton(residual):
        x = partials.sum(0) + bias.float() + residual.float()
        y = F.layer_norm(x, x.shape[-1:], weight.float(), ln_bias.float(), eps)
        return y.to(residual.dtype)
    split, rows, cols = partials.shape
    out = torch.empty_like(residual)
    block = triton.next_power_of_2(cols)
    per, warps = layer_norm_tiles(rows, block)
    _partials_layer_norm_kernel[(triton.cdiv(rows, per),)](
        partials, bias, residual, weight, ln_bias, out, rows, cols, eps,
        SPLIT=split, ROWS=per, BLOCK=block, num_warps=warps, **launch_options(pdl),
    )  # fmt: skip
    return out
