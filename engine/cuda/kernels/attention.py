"""softmax(QK^T / sqrt(d) + bias) V straight from the fused QKV projection,
each row's keys cut at its length; the bias (MPNet's relative positions) a
per-head function of key - query, read from a table, where one is given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.cuda.kernels.base import launch_options, triton, use_triton

if triton is not None:
    from engine.cuda.kernels.base import chain, tl

    @triton.jit
    def _attention_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr, len_ptr, start_ptr, out_ptr, length, heads, scale,
        bias_ptr, center,
        HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PACKED: tl.constexpr, BIAS: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # One program: BLOCK_M queries of one (row, head); qkv is [tokens, 3,
        # heads, HEAD] (the QKV projection's output), out [tokens, heads, HEAD];
        # row b's tokens start at start_ptr[b]. Padded rows (B x L) have L
        # queries each; packed rows only their own (the rest is not computed).
        # BIAS: bias_ptr is float32 [heads, 2 * center + 1], column
        # key - query + center, in natural-log units.
        chain(GDC)
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
            if BIAS:
                rel = cols[None, :] - queries[:, None] + center
                held = inside[None, :] & (rel >= 0) & (rel <= 2 * center)
                table = bias_ptr + head * (2 * center + 1) + rel
                s += tl.load(table, mask=held, other=0.0) * 1.4426950408889634
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
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [tokens, H] from qkv [tokens, 3H]; lengths [B] (a row
    of length 0 attends to its first token, as if 1).

    ``bias`` (float32 [heads, 2M - 1], M >= L; MPNet's
    ``RelativePositionBias.by_distance(M)``) is added to every score, column
    key - query + M - 1.

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
    if bias is not None and bias.shape != (heads, bias.shape[1]):
        raise ValueError(f"bias {tuple(bias.shape)}: one row per head is needed")
    if not use_triton(qkv):
        return _attention_reference(
            qkv, lengths, starts, out, length, heads, packed, bias
        )
    center = 0 if bias is None else (bias.shape[1] - 1) // 2
    block_m = block_m or 64  # benchmarks/small_gemm.py: 64 beat 16, 32, 128 or tied
    grid = (triton.cdiv(length, block_m), batch * heads)
    _attention_kernel[grid](
        qkv, lengths, starts, out, length, heads, math.log2(math.e) / math.sqrt(head),
        qkv if bias is None else bias, center,
        HEAD=head, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=8 if block_m == 128 else 4,
        num_stages=2, PACKED=packed, BIAS=bias is not None, **launch_options(pdl),
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
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA row by row: what the kernel computes, slowly, on any device."""
    head = qkv.shape[1] // (3 * heads)
    for row in range(len(lengths)):
        first, keys = int(starts[row]), max(int(lengths[row]), 1)
        queries = keys if packed else length
        rows = qkv[first : first + queries].view(queries, 3, heads, head)
        q, k, v = rows.permute(1, 2, 0, 3)
        mask = None
        if bias is not None:  # [heads, queries, keys] from key - query
            center = (bias.shape[1] - 1) // 2
            rel = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]
            mask = bias[:, (rel + center).to(bias.device)].to(q.dtype)
        context = F.scaled_dot_product_attention(
            q, k[:, :keys], v[:, :keys], attn_mask=mask
        )
        out[first : first + queries] = context.transpose(0, 1).reshape(queries, -1)
    return out
