"""What every architecture of berth's encoder shares: the config it is built
from, the activations it knows, the key padding mask, and the record by which
engine/encoder.py puts an architecture's parts together."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

# model_type -> weight-name family: the architecture module that reads it.
FAMILIES = {
    "bert": "bert",
    "distilbert": "distilbert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "camembert": "roberta",
    "mpnet": "mpnet",
    "modernbert": "modernbert",
}
# A checkpoint's activation name -> nn.GELU's ``approximate`` (or relu).
ACTIVATIONS = {
    "gelu": "none",  # exact, erf-based
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "relu": "relu",
}


class EncoderLoadError(ValueError):
    """A checkpoint cannot be read as an encoder of a supported architecture."""


@dataclass(frozen=True)
class EncoderConfig:
    """The shape of one encoder, read from a Hugging Face ``config.json``.

    The fields after ``position_offset`` belong to one architecture each and
    keep their defaults elsewhere.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    activation: str
    layer_norm_eps: float
    position_offset: int  # RoBERTa, MPNet: real tokens sit at padding_idx + 1 on
    # MPNet: rows of the relative position bias table (0: no such table).
    relative_buckets: int = 0
    # ModernBERT: per layer, whether it attends within a sliding window; the
    # window (``local_attention``: keys at most local_window // 2 positions
    # from the query); the rotary bases of global and local layers; which
    # linear layers and LayerNorms have a bias.
    local_layers: tuple[bool, ...] = ()
    local_window: int = 0
    rope_theta: float = 0.0
    local_rope_theta: float = 0.0
    attention_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    # Segments folded into the word table (BERT family; a rerank model's
    # pairs: 2): token t of segment s is row t + s * vocab_size, that row the
    # word's embedding plus the segment's (ModelEntry.token_type_offset).
    token_types: int = 1

    @property
    def table_rows(self) -> int:
        """Rows of the word table: the token ids the encoder takes."""
        return self.vocab_size * self.token_types

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def max_length(self) -> int:
        """The longest sequence the model's positions can encode."""
        return self.max_positions - self.position_offset

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def check_activation(name: object) -> str:
    if name not in ACTIVATIONS:
        raise EncoderLoadError(
            f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}"
        )
    return str(name)


def check_heads(config: EncoderConfig) -> None:
    if config.hidden_size % config.num_heads:
        raise EncoderLoadError(
            f"hidden size {config.hidden_size} is not a multiple of "
            f"{config.num_heads} heads"
        )


def activation(config: EncoderConfig) -> nn.Module:
    """The feed-forward activation ``config.activation`` names."""
    if config.activation == "relu":
        return nn.ReLU()
    return nn.GELU(approximate=ACTIVATIONS[config.activation])


def key_padding_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean [B, 1, 1, L]: True where a key is a real token of its row.

    A row of length 0 (batch padding) still sees its first key, so softmax
    never divides by zero and padded rows stay finite.
    """
    positions = torch.arange(length, device=lengths.device)
    real = positions[None, :] < lengths.clamp(min=1)[:, None]
    return real[:, None, None, :]


class PaddingMask(nn.Module):
    """The attention input of encoders with absolute positions: the key mask."""

    def forward(self, lengths: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return key_padding_mask(lengths, hidden.shape[1])


class EncoderEmbeddings(nn.Module):
    """What every architecture's embeddings module has: the word table and
    the longest sequence it embeds (a longer one raises ValueError)."""

    word: nn.Embedding
    max_length: int

    def check_length(self, length: int) -> None:
        if length > self.max_length:
            raise ValueError(
                f"sequence length {length} is over the model's {self.max_length} "
                "positions"
            )


class Parts(NamedTuple):
    """An encoder's modules. Its forward: x = embeddings(ids); inputs =
    attention_inputs(lengths, x); x = layer(x, inputs) for each layer;
    final_norm(x)."""

    embeddings: EncoderEmbeddings
    attention_inputs: nn.Module
    layers: list[nn.Module]
    final_norm: nn.Module


@dataclass(frozen=True)
class Architecture:
    """One family: how its config reads, its modules, its weights' names."""

    # (model_type, config.json) -> EncoderConfig
    parse: Callable[[str, Mapping[str, Any]], EncoderConfig]
    build: Callable[[EncoderConfig], Parts]
    # (config, the base model's tensors) -> tensors under our parameter names
    weights: Callable[[EncoderConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    # The word table's name in the base model: it locates a head's prefix.
    word_embeddings: str = "embeddings.word_embeddings.weight"
