"""What sits on top of the encoder: pooling, Dense layers, normalization, a
classifier head.

All of it works in float32 whatever the encoder's dtype (the hidden states
are upcast before pooling), so an fp16 encoder still yields float32 output.
Like the encoder, nothing here branches on data: it can live in a CUDA graph.
Pooling and Dense compute what sentence-transformers' Pooling and Dense
modules compute.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from services import st_config

# How a head turns scores into its outputs: softmax, or scikit-learn's
# one-vs-rest (head.safetensors metadata); a checkpoint's own head
# (engine/checkpoint_heads.py) also sigmoid (multi-label: a sigmoid per
# label) or none (regression: the raw scores).
PROBABILITIES = ("softmax", "ovr", "sigmoid", "none")


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


class TokenPooling(nn.Module):
    """sentence-transformers' Pooling: each mode over each row's real tokens
    from position ``skip`` on (a prompt left out), concatenated in order.

    cls: the first token pooled (position ``skip``; 0 when the row has no
    token past it). max: the largest value per feature. mean: the sum over
    the count; mean_sqrt_len: over the count's square root. weightedmean:
    token i (from 0) weighs i + 1. lasttoken: the row's last real token.
    A row with no token to pool (batch padding) yields zeros.
    """

    def __init__(self, modes: list[str], skip: int = 0) -> None:
        super().__init__()
        unknown = [m for m in modes if m not in st_config.POOLING_MODES]
        if not modes or unknown:
            raise ValueError(
                f"pooling {'+'.join(modes)!r} is not supported; use "
                f"{', '.join(st_config.POOLING_MODES)}, or several joined by '+'"
            )
        self.modes = list(modes)
        self.skip = skip

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        length = hidden.shape[1]
        positions = torch.arange(length, device=hidden.device)
        lengths = lengths.long()
        real = (positions[None, :] < lengths[:, None]) & (
            positions[None, :] >= self.skip
        )
        mask = real.to(torch.float32)
        count = mask.sum(dim=1, keepdim=True)
        any_real = count > 0
        out = []
        for mode in self.modes:  # fixed by the model, not by the data
            if mode == "cls":
                first = torch.where(lengths > self.skip, self.skip, 0)
                out.append(_row_at(hidden, first))
            elif mode == "max":
                masked = hidden.masked_fill(~real[:, :, None], float("-inf"))
                out.append(torch.where(any_real, masked.amax(dim=1), 0.0))
            elif mode in ("mean", "mean_sqrt_len"):
                summed = torch.einsum("bl,blh->bh", mask, hidden)
                count_ = count.clamp(min=1e-9)
                out.append(summed / (count_ if mode == "mean" else count_.sqrt()))
            elif mode == "weightedmean":
                weights = mask * (positions + 1).to(torch.float32)[None, :]
                summed = torch.einsum("bl,blh->bh", weights, hidden)
                out.append(summed / weights.sum(dim=1, keepdim=True).clamp(min=1e-9))
            else:  # lasttoken
                last = _row_at(hidden, (lengths - 1).clamp(min=0))
                out.append(last * (lengths > self.skip)[:, None].to(torch.float32))
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def _row_at(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden[b, index[b]] for each row b: [B, H]."""
    where = index.long()[:, None, None].expand(-1, 1, hidden.shape[-1])
    return torch.gather(hidden, 1, where)[:, 0]


def make_pooling(kind: str, skip: int = 0) -> nn.Module:
    """The pooling of an entry: a mode of st_config.POOLING_MODES or several
    joined by "+"; ``skip`` leading tokens (a prompt) left out."""
    modes = kind.split("+")
    if skip == 0 and modes == ["mean"]:
        return MeanPooling()
    if skip == 0 and modes == ["cls"]:
        return ClsPooling()
    return TokenPooling(modes, skip)


def pooled_width(kind: str, hidden: int) -> int:
    """The width of a pooled vector: the hidden size per mode."""
    return hidden * len(kind.split("+"))


# sentence-transformers' Dense activations (st_config.ACTIVATIONS' values).
_ACTIVATIONS = {
    "identity": nn.Identity,
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
}


class Dense(nn.Module):
    """sentence-transformers' Dense: activation(linear(x)), plus x (or x
    through a bias-free linear) when it has a residual; float32."""

    def __init__(self, config: st_config.DenseConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.in_features, config.out_features, config.bias)
        self.activation = _ACTIVATIONS[config.activation]()
        self.residual: nn.Module | None = None
        if config.residual:
            self.residual = (
                nn.Identity()
                if config.in_features == config.out_features
                else nn.Linear(config.in_features, config.out_features, bias=False)
            )

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        return out if self.residual is None else out + self.residual(x)


def load_dense(directory: Path) -> Dense:
    """A Dense module from its directory (config.json, model.safetensors)."""
    config = st_config.read_dense(directory)
    dense = Dense(config)
    with safe_open(str(config.weights), framework="pt") as f:
        names = f.keys()  # safe_open is not iterable
        tensors = {name: f.get_tensor(name).float() for name in names}
    if isinstance(dense.residual, nn.Identity):
        tensors.pop("residual.weight", None)
    try:
        dense.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{config.weights}: {exc}") from exc
    return dense.eval().requires_grad_(False)


class L2Normalize(nn.Module):
    """Scale each row to unit length (as sentence-transformers' Normalize)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2.0, dim=-1)


class ClassifierHead(nn.Module):
    """``transform`` (none by default), a linear layer, then the outputs:
    softmax, one-vs-rest as sklearn's, a sigmoid per class, or the scores."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        probability: str = "softmax",
        transform: nn.Module | None = None,
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
        self.transform: nn.Module = transform or nn.Identity()

    @property
    def num_labels(self) -> int:
        return self.linear.out_features

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        scores = self.linear(self.transform(pooled))
        if self.probability == "softmax":
            return torch.softmax(scores, dim=-1)
        if self.probability == "sigmoid":
            return torch.sigmoid(scores)
        if self.probability == "none":
            return scores
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
