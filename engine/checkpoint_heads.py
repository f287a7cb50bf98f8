"""A ``*ForSequenceClassification`` checkpoint's own head, as transformers
defines it, read from the checkpoint's weights.

The pooling (the first token, or ModernBERT's mean with
``classifier_pooling: mean``) is the entry's (services/repository.py sets
it); the head here takes the pooled vector:

- BERT: the pooler (dense, tanh), then ``classifier``;
- DistilBERT: ``pre_classifier``, ReLU, then ``classifier``;
- RoBERTa, XLM-R, CamemBERT, MPNet: ``classifier.dense``, tanh, then
  ``classifier.out_proj``;
- ModernBERT: ``head`` (dense, ``classifier_activation``, LayerNorm), then
  ``classifier``.

Dropout is left out (inference). The outputs follow ``problem_type``
(services/hf_classifier.py): softmax, a sigmoid per label, or the scores.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.encoder import read_safetensors
from engine.heads import ClassifierHead
from services.hf_classifier import CheckpointClassifier, read_config

# ModernBERT's classifier_activation (transformers' ACT2FN names) -> module.
_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "tanh": lambda: nn.Tanh(),
    "silu": lambda: nn.SiLU(),
}


def _linear(
    tensors: dict[str, torch.Tensor], prefix: str, bias: bool = True
) -> nn.Linear:
    weight = tensors[f"{prefix}.weight"].float()
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(tensors[f"{prefix}.bias"].float())
    return layer


def _pooler_prefix(tensors: dict[str, torch.Tensor]) -> str:
    """BERT's pooler: ``bert.pooler.dense`` (any base-model prefix)."""
    found = sorted(k for k in tensors if k.endswith("pooler.dense.weight"))
    if not found:
        raise KeyError("pooler.dense.weight")
    return found[0][: -len(".weight")]


def _modernbert_transform(
    tensors: dict[str, torch.Tensor], config: dict[str, object]
) -> nn.Module:
    activation = str(config.get("classifier_activation", "gelu"))
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"classifier_activation {activation!r} is not supported; use one of "
            f"{sorted(_ACTIVATIONS)}"
        )
    dense = _linear(tensors, "head.dense", bias="head.dense.bias" in tensors)
    hidden = dense.out_features
    eps = float(config.get("norm_eps", 1e-5))  # type: ignore[arg-type]
    has_bias = "head.norm.bias" in tensors
    norm = nn.LayerNorm(hidden, eps=eps, bias=has_bias)
    with torch.no_grad():
        norm.weight.copy_(tensors["head.norm.weight"].float())
        if has_bias:
            norm.bias.copy_(tensors["head.norm.bias"].float())
    return nn.Sequential(dense, _ACTIVATIONS[activation](), norm)


def load_checkpoint_head(
    checkpoint_dir: Path, classifier: CheckpointClassifier
) -> ClassifierHead:
    """The head of ``classifier``'s kind from the checkpoint's tensors."""
    tensors = read_safetensors(checkpoint_dir)
    kind = classifier.kind
    transform: nn.Module
    try:
        if kind == "bert":
            transform = nn.Sequential(
                _linear(tensors, _pooler_prefix(tensors)), nn.Tanh()
            )
            final = _linear(tensors, "classifier")
        elif kind == "distilbert":
            transform = nn.Sequential(_linear(tensors, "pre_classifier"), nn.ReLU())
            final = _linear(tensors, "classifier")
        elif kind in ("roberta", "mpnet"):
            transform = nn.Sequential(_linear(tensors, "classifier.dense"), nn.Tanh())
            final = _linear(tensors, "classifier.out_proj")
        else:  # modernbert
            config = read_config(checkpoint_dir)
            transform = _modernbert_transform(tensors, config)
            final = _linear(tensors, "classifier")
    except KeyError as exc:
        raise ValueError(
            f"{checkpoint_dir}: tensor {exc} of the {classifier.architecture} head "
            "is missing"
        ) from exc
    if final.out_features != len(classifier.labels):
        raise ValueError(
            f"{checkpoint_dir}: the classifier has {final.out_features} outputs, "
            f"id2label {len(classifier.labels)} labels"
        )
    head = ClassifierHead(
        final.weight.detach(),
        final.bias.detach(),
        classifier.probability,
        transform=transform,
    )
    return head.eval().requires_grad_(False)
