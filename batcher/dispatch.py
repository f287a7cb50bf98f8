"""One model's batches on the engines: sent, hedged, re-sent, answered.

A batch that is slow gets hedged to a second engine (the first answer wins,
the other attempt is called off), one whose engine fails is re-sent to
another, and each outcome feeds the model's circuit breaker, the engines'
health and the adaptive batch sizes. Results are split per sequence and
handed to the sequences' waiters.

A batch an engine refuses as invalid (INVALID_ARGUMENT: a bad token id the
batcher could not see, a shape the engine does not take) blames no engine
and no circuit: it is split in halves, and each half run again, until the
sequences at fault fail alone and the others are answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link

from batcher import metrics
from batcher.adaptive import AdaptiveSizer
from batcher.core import Batch
from batcher.engines import EngineClient, EnginePool
from batcher.options import SchedulerConfig
from batcher.resilience import CircuitBreaker, HedgeBudget
from batcher.sequences import Waiter, error_result
from services.errors import BerthError, EngineFailure, InvalidInput, Unavailable
from services.proto.berth.v1 import internal_pb2
from services.telemetry import Span, inject, record_error, recording, tracer

log = logging.getLogger("berth.batcher")
TRACER = tracer("batcher")

P95_EVERY = 16  # batch latencies between recomputations of a bucket's p95
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class Dispatcher:
    """Runs one model's batches on its engines and answers their waiters."""

    def __init__(
        self,
        name: str,
        buckets: int,
        pool: EnginePool,
        config: SchedulerConfig,
        breaker: CircuitBreaker,
        sizer: AdaptiveSizer,
        waiters: dict[int, Waiter],
    ) -> None:
        self.name = name
        self.pool = pool
        self.config = config
        self.breaker = breaker
        self.sizer = sizer
        self.waiters = waiters  # the scheduler's: key -> who waits for it
        self.hedges = HedgeBudget(config.hedge_ratio)
        self.latencies = [deque[float](maxlen=256) for _ in range(buckets)]
        # Per bucket: the hedge delay's p95 and how many latencies ago it was
        # computed (np.percentile per batch costs 7 % of a batcher's samples).
        self._p95: list[tuple[float, int]] = [(0.0, P95_EVERY)] * buckets
        self.running: set[asyncio.Task[None]] = set()  # one task per batch

    def dispatch(self, engine: EngineClient, batch: Batch) -> None:
        """Send one batch to ``engine``, whose slot it takes now."""
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
        self.running.add(task)
        task.add_done_callback(self.running.discard)
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
        refused: InvalidInput | None = None
        try:
            result = await self._execute(engine, message, bucket)
            # An answer of the wrong size fails here, its callers answered.
            outputs = np.frombuffer(result.output, dtype="<f4").reshape(
                len(keys), result.width
            )
            self.breaker.record_success()
        except InvalidInput as exc:  # the input's fault: split, nobody blamed
            refused = exc
            record_error(span, exc)
            self.breaker.record_no_verdict()
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
                    waiter.deliver(error_result(waiter.reply_id, exc.code, str(exc)))
            return
        finally:
            span.end()
        if refused is not None:
            await self._split(message, keys, bucket, refused)
            return
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

    async def _split(
        self,
        message: internal_pb2.Batch,
        keys: list[int],
        bucket: int,
        refused: InvalidInput,
    ) -> None:
        """A batch the engine refused as invalid: a lone sequence fails with
        the engine's reason; a larger batch runs again as two halves (each
        split again if refused), so that only the sequences at fault fail."""
        if len(keys) == 1:
            waiter = self.waiters.pop(keys[0], None)
            if waiter is not None:
                metrics.SEQUENCES.labels(self.name, "invalid").inc()
                waiter.deliver(
                    error_result(
                        waiter.reply_id, grpc.StatusCode.INVALID_ARGUMENT, str(refused)
                    )
                )
            return
        row = 4 * message.length  # bytes of one row's ids
        half = len(keys) // 2
        parts = []
        for lo, hi in ((0, half), (half, len(keys))):
            if not any(key in self.waiters for key in keys[lo:hi]):
                continue  # all cancelled meanwhile
            part = internal_pb2.Batch(
                id=self.pool.next_batch_id(),
                model=message.model,
                batch_size=hi - lo,
                length=message.length,
                token_ids=message.token_ids[lo * row : hi * row],
                lengths=message.lengths[4 * lo : 4 * hi],
                trace_context=message.trace_context,
            )
            parts.append(self._run_part(part, keys[lo:hi], bucket))
        log.info(
            "batch %d of %s (%d sequences) refused as invalid, run again in halves: %s",
            message.id,
            self.name,
            len(keys),
            refused,
        )
        await asyncio.gather(*parts)

    async def _run_part(
        self, message: internal_pb2.Batch, keys: list[int], bucket: int
    ) -> None:
        """Run part of a refused batch on any engine, counted in its slots."""
        engine = self.pool.pick(self.name, any_slot=True)
        if engine is None:
            reason = f"no engine is serving model {self.name!r}"
            for key in keys:
                waiter = self.waiters.pop(key, None)
                if waiter is not None:
                    metrics.SEQUENCES.labels(self.name, "unavailable").inc()
                    waiter.deliver(
                        error_result(
                            waiter.reply_id, grpc.StatusCode.UNAVAILABLE, reason
                        )
                    )
            return
        engine.take_slot()
        try:
            await self._run(engine, message, keys, bucket, INVALID_SPAN)
        finally:
            self._slot_freed(engine)

    async def _execute(
        self, engine: EngineClient, message: internal_pb2.Batch, bucket: int
    ) -> internal_pb2.BatchResult:
        """Run the batch, hedged; if its engine fails, re-send to another.
        The first engine's slot was taken at dispatch (:meth:`dispatch`)."""
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
            done, _ = await asyncio.wait(attempts, timeout=self.hedge_delay(bucket))
            if not done:
                # Only to an engine with a free slot: one queued behind a full
                # engine's work rarely wins and takes capacity the load needs
                # (3 x 8 s at 270/s on 2 cores: p99 135-223 ms with this rule,
                # 167-402 ms with a hedge to any engine).
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
        task first runs: the loop may pick before then, and would give a
        hedge's engine a batch beyond its slots. It is freed once, when the
        task ends however it ends (won, lost, cancelled, failed)."""
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
        if result.code == INVALID_ARGUMENT:  # the batch's fault, not the engine's
            raise InvalidInput(f"engine {engine.address}: {result.message}")
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

    def hedge_delay(self, bucket: int) -> float:
        """How long a batch of this bucket runs alone before it is hedged."""
        delay = self.config.hedge_delay_s
        recent = self.latencies[bucket]
        if self.config.hedge_p95 and len(recent) >= 20:
            p95, age = self._p95[bucket]
            if age >= P95_EVERY:
                p95, age = float(np.percentile(recent, 95)), 0
                self._p95[bucket] = (p95, age)
            delay = max(delay, p95)
        return delay
