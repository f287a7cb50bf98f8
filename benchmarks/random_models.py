"""Encoders with random weights, written as checkpoints berth can load.

Speed does not depend on the weights, so the benchmarks measure BERT-base-
and MiniLM-sized encoders without downloading either. No GPU imports here:
the CPU-side scripts use this too.
"""

from __future__ import annotations

from pathlib import Path

import torch

MODELS = {
    "bert-base": {"hidden": 768, "layers": 12, "heads": 12, "inner": 3072},
    "minilm": {"hidden": 384, "layers": 6, "heads": 12, "inner": 1536},
    # the tests' model: small vocabulary, 64 positions (tests/conftest.py)
    "tiny": {"hidden": 32, "layers": 2, "heads": 2, "inner": 64, "vocab": 1000,
             "positions": 64},
}  # fmt: skip
VOCAB = 30522  # the BERT uncased vocabulary, which MiniLM shares


def write_random_checkpoint(
    name: str, directory: Path, dtype: torch.dtype = torch.float32
) -> None:
    """A transformers BertModel of the ``MODELS[name]`` shape, seed 0."""
    import transformers

    spec = MODELS[name]
    config = transformers.BertConfig(
        vocab_size=spec.get("vocab", VOCAB),
        hidden_size=spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        intermediate_size=spec["inner"],
        max_position_embeddings=spec.get("positions", 512),
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
