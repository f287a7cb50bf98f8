"""Per-model scheduling: one asyncio task owns the model's bucket queues.

Gateways' sequences are pushed into the model's :class:`BucketCore`; the loop
forms padded batches whenever an engine has a free slot and hands them to the
model's :class:`~batcher.dispatch.Dispatcher`, which runs them on the engines
and answers each sequence. Work the scheduler cannot take is refused at once:
a malformed entry, a full queue, no engine, an open circuit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from array import array

import grpc
from opentelemetry.trace import INVALID_SPAN

from batcher import metrics
from batcher.adaptive import AdaptiveSizer
from batcher.core import REASON_CANCELLED, Batch, BucketCore, QueueFull
from batcher.dispatch import Dispatcher
from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.resilience import BreakerState, CircuitBreaker
from batcher.sequences import (
    Deliver,
    Waiter,
    error_result,
    malformed,
    outside_vocabulary,
    without,
)
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry
from services.telemetry import Span, extract, recording, tracer

log = logging.getLogger("berth.batcher")
TRACER = tracer("batcher")

# How long queued work waits for an engine when none is connected at all
# before it is failed (so the gateway can fall back instead of hanging).
NO_ENGINE_GRACE_S = 2.0
# With work queued and no engine slot free, the loop looks again this often
# (an ejection may end without anything waking it).
ENGINE_POLL_S = 0.05


class ModelScheduler:
    """Owns one model's queues and sends its batches to engines."""

    def __init__(
        self, entry: ModelEntry, pool: EnginePool, config: SchedulerConfig
    ) -> None:
        self.name = entry.name
        self.entry = entry
        # The longest sequence it takes: the longest bucket (the core batches
        # none longer), unless max_tokens is lower (not so once loaded from
        # the repository, which ends the buckets at max_tokens).
        self.max_tokens = min(entry.max_tokens, max(entry.buckets))
        self.pool = pool
        self.config = config
        self.core = BucketCore(
            entry.buckets,
            token_budget=config.token_budget,
            max_delay_s=config.max_delay_s,
            capacity=config.capacity,
            max_batch=config.max_batch,
        )
        self.breaker = CircuitBreaker(
            entry.name,
            threshold=config.breaker_failures,
            cooldown_s=config.breaker_cooldown_s,
            on_change=lambda s: metrics.BREAKER_STATE.labels(self.name).set(s.value),
        )
        self.sizer = AdaptiveSizer(self.core, config.latency_target_s, model=entry.name)
        self.waiters: dict[int, Waiter] = {}
        self.dispatcher = Dispatcher(
            entry.name,
            len(entry.buckets),
            pool,
            config,
            self.breaker,
            self.sizer,
            self.waiters,
        )
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._engineless_since: float | None = None
        self._stopped = False  # drained: nothing batches what is queued now
        metrics.BREAKER_STATE.labels(self.name).set(0)
        for b, length in enumerate(entry.buckets):
            metrics.TARGET_BATCH.labels(self.name, length).set(self.core.batch_size(b))
        pool.subscribe(self._wake.set)

    # ---- called by the gateway streams ------------------------------------

    def submit(
        self, group: internal_pb2.Sequences, deliver: Deliver
    ) -> list[tuple[int, int]]:
        """Queue one request's texts, all or none.

        Returns (sequence id, key) pairs for cancel; refused texts are
        answered at once through ``deliver``, a malformed entry's
        INVALID_ARGUMENT (:func:`malformed`) before anything else, then
        each sequence the model cannot take (:meth:`_valid`) alone.
        """
        checked = self._valid(group, deliver)
        if checked is None:
            return []
        group = checked
        now = time.monotonic()
        refusal = self._refusal()
        if refusal is not None:
            self._refuse(
                group, deliver, grpc.StatusCode.UNAVAILABLE, "unavailable", refusal
            )
            return []
        keys = array("Q", itertools.islice(self._ids, len(group.ids)))
        expires = now + group.timeout_ms / 1000 if group.timeout_ms else math.inf
        try:
            self.core.push_many(
                keys,
                memoryview(group.token_ids).cast("i"),
                memoryview(group.offsets).cast("i"),
                now,
                expires,
            )
        except QueueFull:
            message = (
                f"batcher queue for {self.name!r} is full ({len(self.core)} "
                "sequences queued, --queue-capacity); retry later"
            )
            self._refuse(
                group, deliver, grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", message
            )
            return []
        except ValueError as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT
            self._refuse(group, deliver, code, "invalid", str(exc))
            return []
        traced = recording()  # no span per sequence when none is exported
        parent = extract(group.trace_context) if traced else None
        for reply_id, key in zip(group.ids, keys, strict=True):
            span: Span = INVALID_SPAN
            if traced:
                span = TRACER.start_span(
                    "batcher.queue",
                    context=parent,
                    # The caller's deadline as the gateway passed it on
                    # (0: none).
                    attributes={
                        "berth.model": self.name,
                        "berth.timeout_ms": group.timeout_ms,
                    },
                )
            self.waiters[key] = Waiter(reply_id, deliver, now, span)
        metrics.QUEUE_DEPTH.labels(self.name).set(len(self.core))
        self._wake.set()
        return list(zip(group.ids, keys, strict=True))

    def _valid(
        self, group: internal_pb2.Sequences, deliver: Deliver
    ) -> internal_pb2.Sequences | None:
        """``group`` less what the model cannot take, or None when nothing is
        left. A malformed entry is refused whole; a sequence with a token id
        outside the vocabulary the engines told (:meth:`EnginePool.limits`)
        alone, the others of its entry queued: never sent, it can fail no
        batch and count against no engine. Sequences longer than the model's
        max tokens (the lower of the repository's and the engines') are a
        malformed entry."""
        vocab, told_max = self.pool.limits(self.name)
        max_tokens = min(self.max_tokens, told_max) if told_max else self.max_tokens
        problem = malformed(group, max_tokens)
        if problem is not None:
            message = f"malformed Sequences for model {self.name!r}: {problem}"
            if not group.ids:  # nobody to answer: at least say so here
                log.warning("%s (ignored)", message)
            self._refuse(
                group, deliver, grpc.StatusCode.INVALID_ARGUMENT, "invalid", message
            )
            return None
        outside = outside_vocabulary(group, vocab) if vocab else {}
        if not outside:
            return group
        metrics.SEQUENCES.labels(self.name, "invalid").inc(len(outside))
        for index, why in outside.items():
            message = f"invalid sequence for model {self.name!r}: {why}"
            code = grpc.StatusCode.INVALID_ARGUMENT
            deliver(error_result(group.ids[index], code, message))
        if len(outside) == len(group.ids):
            return None
        return without(group, outside)

    def _refuse(
        self,
        group: internal_pb2.Sequences,
        deliver: Deliver,
        code: grpc.StatusCode,
        outcome: str,
        message: str,
    ) -> None:
        metrics.SEQUENCES.labels(self.name, outcome).inc(len(group.ids))
        for reply_id in group.ids:
            deliver(error_result(reply_id, code, message))

    def accepting(self) -> bool:
        """Whether :meth:`submit` would queue work now (not refuse it)."""
        return self._refusal() is None

    def _refusal(self) -> str | None:
        if self._stopped:
            return f"the batcher of {self.name!r} is shutting down"
        if not self.pool.serving(self.name):
            return f"no engine is serving model {self.name!r}"
        if self.breaker.current() is BreakerState.OPEN:
            return f"circuit for {self.name!r} is open after repeated engine failures"
        return None

    def cancel(self, key: int) -> None:
        """The gateway gave up on a sequence: drop it if still queued (else
        its answer is dropped on delivery); nobody is answered."""
        if self.core.cancel(key):
            self._wake.set()
        waiter = self.waiters.pop(key, None)
        if waiter is not None:
            waiter.span.end()
            metrics.SEQUENCES.labels(self.name, "cancelled").inc()

    # ---- the loop ----------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"scheduler-{self.name}")

    async def drain(self) -> None:
        """Send everything queued, wait for the answers, then stop."""
        while len(self.core) or self.dispatcher.running:
            self._wake.set()
            await asyncio.sleep(0.01)
        self._stopped = True  # (drained before it started: refuse work too)
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
            else:
                # No slot free (engines stuck on their batches, say): expire
                # anyway, so that a deadline is answered when it passes.
                self.core.expire(now)
            # 2. Answer the sequences the core dropped (cancelled / expired).
            self._report_dropped()
            if batch is not None and engine is not None:
                if self.breaker.allow():
                    self.dispatcher.dispatch(engine, batch)
                else:
                    self._fail_batch(batch, f"circuit for {self.name!r} is open")
                continue
            self._fail_if_engineless(now)
            metrics.QUEUE_DEPTH.labels(self.name).set(len(self.core))
            # 3. Sleep until new work, a free engine slot, a bucket's delay
            # (with no slot free: a poll) or the earliest queued expiry.
            timeout: float | None = None
            if len(self.core):
                wake_at = now + ENGINE_POLL_S
                if engine is not None:
                    wake_at = self.core.next_deadline()
                wake_at = min(wake_at, self.core.next_expiry())
                timeout = max(0.0, wake_at - now)
            self._wake.clear()
            # (A timer that sets the event: cheaper than wait_for's task.)
            timer = None
            if timeout is not None:
                timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
            await self._wake.wait()
            if timer is not None:
                timer.cancel()

    def _fail_if_engineless(self, now: float) -> None:
        """With no engine connected for a while, fail what is queued."""
        if self.pool.serving(self.name) or not len(self.core):
            self._engineless_since = None
            return
        if self._engineless_since is None:
            self._engineless_since = now
        elif now - self._engineless_since > NO_ENGINE_GRACE_S:
            while (batch := self.core.next_batch(now, eager=True)) is not None:
                self._fail_batch(batch, f"no engine is serving model {self.name!r}")
            # What those passes dropped as expired is answered now: with the
            # queue empty, the loop sleeps until new work arrives.
            self._report_dropped()

    def _report_dropped(self) -> None:
        for key, reason in self.core.take_dropped():
            waiter = self.waiters.pop(key, None)
            if waiter is None:
                continue
            waiter.span.end()
            if reason == REASON_CANCELLED:
                metrics.SEQUENCES.labels(self.name, "cancelled").inc()
                waiter.deliver(
                    error_result(
                        waiter.reply_id, grpc.StatusCode.CANCELLED, "cancelled"
                    )
                )
            else:
                metrics.SEQUENCES.labels(self.name, "expired").inc()
                waiter.deliver(
                    error_result(
                        waiter.reply_id,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"deadline passed while queued for {self.name!r}",
                    )
                )

    def _fail_batch(self, batch: Batch, reason: str) -> None:
        for key in batch.ids:
            waiter = self.waiters.pop(int(key), None)
            if waiter is not None:
                waiter.span.end()
                metrics.SEQUENCES.labels(self.name, "unavailable").inc()
                waiter.deliver(
                    error_result(waiter.reply_id, grpc.StatusCode.UNAVAILABLE, reason)
                )
