"""Per-model scheduling: one asyncio task owns the model's bucket queues.

Gateways' sequences are pushed into the model's :class:`BucketCore`; the loop
below forms padded batches whenever an engine has a free slot and sends them
out. Results are split per sequence and handed back to whoever submitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from batcher.core import REASON_CANCELLED, Batch, BucketCore, QueueFull
from batcher.engines import EngineClient, EnginePool
from services.errors import BerthError, EngineFailure
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry

log = logging.getLogger("berth.batcher")

Deliver = Callable[[internal_pb2.SequenceResult], None]


@dataclass
class SchedulerConfig:
    """Batching policy knobs shared by every model of a batcher."""

    token_budget: int = 16384
    max_delay_s: float = 0.005
    capacity: int = 4096
    max_batch: int = 256


@dataclass
class Waiter:
    """Who gets the answer of one queued sequence."""

    reply_id: int
    deliver: Deliver
    enqueued_at: float


def _error(
    reply_id: int, code: grpc.StatusCode, message: str
) -> internal_pb2.SequenceResult:
    return internal_pb2.SequenceResult(id=reply_id, code=code.value[0], message=message)


class ModelScheduler:
    """Owns one model's queues and sends its batches to engines."""

    def __init__(
        self, entry: ModelEntry, pool: EnginePool, config: SchedulerConfig
    ) -> None:
        self.name = entry.name
        self.entry = entry
        self.pool = pool
        self.core = BucketCore(
            entry.buckets,
            token_budget=config.token_budget,
            max_delay_s=config.max_delay_s,
            capacity=config.capacity,
            max_batch=config.max_batch,
        )
        self.waiters: dict[int, Waiter] = {}
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        pool.subscribe(self._wake.set)

    # ---- called by the gateway streams ------------------------------------

    def submit(self, seq: internal_pb2.Sequence, deliver: Deliver) -> int | None:
        """Queue one sequence; returns its key for cancel, None if refused."""
        now = time.monotonic()
        if not self.pool.serving(self.name):
            deliver(
                _error(
                    seq.id,
                    grpc.StatusCode.UNAVAILABLE,
                    f"no engine is serving model {self.name!r}",
                )
            )
            return None
        key = next(self._ids)
        expires = now + seq.timeout_ms / 1000 if seq.timeout_ms else math.inf
        tokens = memoryview(seq.token_ids).cast("i")
        try:
            self.core.push(key, tokens, now, expires)
        except QueueFull:
            deliver(
                _error(
                    seq.id,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"batcher queue for {self.name!r} is full "
                    f"({len(self.core)} sequences queued); retry later",
                )
            )
            return None
        except ValueError as exc:
            deliver(_error(seq.id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return None
        self.waiters[key] = Waiter(seq.id, deliver, now)
        self._wake.set()
        return key

    def cancel(self, key: int) -> None:
        if self.core.cancel(key):
            self._wake.set()
        # Already in a batch: its answer is dropped on delivery.
        self.waiters.pop(key, None)

    # ---- the loop ----------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"scheduler-{self.name}")

    async def drain(self) -> None:
        """Send everything queued, wait for the answers, then stop."""
        while len(self.core) or self._inflight:
            self._wake.set()
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            # 1. Form a batch if an engine can take one; eager when it idles.
            now = time.monotonic()
            engine = self.pool.pick(self.name)
            batch = None
            if engine is not None:
                batch = self.core.next_batch(now, eager=engine.in_flight == 0)
            # 2. Answer the sequences the core dropped (cancelled / expired).
            self._report_dropped()
            if batch is not None and engine is not None:
                self._dispatch(engine, batch)
                continue
            # 3. Sleep until new work, a free engine slot or a bucket's delay.
            timeout = None
            if engine is not None and len(self.core):
                timeout = max(0.0, self.core.next_deadline() - time.monotonic())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _report_dropped(self) -> None:
        for key, reason in self.core.take_dropped():
            waiter = self.waiters.pop(key, None)
            if waiter is None:
                continue
            if reason == REASON_CANCELLED:
                waiter.deliver(
                    _error(waiter.reply_id, grpc.StatusCode.CANCELLED, "cancelled")
                )
            else:
                waiter.deliver(
                    _error(
                        waiter.reply_id,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"deadline passed while queued for {self.name!r}",
                    )
                )

    def _dispatch(self, engine: EngineClient, batch: Batch) -> None:
        keys = [int(k) for k in batch.ids]
        message = internal_pb2.Batch(
            id=next(self._batch_ids),
            model=self.name,
            batch_size=batch.size,
            length=batch.length,
            token_ids=bytes(batch.tokens),
            lengths=bytes(batch.lengths),
        )
        task = asyncio.create_task(self._run(engine, message, keys, batch.bucket))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _run(
        self,
        engine: EngineClient,
        message: internal_pb2.Batch,
        keys: list[int],
        bucket: int,
    ) -> None:
        started = time.monotonic()
        try:
            result = await self._run_with_retry(engine, message)
        except BerthError as exc:
            for key in keys:
                waiter = self.waiters.pop(key, None)
                if waiter is not None:
                    waiter.deliver(_error(waiter.reply_id, exc.code, str(exc)))
            return
        finally:
            self.pool.completed()
        inference_us = int((time.monotonic() - started) * 1e6)
        outputs = np.frombuffer(result.output, dtype="<f4").reshape(
            len(keys), result.width
        )
        for row, key in enumerate(keys):
            waiter = self.waiters.pop(key, None)
            if waiter is None:  # cancelled while computing
                continue
            waiter.deliver(
                internal_pb2.SequenceResult(
                    id=waiter.reply_id,
                    output=outputs[row].tobytes(),
                    queue_us=int((started - waiter.enqueued_at) * 1e6),
                    inference_us=inference_us,
                    bucket=message.length,
                    batch_size=message.batch_size,
                )
            )

    async def _run_with_retry(
        self, engine: EngineClient, message: internal_pb2.Batch
    ) -> internal_pb2.BatchResult:
        """Run on ``engine``; if it is lost mid-batch, once more on another."""
        try:
            result = await engine.run(message)
        except BerthError as exc:
            other = self.pool.pick(self.name, exclude=engine)
            if other is None:
                raise
            log.warning("re-sending batch %d to %s: %s", message.id, other.address, exc)
            result = await other.run(message)
        if result.code != 0:
            raise EngineFailure(result.message)
        return result
