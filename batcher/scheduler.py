"""Per-model scheduling: one asyncio task owns the model's bucket queues.

Gateways' sequences are pushed into the model's :class:`BucketCore`; the loop
forms padded batches whenever an engine has a free slot and sends them out.
A batch that is slow gets hedged to a second engine, one whose engine fails
is re-sent, and failures feed the model's circuit breaker. Results are split
per sequence and handed back to whoever submitted them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link

from batcher import metrics
from batcher.adaptive import AdaptiveSizer
from batcher.core import REASON_CANCELLED, Batch, BucketCore, QueueFull
from batcher.engines import EngineClient, EnginePool
from batcher.resilience import BreakerState, CircuitBreaker, HedgeBudget
from services.errors import BerthError, EngineFailure, Unavailable
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry
from services.telemetry import (
    Span,
    extract,
    inject,
    record_error,
    recording,
    tracer,
)

log = logging.getLogger("berth.batcher")
TRACER = tracer("batcher")

Deliver = Callable[[internal_pb2.SequenceResult], None]

# How long queued work waits for an engine when none is connected at all
# before it is failed (so the gateway can fall back instead of hanging).
NO_ENGINE_GRACE_S = 2.0
# With work queued and no engine slot free, the loop looks again this often
# (an ejection may end without anything waking it).
ENGINE_POLL_S = 0.05


@dataclass
class SchedulerConfig:
    """Batching and fault-tolerance knobs shared by every model of a batcher."""

    token_budget: int = 16384
    max_delay_s: float = 0.005
    capacity: int = 4096
    max_batch: int = 256
    hedge_delay_s: float = 0.050
    hedge_p95: bool = False  # hedge after max(hedge_delay_s, measured p95)
    hedge_ratio: float = 0.1
    batch_timeout_s: float = 30.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    latency_target_s: float = 0.050  # per batch, for the adaptive sizes


@dataclass
class Waiter:
    """Who gets the answer of one queued sequence, and its queue span."""

    reply_id: int
    deliver: Deliver
    enqueued_at: float
    span: Span


P95_EVERY = 16  # batch latencies between recomputations of a bucket's p95


def _error(
    reply_id: int, code: grpc.StatusCode, message: str
) -> internal_pb2.SequenceResult:
    return internal_pb2.SequenceResult(id=reply_id, code=code.value[0], message=message)


def answer_all(
    ids: Iterable[int], code: grpc.StatusCode, message: str, send: Deliver
) -> None:
    """Answer each of ``ids`` with one error."""
    for seq_id in ids:
        send(_error(seq_id, code, message))


def malformed(group: internal_pb2.Sequences, max_tokens: int) -> str | None:
    """What is wrong with one Sequences entry, naming the field and its value;
    None when it is well-formed.

    The gateway never sends a malformed entry, but another client of the
    internal API (or a bug) may: token bytes that are no whole number of
    int32 (which made the batcher's stream handler raise, ending the stream
    and every request on it), offsets that do not tile token_ids from 0 to
    its end (a sequence's tokens would be cut from the wrong place, or the
    tail ignored), a sequence of no tokens or more than the model takes, or
    an id twice (two answers for one id). Sequences are checked in order and
    the first fault is named by its sequence's id. (The core checks lengths
    and bounds too, as a last line, but names neither ids nor the model.)

    It runs for every request: 1.05 µs for one sequence on the dev machine,
    where all of ModelScheduler.submit takes 7 to 8.
    """
    ids = group.ids
    n = len(ids)
    token_bytes, offset_bytes = len(group.token_ids), len(group.offsets)
    if not n:
        return "ids is empty"
    if token_bytes % 4:
        return (
            f"token_ids holds {token_bytes} bytes, not a whole number of int32 "
            "tokens (a multiple of 4)"
        )
    if offset_bytes % 4:
        return (
            f"offsets holds {offset_bytes} bytes, not a whole number of int32 "
            "offsets (a multiple of 4)"
        )
    if offset_bytes // 4 != n + 1:
        return (
            f"offsets holds {offset_bytes // 4} entries; {n} ids need "
            f"len(ids) + 1 = {n + 1}"
        )
    offsets = memoryview(group.offsets).cast("i")
    n_tokens = token_bytes // 4
    if offsets[0] != 0:
        return f"offsets[0] is {offsets[0]}; it must be 0"
    start = 0
    for i in range(n):
        end = offsets[i + 1]
        if end > n_tokens:
            return (
                f"offsets[{i + 1}] = {end} is past the {n_tokens} tokens of "
                f"token_ids (sequence id {ids[i]})"
            )
        if end < start:
            return (
                f"offsets decrease at sequence id {ids[i]}: offsets[{i}] = "
                f"{start} > offsets[{i + 1}] = {end}"
            )
        if end == start:
            return (
                f"sequence id {ids[i]} has no tokens (offsets[{i}] = "
                f"offsets[{i + 1}] = {end})"
            )
        if end - start > max_tokens:
            return (
                f"sequence id {ids[i]} has {end - start} tokens; the model takes "
                f"at most {max_tokens}"
            )
        start = end
    if start != n_tokens:
        return f"offsets end at {start}, but token_ids holds {n_tokens} tokens"
    if len(set(ids)) != n:
        seen: set[int] = set()
        for seq_id in ids:
            if seq_id in seen:
                return f"sequence id {seq_id} appears twice in ids"
            seen.add(seq_id)
    return None


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
        self.hedges = HedgeBudget(config.hedge_ratio)
        self.sizer = AdaptiveSizer(self.core, config.latency_target_s, model=entry.name)
        self.latencies = [deque[float](maxlen=256) for _ in entry.buckets]
        # Per bucket: the hedge delay's p95 and how many latencies ago it was
        # computed (np.percentile per batch was 7 % of a batcher's samples).
        self._p95: list[tuple[float, int]] = [(0.0, P95_EVERY)] * len(entry.buckets)
        self.waiters: dict[int, Waiter] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
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
        INVALID_ARGUMENT (:func:`malformed`) before anything else.
        """
        problem = malformed(group, self.max_tokens)
        if problem is not None:
            message = f"malformed Sequences for model {self.name!r}: {problem}"
            if not group.ids:  # nobody to answer: at least say so here
                log.warning("%s (ignored)", message)
            self._refuse(
                group, deliver, grpc.StatusCode.INVALID_ARGUMENT, "invalid", message
            )
            return []
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
            deliver(_error(reply_id, code, message))

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
        while len(self.core) or self._inflight:
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
                    self._dispatch(engine, batch)
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
                    _error(waiter.reply_id, grpc.StatusCode.CANCELLED, "cancelled")
                )
            else:
                metrics.SEQUENCES.labels(self.name, "expired").inc()
                waiter.deliver(
                    _error(
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
                    _error(waiter.reply_id, grpc.StatusCode.UNAVAILABLE, reason)
                )

    # ---- one batch ---------------------------------------------------------

    def _dispatch(self, engine: EngineClient, batch: Batch) -> None:
        now = time.monotonic()
        keys = [int(k) for k in batch.ids]
        length = batch.length
        ratio = batch.real_tokens / (batch.size * length)
        queue_wait = metrics.QUEUE_WAIT.labels(self.name, length)
        traced = recording()
        links = []
        for key in keys:
            waiter = self.waiters.get(key)
            if waiter is not None:
                queue_wait.observe(now - waiter.enqueued_at)
                if traced:
                    waiter.span.set_attribute("berth.bucket", length)
                    waiter.span.end()
                    links.append(Link(waiter.span.get_span_context()))
        span: Span = INVALID_SPAN
        trace_context: dict[str, str] = {}
        if traced:
            span = TRACER.start_span(
                "batcher.batch",
                links=links,
                attributes={
                    "berth.model": self.name,
                    "berth.bucket": length,
                    "berth.batch_size": batch.size,
                    "berth.padded_ratio": round(ratio, 4),
                },
            )
            trace_context = inject(trace.set_span_in_context(span))
        message = internal_pb2.Batch(
            id=self.pool.next_batch_id(),
            model=self.name,
            batch_size=batch.size,
            length=length,
            token_ids=bytes(batch.tokens),
            lengths=bytes(batch.lengths),
            trace_context=trace_context,
        )
        metrics.BATCHES.labels(self.name, length).inc()
        metrics.BATCH_SIZE.labels(self.name, length).observe(batch.size)
        metrics.PADDING_RATIO.labels(self.name, length).observe(ratio)
        # The slot is counted now: the loop picks again before this task runs.
        # It is freed when the task ends, however it ends (a done callback
        # runs even for a task cancelled before it started).
        engine.take_slot()
        task = asyncio.create_task(self._run(engine, message, keys, batch.bucket, span))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(lambda _: self._slot_freed(engine))

    def _slot_freed(self, engine: EngineClient) -> None:
        engine.free_slot()
        self.pool.completed()

    async def _run(
        self,
        engine: EngineClient,
        message: internal_pb2.Batch,
        keys: list[int],
        bucket: int,
        span: Span,
    ) -> None:
        started = time.monotonic()
        try:
            result = await self._execute(engine, message, bucket)
            # An answer of the wrong size fails here, its callers answered.
            outputs = np.frombuffer(result.output, dtype="<f4").reshape(
                len(keys), result.width
            )
            self.breaker.record_success()
        except Exception as exc:
            if not isinstance(exc, BerthError):  # a bug: answered, never dropped
                log.exception("batch %d of %s failed", message.id, self.name)
                exc = BerthError(f"batcher failed on a batch of {self.name!r}: {exc}")
            self.breaker.record_failure(str(exc))
            record_error(span, exc)
            for key in keys:
                waiter = self.waiters.pop(key, None)
                if waiter is not None:
                    metrics.SEQUENCES.labels(self.name, "failed").inc()
                    waiter.deliver(_error(waiter.reply_id, exc.code, str(exc)))
            return
        finally:
            span.end()
        latency = time.monotonic() - started
        self.record_latency(bucket, latency)
        metrics.BATCH_LATENCY.labels(self.name, message.length).observe(latency)
        self.hedges.earn()
        self._adapt(bucket, message, result)
        inference_us = int(latency * 1e6)
        answered = 0
        for row, key in enumerate(keys):
            waiter = self.waiters.pop(key, None)
            if waiter is None:  # cancelled while computing
                continue
            answered += 1
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
        metrics.SEQUENCES.labels(self.name, "ok").inc(answered)

    async def _execute(
        self, engine: EngineClient, message: internal_pb2.Batch, bucket: int
    ) -> internal_pb2.BatchResult:
        """Run the batch, hedged; if its engine fails, re-send to another.
        The first engine's slot was taken at dispatch (``_dispatch``)."""
        tried: set[EngineClient] = set()
        slot_taken = True
        while True:
            tried.add(engine)
            try:
                return await self._hedged(engine, message, bucket, tried, slot_taken)
            except (Unavailable, EngineFailure) as exc:
                retry = self.pool.pick(self.name, exclude=tried, any_slot=True)
                if retry is None:
                    raise
                metrics.RESENDS.labels(self.name).inc()
                log.warning(
                    "re-sending batch %d to %s: %s", message.id, retry.address, exc
                )
                engine, slot_taken = retry, False

    async def _hedged(
        self,
        engine: EngineClient,
        message: internal_pb2.Batch,
        bucket: int,
        tried: set[EngineClient],
        slot_taken: bool = False,
    ) -> internal_pb2.BatchResult:
        """One attempt; past the hedge delay, a second engine races it."""
        first = self._start_attempt(engine, message, slot_taken)
        attempts = {first: engine}
        try:
            done, _ = await asyncio.wait(attempts, timeout=self._hedge_delay(bucket))
            if not done:
                # Only to an engine with a free slot: one queued behind a full
                # engine's work rarely wins and takes capacity the load needs
                # (3 x 8 s at 270/s on 2 cores: p99 167-402 ms -> 135-223 ms).
                backup = self.pool.pick(self.name, exclude=tried)
                if backup is not None and self.hedges.try_spend():
                    tried.add(backup)
                    metrics.HEDGES.labels(self.name, "sent").inc()
                    attempts[self._start_attempt(backup, message)] = backup
            return await self._race(first, attempts)
        finally:
            # Whatever ended the race (a winner, or this task cancelled), the
            # attempts still running are called off: dropped before compute.
            for task, attempt_engine in attempts.items():
                if not task.done():
                    task.cancel()
                    attempt_engine.cancel(message.id)

    def _start_attempt(
        self,
        engine: EngineClient,
        message: internal_pb2.Batch,
        slot_taken: bool = False,
    ) -> asyncio.Task[internal_pb2.BatchResult]:
        """Start one attempt; ``slot_taken``: its slot was counted at dispatch.

        Otherwise (a hedge, a re-send) the slot is counted now, not when the
        task first runs: the loop may pick before then, and gave a hedge's
        engine a batch beyond its slots. It is freed once, when the task ends
        however it ends (won, lost, cancelled, failed)."""
        task = asyncio.ensure_future(self._attempt(engine, message))
        if not slot_taken:
            engine.take_slot()
            task.add_done_callback(lambda _: self._slot_freed(engine))
        return task

    async def _race(
        self,
        first: asyncio.Task[internal_pb2.BatchResult],
        attempts: dict[asyncio.Task[internal_pb2.BatchResult], EngineClient],
    ) -> internal_pb2.BatchResult:
        """The result of the first attempt to succeed, else the last error.
        ``first``: the primary attempt, the others its hedge."""
        primary = attempts[first]
        pending = set(attempts)
        error: BaseException | None = None
        while pending:
            # Most often the attempt is over already (_hedged waited for it):
            # asyncio.wait would still take two turns of the event loop.
            done = {task for task in pending if task.done()}
            if done:
                pending -= done
            else:
                done, pending = await asyncio.wait(
                    pending, return_when=asyncio.FIRST_COMPLETED
                )
            for task in done:
                if task.exception() is None:
                    if first in pending:  # the hedge won the race
                        metrics.HEDGES.labels(self.name, "won").inc()
                        self.hedges.won += 1
                        # The primary stalled: let it sit out a back-off,
                        # unless this batch shared it with another (then
                        # it was busy: queued behind, or ahead of, work).
                        if primary.in_flight <= 1:
                            primary.record_failure("slower than its hedge")
                    return task.result()
                error = task.exception()
        assert error is not None
        raise error

    async def _attempt(
        self, engine: EngineClient, message: internal_pb2.Batch
    ) -> internal_pb2.BatchResult:
        try:
            # (asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the
            # call as a task of its own, one more hand-off per batch.)
            async with asyncio.timeout(self.config.batch_timeout_s):
                result = await engine.run(message)
        except TimeoutError:
            engine.cancel(message.id)
            engine.record_failure("batch timed out")
            raise Unavailable(
                f"engine {engine.address} did not answer a batch of {self.name!r} in "
                f"{self.config.batch_timeout_s} s (--batch-timeout-s)"
            ) from None
        except Unavailable as exc:
            engine.record_failure(str(exc))
            raise
        if result.code != 0:
            engine.record_failure(result.message)
            raise EngineFailure(f"engine {engine.address}: {result.message}")
        engine.record_success()
        if result.gpu_utilization >= 0:
            engine.gpu_utilization = result.gpu_utilization
            metrics.GPU_UTILIZATION.labels(engine.address).set(
                result.gpu_utilization / 100
            )
        return result

    def _adapt(
        self, bucket: int, message: internal_pb2.Batch, result: internal_pb2.BatchResult
    ) -> None:
        """Feed the engine's own timing (not our queueing) to the sizer."""
        engine_s = (result.copy_in_us + result.compute_us + result.copy_out_us) / 1e6
        utilization = result.gpu_utilization if result.gpu_utilization >= 0 else None
        size = self.sizer.report(bucket, message.batch_size, engine_s, utilization)
        metrics.TARGET_BATCH.labels(self.name, message.length).set(size)

    def record_latency(self, bucket: int, latency: float) -> None:
        self.latencies[bucket].append(latency)
        p95, age = self._p95[bucket]
        self._p95[bucket] = (p95, age + 1)

    def _hedge_delay(self, bucket: int) -> float:
        delay = self.config.hedge_delay_s
        recent = self.latencies[bucket]
        if self.config.hedge_p95 and len(recent) >= 20:
            p95, age = self._p95[bucket]
            if age >= P95_EVERY:
                p95, age = float(np.percentile(recent, 95)), 0
                self._p95[bucket] = (p95, age)
            delay = max(delay, p95)
        return delay
