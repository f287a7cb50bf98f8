"""Tile tables of the few-token ``linear`` kernel, as data per device kind.

``engine/cuda/tuning/sm_<major><minor>.json`` holds what the tile searches
found on one kind of GPU (benchmarks/small_gemm.py, benchmarks/preload_tiles.py
write the figures they rest on): per projection and hidden size, the tiles
to use up to a token count. Two tables:

- ``small_linear``: where berth's Triton GEMM beat cuBLAS inside CUDA
  graphs; cuBLAS runs every other product;
- ``preload_linear``: every projection as a GEMM that reads its weights
  before it waits for the previous kernel (one unbroken chain of dependent
  launches); taken whole or not at all (``kernels.small_linear_plan``).

A device kind with no file gets empty tables: cuBLAS for every product.
Each file is checked when it is loaded; a bad one stops the engine naming
the file and the entry.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("berth.engine")

TUNING = Path(__file__).with_name("tuning")
PROJECTIONS = ("qkv", "out", "ffn_in", "ffn_out")
# A preloading ``linear`` program holds at most this many K chunks of weights.
PRELOAD_CHUNKS = 4


class LinearConfig(NamedTuple):
    """Tiles of one ``linear`` launch: BLOCK_M x BLOCK_N outputs per program,
    K in BLOCK_K steps, cut into ``split`` slices (float32 partials)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split: int = 1
    warps: int = 4
    stages: int = 3
    # The program's weight slice loaded whole (in block_k chunks, at most
    # PRELOAD_CHUNKS) before it waits for the previous kernel.
    preload: bool = False

    def fits(self, k: int) -> bool:
        if k % (self.split * self.block_k):
            return False
        return not self.preload or k // self.split // self.block_k <= PRELOAD_CHUNKS


# (projection, hidden size) -> [(up to this many tokens, tiles)]
Table = dict[tuple[str, int], list[tuple[int, LinearConfig]]]


class TuningError(ValueError):
    """A tuning file that cannot be used."""


@dataclass(frozen=True)
class TileTables:
    """One device kind's two tables (module docstring)."""

    small: Table
    preload: Table


def device_kind(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


@cache
def tables_for(capability: tuple[int, int]) -> TileTables:
    """The tables of GPUs of this compute capability (empty where none were
    measured); the same object on every call, so a tile search may edit it."""
    path = TUNING / f"{device_kind(capability)}.json"
    if not path.is_file():
        log.info("no tile tables for %s: cuBLAS runs every product", path.stem)
        return TileTables({}, {})
    return load(path)


def load(path: Path) -> TileTables:
    """The tables in ``path``, checked."""
    try:
        data = json.loads(path.read_text())
        return TileTables(
            _table(data["small_linear"], preload=False),
            _table(data["preload_linear"], preload=True),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TuningError(f"{path}: {exc}") from None


def _table(raw: dict[str, list[dict[str, int]]], preload: bool) -> Table:
    table: Table = {}
    for key, rows in raw.items():
        name, _, hidden = key.partition("/")
        if name not in PROJECTIONS or not hidden.isdigit():
            raise ValueError(f"{key!r}: not projection/hidden, e.g. 'qkv/768'")
        entries = []
        for row in rows:
            fields = dict(row)
            limit = fields.pop("up_to_tokens")
            config = LinearConfig(**fields, preload=preload)
            _check(key, limit, config)
            entries.append((limit, config))
        limits = [limit for limit, _ in entries]
        if limits != sorted(set(limits)):
            raise ValueError(f"{key!r}: token counts must rise, got {limits}")
        table[(name, int(hidden))] = entries
    return table


def _check(key: str, limit: int, config: LinearConfig) -> None:
    sizes = (config.block_m, config.block_n, config.block_k)
    if limit < 1 or any(s < 16 or s & (s - 1) for s in sizes):
        raise ValueError(
            f"{key!r} up to {limit} tokens: blocks must be powers of 2 from 16, "
            f"got {sizes}"
        )
    if min(config.split, config.warps, config.stages) < 1:
        raise ValueError(f"{key!r} up to {limit} tokens: {config} has a count < 1")


# The Hopper tables (what the H200's searches found), by name, for the tests
# and the tile search.
HOPPER = tables_for((9, 0))
SMALL_LINEAR = HOPPER.small
PRELOAD_LINEAR = HOPPER.preload
