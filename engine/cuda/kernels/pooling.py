"""The float32 mean of each row's real tokens."""

from __future__ import annotations

import torch

from engine.cuda.kernels.base import launch_options, triton, use_triton
from engine.heads import MeanPooling

if triton is not None:
    from engine.cuda.kernels.base import chain, tl

    @triton.jit
    def _mean_pool_kernel(  # type: ignore[no-untyped-def]
        h_ptr, len_ptr, start_ptr, out_ptr, n_cols,
        BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        keep = cols < n_cols
        real = tl.load(len_ptr + row).to(tl.int32)
        steps = tl.arange(0, BLOCK_L)
        base = h_ptr + tl.load(start_ptr + row).to(tl.int64) * n_cols
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, real, BLOCK_L):
            tokens = start + steps
            inside = (tokens[:, None] < real) & keep[None, :]
            where = base + tokens[:, None] * n_cols + cols[None, :]
            total += tl.sum(tl.load(where, mask=inside, other=0.0).to(tl.float32), 0)
        mean = total / tl.maximum(real, 1).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, mean, mask=keep)


def mean_pool(
    hidden: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [B, H]: the mean of each row's first ``lengths`` states (0 -> zeros).

    hidden is [B, L, H], or packed [tokens, H] with row b from ``starts[b]``;
    written into ``out`` (contiguous float32 [B, H]) when given."""
    if out is not None:
        want = (lengths.shape[0], hidden.shape[-1])
        if out.shape != want or out.dtype != torch.float32:
            raise ValueError(
                f"out must be float32 [{want[0]}, {want[1]}], got {out.dtype} "
                f"{tuple(out.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if not use_triton(hidden):
            return out.copy_(mean_pool(hidden, lengths, starts))
    if starts is None:
        batch, length, cols = hidden.shape
        if not use_triton(hidden):
            return MeanPooling()(hidden, lengths)
        starts = torch.arange(
            0, batch * length, length, dtype=torch.int32, device=hidden.device
        )
    else:
        batch, cols = lengths.shape[0], hidden.shape[-1]
        if not use_triton(hidden):
            at = torch.arange(int(lengths.max().clamp(min=1)), device=hidden.device)
            where = (starts[:-1, None].long() + at[None, :]).clamp(max=len(hidden) - 1)
            inside = (at[None, :] < lengths[:, None])[..., None]
            rows = torch.where(inside, hidden[where], 0)  # not 0 * whatever is there
            return MeanPooling()(rows, lengths)
    if out is None:
        out = torch.empty(batch, cols, dtype=torch.float32, device=hidden.device)
    # rows x column blocks: many programs. 32-column blocks of 2 warps: 10.6 us
    # at 128 x 128 x 768 on the H200 against 18.4 for 128 columns of 4 warps
    # (inside CUDA graphs).
    grid = (batch, triton.cdiv(cols, 32))
    _mean_pool_kernel[grid](
        hidden, lengths, starts, out, cols, BLOCK_L=32, BLOCK_H=32, num_warps=2,
        **launch_options(pdl),
    )  # fmt: skip
    return out
