"""berth's own BERT-family encoder in plain torch, loaded from HF safetensors.

Supports ``model_type`` bert (MiniLM included), distilbert, roberta, xlm-roberta
and camembert: all post-LayerNorm encoders with absolute, learned positions.
Token type ids are always 0, so row 0 of the token-type table is a constant.

``forward`` has no data-dependent Python control flow and never syncs with
the device (no ``.item()``): masks come from ``lengths`` by tensor ops, so
the module can be captured in a CUDA graph per (batch, length) bucket.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

log = logging.getLogger("berth.engine")

# model_type -> weight-name family.
FAMILIES = {
    "bert": "bert",
    "distilbert": "distilbert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "camembert": "roberta",
}
ACTIVATIONS = {
    "gelu": "none",  # exact, erf-based
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "relu": "relu",
}
# Our per-layer parameter -> the checkpoint's sub-modules (several: concatenated).
_BERT_LAYER = {
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
_DISTILBERT_LAYER = {
    "attention.qkv": ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
    "attention.out": ("attention.out_lin",),
    "norm1": ("sa_layer_norm",),
    "ffn_in": ("ffn.lin1",),
    "ffn_out": ("ffn.lin2",),
    "norm2": ("output_layer_norm",),
}
_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"


class EncoderLoadError(ValueError):
    """A checkpoint cannot be read as a supported BERT-family encoder."""


@dataclass(frozen=True)
class EncoderConfig:
    """The shape of one encoder, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    activation: str
    layer_norm_eps: float
    position_offset: int  # RoBERTa: real tokens sit at pad_token_id + 1 onwards

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def max_length(self) -> int:
        """The longest sequence the position embeddings can encode."""
        return self.max_positions - self.position_offset

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EncoderConfig:
        model_type = str(raw.get("model_type", ""))
        if model_type not in FAMILIES:
            raise EncoderLoadError(
                f"model_type {model_type!r} is not supported; berth's encoder "
                f"handles {sorted(FAMILIES)}"
            )
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise EncoderLoadError(
                f"position_embedding_type {position_type!r} is not supported "
                "(only 'absolute')"
            )
        if model_type == "distilbert":
            act = raw.get("activation", "gelu")
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["dim"]),
                num_layers=int(raw["n_layers"]),
                num_heads=int(raw["n_heads"]),
                intermediate_size=int(raw["hidden_dim"]),
                max_positions=int(raw["max_position_embeddings"]),
                activation=_check_activation(act),
                layer_norm_eps=1e-12,  # hard-coded in DistilBERT
                position_offset=0,
            )
        roberta = FAMILIES[model_type] == "roberta"
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_positions=int(raw["max_position_embeddings"]),
            activation=_check_activation(raw.get("hidden_act", "gelu")),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            position_offset=int(raw.get("pad_token_id", 1)) + 1 if roberta else 0,
        )


def _check_activation(name: object) -> str:
    if name not in ACTIVATIONS:
        raise EncoderLoadError(
            f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}"
        )
    return str(name)


def key_padding_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean [B, 1, 1, L]: True where a key is a real token of its row.

    A row of length 0 (batch padding) still sees its first key, so softmax
    never divides by zero and padded rows stay finite.
    """
    positions = torch.arange(length, device=lengths.device)
    real = positions[None, :] < lengths.clamp(min=1)[:, None]
    return real[:, None, None, :]


class Embeddings(nn.Module):
    """Word + token-type-0 + position embeddings, then LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden)
        self.position = nn.Embedding(config.max_positions, hidden)
        self.token_type = nn.Parameter(torch.zeros(hidden))  # zeros: no types
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.offset = config.position_offset
        self.max_length = config.max_length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.max_length:
            raise ValueError(
                f"sequence length {length} is over the model's {self.max_length} "
                "positions"
            )
        # Positions are contiguous, so a slice of the table replaces a gather.
        positions = self.position.weight[self.offset : self.offset + length]
        return self.norm(self.word(input_ids) + self.token_type + positions)


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused QKV projection, then SDPA."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        if hidden % config.num_heads:
            raise EncoderLoadError(
                f"hidden size {hidden} is not a multiple of {config.num_heads} heads"
            )
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
        self.act: nn.Module = (
            nn.ReLU()
            if config.activation == "relu"
            else nn.GELU(approximate=ACTIVATIONS[config.activation])
        )
        self.ffn_out = nn.Linear(config.intermediate_size, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attention(x, mask))
        return self.norm2(x + self.ffn_out(self.act(self.ffn_in(x))))


class Encoder(nn.Module):
    """A BERT-family encoder: (input_ids [B, L], lengths [B]) -> [B, L, H]."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(
            EncoderLayer(config) for _ in range(config.num_layers)
        )

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = key_padding_mask(lengths, input_ids.shape[1])
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def read_config(checkpoint_dir: Path) -> EncoderConfig:
    config_file = checkpoint_dir / "config.json"
    try:
        raw = json.loads(config_file.read_text())
        return EncoderConfig.from_dict(raw)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise EncoderLoadError(f"{config_file}: {exc!r}") from exc


def read_safetensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards its index names."""
    single = checkpoint_dir / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(checkpoint_dir / shard))
        return tensors
    raise EncoderLoadError(
        f"{checkpoint_dir} has no model.safetensors (nor a sharded index); berth "
        "never loads pickled weights: convert the checkpoint with "
        "save_pretrained(..., safe_serialization=True)"
    )


def _base_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors, with the head's prefix (`bert.` …) removed."""
    found = [k for k in tensors if k.endswith(_WORD_EMBEDDINGS)]
    if not found:
        raise EncoderLoadError(f"no {_WORD_EMBEDDINGS} in the checkpoint")
    prefix = min(found, key=len)[: -len(_WORD_EMBEDDINGS)]
    base = {}
    for key, value in tensors.items():
        if key.startswith(prefix):
            name = key[len(prefix) :]
            # Old TF-converted checkpoints name LayerNorm parameters gamma/beta.
            if name.endswith(".gamma"):
                name = name[: -len("gamma")] + "weight"
            elif name.endswith(".beta"):
                name = name[: -len("beta")] + "bias"
            base[name] = value
    return base


def map_weights(
    config: EncoderConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our module's parameter names."""
    src = _base_weights(tensors)
    out = {
        "embeddings.word.weight": src["embeddings.word_embeddings.weight"],
        "embeddings.position.weight": src["embeddings.position_embeddings.weight"],
        "embeddings.norm.weight": src["embeddings.LayerNorm.weight"],
        "embeddings.norm.bias": src["embeddings.LayerNorm.bias"],
    }
    types = src.get("embeddings.token_type_embeddings.weight")
    no_types = torch.zeros(config.hidden_size)
    out["embeddings.token_type"] = no_types if types is None else types[0]
    if config.family == "distilbert":
        table, layer_prefix = _DISTILBERT_LAYER, "transformer.layer"
    else:
        table, layer_prefix = _BERT_LAYER, "encoder.layer"
    for i in range(config.num_layers):
        for ours, theirs in table.items():
            for kind in ("weight", "bias"):
                parts = [src[f"{layer_prefix}.{i}.{name}.{kind}"] for name in theirs]
                out[f"layers.{i}.{ours}.{kind}"] = torch.cat(parts, dim=0)
    return out


def load_encoder(
    checkpoint_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Encoder:
    """Build an :class:`Encoder` from a checkpoint directory, in eval mode."""
    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    tensors = read_safetensors(checkpoint_dir)
    try:
        weights = map_weights(config, tensors)
    except KeyError as exc:
        raise EncoderLoadError(
            f"{checkpoint_dir}: tensor {exc} is missing for a {config.model_type} "
            "encoder"
        ) from exc
    with torch.device("meta"):
        encoder = Encoder(config)
    encoder.load_state_dict(weights, strict=True, assign=True)
    encoder = encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
    log.info(
        "encoder %s loaded: %s, %d layers, hidden %d, on %s as %s",
        checkpoint_dir.name,
        config.model_type,
        config.num_layers,
        config.hidden_size,
        device,
        dtype,
    )
    return encoder
