"""x W^T + b (GELU or ReLU after it) for few tokens, and the plan of which
projections take it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cuda.kernels.base import (
    ACT_NONE,
    activate_reference,
    launch_options,
    triton,
    use_triton,
)
from engine.cuda.tiles import LinearConfig, tables_for

if triton is not None:
    from engine.cuda.kernels.base import activate, chain, row_weights, tl

    @triton.jit
    def _linear_bias(b_ptr, cols, N, SPLIT: tl.constexpr):  # type: ignore[no-untyped-def]
        # A linear program's bias (row_weights; none for split-K partials).
        if SPLIT > 1:
            bias = tl.zeros(cols.shape, dtype=tl.float32)
        else:
            bias = row_weights(b_ptr, cols, N)
        return bias

    @triton.jit
    def _linear_store(  # type: ignore[no-untyped-def]
        acc, rows, cols, bias, out_ptr, M, N,
        ACT: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        # A linear program's end: float32 partial of K slice program_id(2) to
        # out [s, M, N] (SPLIT > 1), or act(acc + bias) to out [M, N].
        keep = (rows[:, None] < M) & (cols[None, :] < N)
        where = rows[:, None].to(tl.int64) * N + cols[None, :]
        if SPLIT > 1:
            part = out_ptr + tl.program_id(2).to(tl.int64) * M * N
            tl.store(part + where, acc, mask=keep)
        else:
            acc += bias[None, :]
            acc = activate(acc, ACT)
            tl.store(out_ptr + where, acc.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _linear_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_slice,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        ACT: tl.constexpr, SPLIT: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # out [M, N] = act(x [M, K] @ w [N, K]^T + b); with SPLIT > 1, program
        # (m, n, s) writes the float32 partial of K slice s to out [s, M, N].
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        bias = _linear_bias(b_ptr, cols, N, SPLIT)
        chain(GDC)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        inner = tl.arange(0, BLOCK_K)
        first = tl.program_id(2) * k_slice
        x_at = x_ptr + rows[:, None].to(tl.int64) * K + (first + inner)[None, :]
        w_at = w_ptr + cols[None, :].to(tl.int64) * K + (first + inner)[:, None]
        row_in, col_in = rows[:, None] < M, cols[None, :] < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(0, k_slice, BLOCK_K):  # K % (SPLIT * BLOCK_K) == 0
            a = tl.load(x_at, mask=row_in, other=0.0)
            b = tl.load(w_at, mask=col_in, other=0.0)
            acc = tl.dot(a, b, acc)
            x_at += BLOCK_K
            w_at += BLOCK_K
        _linear_store(acc, rows, cols, bias, out_ptr, M, N, ACT, SPLIT)

    @triton.jit
    def _linear_preload_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_slice,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
        CHUNKS: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
        GDC: tl.constexpr,
    ):  # fmt: skip
        # _linear_kernel's product with the program's whole weight slice
        # (CHUNKS x CHUNK of K, at most 4) loaded before it waits for the
        # previous kernel: no kernel writes weights, so they may be read
        # early, while the predecessor still runs (dependent launch). x is
        # read after the wait.
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols[None, :] < N
        first = tl.program_id(2) * k_slice
        inner = tl.arange(0, CHUNK)
        w_at = w_ptr + cols[None, :].to(tl.int64) * K + (first + inner)[:, None]
        w0 = tl.load(w_at, mask=col_in, other=0.0)
        if CHUNKS > 1:
            w1 = tl.load(w_at + CHUNK, mask=col_in, other=0.0)
        if CHUNKS > 2:
            w2 = tl.load(w_at + 2 * CHUNK, mask=col_in, other=0.0)
        if CHUNKS > 3:
            w3 = tl.load(w_at + 3 * CHUNK, mask=col_in, other=0.0)
        bias = _linear_bias(b_ptr, cols, N, SPLIT)
        chain(GDC)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_in = rows[:, None] < M
        x_at = x_ptr + rows[:, None].to(tl.int64) * K + (first + inner)[None, :]
        # x chunk c + 1 is loaded before chunk c's product, so its read is in
        # flight while that product runs. Triton keeps the source's order and
        # waits for a product before any load written after it. Every chunk
        # loaded first would hold them all in shared memory at once: over the
        # H200's 227 KB with 128 x 32 tiles over K = 768.
        a0 = tl.load(x_at, mask=row_in, other=0.0)
        if CHUNKS > 1:
            a1 = tl.load(x_at + CHUNK, mask=row_in, other=0.0)
        acc = tl.dot(a0, w0)
        if CHUNKS > 2:
            a2 = tl.load(x_at + 2 * CHUNK, mask=row_in, other=0.0)
        if CHUNKS > 1:
            acc = tl.dot(a1, w1, acc)
        if CHUNKS > 3:
            a3 = tl.load(x_at + 3 * CHUNK, mask=row_in, other=0.0)
        if CHUNKS > 2:
            acc = tl.dot(a2, w2, acc)
        if CHUNKS > 3:
            acc = tl.dot(a3, w3, acc)
        _linear_store(acc, rows, cols, bias, out_ptr, M, N, ACT, SPLIT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: int = ACT_NONE,
    config: LinearConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """act(x W^T + b) for x [M, K], weight [N, K] (nn.Linear's layout).

    With ``config.preload`` the kernel reads ``weight`` before it waits for
    the previous kernel (``pdl``): no work still queued may write it (model
    weights, written at load).

    With ``config.split`` > 1: float32 partial products [split, M, N], no bias,
    no activation, for :func:`add_layer_norm_partials` to finish."""
    config = config or LinearConfig()
    rows, k = x.shape
    n = weight.shape[0]
    if config.split > 1 and activation != ACT_NONE:
        raise ValueError("split-K partials take no activation")
    if not use_triton(x) or not config.fits(k):
        if config.split > 1:  # one "partial": the whole product
            return (x.float() @ weight.float().t()).unsqueeze(0)
        return activate_reference(F.linear(x, weight, bias), activation)
    if config.split > 1:
        out = torch.empty(config.split, rows, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (
        triton.cdiv(rows, config.block_m),
        triton.cdiv(n, config.block_n),
        config.split,
    )
    b = weight if bias is None else bias
    k_slice = k // config.split
    if config.preload:
        _linear_preload_kernel[grid](
            x, weight, b, out, rows, n, k, k_slice,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, CHUNK=config.block_k,
            CHUNKS=k_slice // config.block_k, ACT=activation, SPLIT=config.split,
            num_warps=config.warps, num_stages=config.stages, **launch_options(pdl),
        )  # fmt: skip
        return out
    _linear_kernel[grid](
        x, weight, b, out, rows, n, k, k_slice,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        ACT=activation, SPLIT=config.split,
        num_warps=config.warps, num_stages=config.stages, **launch_options(pdl),
    )  # fmt: skip
    return out


def small_linear_plan(
    weight: torch.Tensor, tokens: int, hidden: int, inner: int, preload: bool = False
) -> dict[str, LinearConfig]:
    """projection -> tiles, for the projections ``linear`` runs faster than
    cuBLAS at this many tokens (empty without Triton, and for device kinds
    or sizes with no tiles: engine/cuda/tiles.py); with ``preload``, the
    preloading table's tiles, or {} past that table or where one of its
    projections does not fit (that plan is taken whole: a cuBLAS launch
    among the preloading GEMMs costs more than the plan saves)."""
    if not (use_triton(weight) and weight.is_cuda):
        return {}
    tables = tables_for(torch.cuda.get_device_capability(weight.device))
    table = tables.preload if preload else tables.small
    plan = {}
    for name in ("qkv", "out", "ffn_in", "ffn_out"):
        k = inner if name == "ffn_out" else hidden
        for limit, config in table.get((name, hidden), []):
            if tokens <= limit:
                if config.fits(k):
                    plan[name] = config
                break
    if preload and len(plan) < 4:
        return {}
    return plan
