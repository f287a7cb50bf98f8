"""ModernBERT: pre-LayerNorm layers with rotary positions, a GeGLU
feed-forward and alternating global and sliding-window attention.

- Embeddings: the word table, then LayerNorm; no position table.
- Each layer: x + attention(attn_norm(x)), then x + mlp(mlp_norm(x)); the
  first layer has no attn_norm (the embeddings' LayerNorm comes right
  before it). After the last layer, final_norm.
- Attention: queries and keys rotated by their positions (base
  ``rope_theta`` in global layers, ``local_rope_theta`` in local ones).
  Global layers attend to every real token; local layers (all but every
  ``global_attn_every_n_layers``-th, or as ``layer_types`` says) only to
  those at most ``local_attention // 2`` positions away.
- MLP: Wi's output halves (input, gate) -> act(input) * gate -> Wo.
- LayerNorms without bias (``norm_bias``), linear layers without bias
  (``attention_bias``, ``mlp_bias``) by default.

The masks come from ``lengths`` by tensor ops. A padding query whose window
holds no real token attends to itself, so every position stays finite; real
tokens never see padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.architectures.base import (
    Architecture,
    EncoderConfig,
    EncoderEmbeddings,
    EncoderLoadError,
    Parts,
    activation,
    check_activation,
    check_heads,
    key_padding_mask,
)

GLOBAL, LOCAL = "full_attention", "sliding_attention"
# One kind of layer's attention input: mask, rotary cos and sin [L, head_dim].
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _rope_theta(
    raw: Mapping[str, Any], kind: str, old_key: str, default: float
) -> float | None:
    """A layer kind's rotary base: ``rope_parameters`` (transformers 5), else
    the older ``global_rope_theta`` / ``local_rope_theta`` (None: null)."""
    params = (raw.get("rope_parameters") or {}).get(kind) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" or raw.get("rope_scaling"):
        raise EncoderLoadError(f"rotary scaling {rope_type!r} is not supported")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    value = raw.get(old_key, default)
    return None if value is None else float(value)


def parse(model_type: str, raw: Mapping[str, Any]) -> EncoderConfig:
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None:
        every = int(raw.get("global_attn_every_n_layers", 3))
        kinds = [LOCAL if i % every else GLOBAL for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {GLOBAL, LOCAL}:
        raise EncoderLoadError(f"layer_types {kinds!r} is not one per layer")
    global_theta = _rope_theta(raw, GLOBAL, "global_rope_theta", 160_000.0)
    if global_theta is None:
        raise EncoderLoadError("global_rope_theta is null")
    local_theta = _rope_theta(raw, LOCAL, "local_rope_theta", 10_000.0)
    if local_theta is None:  # transformers 4: local layers take the global base
        local_theta = global_theta
    return EncoderConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=layers,
        num_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        max_positions=int(raw.get("max_position_embeddings", 8192)),
        activation=check_activation(raw.get("hidden_activation", "gelu")),
        layer_norm_eps=float(raw.get("norm_eps", 1e-5)),
        position_offset=0,
        local_layers=tuple(kind == LOCAL for kind in kinds),
        local_window=int(raw.get("local_attention", 128)),
        rope_theta=global_theta,
        local_rope_theta=local_theta,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        norm_bias=bool(raw.get("norm_bias", False)),
    )


def _norm(config: EncoderConfig) -> nn.LayerNorm:
    return nn.LayerNorm(
        config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias
    )


class Embeddings(EncoderEmbeddings):
    """The word table, then LayerNorm (positions are rotary, in attention)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)
        self.max_length = config.max_length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.check_length(input_ids.shape[1])
        return self.norm(self.word(input_ids))


class RotaryMasks(nn.Module):
    """Every layer's attention input: (global, local) :data:`Inputs`; the
    global mask is [B, 1, 1, L], the local one [B, 1, L, L]."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.half_window = config.local_window // 2
        self.theta = (config.rope_theta, config.local_rope_theta)

    def rotary(
        self, theta: float, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [L, head_dim] of each position's angles, as transformers
        computes them (in float32, then cast to the model's dtype)."""
        dims = torch.arange(
            0, self.head_dim, 2, dtype=torch.float32, device=positions.device
        )
        inv_freq = 1.0 / (theta ** (dims / self.head_dim))
        freqs = positions[:, None].float() * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, lengths: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[Inputs, Inputs]:
        length = hidden.shape[1]
        real = key_padding_mask(lengths, length)
        positions = torch.arange(length, device=hidden.device)
        offsets = positions[None, :] - positions[:, None]  # key - query
        near = offsets.abs() <= self.half_window
        local = near & (real | (offsets == 0))
        outer, inner = (self.rotary(t, positions, hidden.dtype) for t in self.theta)
        return (real, *outer), (local, *inner)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., L, d] rotated by its positions' angles (in float32)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    turned = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + turned * sin).to(x.dtype)


class RotarySelfAttention(nn.Module):
    """Fused QKV projection, rotary queries and keys, SDPA, output projection."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        check_heads(config)
        hidden, bias = config.hidden_size, config.attention_bias
        self.heads = config.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, inputs: Inputs) -> torch.Tensor:
        mask, cos, sin = inputs
        batch, length, hidden = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, L, d]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(context.transpose(1, 2).reshape(batch, length, hidden))


class EncoderLayer(nn.Module):
    """One pre-LayerNorm block: rotary attention (global or local), GeGLU."""

    def __init__(self, config: EncoderConfig, index: int) -> None:
        super().__init__()
        self.local = config.local_layers[index]
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else _norm(config)
        self.attention = RotarySelfAttention(config)
        self.mlp_norm = _norm(config)
        inner, bias = config.intermediate_size, config.mlp_bias
        self.ffn_in = nn.Linear(config.hidden_size, 2 * inner, bias=bias)
        self.act = activation(config)
        self.ffn_out = nn.Linear(inner, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, inputs: tuple[Inputs, Inputs]) -> torch.Tensor:
        x = x + self.attention(
            self.attn_norm(x), inputs[1] if self.local else inputs[0]
        )
        values, gate = self.ffn_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.ffn_out(self.act(values) * gate)


def build(config: EncoderConfig) -> Parts:
    layers: list[nn.Module] = [
        EncoderLayer(config, i) for i in range(config.num_layers)
    ]
    return Parts(Embeddings(config), RotaryMasks(config), layers, _norm(config))


# Our per-layer module -> the checkpoint's, and whether it has a bias.
_LAYER = {
    "attn_norm": ("attn_norm", "norm_bias"),
    "attention.qkv": ("attn.Wqkv", "attention_bias"),
    "attention.out": ("attn.Wo", "attention_bias"),
    "mlp_norm": ("mlp_norm", "norm_bias"),
    "ffn_in": ("mlp.Wi", "mlp_bias"),
    "ffn_out": ("mlp.Wo", "mlp_bias"),
}


def weights(
    config: EncoderConfig, src: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    pairs = [
        ("embeddings.norm", "embeddings.norm", "norm_bias"),
        ("final_norm", "final_norm", "norm_bias"),
    ]
    for i in range(config.num_layers):
        pairs += [
            (f"layers.{i}.{ours}", f"layers.{i}.{theirs}", bias)
            for ours, (theirs, bias) in _LAYER.items()
            if not (i == 0 and ours == "attn_norm")  # layer 0: Identity
        ]
    out = {"embeddings.word.weight": src["embeddings.tok_embeddings.weight"]}
    for ours, theirs, bias in pairs:
        out[f"{ours}.weight"] = src[f"{theirs}.weight"]
        if getattr(config, bias):
            out[f"{ours}.bias"] = src[f"{theirs}.bias"]
    return out


ARCHITECTURE = Architecture(
    parse=parse,
    build=build,
    weights=weights,
    word_embeddings="embeddings.tok_embeddings.weight",
)
