"""CUDA graphs, one per (input buffer, batch, length) bucket shape of a model.

The batcher only sends bucket lengths and batch sizes up to
``min(max_batch, token_budget // length)``; :func:`bucket_shapes` lists the
sizes the engine captures (a ladder of powers of two, capped there), and a
batch is padded up to the next captured size with zero-length rows.

Large shapes (B * L >= PACK_MIN_TOKENS) are captured packed instead: the
rows' tokens laid end to end, so no padding token is computed, with a graph
per token count on a ladder (:func:`token_ladder`); a batch runs in the
smallest one that holds its tokens (each row counts at least 1); a batch of
full rows gets a graph of its own, whose attention needs no mask.

Graphs are captured largest first into one memory pool shared by every
graph of the backend (replays never overlap: one stream runs them all),
each after one eager warm-up of its shape (Triton compiles, cuBLAS picks its
kernels). A graph reads a fixed int32 buffer, ``[ids (B*L) | lengths (B)]``,
and writes a fixed float32 output [B, width]: one the graph allocates, or a
given one (zero-copy: a pinned buffer mapped into the device).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.cuda.pinned import cuda_runtime

log = logging.getLogger("berth.engine")

BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Shapes of at least this many tokens run packed (below it the GPU is not
# busy enough for padding to cost much), in token counts from half the shape
# up, in steps of B*L/16 (at least PACK_STEP_MIN).
PACK_MIN_TOKENS = 4096
PACK_STEP_MIN = 1024
PROGRESS_EVERY_S = 2.0

# (io [B*L + B] int32, output buffer or None, batch, length, packed tokens or
# None) -> float32 [B, width]
Step = Callable[[torch.Tensor, torch.Tensor | None, int, int, int | None], torch.Tensor]
Buffers = tuple[torch.Tensor, torch.Tensor | None]  # (io, output) of one graph
Shape = tuple[int, int, int | None]  # (batch, length, packed tokens or None)


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


def token_ladder(batch: int, length: int) -> list[int]:
    """Packed token counts to capture for a shape, largest last; [] when the
    shape stays padded.

    The largest, B * L, holds only a batch whose every row is full: its graph
    runs the padded layout (the same thing then) with attention needing no
    mask, where the fastest kernel applies (FusedForward). B * L - 1 holds
    every other batch of the top step."""
    full = batch * length
    if full < PACK_MIN_TOKENS:
        return []
    step = max(PACK_STEP_MIN, full // 16)
    first = -(-(full // 2) // step) * step
    return sorted({*range(first, full, step), full - 1, full})


def packed_tokens(lengths: Iterable[int], rows: int) -> int:
    """Tokens a packed batch of these lengths needs, padded to rows rows:
    every row holds at least one (an empty row still gets a [PAD])."""
    real = [max(1, int(n)) for n in lengths]
    return sum(real) + rows - len(real)


def io_views(
    io: torch.Tensor, batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], lengths [B]) inside one batch's io buffer."""
    tokens = batch * length
    return io[:tokens].view(batch, length), io[tokens : tokens + batch]


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, **kwargs)`` with Python's cyclic garbage
    collector paused, in thread-local capture mode.

    A collection that runs during a capture frees whatever dead cycles hold:
    an earlier model's graphs (cudaGraphExecDestroy) or pinned buffers
    (engine/cuda/pinned.py: cudaFreeHost). Neither is allowed while a stream
    captures; CUDA invalidates the capture and it fails at its next launch
    ("operation failed due to a previous error during capture"). torch ran a
    collection before each capture until 2.9, none since (pytorch#161037,
    TransformerEngine#2092). Thread-local mode keeps other threads' calls
    (a serving thread's event waits) from invalidating this thread's capture.
    Captures in several threads at once keep the collector paused until the
    last of them ends.
    """
    global _captures, _collector_was_on
    with _capture_lock:
        if _captures == 0:
            _collector_was_on = gc.isenabled()
            gc.disable()
        _captures += 1
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local", **kwargs):
            yield
    finally:
        with _capture_lock:
            _captures -= 1
            if _captures == 0 and _collector_was_on:
                gc.enable()


_capture_lock = threading.Lock()
_RUNTIME = cuda_runtime()  # cuda-python's runtime, where installed
_captures = 0  # captures under way, in any thread
_collector_was_on = True


@dataclass
class Captured:
    """One captured graph and the static tensor its replays overwrite;
    ``executable``: its cudaGraphExec_t, where cuda-python can launch it."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    executable: int | None = None


class GraphCache:
    """The CUDA graphs of one model, by (input buffer, batch, length, tokens)."""

    def __init__(self, step: Step, stream: torch.cuda.Stream, pool: Any) -> None:
        self.step = step
        self.stream = stream
        self.pool = pool
        self._graphs: dict[tuple[int, int, int, int | None], Captured] = {}
        self._sizes: dict[int, list[int]] = {}  # length -> captured batch sizes
        # (batch, length) -> packed token counts, ascending ([] : padded)
        self._tokens: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, buffers: list[Buffers], shapes: list[Shape]) -> None:
        """Capture every shape for every (io, output) pair, largest shape first."""
        ordered = sorted(
            set(shapes),
            key=lambda s: (s[2] or s[0] * s[1], s[0] * s[1], s[0]),
            reverse=True,
        )
        began = last = time.monotonic()
        gc.collect()  # dead cycles freed here, not during a capture (capturing)
        with torch.cuda.stream(self.stream):
            for done, (batch, length, tokens) in enumerate(ordered):
                now = time.monotonic()
                if now - last > PROGRESS_EVERY_S:  # a long capture shows progress
                    last = now
                    log.info(
                        "capturing CUDA graphs: %d of %d shapes done in %.1f s (now "
                        "%dx%d%s)",
                        done, len(ordered), now - began, batch, length,
                        f", {tokens} tokens packed" if tokens else "",
                    )  # fmt: skip
                size = batch * (length + 1)
                io, out = buffers[0]
                self.step(io[:size], out, batch, length, tokens)  # warm-up, eager
                self.stream.synchronize()
                for index, (io, out) in enumerate(buffers):
                    graph = torch.cuda.CUDAGraph()
                    with capturing(graph, pool=self.pool, stream=self.stream):
                        output = self.step(io[:size], out, batch, length, tokens)
                    key = (index, batch, length, tokens)
                    self._graphs[key] = Captured(graph, output, _executable(graph))
                sizes = self._sizes.setdefault(length, [])
                if batch not in sizes:
                    bisect.insort(sizes, batch)
                counts = self._tokens.setdefault((batch, length), [])
                if tokens is not None:
                    bisect.insort(counts, tokens)

    def padded_batch(self, batch: int, length: int) -> int | None:
        """The smallest captured batch size >= batch for length, or None."""
        sizes = self._sizes.get(length, [])
        at = bisect.bisect_left(sizes, batch)
        return sizes[at] if at < len(sizes) else None

    def packs(self, batch: int, length: int) -> bool:
        """Whether a captured shape runs packed (a ladder of token counts)."""
        return bool(self._tokens.get((batch, length)))

    def tokens_for(self, batch: int, length: int, needed: int) -> int | None:
        """The smallest packed graph of a captured shape that holds ``needed``
        tokens; None where the shape runs padded."""
        counts = self._tokens.get((batch, length), [])
        at = bisect.bisect_left(counts, needed)
        if at == len(counts):
            if counts:
                raise ValueError(f"{needed} tokens do not fit a {batch}x{length} batch")
            return None
        return counts[at]

    def replay(
        self, buffer: int, batch: int, length: int, tokens: int | None = None
    ) -> torch.Tensor:
        """Run a captured shape on the current stream; returns its static output."""
        captured = self._graphs[(buffer, batch, length, tokens)]
        captured.graph.replay()
        return captured.output

    def launch(
        self,
        buffer: int,
        batch: int,
        length: int,
        tokens: int | None,
        stream: torch.cuda.Stream,
    ) -> torch.Tensor:
        """``replay`` on ``stream``, without making it the current stream:
        cudaGraphLaunch straight on the graph's executable through
        cuda-python (the host work of a batch-1 launch: 1.9 us against 4.1
        for torch's stream context and replay, H200 host); torch's replay
        where cuda-python is missing or another device is current."""
        captured = self._graphs[(buffer, batch, length, tokens)]
        if (
            captured.executable is None
            or torch.cuda.current_device() != stream.device_index
        ):
            with torch.cuda.stream(stream):
                captured.graph.replay()
            return captured.output
        launch_graph(captured.executable, stream.cuda_stream)
        return captured.output

    def executables(self, batch: int, length: int) -> tuple[int, ...] | None:
        """The cudaGraphExec_t of an unpacked shape's graph on each buffer, in
        buffer order, for ``launch_graph``; None where one is missing (no
        cuda-python, another torch build, or the shape not captured)."""
        found = []
        for buffer in itertools.count():
            captured = self._graphs.get((buffer, batch, length, None))
            if captured is None:
                break
            if captured.executable is None:
                return None
            found.append(captured.executable)
        return tuple(found) or None

    def outputs(self) -> list[torch.Tensor]:
        """Every graph's static output (tests poison them)."""
        return [captured.output for captured in self._graphs.values()]


def launch_graph(executable: int, stream: int) -> None:
    """cudaGraphLaunch of a ``GraphCache.executables`` handle on a raw stream
    handle (torch's ``stream.cuda_stream``), through cuda-python; the
    calling thread's current device must be the stream's."""
    runtime = _RUNTIME
    if runtime is None:  # no executable is found without it
        raise RuntimeError("launch_graph needs cuda-python")
    (err,) = runtime.cudaGraphLaunch(executable, stream)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphLaunch failed: {err}")


def _executable(graph: torch.cuda.CUDAGraph) -> int | None:
    """The instantiated graph's cudaGraphExec_t (torch >= 2.6), or None."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None or _RUNTIME is None:
        return None
    try:
        return int(raw())
    except (TypeError, RuntimeError):  # another build's handle type: replay()
        return None
