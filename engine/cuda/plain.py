"""A served model's forward as plain torch, for the GPU runner's CUDA graphs:
the architectures berth's fused kernels do not compute.

The fused kernels (engine/cuda/forward.py) compute the BERT family's
post-LayerNorm layers and MPNet's (``FUSED_FAMILIES``). Any other encoder
(ModernBERT) runs as :class:`engine.model.ServedModel` itself, in the model's
dtype, captured in the same graphs and fed through the same pinned slots:
rows padded to their bucket (never packed), one attention (torch's SDPA),
ids and lengths checked before each launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model import ServedModel

FUSED_FAMILIES = ("bert", "distilbert", "roberta", "mpnet")


def unfused_reason(served: ServedModel) -> str | None:
    """Why the fused forward cannot compute ``served``; None where it can."""
    config = served.encoder.config
    if config.family in FUSED_FAMILIES:
        return None
    return (
        f"the fused kernels compute {', '.join(FUSED_FAMILIES)} encoders, "
        f"not {config.model_type}"
    )


class PlainForward:
    """ServedModel's own forward, with FusedForward's face for ModelRunner:
    every capture-time choice is the one way there is."""

    kinds = ["sdpa"]
    pdl = False

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.chosen: dict[tuple[int, int], str] = {}
        self.preloaded: dict[tuple[int, int], bool] = {}

    def __call__(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        tokens: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids [B, L], lengths [B] -> [B, width] (a new tensor: ``out`` is
        never written; ``tokens`` must be None or B * L, rows are not packed)."""
        if tokens is not None and tokens != ids.numel():
            raise ValueError("the plain forward does not pack rows")
        result: torch.Tensor = self.served(ids, lengths)
        return result

    def choose_attention(self, batch: int, length: int, packed: bool = False) -> str:
        self.chosen[(batch, length)] = self.kinds[0]
        return self.kinds[0]

    def choose_full_rows(self, batch: int, length: int) -> str:
        return self.kinds[0]

    def choose_plan(
        self, batch: int, length: int, run: Callable[[], object] | None = None
    ) -> bool:
        self.preloaded[(batch, length)] = False
        return False

    def preload_eligible(self, tokens: int) -> bool:
        return False

    def packs(self, batch: int, length: int) -> bool:
        return False

    def clamps_inputs(self, batch: int, length: int, tokens: int | None) -> bool:
        return False  # values are checked before every launch

    def reads_host(self, batch: int, length: int, tokens: int | None) -> bool:
        return False
