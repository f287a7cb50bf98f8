"""One model's runner on a GPU: its fused forward, CUDA graphs and pinned
slots, and the way a batch goes in, runs and comes out (``submit`` then
``collect``), with its values checked before the launch or while it runs."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.backend import BackendError
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
from engine.cuda.plain import PlainForward, unfused_reason
from engine.model import ServedModel
from engine.validate import BadBatch

if TYPE_CHECKING:
    from engine.cuda.backend import CudaBackend

log = logging.getLogger("berth.engine")


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
    submit takes 32-39 us with it against 94 (benchmarks/engine.py's
    submit_us). Torch without these
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
    """One model on the GPU: fused forward (or, for an architecture the fused
    kernels do not compute, engine/cuda/plain.py's), its graphs, its pinned
    slots."""

    def __init__(
        self, served: ServedModel, backend: CudaBackend, gelu_epilogue: bool
    ) -> None:
        self.forward: FusedForward | PlainForward
        reason = unfused_reason(served)
        if reason is None:
            self.forward = FusedForward(
                served, gelu_epilogue=gelu_epilogue, pdl=backend.pdl
            )
        else:
            log.warning(
                "model %s: %s; it runs as plain torch in CUDA graphs",
                served.name,
                reason,
            )
            self.forward = PlainForward(served)
        self.width = served.width
        self.vocab = served.encoder.config.table_rows
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
        raise BadBatch(
            f"token ids must lie in [0, {vocab}), got {ids.min()} to {ids.max()}"
        )
    if _outside(lengths, length + 1):
        raise BadBatch(
            f"lengths must lie in [0, {length}], got {lengths.min()} to {lengths.max()}"
        )


def _outside(values: np.ndarray, end: int) -> bool:
    """Any value outside [0, end); int32 in one pass (negatives are huge as uint32)."""
    if not values.size:
        return False
    if values.dtype == np.int32:
        return bool(values.view(np.uint32).max() >= end)
    return bool(values.min() < 0 or values.max() >= end)
