"""Configuration: command-line flags whose defaults come from BERTH_* env vars."""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_REPOSITORY = "model_repository"
DEFAULT_GATEWAY_PORT = 50051
# The gateways' HTTP/JSON port under `berth serve` (a lone gateway: off).
DEFAULT_HTTP_PORT = 8080
DEFAULT_BATCHER_PORT = 50060
DEFAULT_ENGINE_PORT = 50070

# HTTP/2 keepalive of berth's channels and servers (services/channels.py),
# from BERTH_KEEPALIVE_TIME_MS and BERTH_KEEPALIVE_TIMEOUT_MS. No flags: every
# process reads them itself, so set them alike on all of them. A channel
# pings after 10 s in which nothing came from its peer, and a peer that does
# not answer within 5 s is taken for gone: its stream fails UNAVAILABLE with
# what was in flight on it, and the client reconnects. A vanished host
# (powered off, partitioned away) sends no FIN or RST; without pings its
# streams would look up until TCP gave up, minutes to hours later, and every
# request on them would wait out its deadline.
DEFAULT_KEEPALIVE_TIME_MS = 10_000
DEFAULT_KEEPALIVE_TIMEOUT_MS = 5_000


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A BERTH_* environment variable holds a value its flag cannot take."""


def env(name: str, default: Any) -> Any:
    """``BERTH_<NAME>`` from the environment, converted to default's type.

    An empty value counts as unset (as OpenTelemetry's OTEL_* variables do);
    one that is not of the flag's type raises ConfigError, naming it."""
    var = f"BERTH_{name.upper()}"
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    if isinstance(default, bool):
        if raw.lower() in TRUE:
            return True
        if raw.lower() in FALSE:
            return False
        raise ConfigError(
            f"{var}={raw!r} is not a boolean (one of {', '.join(TRUE + FALSE)})"
        )
    kind = type(default)
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{var}={raw!r} is not {what}") from None
    return raw


def add_flag(
    parser: argparse.ArgumentParser, name: str, default: Any, help: str
) -> None:
    """``--name`` with default from BERTH_NAME, e.g. --max-delay-ms."""
    key = name.replace("-", "_")
    try:
        value = env(key, default)
    except ConfigError as exc:
        parser.error(f"{exc}; it sets --{name}: fix it or unset it")
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


def gpu_buckets_flag(parser: argparse.ArgumentParser) -> None:
    """A batcher's or gateway's: batch to each model's gpu_buckets, the
    lengths engines on GPUs capture graphs for (`berth serve` sets it)."""
    add_flag(
        parser,
        "gpu-buckets",
        False,
        "the engines run on GPUs: batch to each model's gpu_buckets (berth.json) "
        "where it has them (env BERTH_GPU_BUCKETS)",
    )
