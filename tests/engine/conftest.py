"""Engine fixtures: a default repository built once, its models, references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from engine.torch_backend import TorchBackend
from services.cli.default_models import build_default_repository, minilm_checkpoint
from services.repository import ModelEntry, load_repository


@pytest.fixture(scope="session")
def default_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh default repository (not tests/conftest's, which may reuse one)."""
    root = tmp_path_factory.mktemp("model_repository")
    build_default_repository(root)
    return root


@pytest.fixture(scope="session")
def entries(default_repo: Path) -> dict[str, ModelEntry]:
    return load_repository(default_repo)


@pytest.fixture(scope="session")
def backend(entries: dict[str, ModelEntry]) -> TorchBackend:
    torch_backend = TorchBackend("cpu")
    for entry in entries.values():
        torch_backend.load(entry)
    return torch_backend


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(minilm_checkpoint() / "tokenizer.json"))
    tok.no_truncation()  # tokenizer.json truncates (and pads) to 128
    tok.no_padding()
    return tok


@pytest.fixture(scope="session")
def sentence_transformer() -> Any:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_checkpoint()), device="cpu")
    # The package's sentence_bert_config.json truncates at 256 tokens (and so
    # does the served model, tests/test_sentence_transformers.py); lifted to
    # the position limit here, so that the engine's encoder is compared at
    # every length it computes (up to 400 tokens).
    model.max_seq_length = 512
    return model
