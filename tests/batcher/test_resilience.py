"""Circuit breaker and hedge budget, on a fake clock; the breaker also
behind a real scheduler and a loopback engine."""

from __future__ import annotations

import asyncio
import time

import grpc

from batcher.engines import EngineClient, EnginePool
from batcher.options import SchedulerConfig
from batcher.resilience import BreakerState, CircuitBreaker, HedgeBudget
from batcher.scheduler import ModelScheduler
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from tests.batcher.loopback import (
    ENTRY,
    SleepyEngine,
    sequence,
    started,
    stopped,
)
from tests.waits import until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_three_failures_in_a_row_open_the_circuit() -> None:
    clock = Clock()
    changes: list[BreakerState] = []
    breaker = CircuitBreaker(
        "m", threshold=3, cooldown_s=5, clock=clock, on_change=changes.append
    )
    breaker.record_failure("boom")
    breaker.record_failure("boom")
    assert breaker.allow() and breaker.state is BreakerState.CLOSED
    breaker.record_success()  # a success resets the count
    for _ in range(2):
        breaker.record_failure("boom")
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure("boom")
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow()
    assert changes == [BreakerState.OPEN]


def test_half_open_probes_close_or_reopen() -> None:
    clock = Clock()
    breaker = CircuitBreaker("m", threshold=3, cooldown_s=5, probes=2, clock=clock)
    for _ in range(3):
        breaker.record_failure("boom")
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()
    assert not breaker.allow()  # only two probes
    breaker.record_failure("still down")  # one failed probe reopens at once
    assert breaker.state is BreakerState.OPEN
    clock.now += 5.1
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()


def test_hedge_budget_caps_extra_batches_at_the_ratio() -> None:
    budget = HedgeBudget(ratio=0.1, burst=2)
    hedged = 0
    for _ in range(1000):  # every batch is slow and wants a hedge
        budget.earn()
        hedged += budget.try_spend()
    assert hedged <= 0.1 * 1000 + 2
    assert hedged >= 0.1 * 1000 - 1
    assert budget.sent == hedged


def test_a_hedge_ratio_of_zero_sends_no_hedges() -> None:
    budget = HedgeBudget(ratio=0.0)
    for _ in range(100):
        budget.earn()
        assert not budget.try_spend()
    assert budget.sent == 0


def test_ejection_back_off_survives_any_number_of_failures() -> None:
    """An engine that fails every probe for hours: its back-off stays 30 s
    (2.0 ** 1024 overflowed at the 1,025th failure in a row, which failed
    the batch with INTERNAL and never ejected the engine again)."""

    async def scenario() -> float:
        engine = EngineClient("127.0.0.1:9", lambda: None)  # never connected
        try:
            for _ in range(1100):
                engine.record_failure("probe failed")
            return engine.ejected_until - time.monotonic()
        finally:
            await engine.channel.close()

    assert 29.0 < asyncio.run(scenario()) <= 30.0


def test_a_late_success_does_not_close_an_open_circuit() -> None:
    """Batches sent before the circuit opened still finish after it did: one
    that succeeds then must not close it (and skip the cool-down); only a
    probe after the cool-down may."""
    clock = Clock()
    changes: list[BreakerState] = []
    breaker = CircuitBreaker(
        "m", threshold=3, cooldown_s=5, clock=clock, on_change=changes.append
    )
    for _ in range(3):
        breaker.record_failure("boom")
    assert breaker.state is BreakerState.OPEN
    clock.now += 1.0
    breaker.record_success()  # a batch dispatched while it was still closed
    assert breaker.current() is BreakerState.OPEN
    assert not breaker.allow()
    clock.now += 4.1  # the cool-down is over: one probe closes it
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert changes == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]


class ShortOkLongFails(SleepyEngine):
    """Answers a batch of the 8-token bucket after ``delay_s``; fails one of
    the 16-token bucket at once (an engine broken for long inputs)."""

    def delay_of(self, batch: internal_pb2.Batch) -> float:
        return 0.0 if batch.length == 16 else self.delay_s

    def fails_batch(self, batch: internal_pb2.Batch) -> bool:
        return batch.length == 16


def test_a_batch_sent_before_the_circuit_opened_does_not_close_it() -> None:
    """A short batch is computing when three long ones fail in a row and
    open the circuit; the short one then succeeds. The circuit stays open
    (new work refused, the gateway answers from its fallback) for its
    cool-down: the success says nothing about the batches that failed."""

    async def scenario() -> tuple[list[int], BreakerState, int]:
        engine = ShortOkLongFails(delay_s=1.0)
        config = SchedulerConfig(max_delay_s=0.001, breaker_cooldown_s=30)
        scheduler, pool, servers = await started([engine], 4, config)
        codes: dict[int, int] = {}

        def deliver(result: internal_pb2.SequenceResult) -> None:
            codes[result.id] = result.code

        try:
            scheduler.submit(sequence(1, 5), deliver)  # computing for 1 s
            for reply_id in (2, 3, 4):  # three long batches, one at a time
                scheduler.submit(sequence(reply_id, 12), deliver)
                async with asyncio.timeout(5):
                    while reply_id not in codes:
                        await asyncio.sleep(0.005)
            assert scheduler.breaker.state is BreakerState.OPEN
            async with asyncio.timeout(5):
                while 1 not in codes:  # the short batch succeeds
                    await asyncio.sleep(0.005)
            state = scheduler.breaker.current()
            scheduler.submit(sequence(5, 5), deliver)  # refused while open
            async with asyncio.timeout(5):
                while 5 not in codes:
                    await asyncio.sleep(0.005)
            return [codes[i] for i in range(1, 6)], state, engine.received
        finally:
            await stopped(scheduler, pool, servers)

    codes, state, received = asyncio.run(scenario())
    internal = grpc.StatusCode.INTERNAL.value[0]
    assert codes[:4] == [0, internal, internal, internal]
    assert state is BreakerState.OPEN
    assert codes[4] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert received == 4  # the fifth never reached the engine


def test_a_scheduler_drained_before_it_started_refuses_work() -> None:
    """drain() stops a scheduler whether or not its loop ever started: work
    submitted afterwards is refused at once (queued, nothing would ever
    batch it)."""

    async def scenario() -> list[str]:
        server = grpc.aio.server()
        internal_pb2_grpc.add_EngineServicer_to_server(SleepyEngine(0.0), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        pool = EnginePool([address], slots_per_engine=1)
        pool.start()
        try:
            await until(lambda: pool.serving(ENTRY.name), "the engine serving")
            scheduler = ModelScheduler(ENTRY, pool, SchedulerConfig())
            await scheduler.drain()
            answers: list[str] = []
            scheduler.submit(sequence(1, 5), lambda r: answers.append(r.message))
            return answers
        finally:
            await pool.close()
            await server.stop(None)

    (answer,) = asyncio.run(scenario())
    assert "shutting down" in answer
