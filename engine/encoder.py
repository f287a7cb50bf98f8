"""berth's own encoder in plain torch, loaded from HF safetensors.

Supported ``model_type`` values, by family (engine/architectures/):

- ``bert`` (MiniLM included), ``distilbert``, ``roberta``, ``xlm-roberta``,
  ``camembert``: post-LayerNorm encoders with absolute, learned positions
  (bert.py);
- ``mpnet``: BERT's layers with a relative position bias shared by all
  layers (mpnet.py);
- ``modernbert``: pre-LayerNorm layers, rotary positions, GeGLU, alternating
  global and sliding-window attention (modernbert.py).

An :class:`Encoder` is (input_ids [B, L], lengths [B]) -> hidden [B, L, H]:
embeddings, each layer's attention inputs computed once from ``lengths``
(masks, position biases, rotary angles), the layers, a final norm.
``forward`` has no data-dependent Python control flow and never syncs with
the device (no ``.item()``): masks come from ``lengths`` by tensor ops, so
the module can be captured in a CUDA graph per (batch, length) bucket and
exported to ONNX with dynamic batch and length.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from engine.architectures import bert, modernbert, mpnet
from engine.architectures.base import (
    ACTIVATIONS,
    FAMILIES,
    Architecture,
    EncoderConfig,
    EncoderEmbeddings,
    EncoderLoadError,
    key_padding_mask,
)
from engine.architectures.bert import Embeddings, EncoderLayer

__all__ = [
    "ACTIVATIONS",
    "ARCHITECTURES",
    "FAMILIES",
    "Embeddings",
    "Encoder",
    "EncoderConfig",
    "EncoderLayer",
    "EncoderLoadError",
    "config_from_dict",
    "key_padding_mask",
    "load_encoder",
    "map_weights",
    "read_config",
    "read_safetensors",
]

log = logging.getLogger("berth.engine")

# family (FAMILIES' values) -> its architecture.
ARCHITECTURES: dict[str, Architecture] = {
    "bert": bert.ARCHITECTURE,
    "distilbert": bert.ARCHITECTURE,
    "roberta": bert.ARCHITECTURE,
    "mpnet": mpnet.ARCHITECTURE,
    "modernbert": modernbert.ARCHITECTURE,
}


class Encoder(nn.Module):
    """An encoder of any supported architecture: (input_ids [B, L], lengths [B])
    -> [B, L, H]."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        parts = ARCHITECTURES[config.family].build(config)
        self.embeddings: EncoderEmbeddings = parts.embeddings
        self.attention_inputs = parts.attention_inputs
        self.layers = nn.ModuleList(parts.layers)
        self.final_norm = parts.final_norm

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        inputs = self.attention_inputs(lengths, x)
        for layer in self.layers:
            x = layer(x, inputs)
        out: torch.Tensor = self.final_norm(x)
        return out


def config_from_dict(raw: Mapping[str, Any]) -> EncoderConfig:
    model_type = str(raw.get("model_type", ""))
    if model_type not in FAMILIES:
        raise EncoderLoadError(
            f"model_type {model_type!r} is not supported; berth's encoder "
            f"handles {sorted(FAMILIES)}"
        )
    return ARCHITECTURES[FAMILIES[model_type]].parse(model_type, raw)


def read_config(checkpoint_dir: Path) -> EncoderConfig:
    config_file = checkpoint_dir / "config.json"
    try:
        raw = json.loads(config_file.read_text())
        return config_from_dict(raw)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
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


def _base_weights(
    tensors: dict[str, torch.Tensor], word_embeddings: str
) -> dict[str, torch.Tensor]:
    """The base model's tensors, with the head's prefix (`bert.` …) removed."""
    found = [k for k in tensors if k.endswith(word_embeddings)]
    if not found:
        raise EncoderLoadError(f"no {word_embeddings} in the checkpoint")
    prefix = min(found, key=len)[: -len(word_embeddings)]
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
    architecture = ARCHITECTURES[config.family]
    return architecture.weights(
        config, _base_weights(tensors, architecture.word_embeddings)
    )


def load_encoder(
    checkpoint_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    token_types: int = 1,
) -> Encoder:
    """Build an :class:`Encoder` from a checkpoint directory, in eval mode;
    ``token_types`` > 1 folds that many segments into the word table
    (EncoderConfig.token_types)."""
    checkpoint_dir = Path(checkpoint_dir)
    config = replace(read_config(checkpoint_dir), token_types=token_types)
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
