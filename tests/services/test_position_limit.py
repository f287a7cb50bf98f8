"""services.repository.position_limit: the tokens a checkpoint's positions
allow, per architecture (engine/encoder.py's ``max_length`` agrees:
tests/engine/test_architectures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.repository import MAX_TOKENS_CAP, position_limit


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        ({"model_type": "bert", "max_position_embeddings": 512}, 512),
        ({"model_type": "distilbert", "max_position_embeddings": 512}, 512),
        (
            {
                "model_type": "roberta",
                "max_position_embeddings": 514,
                "pad_token_id": 1,
            },
            512,
        ),
        ({"model_type": "xlm-roberta", "max_position_embeddings": 514}, 512),
        (
            {
                "model_type": "camembert",
                "max_position_embeddings": 514,
                "pad_token_id": 3,
            },
            510,
        ),
        # all-mpnet-base-v2: real tokens from position 2 (padding_idx 1)
        (
            {"model_type": "mpnet", "max_position_embeddings": 514, "pad_token_id": 1},
            512,
        ),
        ({"model_type": "mpnet", "max_position_embeddings": 160}, 158),
        # ModernBERT: rotary, no offset
        (
            {
                "model_type": "modernbert",
                "max_position_embeddings": 8192,
                "pad_token_id": 50283,
            },
            8192,
        ),
        ({"model_type": "bert"}, MAX_TOKENS_CAP),
    ],
)
def test_position_limit(tmp_path: Path, config: dict[str, object], limit: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert position_limit(tmp_path) == limit
