"""One servable model: encoder, pooling, Dense layers and (for classify) the
head, as a module."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from engine.checkpoint_heads import load_checkpoint_head
from engine.encoder import Encoder, load_encoder
from engine.heads import (
    ClassifierHead,
    Dense,
    L2Normalize,
    load_classifier_head,
    load_dense,
    make_pooling,
    pooled_width,
)
from services.repository import ModelEntry, RepositoryError

log = logging.getLogger("berth.engine")


class ServedModel(nn.Module):
    """A model entry as one module: (input_ids, lengths) -> float32 [B, width].

    embed: the pooled embedding through the entry's Dense layers, not
    normalized (the gateway normalizes when asked); width = hidden size per
    pooling mode, or the last Dense layer's out_features. classify: that,
    then normalize (if the entry says so) -> linear -> probabilities; width =
    number of labels (a checkpoint's own head: its hidden layers, then its
    classifier, with softmax, a sigmoid per label or the raw scores; no
    normalization). rerank: a cross-encoder's head on a pair, its raw score
    (width 1; the gateway applies the model's activation). Everything after
    pooling is ``post`` (Identity when there is nothing), which the fused
    CUDA forward applies as well.
    """

    def __init__(
        self,
        entry: ModelEntry,
        encoder: Encoder,
        head: ClassifierHead | None = None,
        labels: list[str] | None = None,
        dense: list[Dense] | None = None,
        skip: int = 0,
    ) -> None:
        super().__init__()
        self.name = entry.name
        self.task = entry.task
        self.encoder = encoder
        self.pooling = make_pooling(entry.pooling, skip)
        self.width = pooled_width(entry.pooling, encoder.hidden_size)
        steps: list[nn.Module] = []
        for layer in dense or []:
            if layer.in_features != self.width:
                raise RepositoryError(
                    f"{entry.name}: a Dense layer takes {layer.in_features} "
                    f"features, the step before it gives {self.width}"
                )
            steps.append(layer)
            self.width = layer.out_features
        self.post: nn.Module = nn.Sequential(*steps) if steps else nn.Identity()
        self.labels = labels or []
        if entry.task in ("classify", "rerank"):
            if head is None:
                raise RepositoryError(
                    f"{entry.name}: a {entry.task} model needs a head"
                )
            num_labels = head.num_labels
            if len(self.labels) != num_labels:
                raise RepositoryError(
                    f"{entry.name}: {len(self.labels)} labels for a head of "
                    f"{num_labels} outputs"
                )
            if head.linear.in_features != self.width:
                raise RepositoryError(
                    f"{entry.name}: head expects {head.linear.in_features} "
                    f"features, the model gives {self.width}"
                )
            norm: nn.Module = L2Normalize() if entry.normalize else nn.Identity()
            self.post = nn.Sequential(*steps, norm, head)
            self.width = num_labels

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids, lengths)
        pooled = self.pooling(hidden, lengths)
        return self.post(pooled)


def load_served_model(
    entry: ModelEntry,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ServedModel:
    """Load an entry's checkpoint (and head) onto ``device``.

    The encoder runs in ``dtype``; pooling, Dense layers and the head always
    in float32.
    """
    types = 2 if entry.token_type_offset() else 1
    encoder = load_encoder(entry.checkpoint_dir, device, dtype, token_types=types)
    head = None
    labels: list[str] = []
    if entry.checkpoint_head:
        classifier = entry.classifier()
        if entry.task == "rerank":  # the raw score: the gateway activates it
            classifier = replace(classifier, probability="none")
        head = load_checkpoint_head(entry.checkpoint_dir, classifier)
        labels = entry.label_names()
    elif entry.task == "classify":
        if entry.head is None:
            raise RepositoryError(f"{entry.name}: a classify model needs a head")
        head = load_classifier_head(entry.path(entry.head))
        labels = entry.label_names()
    dense = [load_dense(entry.path(d)) for d in entry.dense]
    skip = entry.pooling_skip()
    model = ServedModel(entry, encoder, head, labels, dense, skip)
    model = model.to(device).eval().requires_grad_(False)
    log.info(
        "model %s ready: task %s, pooling %s%s, %d Dense, width %d, on %s",
        entry.name,
        entry.task,
        entry.pooling,
        f" (the prompt's {skip} tokens left out)" if skip else "",
        len(dense),
        model.width,
        device,
    )
    return model
