"""Configuration: command-line flags whose defaults come from BERTH_* env vars."""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_REPOSITORY = "model_repository"
DEFAULT_GATEWAY_PORT = 50051
DEFAULT_BATCHER_PORT = 50060
DEFAULT_ENGINE_PORT = 50070


def env(name: str, default: Any) -> Any:
    """``BERTH_<NAME>`` from the environment, converted to default's type."""
    raw = os.environ.get(f"BERTH_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


def add_flag(
    parser: argparse.ArgumentParser, name: str, default: Any, help: str
) -> None:
    """``--name`` with default from BERTH_NAME, e.g. --max-delay-ms."""
    key = name.replace("-", "_")
    value = env(key, default)
    kind = type(default) if default is not None else str
    if kind is bool:
        parser.add_argument(
            f"--{name}", action=argparse.BooleanOptionalAction, default=value, help=help
        )
    else:
        parser.add_argument(
            f"--{name}",
            type=kind,
            default=value,
            help=f"{help} (env BERTH_{key.upper()}, default {value})",
        )


def repository_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "model-repository",
        DEFAULT_REPOSITORY,
        "directory with one <model>/berth.json per model",
    )
