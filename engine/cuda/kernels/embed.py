"""Word + position + type-0 embeddings, then LayerNorm, and the rows' lengths
copied (padded or packed rows).
"""

from __future__ import annotations

import torch

from engine.cuda.kernels.base import launch_options, triton, use_triton, warps_for
from engine.encoder import Embeddings

if triton is not None:
    from engine.cuda.kernels.base import chain, layer_norm_rows, row_weights, tl

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
        w, b = row_weights(w_ptr, cols, n_cols), row_weights(b_ptr, cols, n_cols)
        x = row_weights(pos_ptr + position * n_cols, cols, n_cols)[None, :]
        x += row_weights(type_ptr, cols, n_cols)[None, :]
        chain(GDC)
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
        y = layer_norm_rows(x, keep, n_cols, eps, w, b)
        where = out_ptr + at * n_cols + cols[None, :]
        tl.store(where, y.to(out_ptr.dtype.element_ty), mask=keep)


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
    if not ids.is_contiguous():  # the kernel reads row b at b * L
        raise ValueError("the embedding kernel reads contiguous ids")
    side = starts if starts is not None else copied
    if side is None:
        raise ValueError("packed rows need their starts, padded ones a lengths copy")
    cols = emb.word.weight.shape[1]
    block = triton.next_power_of_2(cols)
    _embed_layer_norm_kernel[(ids.numel(),)](
        ids, lengths, side, emb.word.weight, emb.position.weight[emb.offset :],
        emb.token_type, emb.norm.weight, emb.norm.bias, out, ids.shape[1],
        ids.shape[0], cols, emb.word.weight.shape[0], emb.norm.eps, BLOCK=block,
        num_warps=warps_for(block), PACKED=starts is not None, **launch_options(pdl),
    )  # fmt: skip
