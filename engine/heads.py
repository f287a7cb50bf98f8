"""What sits on top of the encoder: pooling, normalization, a classifier head.

All of it works in float32 whatever the encoder's dtype (the hidden states
are upcast before pooling), so an fp16 encoder still yields float32 output.
Like the encoder, nothing here branches on data: it can live in a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

# How a head turns scores into probabilities (head.safetensors metadata).
PROBABILITIES = ("softmax", "ovr")


class MeanPooling(nn.Module):
    """Mean of the hidden states over each row's real tokens."""

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        length = hidden.shape[1]
        positions = torch.arange(length, device=hidden.device)
        real = (positions[None, :] < lengths[:, None]).to(torch.float32)
        summed = torch.einsum("bl,blh->bh", real, hidden.float())
        # A row of length 0 (batch padding) yields zeros, not NaN.
        return summed / lengths.clamp(min=1)[:, None].to(torch.float32)


class ClsPooling(nn.Module):
    """The hidden state of the first token ([CLS] / <s>)."""

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0].float()


def make_pooling(kind: str) -> nn.Module:
    if kind == "mean":
        return MeanPooling()
    if kind == "cls":
        return ClsPooling()
    raise ValueError(f"pooling {kind!r} is not supported; use 'mean' or 'cls'")


class L2Normalize(nn.Module):
    """Scale each row to unit length (as sentence-transformers' Normalize)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2.0, dim=-1)


class ClassifierHead(nn.Module):
    """Linear layer then probabilities: softmax, or one-vs-rest as sklearn's."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, probability: str = "softmax"
    ) -> None:
        super().__init__()
        if probability not in PROBABILITIES:
            raise ValueError(f"probability {probability!r} not in {PROBABILITIES}")
        if weight.ndim != 2 or bias.shape != weight.shape[:1]:
            raise ValueError(
                f"head needs weight [C, H] and bias [C], got {tuple(weight.shape)} "
                f"and {tuple(bias.shape)}"
            )
        self.linear = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)
        self.probability = probability

    @property
    def num_labels(self) -> int:
        return self.linear.out_features

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        scores = self.linear(pooled)
        if self.probability == "softmax":
            return torch.softmax(scores, dim=-1)
        # sklearn's one-vs-rest: a sigmoid per class, rescaled to sum to 1.
        ovr = torch.sigmoid(scores)
        return ovr / ovr.sum(dim=-1, keepdim=True)


def load_classifier_head(path: Path) -> ClassifierHead:
    """A head from safetensors: ``weight`` [C, H], ``bias`` [C], and metadata
    ``probability`` ("softmax", the default, or "ovr")."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        weight = f.get_tensor("weight").float()
        bias = f.get_tensor("bias").float()
    return ClassifierHead(weight, bias, metadata.get("probability", "softmax"))
