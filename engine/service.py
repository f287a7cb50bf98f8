"""The engine's gRPC face: one long-lived stream per batcher, batches in order.

Batches are decoded as soon as they arrive and go to a single compute thread
that owns the device. On a backend that can queue work (the CUDA one:
``submit`` and ``collect``), batch n+1 is submitted before batch n is waited
for, so its input lands while n computes and the GPU never waits on Python.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN

from engine import metrics
from engine.backend import Backend
from engine.gpu_stats import open_gpu_stats
from engine.validate import (
    WIRE_INT32,
    BadBatch,
    check_ids,
    check_lengths,
    check_shape,
    model_limits,
)
from services.errors import ENGINE_LOADING
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry
from services.telemetry import (
    Span,
    extract,
    record_error,
    recording,
    tracer,
)

log = logging.getLogger("berth.engine")
TRACER = tracer("engine")


@dataclass
class Started:
    """A batch on its way through the device."""

    batch: internal_pb2.Batch
    span: Span
    ticket: Any = None  # the backend's handle while the device works on it
    result: internal_pb2.BatchResult | None = None  # set once answered


END = object()  # a stream's reader is done
SKIPPED = object()  # a batch cancelled before compute: counted, not answered


@dataclass(eq=False)
class Caller:
    """One Run stream, as the device loop sees it."""

    answers: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    queued: set[int] = field(default_factory=set)  # batch ids not yet started
    # Of those, the ones the batcher cancelled. A cancel that comes too late
    # (a hedge's loser, a batch past its timeout) is not kept: a stream lives
    # for days, and such ids would pile up.
    cancelled: set[int] = field(default_factory=set)
    closed: bool = False  # the stream is gone: drop its answers

    def cancel(self, batch_id: int) -> None:
        if batch_id in self.queued:
            self.cancelled.add(batch_id)

    def answer(self, result: internal_pb2.BatchResult) -> None:
        if not self.closed:
            self.answers.put_nowait(result)


Work = tuple[internal_pb2.Batch, Caller]

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]

# Largest lone batch (rows x length) run on the event loop's thread: BERT-base
# computes 1,024 tokens in 0.6-0.7 ms on the H200, one 128-token text in 0.38
# (benchmarks/results/engine_h200.json, graph times).
ON_LOOP_MAX_TOKENS = 1024


class EngineService(internal_pb2_grpc.EngineServicer):
    """Runs padded batches from the batcher through the backend."""

    def __init__(
        self,
        backend: Backend,
        models: dict[str, ModelEntry],
        max_batch: int = 256,
        token_budget: int = 16384,
    ) -> None:
        """``max_batch`` and ``token_budget``: the batcher's limits (the
        engine's --max-batch and --token-budget); larger batches are refused."""
        self.backend = backend
        self.models = models
        self.limits = {name: model_limits(entry) for name, entry in models.items()}
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.refused = 0  # batches refused as invalid (not failures)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.batches = 0
        self.failures = 0
        self.ready = False  # set once every model is loaded and warmed up
        self.failing = False  # chaos: fail every batch (toggled by SIGUSR1)
        self.gpu = open_gpu_stats(backend.device)  # NVML reader; None on the CPU
        self.callers: set[Caller] = set()  # the open Run streams
        # One loop feeds the device from every stream (started by the first).
        self._work: asyncio.Queue[Work] | None = None
        self._device: asyncio.Task[None] | None = None

    async def Info(
        self, request: internal_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.EngineInfo:
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_LOADING)
        return internal_pb2.EngineInfo(
            models=[
                internal_pb2.EngineModel(
                    name=name,
                    task=entry.task,
                    width=self.backend.width(name),
                    vocab_size=self.limits[name].vocab_size,
                    max_tokens=self.limits[name].max_tokens,
                )
                for name, entry in self.models.items()
            ],
            device=self.backend.device,
            backend=self.backend.name,
        )

    async def Run(
        self,
        request_iterator: AsyncIterator[internal_pb2.EngineRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[internal_pb2.BatchResult]:
        """One batcher's stream: its batches join the device's one queue;
        answers come back in the order computed."""
        work = self._device_queue()
        caller = Caller()
        sent = 0  # batches of this stream the device has not answered yet

        async def read() -> None:
            nonlocal sent
            try:
                async for request in request_iterator:
                    if request.HasField("batch"):
                        sent += 1
                        refusal = self.refusal(request.batch)
                        if refusal is not None:  # answered now, never computed
                            caller.answer(refusal)
                            continue
                        caller.queued.add(request.batch.id)
                        work.put_nowait((request.batch, caller))
                    else:
                        caller.cancel(request.cancel.id)
            finally:
                caller.answers.put_nowait(END)

        reader = asyncio.create_task(read())
        ended = False
        self.callers.add(caller)
        try:
            while not ended or sent:
                answer = await caller.answers.get()
                if answer is END:
                    ended = True
                    continue
                sent -= 1
                if answer is not SKIPPED:
                    yield answer
        finally:
            caller.closed = True  # what it still has queued is dropped
            self.callers.discard(caller)
            reader.cancel()

    def _device_queue(self) -> asyncio.Queue[Work]:
        """The device loop's queue, the loop started on first use (and again
        should the event loop have changed, as between tests)."""
        if self._device is None or self._device.get_loop() is not (
            asyncio.get_running_loop()
        ):
            self._work = asyncio.Queue()
            self._device = asyncio.create_task(self._device_loop())
        assert self._work is not None
        return self._work

    async def _next_work(self, wait: bool) -> Work | None:
        """The next queued batch someone still wants; without wait, None
        when there is none now."""
        assert self._work is not None
        while wait or not self._work.empty():
            batch, caller = await self._work.get()  # at once when not empty
            caller.queued.discard(batch.id)
            if caller.closed:
                continue
            if batch.id in caller.cancelled:  # dropped before compute
                caller.cancelled.discard(batch.id)
                caller.answers.put_nowait(SKIPPED)
                continue
            return batch, caller
        return None

    async def _device_loop(self) -> None:
        """Every stream's batches through the device, in arrival order. At
        most one batch is on the GPU uncollected: the next is submitted
        before the previous is waited for (the pinned slots double-buffer),
        so the device never waits on Python between batches. start, finish
        and run_batch turn a batch's failure into its answer."""
        assert self._work is not None
        loop = asyncio.get_running_loop()
        compute = self._compute
        in_flight: tuple[Started, Caller] | None = None
        while True:
            if in_flight is None:
                item = await self._next_work(wait=True)
                assert item is not None  # (wait=True returns a batch)
                batch, caller = item
                # Nothing to overlap: no batch waiting, or a backend without
                # submit, whose start computes the whole batch (the answer
                # would wait for the next batch's compute).
                if self._work.empty() or not self._queues_work():
                    if self._on_loop(batch):
                        caller.answer(self.run_batch(batch))
                    else:  # one thread hop
                        caller.answer(
                            await loop.run_in_executor(compute, self.run_batch, batch)
                        )
                    continue
                started = await loop.run_in_executor(compute, self.start, batch)
                in_flight = (started, caller)
                continue
            item = await self._next_work(wait=False)
            done, done_caller = in_flight
            result, started_next = await loop.run_in_executor(
                compute, self._advance, done, item[0] if item else None
            )
            done_caller.answer(result)
            in_flight = None
            if item is not None and started_next is not None:
                in_flight = (started_next, item[1])

    def refusal(self, batch: internal_pb2.Batch) -> internal_pb2.BatchResult | None:
        """The answer of a batch the engine will not compute, checked as it
        arrives (before it queues behind other work): a model it does not
        serve, or a batch engine/validate.py refuses. None for a good one.
        The token ids are checked here unless the backend checks them itself
        as it queues the batch (the CUDA one: engine/cuda/runner.py)."""
        limits = self.limits.get(batch.model)
        if limits is None:
            return self._refused(
                batch,
                NOT_FOUND,
                f"engine does not serve model {batch.model!r} "
                f"(it serves {', '.join(sorted(self.models))})",
            )
        try:
            check_shape(
                batch.batch_size,
                batch.length,
                len(batch.token_ids),
                len(batch.lengths),
                limits,
                self.max_batch,
                self.token_budget,
            )
            check_lengths(np.frombuffer(batch.lengths, WIRE_INT32), batch.length)
            if not self._queues_work():
                ids = np.frombuffer(batch.token_ids, WIRE_INT32)
                check_ids(
                    ids.reshape(batch.batch_size, batch.length), limits.vocab_size
                )
        except BadBatch as exc:
            return self._refused(batch, INVALID_ARGUMENT, str(exc))
        return None

    def _refused(
        self, batch: internal_pb2.Batch, code: int, why: str
    ) -> internal_pb2.BatchResult:
        """A batch answered as the sender's fault: counted, not a failure."""
        self.refused += 1
        metrics.BATCHES.labels(batch.model, "invalid").inc()
        log.warning("batch %d of %r refused: %s", batch.id, batch.model, why)
        return internal_pb2.BatchResult(
            id=batch.id, code=code, message=f"invalid batch of {batch.model}: {why}"
        )

    def _on_loop(self, batch: internal_pb2.Batch) -> bool:
        """Whether a lone batch runs on the event loop's own thread: a small
        one on a backend that queues work on a GPU stream (its host part is
        a graph launch, its wait a fraction of a millisecond). The hand-off
        to the compute thread and back costs two cross-CPU wake-ups, which
        on the H200 machine's virtual CPUs cost more than such a batch
        computes. Larger batches and CPU backends keep the loop free."""
        return (
            self._queues_work()
            and batch.batch_size * batch.length <= ON_LOOP_MAX_TOKENS
        )

    def _queues_work(self) -> bool:
        """Whether the backend queues work on a device (submit, then collect)."""
        return getattr(self.backend, "submit", None) is not None

    def _advance(
        self, done: Started, batch: internal_pb2.Batch | None
    ) -> tuple[internal_pb2.BatchResult, Started | None]:
        """Submit the next batch (if any), then collect the one before it."""
        started = self.start(batch) if batch is not None else None
        return self.finish(done), started

    def run_batch(self, batch: internal_pb2.Batch) -> internal_pb2.BatchResult:
        """Compute one batch start to finish (on the compute thread)."""
        return self.finish(self.start(batch))

    def start(self, batch: internal_pb2.Batch) -> Started:
        """Check a batch and queue it on the device (compute thread)."""
        span: Span = INVALID_SPAN
        if recording():
            span = TRACER.start_span(
                "engine.batch",
                context=extract(batch.trace_context),
                attributes={
                    "berth.model": batch.model,
                    "berth.batch_size": batch.batch_size,
                    "berth.bucket": batch.length,
                },
            )
        started = Started(batch, span)
        try:
            if self.failing:
                raise RuntimeError("fault injected (SIGUSR1 toggles it; --chaos)")
            if batch.model not in self.models:
                raise KeyError(f"engine does not serve model {batch.model!r}")
            submit = getattr(self.backend, "submit", None)
            if submit is not None:
                # The backend writes the bytes straight into a pinned slot and
                # queues copy in, compute and copy out on its stream.
                started.ticket = submit(
                    batch.model,
                    batch.token_ids,
                    batch.lengths,
                    batch.batch_size,
                    batch.length,
                )
            else:
                started.result = self._compute_eagerly(batch, span)
        except Exception as exc:  # one batch failed; the engine lives on
            started.result = self._failed(batch, span, exc)
        return started

    def finish(self, started: Started) -> internal_pb2.BatchResult:
        """Wait for a started batch and answer it (compute thread)."""
        batch, span = started.batch, started.span
        try:
            if started.result is None:
                collect = self.backend.collect  # type: ignore[attr-defined]
                output, stages = collect(started.ticket)
                data = np.ascontiguousarray(output, dtype="<f4").tobytes()
                started.result = self._answer(batch, data, output.shape[1], stages)
                _stage_spans(span, stages)
        except Exception as exc:
            started.result = self._failed(batch, span, exc)
        finally:
            span.end()
        if started.result.code == 0:
            self.batches += 1
            metrics.BATCHES.labels(batch.model, "ok").inc()
        return started.result

    def _failed(
        self, batch: internal_pb2.Batch, span: Span, exc: Exception
    ) -> internal_pb2.BatchResult:
        record_error(span, exc)
        if isinstance(exc, BadBatch):  # found by the backend's own checks
            return self._refused(batch, INVALID_ARGUMENT, str(exc))
        self.failures += 1
        metrics.BATCHES.labels(batch.model, "failed").inc()
        log.exception("batch %d of %s failed", batch.id, batch.model, exc_info=exc)
        return internal_pb2.BatchResult(
            id=batch.id,
            code=grpc.StatusCode.INTERNAL.value[0],
            message=f"engine failed on a batch of {batch.model}: {exc}",
        )

    def _compute_eagerly(
        self, batch: internal_pb2.Batch, span: Span
    ) -> internal_pb2.BatchResult:
        """A backend without submit (CPU, onnxruntime): compute right away."""
        t0 = time.perf_counter()
        ids = np.frombuffer(batch.token_ids, dtype="<i4").reshape(
            batch.batch_size, batch.length
        )
        lengths = np.frombuffer(batch.lengths, dtype="<i4")
        t1 = time.perf_counter()
        output = self.backend.run(batch.model, ids, lengths)
        t2 = time.perf_counter()
        data = np.ascontiguousarray(output, dtype="<f4").tobytes()
        stages = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        _stage_spans(span, stages)
        return self._answer(batch, data, output.shape[1], stages)

    def _answer(
        self,
        batch: internal_pb2.Batch,
        data: bytes,
        width: int,
        stages: tuple[float, float, float],
    ) -> internal_pb2.BatchResult:
        copy_in, compute, copy_out = stages
        for stage, seconds in (
            ("copy_in", copy_in),
            ("compute", compute),
            ("copy_out", copy_out),
        ):
            metrics.STAGE_SECONDS.labels(batch.model, stage).observe(seconds)
        utilization, memory = -1.0, 0
        if self.gpu is not None:
            utilization, memory = self.gpu.sample()
            metrics.GPU_UTILIZATION.set(max(utilization, 0.0) / 100)
            metrics.GPU_MEMORY_USED.set(memory)
        return internal_pb2.BatchResult(
            id=batch.id,
            output=data,
            width=width,
            copy_in_us=int(copy_in * 1e6),
            compute_us=int(compute * 1e6),
            copy_out_us=int(copy_out * 1e6),
            gpu_utilization=utilization,
            gpu_memory_used=memory,
        )

    def toggle_failing(self) -> None:
        """Chaos hook: from now on every batch fails (or stops failing)."""
        self.failing = not self.failing
        log.warning(
            "fault injection: every batch %s", "FAILS" if self.failing else "ok"
        )


STAGES = ("engine.copy_in", "engine.compute", "engine.copy_out")


def _stage_spans(batch_span: Span, stages: tuple[float, float, float]) -> None:
    """Copy in, compute and copy out as child spans of the batch's, ending
    now and as long as measured (device events on a GPU, where the three
    overlap other batches' Python work and cannot be wrapped in a block)."""
    if not recording():
        return
    parent = trace.set_span_in_context(batch_span)
    end = time.time_ns()
    start = end - int(sum(stages) * 1e9)
    for name, seconds in zip(STAGES, stages, strict=True):
        stop = start + int(seconds * 1e9)
        TRACER.start_span(name, context=parent, start_time=start).end(end_time=stop)
        start = stop
