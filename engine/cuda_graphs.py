"""CUDA graphs, one per (input buffer, batch, length) bucket shape of a model.

The batcher only sends bucket lengths and batch sizes up to
``min(max_batch, token_budget // length)``; :func:`bucket_shapes` lists the
sizes the engine captures (a ladder of powers of two, capped there), and a
batch is padded up to the next captured size with zero-length rows.

Graphs are captured largest first into one memory pool shared by every
graph of the backend (replays never overlap: one stream runs them all),
each after one eager warm-up of its shape (Triton compiles, cuBLAS picks its
kernels). A graph reads a fixed int32 buffer, ``[ids (B*L) | lengths (B)]``,
and writes a fixed float32 output [B, width]: one the graph allocates, or a
given one (zero-copy: a pinned buffer mapped into the device).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("berth.engine")

BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# (io [B*L + B] int32, output buffer or None, batch, length) -> float32 [B, width]
Step = Callable[[torch.Tensor, torch.Tensor | None, int, int], torch.Tensor]
Buffers = tuple[torch.Tensor, torch.Tensor | None]  # (io, output) of one graph


def bucket_shapes(
    lengths: Iterable[int], max_batch: int, token_budget: int
) -> list[tuple[int, int]]:
    """Every (batch, length) to capture: ladder sizes below the batcher's cap
    for that length, and the cap itself (the batcher's own rule)."""
    shapes = []
    for length in sorted(set(lengths)):
        cap = max(1, min(max_batch, token_budget // length))
        sizes = {size for size in BATCH_LADDER if size < cap} | {cap}
        shapes += [(size, length) for size in sorted(sizes)]
    return shapes


def io_views(
    io: torch.Tensor, batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], lengths [B]) inside one batch's io buffer."""
    tokens = batch * length
    return io[:tokens].view(batch, length), io[tokens : tokens + batch]


@dataclass
class Captured:
    """One captured graph and the static tensor its replays overwrite."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor


class GraphCache:
    """The CUDA graphs of one model, by (input buffer, batch, length)."""

    def __init__(self, step: Step, stream: torch.cuda.Stream, pool: Any) -> None:
        self.step = step
        self.stream = stream
        self.pool = pool
        self._graphs: dict[tuple[int, int, int], Captured] = {}
        self._sizes: dict[int, list[int]] = {}  # length -> captured batch sizes

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, buffers: list[Buffers], shapes: list[tuple[int, int]]) -> None:
        """Capture every shape for every (io, output) pair, largest shape first."""
        ordered = sorted(set(shapes), key=lambda s: (s[0] * s[1], s[0]), reverse=True)
        with torch.cuda.stream(self.stream):
            for batch, length in ordered:
                size = batch * (length + 1)
                io, out = buffers[0]
                self.step(io[:size], out, batch, length)  # warm-up, eager
                self.stream.synchronize()
                for index, (io, out) in enumerate(buffers):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                        output = self.step(io[:size], out, batch, length)
                    self._graphs[(index, batch, length)] = Captured(graph, output)
                bisect.insort(self._sizes.setdefault(length, []), batch)

    def padded_batch(self, batch: int, length: int) -> int | None:
        """The smallest captured batch size >= batch for length, or None."""
        sizes = self._sizes.get(length, [])
        at = bisect.bisect_left(sizes, batch)
        return sizes[at] if at < len(sizes) else None

    def replay(self, buffer: int, batch: int, length: int) -> torch.Tensor:
        """Run a captured shape on the current stream; returns its static output."""
        captured = self._graphs[(buffer, batch, length)]
        captured.graph.replay()
        return captured.output

    def outputs(self) -> list[torch.Tensor]:
        """Every graph's static output (tests poison them)."""
        return [captured.output for captured in self._graphs.values()]
