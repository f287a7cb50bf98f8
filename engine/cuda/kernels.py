"""Triton kernels of the fused forward, each with a plain-torch fallback.

- ``add_layer_norm``: LayerNorm(x + residual), one pass;
  ``add_layer_norm_e4m3`` also writes the rows as the next FP8 product's
  e4m3 input;
- ``quantize_e4m3``: act(x) / scale as e4m3, one pass (an FP8 product's
  input where its producer cannot write e4m3 itself);
- ``embed_with_lengths``: word + position + type-0 embeddings, then
  LayerNorm, and the rows' lengths copied (``embed_packed``: rows packed);
- ``mean_pool``: the float32 mean of each row's real tokens;
- ``attention``: softmax(QK^T / sqrt(d)) V straight from the fused QKV
  projection, keys cut at each row's length, key blocks past it skipped;
- ``linear``: x W^T + b (GELU or ReLU after it) for few tokens, where
  cuBLAS's tiles leave most SMs idle; with ``split`` > 1 the K range is cut
  into slices whose float32 partial products ``add_layer_norm_partials``
  sums, with the bias and the residual, before its LayerNorm (no separate
  split-K reduction, no memset).

Every kernel takes ``pdl``: programmatic dependent launch (Hopper and
later), the kernel launched while its predecessor still runs, each program
waiting for the predecessor's writes (``gdc_wait``) before it reads
anything, then letting its own successor launch (``gdc_launch_dependents``).
A chain of such kernels overlaps each launch with the previous kernel's
tail, what a few-token forward of ~90 short kernels spends much of its time
in (notes/gpu.md). Every program of every such kernel waits before it
reads anything a kernel writes, so the ordering stays transitive: a kernel
reading what two kernels back wrote is safe. What kernels read before they
wait is model weights, which no kernel writes, so they stream in while the
predecessor runs: biases, LayerNorm weights, position embeddings, and with
``LinearConfig.preload`` ``linear``'s whole weight slice.

Without Triton (the CPU build of torch) or off the GPU each falls back to
torch ops, so the module imports and computes everywhere; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests of the kernels
themselves).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.encoder import Embeddings
from engine.heads import MeanPooling

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

# Rows per LayerNorm program on large batches, one warp each. H200, 16384 x
# 768 with the residual added (session 17's probe, CUDA graphs): 2 rows on
# 2 warps 14.0 us, 4 on 4 14.5, against 19.5 for 4 rows on 8 warps (the
# rule before) and 12.7 for a plain copy of the rows.
LN_ROWS = 2
# float8_e4m3fn's largest finite value.
E4M3_MAX = 448.0

# ``linear``'s activations (a constexpr of the kernel).
ACT_NONE, ACT_GELU_TANH, ACT_GELU_ERF, ACT_RELU = 0, 1, 2, 3


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (
        x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    )


def _warps(elements: int) -> int:
    return max(1, min(8, elements // 256))


def _layer_norm_tiles(rows: int, block: int, per: int | None = None) -> tuple[int, int]:
    """(rows per program, warps) of a LayerNorm kernel over ``rows`` rows of
    ``block`` columns: one row on block / 256 warps at few rows (the batch-1
    chain's best, session 15), LN_ROWS rows (or ``per``) on a warp each on
    large batches."""
    per = per or (LN_ROWS if rows >= 2048 else 1)
    return per, per if per > 1 else _warps(block)


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


def _launch(pdl: bool) -> dict[str, bool]:
    """A launch's options: with ``pdl``, dependent launch and the programs' wait."""
    return {"GDC": True, "launch_pdl": True} if pdl else {"GDC": False}


if triton is not None:

    @triton.jit
    def _chain(GDC: tl.constexpr):  # type: ignore[no-untyped-def]
        # Before a kernel reads what any kernel writes: wait for the previous
        # kernel's writes, then let the next kernel launch (no-ops without
        # dependent launch). Kernels read only model weights before it.
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _row_weights(ptr, cols, n_cols):  # type: ignore[no-untyped-def]
        # float32 [BLOCK] of a model weight vector (a bias, a LayerNorm's
        # weight or bias) at cols, 0 past n_cols: loaded before a kernel's
        # wait (no kernel writes weights), off the chain's critical path.
        return tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)

    @triton.jit
    def _layer_norm(x, keep, n_cols, eps, w, b):  # type: ignore[no-untyped-def]
        # LayerNorm over the columns of float32 rows x [R, BLOCK] (0 outside
        # keep) with float32 weights w and biases b [BLOCK] (_row_weights):
        # every LayerNorm kernel's end.
        mean = tl.sum(x, axis=1) / n_cols
        diff = tl.where(keep, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=1) / n_cols + eps)
        return diff * rstd[:, None] * w[None, :] + b[None, :]

    @triton.jit
    def _activate(acc, ACT: tl.constexpr):  # type: ignore[no-untyped-def]
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
    def _e4m3(y, inv_ptr):  # type: ignore[no-untyped-def]
        # float32 y / scale, saturated to e4m3's largest finite value (its
        # float8 type has no inf: an overflow would be NaN); the caller stores
        # it to a float8_e4m3fn tensor, which rounds to nearest even.
        return tl.clamp(y * tl.load(inv_ptr), -448.0, 448.0)

    @triton.jit
    def _add_layer_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, q_ptr, inv_ptr, n_rows, n_cols, eps,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
        GDC: tl.constexpr,
    ):  # fmt: skip
        # With QUANT, the normalized rows are also stored as e4m3 (q_ptr), in
        # the scale the next FP8 matmul reads them with (1 / scale at inv_ptr).
        cols = tl.arange(0, BLOCK)
        w, b = _row_weights(w_ptr, cols, n_cols), _row_weights(b_ptr, cols, n_cols)
        _chain(GDC)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        keep = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        x += tl.load(r_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        y = _layer_norm(x, keep, n_cols, eps, w, b)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=keep)
        if QUANT:
            q = _e4m3(y, inv_ptr)
            tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _quantize_e4m3_kernel(  # type: ignore[no-untyped-def]
        x_ptr, out_ptr, inv_ptr, n,
        ACT: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # out = e4m3(act(x) / scale), elementwise over n values.
        _chain(GDC)
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + at, mask=at < n, other=0.0).to(tl.float32)
        q = _e4m3(_activate(x, ACT), inv_ptr)
        tl.store(out_ptr + at, q.to(out_ptr.dtype.element_ty), mask=at < n)

    @triton.jit
    def _embed_layer_norm_kernel(  # type: ignore[no-untyped-def]
        ids_ptr, len_ptr, side_ptr, word_ptr, pos_ptr, type_ptr, w_ptr, b_ptr,
        out_ptr, length, n_rows, n_cols, vocab, eps,
        BLOCK: tl.constexpr, PACKED: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # Program p: token p % L of row p // L. PACKED: stored at its row's
        # start (side_ptr: the starts) + p % L when inside the row (lengths
        # >= 1 here), nothing otherwise. Padded: stored at p, and program
        # p < B copies row p's length, clamped to [0, L], to side_ptr. Ids are
        # clamped to [0, vocab): no input makes this kernel read outside the
        # table (the engine may check a batch's values after launching it).
        pid = tl.program_id(0)
        position = pid % length
        cols = tl.arange(0, BLOCK)
        keep = (cols < n_cols)[None, :]  # one row: [1, BLOCK]
        w, b = _row_weights(w_ptr, cols, n_cols), _row_weights(b_ptr, cols, n_cols)
        x = _row_weights(pos_ptr + position * n_cols, cols, n_cols)[None, :]
        x += _row_weights(type_ptr, cols, n_cols)[None, :]
        _chain(GDC)
        if not PACKED:  # noqa: SIM102 (a compile-time branch, then a runtime one)
            if pid < n_rows:
                used = tl.minimum(tl.maximum(tl.load(len_ptr + pid), 0), length)
                tl.store(side_ptr + pid, used)
        at = pid.to(tl.int64)
        if PACKED:
            row = pid // length
            if position >= tl.load(len_ptr + row):
                return
            at = tl.load(side_ptr + row).to(tl.int64) + position
        token = tl.load(ids_ptr + pid.to(tl.int64)).to(tl.int64)
        token = tl.minimum(tl.maximum(token, 0), vocab - 1)
        word = tl.load(word_ptr + token * n_cols + cols[None, :], mask=keep, other=0.0)
        x += word.to(tl.float32)
        y = _layer_norm(x, keep, n_cols, eps, w, b)
        where = out_ptr + at * n_cols + cols[None, :]
        tl.store(where, y.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _mean_pool_kernel(  # type: ignore[no-untyped-def]
        h_ptr, len_ptr, start_ptr, out_ptr, n_cols,
        BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        _chain(GDC)
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

    @triton.jit
    def _attention_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr, len_ptr, start_ptr, out_ptr, length, heads, scale,
        HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PACKED: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # One program: BLOCK_M queries of one (row, head); qkv is [tokens, 3,
        # heads, HEAD] (the QKV projection's output), out [tokens, heads, HEAD];
        # row b's tokens start at start_ptr[b]. Padded rows (B x L) have L
        # queries each; packed rows only their own (the rest is not computed).
        _chain(GDC)
        row = tl.program_id(1) // heads
        head = tl.program_id(1) % heads
        hidden = heads * HEAD
        keys = tl.maximum(tl.load(len_ptr + row).to(tl.int32), 1)
        rows_queries = keys if PACKED else length
        if tl.program_id(0) * BLOCK_M >= rows_queries:
            return
        queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD)
        first = tl.load(start_ptr + row).to(tl.int64)
        base = qkv_ptr + first * 3 * hidden + head * HEAD
        q = tl.load(
            base + queries[:, None] * 3 * hidden + dims[None, :],
            mask=queries[:, None] < rows_queries,
            other=0.0,
        )
        best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
        for start in range(0, keys, BLOCK_N):  # key blocks past the row's end: none
            cols = start + tl.arange(0, BLOCK_N)
            inside = cols < keys
            where = base + cols[:, None] * 3 * hidden + dims[None, :]
            k = tl.load(where + hidden, mask=inside[:, None], other=0.0)
            v = tl.load(where + 2 * hidden, mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # log2 units
            s = tl.where(inside[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, 1))
            p = tl.exp2(s - new_best[:, None])
            alpha = tl.exp2(best - new_best)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
        out = out_ptr + first * hidden + head * HEAD
        result = (acc / total[:, None]).to(out_ptr.dtype.element_ty)
        where_out = out + queries[:, None] * hidden + dims[None, :]
        tl.store(where_out, result, mask=queries[:, None] < rows_queries)

    @triton.jit
    def _linear_bias(b_ptr, cols, N, SPLIT: tl.constexpr):  # type: ignore[no-untyped-def]
        # A linear program's bias (_row_weights; none for split-K partials).
        if SPLIT > 1:
            bias = tl.zeros(cols.shape, dtype=tl.float32)
        else:
            bias = _row_weights(b_ptr, cols, N)
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
            acc = _activate(acc, ACT)
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
        _chain(GDC)
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
        _chain(GDC)
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

    @triton.jit
    def _partials_layer_norm_kernel(  # type: ignore[no-untyped-def]
        p_ptr, bias_ptr, r_ptr, w_ptr, b_ptr, out_ptr, n_rows, n_cols, eps,
        SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        cols = tl.arange(0, BLOCK)
        bias = _row_weights(bias_ptr, cols, n_cols)
        w, b = _row_weights(w_ptr, cols, n_cols), _row_weights(b_ptr, cols, n_cols)
        _chain(GDC)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        keep = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(r_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        x += bias[None, :]
        for s in tl.static_range(SPLIT):
            x += tl.load(p_ptr + s * n_rows * n_cols + offsets, mask=keep, other=0.0)
        y = _layer_norm(x, keep, n_cols, eps, w, b)
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
    per, warps = _layer_norm_tiles(rows, block, rows_per_program)
    out8, inv = quant if quant is not None else (out, bias)  # unread without QUANT
    _add_layer_norm_kernel[(triton.cdiv(rows, per),)](
        x, residual, weight, bias, out, out8, inv, rows, cols, eps,
        ROWS=per, BLOCK=block, QUANT=quant is not None,
        num_warps=warps, **_launch(pdl),
    )  # fmt: skip


# Values per program of quantize_e4m3.
QUANT_BLOCK = 2048


def quantize_e4m3(
    x: torch.Tensor, inv_scale: torch.Tensor, act: int = ACT_NONE, pdl: bool = False
) -> torch.Tensor:
    """e4m3(act(x) / scale) in one pass (``inv_scale`` = 1 / scale, a device
    scalar, so a CUDA graph keeps reading the current one): the input of an
    FP8 matmul whose producer cannot write e4m3 itself."""
    if not use_triton(x):
        return to_e4m3(_activate_reference(x.float(), act), inv_scale)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    _quantize_e4m3_kernel[(triton.cdiv(n, QUANT_BLOCK),)](
        x, out, inv_scale, n, ACT=act, BLOCK=QUANT_BLOCK, num_warps=4, **_launch(pdl)
    )
    return out


def _activate_reference(x: torch.Tensor, act: int) -> torch.Tensor:
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


def embed_with_lengths(
    emb: Embeddings, ids: torch.Tensor, lengths: torch.Tensor, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B*L, H]: the embeddings module's output for ids [B, L], flattened;
    lengths [B] copied into new device memory, clamped to [0, L]), from one
    kernel: ids and lengths may live in a device-mapped host buffer (a
    zero-copy graph's input), read once over PCIe by this kernel and never
    again, with no copy kernel before it."""
    if not use_triton(emb.word.weight):
        return emb(ids).flatten(0, 1), lengths
    out = _embed_out(emb, ids.numel(), ids.device)
    copied = torch.empty_like(lengths)
    _embed(emb, ids, lengths, out, pdl, copied=copied)
    return out, copied


def _embed_out(emb: Embeddings, tokens: int, device: torch.device) -> torch.Tensor:
    cols = emb.word.weight.shape[1]
    return torch.empty(tokens, cols, dtype=emb.word.weight.dtype, device=device)


def embed_packed(
    emb: Embeddings,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    tokens: int,
    pdl: bool = False,
) -> torch.Tensor:
    """[tokens, H]: row b's first lengths[b] embeddings at starts[b] onwards, for
    ids [B, L] and lengths >= 1; rows past the last row's end are not written."""
    batch, length = ids.shape
    out = _embed_out(emb, tokens, ids.device)
    if not use_triton(emb.word.weight):
        padded = emb(ids).flatten(0, 1)
        at = torch.arange(length, device=ids.device)
        inside = (at[None, :] < lengths[:, None]).flatten()
        where = (starts[:-1, None].long() + at[None, :]).flatten()[inside]
        out[where] = padded[inside]
        return out
    _embed(emb, ids, lengths, out, pdl, starts=starts)
    return out


def _embed(
    emb: Embeddings,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    pdl: bool,
    starts: torch.Tensor | None = None,
    copied: torch.Tensor | None = None,
) -> None:
    """The embeddings kernel over ids [B, L] into out: packed from lengths
    and ``starts``, or padded, lengths clamped into ``copied``."""
    side = starts if starts is not None else copied
    if side is None:
        raise ValueError("packed rows need their starts, padded ones a lengths copy")
    cols = emb.word.weight.shape[1]
    block = triton.next_power_of_2(cols)
    _embed_layer_norm_kernel[(ids.numel(),)](
        ids, lengths, side, emb.word.weight, emb.position.weight[emb.offset :],
        emb.token_type, emb.norm.weight, emb.norm.bias, out, ids.shape[1],
        ids.shape[0], cols, emb.word.weight.shape[0], emb.norm.eps, BLOCK=block,
        num_warps=_warps(block), PACKED=starts is not None, **_launch(pdl),
    )  # fmt: skip


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
        **_launch(pdl),
    )  # fmt: skip
    return out


def attention(
    qkv: torch.Tensor,
    lengths: torch.Tensor,
    batch: int,
    length: int,
    heads: int,
    block_m: int | None = None,
    block_n: int = 64,
    starts: torch.Tensor | None = None,
    packed: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention output [tokens, H] from qkv [tokens, 3H]; lengths [B] (a row
    of length 0 attends to its first token, as if 1).

    Row b's tokens start at ``starts[b]`` (int32 [B + 1]; default b * L). Padded
    (tokens = B * L): every one of a row's L queries is computed, keys cut at
    its length. ``packed``: rows follow each other (starts = the cumulative
    lengths), only a row's own queries are computed, later tokens are not."""
    head = qkv.shape[1] // (3 * heads)
    if starts is None:
        if packed:
            raise ValueError("packed rows need their starts")
        starts = torch.arange(0, batch * length, length, device=qkv.device)
        starts = starts.to(torch.int32)
    out = torch.empty(qkv.shape[0], heads * head, dtype=qkv.dtype, device=qkv.device)
    if not use_triton(qkv):
        return _attention_reference(qkv, lengths, starts, out, length, heads, packed)
    block_m = block_m or 64  # benchmarks/small_gemm.py: 64 beat 16, 32, 128 or tied
    grid = (triton.cdiv(length, block_m), batch * heads)
    _attention_kernel[grid](
        qkv, lengths, starts, out, length, heads, math.log2(math.e) / math.sqrt(head),
        HEAD=head, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=8 if block_m == 128 else 4,
        num_stages=2, PACKED=packed, **_launch(pdl),
    )  # fmt: skip
    return out


def _attention_reference(
    qkv: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    out: torch.Tensor,
    length: int,
    heads: int,
    packed: bool,
) -> torch.Tensor:
    """SDPA row by row: what the kernel computes, slowly, on any device."""
    head = qkv.shape[1] // (3 * heads)
    for row in range(len(lengths)):
        first, keys = int(starts[row]), max(int(lengths[row]), 1)
        queries = keys if packed else length
        rows = qkv[first : first + queries].view(queries, 3, heads, head)
        q, k, v = rows.permute(1, 2, 0, 3)
        context = F.scaled_dot_product_attention(q, k[:, :keys], v[:, :keys])
        out[first : first + queries] = context.transpose(0, 1).reshape(queries, -1)
    return out


# A preloading ``linear`` program holds at most this many K chunks of weights.
PRELOAD_CHUNKS = 4


class LinearConfig(NamedTuple):
    """Tiles of one ``linear`` launch: BLOCK_M x BLOCK_N outputs per program,
    K in BLOCK_K steps, cut into ``split`` slices (float32 partials)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split: int = 1
    warps: int = 4
    stages: int = 3
    # The program's weight slice loaded whole (in block_k chunks, at most
    # PRELOAD_CHUNKS) before it waits for the previous kernel.
    preload: bool = False

    def fits(self, k: int) -> bool:
        if k % (self.split * self.block_k):
            return False
        return not self.preload or k // self.split // self.block_k <= PRELOAD_CHUNKS


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
        return _activate_reference(F.linear(x, weight, bias), activation)
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
            num_warps=config.warps, num_stages=config.stages, **_launch(pdl),
        )  # fmt: skip
        return out
    _linear_kernel[grid](
        x, weight, b, out, rows, n, k, k_slice,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        ACT=activation, SPLIT=config.split,
        num_warps=config.warps, num_stages=config.stages, **_launch(pdl),
    )  # fmt: skip
    return out


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
    per, warps = _layer_norm_tiles(rows, block)
    _partials_layer_norm_kernel[(triton.cdiv(rows, per),)](
        partials, bias, residual, weight, ln_bias, out, rows, cols, eps,
        SPLIT=split, ROWS=per, BLOCK=block, num_warps=warps, **_launch(pdl),
    )  # fmt: skip
    return out


# Few-token tiles where ``linear`` beat cuBLAS by 5 % or more inside CUDA
# graphs on the H200 (benchmarks/small_gemm.py, results/small_gemm_h200.json):
# (projection, hidden size) -> [(up to this many tokens, tiles)], cuBLAS past
# the last. Projections: qkv, out (+ residual + LayerNorm), ffn_in (+ GELU),
# ffn_out (+ residual + LayerNorm). Measured on Hopper only: used there only.
SMALL_LINEAR: dict[tuple[str, int], list[tuple[int, LinearConfig]]] = {
    ("out", 768): [
        (16, LinearConfig(16, 32, 64, 4)),
        (32, LinearConfig(32, 32, 64, 4)),
        (64, LinearConfig(64, 32, 64, 3)),
        (128, LinearConfig(64, 32, 64, 2)),
    ],
    ("ffn_out", 768): [
        (16, LinearConfig(16, 32, 64, 6)),
        (64, LinearConfig(64, 32, 64, 4)),
        (128, LinearConfig(128, 64, 64, 6, warps=8)),
        (256, LinearConfig(128, 64, 64, 4, warps=8)),
    ],
    ("qkv", 384): [
        (16, LinearConfig(16, 32, 64, 1)),
        (128, LinearConfig(64, 32, 64, 1)),
        (256, LinearConfig(64, 64, 64, 1)),
    ],
    ("out", 384): [
        (32, LinearConfig(16, 32, 64, 3)),
        (128, LinearConfig(64, 32, 64, 3)),
        (256, LinearConfig(64, 32, 64, 2)),
        (512, LinearConfig(64, 32, 64, 1)),
    ],
    ("ffn_in", 384): [
        (32, LinearConfig(16, 32, 64, 1)),
        (64, LinearConfig(32, 32, 64, 1)),
        (128, LinearConfig(64, 32, 64, 1)),
    ],
    ("ffn_out", 384): [
        (16, LinearConfig(16, 32, 64, 6)),
        (64, LinearConfig(64, 32, 64, 6)),
        (128, LinearConfig(64, 32, 64, 4)),
        (256, LinearConfig(64, 64, 64, 4)),
    ],
}


def _preloaded(
    rows: list[tuple[int, int, int, int, int]],
) -> list[tuple[int, LinearConfig]]:
    """PRELOAD_LINEAR's rows for up to 16, 32, 64 and 128 tokens, from
    (block_m, block_n, K chunk, split, warps) each."""
    return [
        (limit, LinearConfig(bm, bn, chunk, split, warps, preload=True))
        for limit, (bm, bn, chunk, split, warps) in zip(
            (16, 32, 64, 128), rows, strict=True
        )
    ]


# Every projection as a preloading ``linear`` (its weights read before it
# waits for the previous kernel), so a few-token forward is one unbroken chain
# of dependent launches in which each GEMM's weights stream in while the
# kernel before it runs. H200, whole forwards in CUDA graphs against the
# SMALL_LINEAR plan (probes of session 14, notes/gpu.md): BERT-base 1 x 16
# 1.23x, 1 x 32 1.28x, 1 x 64 1.03x, 1 x 128 1.06x, but 8 x 16 0.95x; MiniLM
# 1 x 16 1.12x, 1 x 64 1.06x, 1 x 128 0.99x. Neither plan wins every shape,
# so the engine times both per shape at capture (FusedForward.choose_plan).
# At BERT-base 1 x 128 all four preloading measured best (1.055x); QKV or
# FFN-in alone among the other plan's GEMMs was slower (0.997x, 0.967x), and
# one loop kernel among the preloading ones cost more than the plan saves
# (0.88x): the plan is taken whole. Rows: (block_m, block_n, K chunk, split,
# warps) at up to 16, 32, 64 and 128 tokens (_preloaded).
_BERT_BASE_IN = [  # QKV, and FFN-in but at up to 64 tokens
    (16, 32, 256, 1, 8),
    (32, 32, 256, 1, 4),
    (64, 32, 256, 1, 4),
    (128, 32, 256, 1, 8),
]
_BLOCK_M = (16, 32, 64, 64)  # every MiniLM projection
PRELOAD_LINEAR: dict[tuple[str, int], list[tuple[int, LinearConfig]]] = {
    ("qkv", 768): _preloaded(_BERT_BASE_IN),
    # FFN-in on 64 columns at up to 64 tokens: 1 x 64 1.023x in session 18's
    # tile search (benchmarks/preload_tiles.py), confirmed in session 19's.
    ("ffn_in", 768): _preloaded(
        [*_BERT_BASE_IN[:2], (64, 64, 256, 1, 4), _BERT_BASE_IN[3]]
    ),
    # 64 columns a program. With x read one chunk ahead (session 17's probes,
    # whole forwards in turn, against 32 columns in 2 slices of 128): 1 x 16
    # to 1 x 64 0.4-1.4 % faster, 1 x 128 and 8 x 16 2.9-4.6 % (4 slices gave
    # those two 0.2-1.2 %). With the earlier kernel every change was slower.
    # K in 8 slices of 32-wide chunks up to 32 tokens (1 x 16 1.021x, 1 x 32
    # 1.024x against 4 of 64 in session 18's tile search, confirmed in session
    # 19's), 4 of 64 at 64 and 2 of 128 at 128.
    ("out", 768): _preloaded(
        [
            (16, 64, 32, 8, 4),
            (32, 64, 32, 8, 4),
            (64, 64, 64, 4, 4),
            (64, 64, 128, 2, 4),
        ]
    ),
    # K in 12 slices of 128-wide chunks up to 64 tokens (1 x 16 1.018x, 1 x 32
    # 1.012x, 1 x 64 1.017x against 6 of 256 in session 19's tile search, on
    # the attention-out and FFN-in tiles above; confirmed in a second run),
    # 6 of 256 at 128.
    ("ffn_out", 768): _preloaded(
        [
            (16, 64, 128, 12, 8),
            (32, 64, 128, 12, 4),
            (64, 64, 128, 12, 4),
            (128, 64, 256, 6, 8),
        ]
    ),
    ("qkv", 384): _preloaded([(bm, 32, 128, 1, 4) for bm in _BLOCK_M]),
    ("ffn_in", 384): _preloaded([(bm, 32, 128, 1, 4) for bm in _BLOCK_M]),
    ("out", 384): _preloaded([(bm, 32, 128, 3, 4) for bm in _BLOCK_M]),
    ("ffn_out", 384): _preloaded([(bm, 32, 256, 6, 4) for bm in _BLOCK_M]),
}


def small_linear_plan(
    weight: torch.Tensor, tokens: int, hidden: int, inner: int, preload: bool = False
) -> dict[str, LinearConfig]:
    """projection -> tiles, for the projections ``linear`` runs faster than
    cuBLAS at this many tokens (empty off Hopper, without Triton, or for
    sizes never measured); with ``preload``, PRELOAD_LINEAR's tiles, or {}
    past that table or where one of its projections does not fit."""
    if not (use_triton(weight) and weight.is_cuda):
        return {}
    if torch.cuda.get_device_capability(weight.device) != (9, 0):
        return {}
    table = PRELOAD_LINEAR if preload else SMALL_LINEAR
    plan = {}
    for name in ("qkv", "out", "ffn_in", "ffn_out"):
        k = inner if name == "ffn_out" else hidden
        for limit, config in table.get((name, hidden), []):
            if tokens <= limit:
                if config.fits(k):
                    plan[name] = config
                break
    if preload and len(plan) < 4:  # taken whole (PRELOAD_LINEAR's comment)
        return {}
    return plan
