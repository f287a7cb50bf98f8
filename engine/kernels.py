"""Triton kernels of the fused forward, each with a plain-torch fallback.

- ``add_layer_norm``: LayerNorm(x + residual), one pass;
- ``embed_layer_norm``: word + position + type-0 embeddings, then LayerNorm;
- ``mean_pool``: the float32 mean of each row's real tokens;
- ``attention``: softmax(QK^T / sqrt(d)) V straight from the fused QKV
  projection, keys cut at each row's length, key blocks past it skipped.

Without Triton (the CPU build of torch) or off the GPU each falls back to
torch ops, so the module imports and computes everywhere; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests of the kernels
themselves).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from engine.encoder import Embeddings
from engine.heads import MeanPooling

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

# Rows per add + LayerNorm program on large batches (benchmarks/engine.py probes).
LN_ROWS = 4


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (
        x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    )


def _warps(elements: int) -> int:
    return max(1, min(8, elements // 256))


if triton is not None:

    @triton.jit
    def _add_layer_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, n_rows, n_cols, eps,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        keep = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        x += tl.load(r_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / n_cols
        diff = tl.where(keep, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=1) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = diff * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _embed_layer_norm_kernel(  # type: ignore[no-untyped-def]
        ids_ptr, word_ptr, pos_ptr, type_ptr, w_ptr, b_ptr, out_ptr,
        length, n_cols, eps, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        token = tl.load(ids_ptr + row).to(tl.int64)
        position = row % length
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(word_ptr + token * n_cols + cols, mask=keep, other=0.0)
        x = x.to(tl.float32)
        x += tl.load(pos_ptr + position * n_cols + cols, mask=keep, other=0.0)
        x += tl.load(type_ptr + cols, mask=keep, other=0.0)
        mean = tl.sum(x, axis=0) / n_cols
        diff = tl.where(keep, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        y = (diff * rstd * w + b).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, y, mask=keep)

    @triton.jit
    def _mean_pool_kernel(  # type: ignore[no-untyped-def]
        h_ptr, len_ptr, out_ptr, length, n_cols,
        BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        keep = cols < n_cols
        real = tl.load(len_ptr + row).to(tl.int32)
        steps = tl.arange(0, BLOCK_L)
        base = h_ptr + row * length * n_cols
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
        qkv_ptr, len_ptr, out_ptr, length, heads, scale,
        HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One program: BLOCK_M queries of one (row, head); qkv is [B*L, 3, heads,
        # HEAD] (the QKV projection's output), out [B*L, heads, HEAD].
        row = tl.program_id(1) // heads
        head = tl.program_id(1) % heads
        hidden = heads * HEAD
        keys = tl.load(len_ptr + row)  # >= 1
        queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD)
        first = row.to(tl.int64) * length
        base = qkv_ptr + first * 3 * hidden + head * HEAD
        q = tl.load(
            base + queries[:, None] * 3 * hidden + dims[None, :],
            mask=queries[:, None] < length,
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
        tl.store(where_out, result, mask=queries[:, None] < length)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    rows_per_program: int | None = None,
) -> torch.Tensor:
    """LayerNorm(x + residual) over rows of a contiguous [tokens, hidden].

    Several rows per program once there are many: fewer, fuller programs."""
    if not use_triton(x):
        return F.layer_norm(x + residual, x.shape[-1:], weight, bias, eps)
    rows, cols = x.shape
    per = rows_per_program or (LN_ROWS if rows >= 2048 else 1)
    out = torch.empty_like(x)
    block = triton.next_power_of_2(cols)
    _add_layer_norm_kernel[(triton.cdiv(rows, per),)](
        x, residual, weight, bias, out, rows, cols, eps,
        ROWS=per, BLOCK=block, num_warps=_warps(per * block),
    )  # fmt: skip
    return out


def embed_layer_norm(emb: Embeddings, ids: torch.Tensor) -> torch.Tensor:
    """[B*L, H]: the embeddings module's output for ids [B, L], flattened."""
    if not use_triton(emb.word.weight):
        return emb(ids).flatten(0, 1)
    length, cols = ids.shape[1], emb.word.weight.shape[1]
    out = torch.empty(ids.numel(), cols, dtype=emb.word.weight.dtype, device=ids.device)
    block = triton.next_power_of_2(cols)
    _embed_layer_norm_kernel[(ids.numel(),)](
        ids, emb.word.weight, emb.position.weight[emb.offset :], emb.token_type,
        emb.norm.weight, emb.norm.bias, out, length, cols, emb.norm.eps,
        BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return out


def mean_pool(hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float32 [B, H]: the mean of each row's first ``lengths`` states (0 -> zeros)."""
    if not use_triton(hidden):
        return MeanPooling()(hidden, lengths)
    batch, length, cols = hidden.shape
    out = torch.empty(batch, cols, dtype=torch.float32, device=hidden.device)
    grid = (batch, triton.cdiv(cols, 128))  # rows x column blocks: many programs
    _mean_pool_kernel[grid](
        hidden, lengths, out, length, cols, BLOCK_L=32, BLOCK_H=128, num_warps=4
    )
    return out


def attention(
    qkv: torch.Tensor, lengths: torch.Tensor, batch: int, length: int, heads: int
) -> torch.Tensor:
    """[B*L, H] attention output from qkv [B*L, 3H]; lengths int32 [B], >= 1."""
    head = qkv.shape[1] // (3 * heads)
    if not use_triton(qkv):
        shaped = qkv.view(batch, length, 3, heads, head).permute(2, 0, 3, 1, 4)
        q, k, v = shaped.unbind(0)
        keys = torch.arange(length, device=qkv.device)[None] < lengths[:, None]
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None])
        return context.transpose(1, 2).reshape(batch * length, -1)
    out = torch.empty(batch * length, heads * head, dtype=qkv.dtype, device=qkv.device)
    # Short rows and small batches: smaller query blocks, more programs.
    block_m = 128 if length >= 128 and batch * heads * length >= 128 * 264 else 64
    grid = (triton.cdiv(length, block_m), batch * heads)
    _attention_kernel[grid](
        qkv, lengths, out, length, heads, math.log2(math.e) / math.sqrt(head),
        HEAD=head, BLOCK_M=block_m, BLOCK_N=64, num_warps=4 if block_m == 64 else 8,
        num_stages=2,
    )  # fmt: skip
    return out
