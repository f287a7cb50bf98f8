"""The torch backend on a GPU: fp16 weights, fused kernels, a CUDA graph per
bucket shape, and pinned, device-mapped host buffers for the batch bytes.

``create_backend("torch", "cuda:0")`` returns a :class:`CudaBackend`
(:func:`torch_backend` picks by device); ``torch-eager`` keeps plain eager
torch on any device. Settings from the environment:

- ``BERTH_CUDA_DTYPE``: ``float16`` (default) or ``bfloat16`` weights;
- ``BERTH_CUDA_INPUT``: ``zero-copy`` (default: the graph reads the mapped
  pinned input and writes the mapped pinned output itself, one graph per
  slot) or ``staging`` (async copies from and to the pinned buffers around
  each replay); benchmarks/engine.py measures both: zero-copy wins end to
  end on small batches (fewer host calls) and ties on large ones;
- ``BERTH_EXACT_GELU=1``: erf GELU after the matmul instead of the tanh form
  in the cuBLASLt epilogue;
- ``BERTH_CUDA_PACK=0``: large shapes stay padded (by default they run
  packed: no padding token computed, engine/cuda/graphs.py);
- ``BERTH_PDL=0``: no programmatic dependent launches (on by default on
  Hopper and later, engine/cuda/forward.py);
- ``BERTH_PRELOAD=0``: few-token shapes keep kernels.SMALL_LINEAR's GEMMs,
  never timing PRELOAD_LINEAR's against them (engine/cuda/forward.py).

One batch: write the wire bytes into a pinned slot, pad to the next
captured batch size, enqueue (copy in, replay, copy out) on the engine's
stream, wait. Its values are validated before the launch, or, where the
graph's embedding kernel clamps them (unpacked shapes), while it runs; such
shapes in zero-copy mode take the Direct way, their graph handles and output
views looked up once per request shape. ``submit``/``collect`` split that in
two, so a caller may fill the next slot while the GPU runs this one.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.backend import Backend, BackendError
from engine.cuda.forward import FusedForward
from engine.cuda.graphs import (
    Buffers,
    GraphCache,
    Shape,
    io_views,
    launch_graph,
    packed_tokens,
    token_ladder,
)
from engine.cuda.pinned import Slot, SlotRing
from engine.model import ServedModel
from engine.torch_backend import TorchBackend, check_batch, resolve_device
from services.config import env
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
INPUT_MODES = ("staging", "zero-copy")
DEFAULT_INPUT = "zero-copy"  # faster end to end: benchmarks/engine.py, notes/gpu.md
SLOTS = 2  # double buffering
MAX_ROWS = 256  # the batcher's max_batch default: pinned slots hold this many rows

Times = tuple[float, float, float]  # seconds: copy in, compute, copy out
# The wire's little-endian int32, as the scalar type where that is native:
# np.frombuffer takes 0.26 us with it against 0.68 with "<i4" (whose string
# it parses every call), twice on a batch's way to the GPU.
WIRE_INT32: Any = np.int32 if sys.byteorder == "little" else np.dtype("<i4")


_SET_STREAM = hasattr(torch._C, "_cuda_setStream")  # checked once, not per batch


class OnStream:
    """``with torch.cuda.stream(stream)`` for one batch, at a fraction of its
    host cost: torch's context looks the device up four times and the current
    stream three; this sets the stream by id and puts the previous one back.
    That context (and events recorded on the "current" stream) was most of a
    batch-1 submit's host time in a cProfile on the H200's Xeon; the median
    submit went from 94 to 32-39 us (notes/gpu.md). Torch without these
    hooks gets torch's context."""

    __slots__ = ("ids", "previous", "fallback")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.ids = (stream.stream_id, stream.device_index, stream.device_type)
        self.fallback = None if _SET_STREAM else torch.cuda.stream(stream)

    def __enter__(self) -> None:
        if self.fallback is not None:
            self.fallback.__enter__()
            return
        self.previous = torch._C._cuda_getCurrentStream(self.ids[1])
        stream_id, device_index, device_type = self.ids
        torch._C._cuda_setStream(
            stream_id=stream_id, device_index=device_index, device_type=device_type
        )

    def __exit__(self, *exc: object) -> None:
        if self.fallback is not None:
            self.fallback.__exit__(*exc)
            return
        stream_id, device_index, device_type = self.previous
        torch._C._cuda_setStream(
            stream_id=stream_id, device_index=device_index, device_type=device_type
        )


def torch_backend(device: str = "auto") -> Backend:
    """The "torch" backend: graphs and pinned I/O on a GPU, eager on the CPU."""
    if resolve_device(device).type == "cuda":
        return CudaBackend(device)
    return TorchBackend(device)


@dataclass(slots=True)
class Ticket:
    """A submitted batch: where its output will land (``output``: that view,
    made in advance, where the shape has one)."""

    slot: Slot
    rows: int
    width: int
    output: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Direct:
    """A request shape (rows, length) whose batches take the shortest way to
    the GPU (``ModelRunner.submit``): zero-copy graphs of an unpacked shape
    whose forward clamps its inputs, launched through cuda-python, with
    everything a batch of this shape looks up found in advance."""

    batch: int  # the captured batch size the rows are padded to
    tokens: int  # batch * length: where the lengths start in a slot's io
    executables: tuple[int, ...]  # the shape's graph on each slot
    outputs: tuple[np.ndarray, ...]  # each slot's output rows [rows, width]


class ModelRunner:
    """One model on the GPU: fused forward, its graphs, its pinned slots."""

    def __init__(
        self, served: ServedModel, backend: CudaBackend, gelu_epilogue: bool
    ) -> None:
        self.forward = FusedForward(
            served, gelu_epilogue=gelu_epilogue, pdl=backend.pdl
        )
        self.width = served.width
        self.vocab = served.encoder.config.vocab_size
        self.max_length = served.encoder.embeddings.max_length
        self.zero_copy = backend.input_mode == "zero-copy"
        self.pack = backend.pack
        self.stream = backend.stream
        self.device = backend.torch_device
        self.graphs = GraphCache(self.step, backend.stream, backend.pool)
        self.rows = 0  # pinned slots are sized at the first capture or batch
        # (rows, length) -> its Direct, or None: a batch of it takes the
        # general way (filled in as shapes arrive, emptied at capture).
        self._direct: dict[tuple[int, int], Direct | None] = {}
        self._device_index = backend.stream.device_index
        self._stream_handle = backend.stream.cuda_stream

    def allocate(self, rows: int) -> None:
        """Pinned slots and the device input buffer for batches of up to rows."""
        if rows <= self.rows:
            return
        if len(self.graphs):
            raise BackendError(
                f"graphs read {self.rows}-row buffers; a {rows}-row batch needs "
                "the engine restarted with a larger --max-batch"
            )
        io_size = rows * (self.max_length + 1)
        slots = [Slot(io_size, rows * self.width, self.device) for _ in range(SLOTS)]
        self.ring = SlotRing(slots)
        self.device_io = torch.zeros(io_size, dtype=torch.int32, device=self.device)
        self.rows = rows

    def step(
        self,
        io: torch.Tensor,
        out: torch.Tensor | None,
        batch: int,
        length: int,
        tokens: int | None = None,
    ) -> torch.Tensor:
        """What a graph runs: one batch's io buffer -> float32 [B, width], into
        out when given (zero-copy: the mapped pinned output); packed into
        ``tokens`` rows when given."""
        if self.zero_copy and not self.forward.reads_host(batch, length, tokens):
            io = io.to(torch.int64)  # one coalesced read of the mapped host buffer
        ids, lengths = io_views(io, batch, length)
        if out is None:
            return self.forward(ids, lengths, tokens)
        target = out[: batch * self.width].view(batch, self.width)
        result = self.forward(ids, lengths, tokens, out=target)
        if result is target:  # the pooling kernel wrote it, over PCIe
            return target
        return torch.mul(result, 1.0, out=target)  # a kernel's writes, over PCIe

    def capture(self, shapes: list[tuple[int, int]]) -> None:
        fits = [(b, n) for b, n in shapes if n <= self.max_length]
        self.allocate(max([MAX_ROWS, *(b for b, _ in fits)]))
        buffers: list[Buffers]
        if self.zero_copy:
            buffers = [(slot.io_cuda, slot.out_cuda) for slot in self.ring.slots]
        else:
            buffers = [(self.device_io, None)]
        graphs: list[Shape] = []
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for batch, length in fits:  # the faster attention kernel per shape
                ladder = token_ladder(batch, length) if self.pack else []
                self.forward.choose_attention(batch, length, packed=bool(ladder))
                self._choose_plan(buffers[0], batch, length)
                if not self.forward.packs(batch, length):
                    ladder = []
                if ladder:  # its top rung: batches of full rows
                    self.forward.choose_full_rows(batch, length)
                graphs += [(batch, length, t) for t in ladder] or [
                    (batch, length, None)
                ]
            self.graphs.capture(buffers, graphs)
        self._direct.clear()

    def _choose_plan(self, buffers: Buffers, batch: int, length: int) -> None:
        """FusedForward.choose_plan timing the step this shape's graph will
        run, on the graph's own buffers (the first slot's, zero-copy) holding
        random ids and lengths in (L/2, L]; zeros again afterwards, what every
        capture's warm-up reads (lengths that fit any packed graph)."""
        tokens = batch * length
        if not self.forward.preload_eligible(tokens):
            self.forward.choose_plan(batch, length)  # records "not preloaded"
            return
        rng = np.random.default_rng(tokens + length)
        values = np.empty(tokens + batch, dtype=np.int32)
        values[:tokens] = rng.integers(0, self.vocab, size=tokens, dtype=np.int32)
        values[tokens:] = rng.integers(length // 2 + 1, length + 1, size=batch)
        io, out = buffers
        write = self.ring.slots[0].io if self.zero_copy else None
        if write is not None:
            write[: tokens + batch] = values
        else:
            io[: tokens + batch].copy_(torch.from_numpy(values))
        try:
            run = partial(self.step, io[: tokens + batch], out, batch, length)
            self.forward.choose_plan(batch, length, run)
        finally:
            if write is not None:
                write[: tokens + batch] = 0
            else:
                io[: tokens + batch].zero_()

    def submit(
        self, ids: np.ndarray, lengths: np.ndarray, rows: int, length: int
    ) -> Ticket:
        try:
            direct = self._direct[(rows, length)]
        except KeyError:
            direct = self._direct[(rows, length)] = self._direct_for(rows, length)
        if direct is not None and torch.cuda.current_device() == self._device_index:
            return self._submit_direct(direct, ids, lengths, rows, length)
        if length > self.max_length:
            raise ValueError(
                f"sequence length {length} is over the model's {self.max_length} "
                "positions"
            )
        self.allocate(max(rows, MAX_ROWS))
        # 1. The graph: the smallest captured batch that holds these rows.
        padded = self.graphs.padded_batch(rows, length)
        # 2. Validate what could crash a kernel: ids index the embedding
        # table, lengths cut rows. Where the forward clamps both itself, the
        # graph is launched first and the values checked while it runs (a
        # batch-1 graph starts ~3 us sooner); a batch that fails is waited
        # for, its slot freed, and its error raised as before.
        packs = padded is not None and self.graphs.packs(padded, length)
        later = self._checks_while_running(padded, length, packs)
        if not later:
            _check_values(ids, lengths, length, self.vocab)
        index, slot = self.ring.take()
        try:
            self._enqueue(index, slot, ids, lengths, rows, length, padded, packs)
        except BaseException:
            slot.busy = False
            raise
        ticket = Ticket(slot, rows, self.width)
        if later:
            return _checked_while_running(ticket, ids, lengths, length, self.vocab)
        return ticket

    def _checks_while_running(
        self, padded: int | None, length: int, packs: bool
    ) -> bool:
        """Whether a batch padded to ``padded`` rows may be launched before
        its values are checked: a captured, unpacked shape whose forward
        clamps ids and lengths itself (``FusedForward.clamps_inputs``)."""
        return (
            padded is not None
            and not packs
            and self.forward.clamps_inputs(padded, length, None)
        )

    def _direct_for(self, rows: int, length: int) -> Direct | None:
        """The Direct of a request shape, or None where its batches take the
        general way: packed or staged graphs, none captured, a forward that
        reads its inputs unclamped, or graphs torch alone can launch."""
        if not self.zero_copy or length > self.max_length or rows > self.rows:
            return None
        padded = self.graphs.padded_batch(rows, length)
        packs = padded is not None and self.graphs.packs(padded, length)
        if padded is None or not self._checks_while_running(padded, length, packs):
            return None
        executables = self.graphs.executables(padded, length)
        if executables is None or len(executables) != len(self.ring.slots):
            return None
        outputs = tuple(
            slot.out[: rows * self.width].reshape(rows, self.width)
            for slot in self.ring.slots
        )
        return Direct(padded, padded * length, executables, outputs)

    def _submit_direct(
        self,
        direct: Direct,
        ids: np.ndarray,
        lengths: np.ndarray,
        rows: int,
        length: int,
    ) -> Ticket:
        """``submit``'s work for a Direct shape, in the order of the general
        way's, without its lookups: a batch-1 graph starts sooner."""
        index, slot = self.ring.take()
        io, tokens, batch = slot.io, direct.tokens, direct.batch
        io[: rows * length] = ids
        io[tokens : tokens + rows] = lengths
        if rows < batch:  # padding rows: no ids, length 0
            io[rows * length : tokens] = 0
            io[tokens + rows : tokens + batch] = 0
        slot.staged = False
        events = slot.events
        events[1].record(self.stream)
        try:
            launch_graph(direct.executables[index], self._stream_handle)
        except BaseException:
            slot.busy = False
            raise
        events[3].record(self.stream)
        ticket = Ticket(slot, rows, self.width, direct.outputs[index])
        return _checked_while_running(ticket, ids, lengths, length, self.vocab)

    def _enqueue(
        self,
        index: int,
        slot: Slot,
        ids: np.ndarray,
        lengths: np.ndarray,
        rows: int,
        length: int,
        padded: int | None,
        packs: bool,
    ) -> None:
        # 3. The wire bytes into pinned memory: ids, then lengths (0 for padding).
        batch = padded or rows
        packed = None
        if padded is not None and packs:
            # the graph with the fewest tokens that holds these
            needed = packed_tokens(lengths, padded)
            packed = self.graphs.tokens_for(padded, length, needed)
        tokens = batch * length
        slot.io[: rows * length] = ids
        slot.io[tokens : tokens + rows] = lengths
        if rows < batch:  # padding rows: no ids, length 0
            slot.io[rows * length : tokens] = 0
            slot.io[tokens + rows : tokens + batch] = 0
        # 4. Copy in, compute, copy out: queued on the engine's stream.
        copy_in, compute, computed, copied = slot.events
        slot.staged = not self.zero_copy
        stream = self.stream
        if padded is not None and self.zero_copy:  # the graph does all three
            compute.record(stream)
            self.graphs.launch(index, batch, length, packed, stream)
            copied.record(stream)
            return
        with OnStream(stream):
            copy_in.record(stream)
            source = slot.io_cuda if self.zero_copy else self.device_io
            if not self.zero_copy:
                source[: tokens + batch].copy_(
                    slot.io_cpu[: tokens + batch], non_blocking=True
                )
            compute.record(stream)
            if padded is not None:
                output = self.graphs.replay(0, batch, length, packed)
            else:  # a shape with no graph: eager, same kernels
                target = slot.out_cuda if self.zero_copy else None
                with torch.inference_mode():
                    output = self.step(source[: tokens + batch], target, batch, length)
            computed.record(stream)
            if not self.zero_copy:
                out = slot.out_cpu[: rows * self.width].view(rows, self.width)
                out.copy_(output[:rows], non_blocking=True)
            copied.record(stream)
            slot.staged = True


def collect(ticket: Ticket) -> tuple[np.ndarray, Times]:
    """Wait for a submitted batch; its output is valid until its slot is reused."""
    slot = ticket.slot
    slot.events[-1].synchronize()
    times = slot.times()
    slot.busy = False
    if ticket.output is not None:
        return ticket.output, times
    return slot.out[: ticket.rows * ticket.width].reshape(
        ticket.rows, ticket.width
    ), times


def _checked_while_running(
    ticket: Ticket, ids: np.ndarray, lengths: np.ndarray, length: int, vocab: int
) -> Ticket:
    """The ticket of a launched batch whose graph clamps its inputs, once its
    values pass ``_check_values`` (checked while the GPU computes); a batch
    that fails is waited for, its slot freed, and its ValueError raised."""
    try:
        _check_values(ids, lengths, length, vocab)
    except ValueError:
        collect(ticket)  # computed on clamped values: discarded
        raise
    return ticket


def _check_values(
    ids: np.ndarray, lengths: np.ndarray, length: int, vocab: int
) -> None:
    if _outside(ids, vocab):
        raise ValueError(
            f"token ids must lie in [0, {vocab}), got {ids.min()} to {ids.max()}"
        )
    if _outside(lengths, length + 1):
        raise ValueError(
            f"lengths must lie in [0, {length}], got {lengths.min()} to {lengths.max()}"
        )


def _outside(values: np.ndarray, end: int) -> bool:
    """Any value outside [0, end); int32 in one pass (negatives are huge as uint32)."""
    if not values.size:
        return False
    if values.dtype == np.int32:
        return bool(values.view(np.uint32).max() >= end)
    return bool(values.min() < 0 or values.max() >= end)


class CudaBackend(TorchBackend):
    """Serves models on one GPU from CUDA graphs fed through pinned buffers."""

    name = "torch-cuda"

    def __init__(
        self,
        device: str = "cuda",
        dtype: torch.dtype | None = None,
        input_mode: str | None = None,
        gelu_epilogue: bool | None = None,
        pack: bool | None = None,
        pdl: bool | None = None,
    ) -> None:
        dtype_name = os.environ.get("BERTH_CUDA_DTYPE", "float16")
        if dtype is None and dtype_name not in DTYPES:
            raise ValueError(
                f"BERTH_CUDA_DTYPE={dtype_name!r}: use one of {list(DTYPES)}"
            )
        super().__init__(device, dtype or DTYPES[dtype_name])
        if self.torch_device.type != "cuda":
            raise ValueError(f"{self.name} needs a CUDA device, got {device!r}")
        self.input_mode = input_mode or os.environ.get(
            "BERTH_CUDA_INPUT", DEFAULT_INPUT
        )
        if self.input_mode not in INPUT_MODES:
            raise ValueError(
                f"input mode {self.input_mode!r}: use one of {INPUT_MODES}"
            )
        if gelu_epilogue is None:
            gelu_epilogue = not env("EXACT_GELU", False)
        self.gelu_epilogue = gelu_epilogue
        if pack is None:
            pack = env("CUDA_PACK", True)
        self.pack = pack
        self.pdl = pdl  # None: BERTH_PDL, where the GPU has it (FusedForward)
        torch.cuda.set_device(self.torch_device)
        self.stream = torch.cuda.Stream(self.torch_device)
        self.pool = torch.cuda.graph_pool_handle()
        self._runners: dict[str, ModelRunner] = {}
        props = torch.cuda.get_device_properties(self.torch_device)
        log.info(
            "torch-cuda on %s (%s %s, %d SMs, %.0f GiB): %s weights, %s inputs, "
            "GELU %s",
            self.device,
            props.name,
            getattr(props, "uuid", ""),  # which card, whatever CUDA numbers it
            props.multi_processor_count,
            props.total_memory / 2**30,
            str(self.dtype).removeprefix("torch."),
            self.input_mode,
            "tanh, in the matmul epilogue"
            if gelu_epilogue
            else "exact, after the matmul",
        )

    # The interface.

    def load(self, entry: ModelEntry) -> None:
        super().load(entry)
        runner = ModelRunner(self.model(entry.name), self, self.gelu_epilogue)
        self._runners[entry.name] = runner
        log.info(
            "model %s on %s: attention kernels %s (the faster per shape); "
            "dependent launches %s",
            entry.name,
            self.device,
            ", ".join(runner.forward.kinds),
            "on" if runner.forward.pdl else "off",
        )

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        """Capture a graph per shape (largest first); done before SERVING."""
        runner = self.runner(model)
        start = time.perf_counter()
        runner.capture(shapes)
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.empty_cache()  # the eager warm-ups' blocks; graphs keep their pool
        chosen = list(runner.forward.chosen.values())
        preloaded = sum(runner.forward.preloaded.values())
        log.info(
            "model %s: %d CUDA graphs captured for %d shapes (%s inputs, pinned "
            "memory from %s) in %.2f s; %.0f MiB reserved on %s; attention %s; "
            "preloading GEMMs on %d shapes",
            model,
            len(runner.graphs),
            len(set(shapes)),
            self.input_mode,
            runner.ring.slots[0].allocator,
            time.perf_counter() - start,
            torch.cuda.memory_reserved(self.torch_device) / 2**20,
            self.device,
            ", ".join(f"{k} on {chosen.count(k)} shapes" for k in sorted(set(chosen))),
            preloaded,
        )

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        check_batch(token_ids, lengths)
        rows, length = token_ids.shape
        ticket = self.runner(model).submit(token_ids.reshape(-1), lengths, rows, length)
        output, _ = collect(ticket)
        return output.copy()

    def run_bytes(
        self, model: str, token_ids: bytes, lengths: bytes, batch: int, length: int
    ) -> tuple[np.ndarray, Times]:
        """A batch straight from the wire; the output is a view of a pinned slot,
        valid until that slot is reused (two batches later)."""
        return collect(self.submit(model, token_ids, lengths, batch, length))

    # Pipelining: fill slot n+1 while slot n computes.

    def submit(
        self, model: str, token_ids: bytes, lengths: bytes, batch: int, length: int
    ) -> Ticket:
        ids = np.frombuffer(token_ids, dtype=WIRE_INT32)
        lens = np.frombuffer(lengths, dtype=WIRE_INT32)
        if ids.size != batch * length or lens.size != batch:
            raise ValueError(
                f"batch {batch}x{length} needs {batch * length} ids and {batch} "
                f"lengths, got {ids.size} and {lens.size}"
            )
        # An unknown name goes to runner(), whose error names the loaded models.
        runner = self._runners.get(model) or self.runner(model)
        return runner.submit(ids, lens, batch, length)

    def collect(self, ticket: Ticket) -> tuple[np.ndarray, Times]:
        """Wait for a submitted batch: its output (a view of its pinned slot,
        valid until the slot is reused) and copy-in/compute/copy-out times."""
        return collect(ticket)

    def runner(self, model: str) -> ModelRunner:
        """The GPU state of one loaded model (graphs, slots)."""
        self.model(model)  # raises BackendError naming the loaded models
        return self._runners[model]
