"""One servable model: encoder, pooling and (for classify) the head, as a module."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.encoder import Encoder, load_encoder
from engine.heads import (
    ClassifierHead,
    L2Normalize,
    load_classifier_head,
    make_pooling,
)
from services.repository import ModelEntry, RepositoryError

log = logging.getLogger("berth.engine")


class ServedModel(nn.Module):
    """A model entry as one module: (input_ids, lengths) -> float32 [B, width].

    embed: the pooled embedding, not normalized (the gateway normalizes when
    asked); width = hidden size. classify: pooled -> normalize (if the entry
    says so) -> linear -> probabilities; width = number of labels.
    """

    def __init__(
        self,
        entry: ModelEntry,
        encoder: Encoder,
        head: ClassifierHead | None = None,
        labels: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.name = entry.name
        self.task = entry.task
        self.encoder = encoder
        self.pooling = make_pooling(entry.pooling)
        self.post: nn.Module = nn.Identity()
        self.width = encoder.hidden_size
        self.labels = labels or []
        if entry.task == "classify":
            if head is None:
                raise RepositoryError(f"{entry.name}: a classify model needs a head")
            num_labels = head.num_labels
            if len(self.labels) != num_labels:
                raise RepositoryError(
                    f"{entry.name}: {len(self.labels)} labels for a head of "
                    f"{num_labels} outputs"
                )
            norm: nn.Module = L2Normalize() if entry.normalize else nn.Identity()
            self.post = nn.Sequential(norm, head)
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

    The encoder runs in ``dtype``; pooling and the head always in float32.
    """
    encoder = load_encoder(entry.checkpoint_dir, device=device, dtype=dtype)
    head = None
    labels: list[str] = []
    if entry.task == "classify":
        if entry.head is None:
            raise RepositoryError(f"{entry.name}: a classify model needs a head")
        head = load_classifier_head(entry.path(entry.head))
        labels = entry.label_names()
        hidden = encoder.hidden_size
        if head.linear.in_features != hidden:
            raise RepositoryError(
                f"{entry.name}: head expects {head.linear.in_features} features, "
                f"the encoder gives {hidden}"
            )
    model = ServedModel(entry, encoder, head, labels)
    model = model.to(device).eval().requires_grad_(False)
    log.info(
        "model %s ready: task %s, pooling %s, width %d, on %s",
        entry.name,
        entry.task,
        entry.pooling,
        model.width,
        device,
    )
    return model
