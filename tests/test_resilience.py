"""Circuit breaker and hedge budget, on a fake clock."""

from __future__ import annotations

from batcher.resilience import BreakerState, CircuitBreaker, HedgeBudget


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
