"""Shared fixtures: the default model repository, a running stack, a tiny
random BERT."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.proto.berth.v1 import berth_pb2_grpc
from services.repository import ModelEntry
from tests.stack import Stack, serving

# `berth serve` started by a test listens for HTTP only where the test asks
# (Stack(http=True) gives a free port): serve's default, 8080, is one fixed
# port that stacks running side by side would contend for.
os.environ.setdefault("BERTH_HTTP_PORT", "0")


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model repository: the one `make` built, else a fresh one."""
    configured = os.environ.get("BERTH_MODEL_REPOSITORY")
    if configured and (Path(configured) / "minilm" / "fallback.safetensors").exists():
        return Path(configured)
    from services.cli.default_models import build_models

    root = tmp_path_factory.mktemp("model_repository")
    build_models(root)
    return root


@pytest.fixture(scope="session")
def stack(repository: Path) -> Iterator[Stack]:
    """`berth serve` with the default models, shared by the e2e tests."""
    with serving(Stack(repository)) as s:
        yield s


@pytest.fixture(scope="session")
def client(stack: Stack) -> Iterator[berth_pb2_grpc.BerthStub]:
    with grpc.insecure_channel(stack.gateway) as channel:
        yield berth_pb2_grpc.BerthStub(channel)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelEntry:
    """A random 2-layer BERT (hidden 32, 64 positions): a real model, fast."""
    from benchmarks.random_models import write_random_checkpoint

    directory = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint("tiny", directory)
    return ModelEntry(name="tiny", task="embed", checkpoint=str(directory), root="/")
