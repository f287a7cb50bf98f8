"""BERT, DistilBERT and RoBERTa (XLM-R, CamemBERT): post-LayerNorm encoders
with absolute, learned positions.

A single text's token types are all 0, so row 0 of the token-type table is
a constant. A pair's (a rerank model's query and text) are 0 and 1: they are
folded into the word table (EncoderConfig.token_types), so that the ids alone
carry them, through the batcher and into every backend unchanged.
MPNet (engine/architectures/mpnet.py) reuses these embeddings and layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.architectures.base import (
    FAMILIES,
    Architecture,
    EncoderConfig,
    EncoderEmbeddings,
    EncoderLoadError,
    PaddingMask,
    Parts,
    activation,
    check_activation,
    check_heads,
)

# Our per-layer parameter -> the checkpoint's sub-modules (several: concatenated).
LayerTable = Mapping[str, tuple[str, ...]]
_BERT_LAYER: LayerTable = {
    "attention.qkv": (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
    ),
    "attention.out": ("attention.output.dense",),
    "norm1": ("attention.output.LayerNorm",),
    "ffn_in": ("intermediate.dense",),
    "ffn_out": ("output.dense",),
    "norm2": ("output.LayerNorm",),
}
_DISTILBERT_LAYER: LayerTable = {
    "attention.qkv": ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
    "attention.out": ("attention.out_lin",),
    "norm1": ("sa_layer_norm",),
    "ffn_in": ("ffn.lin1",),
    "ffn_out": ("ffn.lin2",),
    "norm2": ("output_layer_norm",),
}


def parse(model_type: str, raw: Mapping[str, Any]) -> EncoderConfig:
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise EncoderLoadError(
            f"position_embedding_type {position_type!r} is not supported "
            "(only 'absolute')"
        )
    if model_type == "distilbert":
        return EncoderConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["dim"]),
            num_layers=int(raw["n_layers"]),
            num_heads=int(raw["n_heads"]),
            intermediate_size=int(raw["hidden_dim"]),
            max_positions=int(raw["max_position_embeddings"]),
            activation=check_activation(raw.get("activation", "gelu")),
            layer_norm_eps=1e-12,  # hard-coded in DistilBERT
            position_offset=0,
        )
    roberta = FAMILIES[model_type] == "roberta"
    offset = int(raw.get("pad_token_id", 1)) + 1 if roberta else 0
    return bert_like(model_type, raw, offset)


def bert_like(
    model_type: str, raw: Mapping[str, Any], position_offset: int
) -> EncoderConfig:
    """The config of a BERT-named ``config.json`` (hidden_size, hidden_act…)."""
    return EncoderConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        max_positions=int(raw["max_position_embeddings"]),
        activation=check_activation(raw.get("hidden_act", "gelu")),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        position_offset=position_offset,
    )


class Embeddings(EncoderEmbeddings):
    """Word + token-type-0 + position embeddings, then LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word = nn.Embedding(config.table_rows, hidden)
        self.position = nn.Embedding(config.max_positions, hidden)
        # Token type 0's embedding, added to every token; zeros where the
        # types are folded into the word table (config.token_types) or the
        # checkpoint has none.
        self.token_type = nn.Parameter(torch.zeros(hidden))
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.offset = config.position_offset
        self.max_length = config.max_length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        self.check_length(length)
        # Positions are contiguous, so a slice of the table replaces a gather.
        positions = self.position.weight[self.offset : self.offset + length]
        return self.norm(self.word(input_ids) + self.token_type + positions)


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused QKV projection, then SDPA.

    ``mask``: boolean (True: attend) or float (added to the scores), any
    shape that broadcasts to [B, heads, L, L].
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        check_heads(config)
        hidden = config.hidden_size
        self.heads = config.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, L, d]
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(context.transpose(1, 2).reshape(batch, length, hidden))


class EncoderLayer(nn.Module):
    """One post-LayerNorm transformer block: attention, then feed-forward."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.attention = SelfAttention(config)
        self.norm1 = nn.LayerNorm(hidden, eps=eps)
        self.ffn_in = nn.Linear(hidden, config.intermediate_size)
        self.act = activation(config)
        self.ffn_out = nn.Linear(config.intermediate_size, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attention(x, mask))
        return self.norm2(x + self.ffn_out(self.act(self.ffn_in(x))))


def build(config: EncoderConfig) -> Parts:
    layers: list[nn.Module] = [EncoderLayer(config) for _ in range(config.num_layers)]
    return Parts(Embeddings(config), PaddingMask(), layers, nn.Identity())


def post_norm_weights(
    config: EncoderConfig,
    src: dict[str, torch.Tensor],
    table: LayerTable,
    layer_prefix: str,
) -> dict[str, torch.Tensor]:
    """Embeddings and layers of a BERT-shaped checkpoint under our names;
    ``table`` names each layer's sub-modules under ``layer_prefix.N.``."""
    word = src["embeddings.word_embeddings.weight"]
    types = src.get("embeddings.token_type_embeddings.weight")
    no_types = torch.zeros(config.hidden_size)
    if config.token_types > 1:
        if types is None or types.shape[0] < config.token_types:
            raise EncoderLoadError(
                f"the checkpoint has {0 if types is None else types.shape[0]} "
                f"token types, {config.token_types} are needed for pairs"
            )
        # Word plus segment, summed as transformers sums them (word + type,
        # then + position), so the folded rows give the same float32 sums.
        word = torch.cat([word + types[s] for s in range(config.token_types)])
        types = None
    out = {
        "embeddings.word.weight": word,
        "embeddings.position.weight": src["embeddings.position_embeddings.weight"],
        "embeddings.norm.weight": src["embeddings.LayerNorm.weight"],
        "embeddings.norm.bias": src["embeddings.LayerNorm.bias"],
    }
    out["embeddings.token_type"] = no_types if types is None else types[0]
    for i in range(config.num_layers):
        for ours, theirs in table.items():
            for kind in ("weight", "bias"):
                parts = [src[f"{layer_prefix}.{i}.{name}.{kind}"] for name in theirs]
                out[f"layers.{i}.{ours}.{kind}"] = torch.cat(parts, dim=0)
    return out


def weights(
    config: EncoderConfig, src: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if config.family == "distilbert":
        return post_norm_weights(config, src, _DISTILBERT_LAYER, "transformer.layer")
    return post_norm_weights(config, src, _BERT_LAYER, "encoder.layer")


ARCHITECTURE = Architecture(parse=parse, build=build, weights=weights)
