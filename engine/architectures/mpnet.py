"""MPNet (all-mpnet-base-v2): BERT's post-LayerNorm layers, with a relative
position bias added to every layer's attention scores.

The bias is one learned value per head for each bucket of relative position
(key - query), from a table shared by all layers: T5's buckets, 32 of them,
up to a distance of 128, as transformers computes them (it always buckets
into 32, whatever ``relative_attention_num_buckets`` says). Absolute
positions are embedded as in RoBERTa: transformers fixes MPNet's
``padding_idx`` at 1, so real tokens take positions 2 onwards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine.architectures.base import (
    Architecture,
    EncoderConfig,
    EncoderLoadError,
    Parts,
    key_padding_mask,
)
from engine.architectures.bert import (
    Embeddings,
    EncoderLayer,
    LayerTable,
    bert_like,
    post_norm_weights,
)

BUCKETS = 32
MAX_DISTANCE = 128
PADDING_IDX = 1  # transformers' MPNetEmbeddings, whatever pad_token_id says
_LAYER: LayerTable = {
    "attention.qkv": ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
    "attention.out": ("attention.attn.o",),
    "norm1": ("attention.LayerNorm",),
    "ffn_in": ("intermediate.dense",),
    "ffn_out": ("output.dense",),
    "norm2": ("output.LayerNorm",),
}


def parse(model_type: str, raw: Mapping[str, Any]) -> EncoderConfig:
    config = bert_like(model_type, raw, position_offset=PADDING_IDX + 1)
    rows = int(raw.get("relative_attention_num_buckets", BUCKETS))
    if rows < BUCKETS:
        raise EncoderLoadError(
            f"relative_attention_num_buckets {rows}: MPNet buckets relative "
            f"positions into {BUCKETS}"
        )
    return replace(config, relative_buckets=rows)


def relative_buckets(relative: torch.Tensor) -> torch.Tensor:
    """Bucket of each relative position (key - query), int64: the sign in
    the upper half; distances under 8 exact; 8 to 128 on a log scale; 128
    and beyond in the last bucket of their half."""
    half = BUCKETS // 2
    exact = half // 2
    n = -relative
    bucket = (n < 0).to(torch.long) * half
    n = n.abs()
    # The log of distances under ``exact`` is never used (the clamp keeps it finite).
    scaled = torch.log(n.clamp(min=exact).float() / exact)
    scaled = scaled / math.log(MAX_DISTANCE / exact) * (half - exact)
    large = (exact + scaled.to(torch.long)).clamp(max=half - 1)
    return bucket + torch.where(n < exact, n, large)


class RelativePositionBias(nn.Module):
    """Every layer's attention input: float [B, heads, L, L], the relative
    position bias, with the lowest value of its dtype at padding keys."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.bias = nn.Embedding(config.relative_buckets, config.num_heads)

    def forward(self, lengths: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.scores(lengths, hidden.shape[1])

    def scores(self, lengths: torch.Tensor, length: int) -> torch.Tensor:
        """What is added to the attention scores of rows ``lengths`` padded
        to ``length``: [B, heads, L, L] in the table's dtype."""
        positions = torch.arange(length, device=lengths.device)
        buckets = relative_buckets(positions[None, :] - positions[:, None])
        bias = self.bias(buckets).permute(2, 0, 1)  # [heads, L, L]
        real = key_padding_mask(lengths, length)  # [B, 1, 1, L]
        lowest = torch.finfo(bias.dtype).min
        return torch.where(real, bias, torch.full_like(bias, lowest))

    def by_distance(self, length: int) -> torch.Tensor:
        """float32 [heads, 2L - 1]: column r + L - 1 holds each head's bias
        for key - query = r, |r| < L (the fused attention kernel's table)."""
        weight = self.bias.weight
        relative = torch.arange(1 - length, length, device=weight.device)
        return self.bias(relative_buckets(relative)).t().float().contiguous()


def build(config: EncoderConfig) -> Parts:
    layers: list[nn.Module] = [EncoderLayer(config) for _ in range(config.num_layers)]
    return Parts(
        Embeddings(config), RelativePositionBias(config), layers, nn.Identity()
    )


def weights(
    config: EncoderConfig, src: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    out = post_norm_weights(config, src, _LAYER, "encoder.layer")
    out["attention_inputs.bias.weight"] = src["encoder.relative_attention_bias.weight"]
    return out


ARCHITECTURE = Architecture(parse=parse, build=build, weights=weights)
