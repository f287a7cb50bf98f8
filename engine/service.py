"""The engine's gRPC face: one long-lived stream per batcher, batches in order.

Batches are decoded as soon as they arrive (so the next one is ready while
the current one computes) and run one at a time on a single compute thread
that owns the device.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from engine import metrics
from engine.backend import Backend
from engine.gpu_stats import open_gpu_stats
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry
from services.telemetry import extract, record_error, tracer

log = logging.getLogger("berth.engine")
TRACER = tracer("engine")


class EngineService(internal_pb2_grpc.EngineServicer):
    """Runs padded batches from the batcher through the backend."""

    def __init__(self, backend: Backend, models: dict[str, ModelEntry]) -> None:
        self.backend = backend
        self.models = models
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.batches = 0
        self.failures = 0
        self.ready = False  # set once every model is loaded and warmed up
        self.failing = False  # chaos: fail every batch (toggled by SIGUSR1)
        self.gpu = open_gpu_stats(backend.device)  # NVML reader; None on the CPU

    async def Info(
        self, request: internal_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.EngineInfo:
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading models")
        return internal_pb2.EngineInfo(
            models=[
                internal_pb2.EngineModel(
                    name=name, task=entry.task, width=self.backend.width(name)
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
        pending: asyncio.Queue[internal_pb2.Batch | None] = asyncio.Queue()
        cancelled: set[int] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if request.HasField("batch"):
                        pending.put_nowait(request.batch)
                    else:
                        cancelled.add(request.cancel.id)
            finally:
                pending.put_nowait(None)

        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        try:
            while (batch := await pending.get()) is not None:
                if batch.id in cancelled:  # dropped before compute
                    cancelled.discard(batch.id)
                    continue
                yield await loop.run_in_executor(self._compute, self.run_batch, batch)
        finally:
            reader.cancel()

    def run_batch(self, batch: internal_pb2.Batch) -> internal_pb2.BatchResult:
        """Compute one batch (on the compute thread); errors become a result."""
        attributes: dict[str, str | int] = {
            "berth.model": batch.model,
            "berth.batch_size": batch.batch_size,
            "berth.bucket": batch.length,
        }
        with TRACER.start_as_current_span(
            "engine.batch", context=extract(batch.trace_context), attributes=attributes
        ) as span:
            try:
                result = self._compute_batch(batch)
            except Exception as exc:  # one batch failed; the engine lives on
                self.failures += 1
                record_error(span, exc)
                metrics.BATCHES.labels(batch.model, "failed").inc()
                log.exception("batch %d of %s failed", batch.id, batch.model)
                return internal_pb2.BatchResult(
                    id=batch.id,
                    code=grpc.StatusCode.INTERNAL.value[0],
                    message=f"engine failed on a batch of {batch.model}: {exc}",
                )
        self.batches += 1
        metrics.BATCHES.labels(batch.model, "ok").inc()
        return result

    def _compute_batch(self, batch: internal_pb2.Batch) -> internal_pb2.BatchResult:
        if self.failing:
            raise RuntimeError("fault injected (SIGUSR1 toggles it; --chaos)")
        if batch.model not in self.models:
            raise KeyError(f"engine does not serve model {batch.model!r}")
        run_bytes = getattr(self.backend, "run_bytes", None)
        if run_bytes is not None:
            # The backend writes the bytes straight into its pinned buffers and
            # times copy in, compute and copy out on the device.
            with TRACER.start_as_current_span("engine.compute"):
                output, stages = run_bytes(
                    batch.model,
                    batch.token_ids,
                    batch.lengths,
                    batch.batch_size,
                    batch.length,
                )
            with TRACER.start_as_current_span("engine.copy_out"):
                data = np.ascontiguousarray(output, dtype="<f4").tobytes()
        else:
            t0 = time.perf_counter()
            with TRACER.start_as_current_span("engine.copy_in"):
                ids = np.frombuffer(batch.token_ids, dtype="<i4").reshape(
                    batch.batch_size, batch.length
                )
                lengths = np.frombuffer(batch.lengths, dtype="<i4")
            t1 = time.perf_counter()
            with TRACER.start_as_current_span("engine.compute"):
                output = self.backend.run(batch.model, ids, lengths)
            t2 = time.perf_counter()
            with TRACER.start_as_current_span("engine.copy_out"):
                data = np.ascontiguousarray(output, dtype="<f4").tobytes()
            stages = (t1 - t0, t2 - t1, time.perf_counter() - t2)
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
            width=output.shape[1],
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
