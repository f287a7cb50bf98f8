"""MPNet on the fused forward: its relative position bias in each attention
kernel, against the served model (transformers-exact: test_architectures.py).

Off the GPU the fused forward runs torch's stand-ins of berth's kernels (and,
with ``TRITON_INTERPRET=1`` and Triton installed, the Triton kernels
themselves); tests/gpu/test_checkpoints_on_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.architectures.mpnet import RelativePositionBias
from engine.cuda.forward import FusedForward
from engine.cuda.kernels import attention
from engine.cuda.plain import unfused_reason
from engine.model import ServedModel, load_served_model
from tests.engine.test_architectures import VOCAB, _entry, write_checkpoint

LENGTHS = [158, 1, 0, 131, 7, 0, 140]  # 158: every position (160 - 2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    directory = tmp_path_factory.mktemp("mpnet")
    write_checkpoint(directory, "mpnet")
    return load_served_model(_entry(directory, "mpnet"))


def _batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (len(LENGTHS), length), generator=generator)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32).clamp(max=length)
    ids[torch.arange(length)[None, :] >= lengths[:, None]] = 0
    return ids.to(torch.int32), lengths


def test_mpnet_takes_the_fused_forward_without_flash(served: ServedModel) -> None:
    assert unfused_reason(served) is None
    forward = FusedForward(served)
    assert isinstance(forward.relative, RelativePositionBias)
    assert forward.position_bias is not None
    assert forward.position_bias.shape == (4, 2 * 158 - 1)
    assert forward.position_bias.dtype == torch.float32
    assert "flash" not in forward.kinds


def test_the_distance_table_holds_every_pairs_bias(served: ServedModel) -> None:
    """Column key - query + L - 1 of ``by_distance(L)`` is the bias the
    served model adds to that query and key's score, in every head."""
    relative = served.encoder.attention_inputs
    assert isinstance(relative, RelativePositionBias)
    length = 158
    table = relative.by_distance(length)
    full = relative.scores(torch.tensor([length]), length)[0]  # [heads, L, L]
    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    assert torch.equal(table[:, rel + length - 1], full)
    # Far apart (past 128) the buckets are the last of each sign's half.
    assert len(set(table[0, :30].tolist())) == 1
    assert len(set(table[0, -30:].tolist())) == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", ["sdpa", "triton"])
def test_each_path_equals_the_served_model(served: ServedModel, kind: str) -> None:
    """Padded rows, packed rows (berth's kernel takes row starts) and full
    rows (the graphs' top rung: SDPA with the bias alone, or berth's kernel)
    each give what the served model gives."""
    forward = FusedForward(served)
    ids, lengths = _batch(160 - 2)
    shape = (len(LENGTHS), int(ids.shape[1]))
    forward.chosen[shape] = kind
    with torch.inference_mode():
        plain = served(ids.long(), lengths)
        padded = forward(ids, lengths)
        torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-5)
        if kind == "triton":
            assert forward.packs(*shape)
            needed = int(lengths.clamp(min=1).sum())
            packed = forward(ids, lengths, needed + 5)
            torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)
        full_ids = torch.where(ids == 0, 7, ids)[:, :40].contiguous()
        full_lengths = torch.full((len(LENGTHS),), 40, dtype=torch.int32)
        forward.full_rows[(len(LENGTHS), 40)] = kind
        full = forward(full_ids, full_lengths, len(LENGTHS) * 40)
        want = served(full_ids.long(), full_lengths)
    torch.testing.assert_close(full, want, rtol=1e-4, atol=1e-5)


def _biased_attention(
    qkv: torch.Tensor, lengths: list[int], length: int, heads: int, bias: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias[key - query]) v, written out."""
    head = qkv.shape[1] // (3 * heads)
    center = (bias.shape[1] - 1) // 2
    out = torch.zeros(qkv.shape[0], heads * head)
    for row, used in enumerate(lengths):
        keys = max(used, 1)
        x = qkv[row * length : (row + 1) * length].view(length, 3, heads, head)
        q, k, v = x.permute(1, 2, 0, 3)  # each [heads, L, d]
        scores = q @ k[:, :keys].transpose(1, 2) / math.sqrt(head)
        rel = torch.arange(keys)[None, :] - torch.arange(length)[:, None]
        weights = torch.softmax(scores + bias[:, rel + center], dim=-1)
        context = weights @ v[:, :keys]
        out[row * length : (row + 1) * length] = context.transpose(0, 1).flatten(1)
    return out


def test_the_attention_kernel_adds_the_bias_by_distance() -> None:
    generator = torch.Generator().manual_seed(2)
    heads, head, length, lengths = 2, 16, 24, [24, 9, 0]
    qkv = torch.randn(len(lengths) * length, 3 * heads * head, generator=generator)
    bias = torch.randn(heads, 2 * 40 - 1, generator=generator) * 2
    got = attention(qkv, torch.tensor(lengths), len(lengths), length, heads, bias=bias)
    want = _biased_attention(qkv, lengths, length, heads, bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    plain = attention(qkv, torch.tensor(lengths), len(lengths), length, heads)
    assert (got - plain).abs().max() > 0.1  # the bias counts
    with pytest.raises(ValueError, match="one row per head"):
        attention(qkv, torch.tensor(lengths), 3, length, heads, bias=bias[:1])


def test_sdpa_takes_the_bias_as_a_float_mask(served: ServedModel) -> None:
    forward = FusedForward(served)
    lengths = torch.tensor([5, 0])
    mask = forward.sdpa_mask(lengths, 8)
    assert mask.shape == (2, 4, 8, 8) and mask.is_floating_point()
    lowest = torch.finfo(mask.dtype).min
    assert (mask[0, :, :, 5:] == lowest).all() and (mask[0, :, :, :5] > lowest).all()
    assert (mask[1, :, :, 1:] == lowest).all()  # an empty row sees one key
    assert F.softmax(mask[1, 0, 0].float(), -1)[0] == 1
