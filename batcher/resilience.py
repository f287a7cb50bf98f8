"""Level-2 and level-3 fault tolerance: hedge budget and circuit breaker."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum

log = logging.getLogger("berth.batcher")


class HedgeBudget:
    """Token bucket: each batch earns ``ratio`` of a hedge, a hedge costs one.

    With ratio 0.1 at most ~10 % extra batches are sent however slow the
    fleet gets, so hedging cannot double the load of an overloaded fleet.
    """

    def __init__(self, ratio: float = 0.1, burst: float = 5.0) -> None:
        self.ratio = ratio
        self.burst = burst if ratio > 0 else 0.0  # --hedge-ratio 0: no hedges
        self.tokens = self.burst
        self.sent = 0
        self.won = 0

    def earn(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def try_spend(self) -> bool:
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        self.sent += 1
        return True


class BreakerState(Enum):
    """Circuit states, with the numbers exported as a metric."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Per model: N consecutive failed batches open it; probes close it.

    Only engine failures and timeouts count; client errors and cancellations
    never reach it. While open, new work is refused at once (the gateway
    answers from the CPU fallback); after ``cooldown_s`` it lets
    ``probes`` batches through (half-open) and closes on the first success.
    """

    def __init__(
        self,
        model: str,
        threshold: int = 3,
        cooldown_s: float = 5.0,
        probes: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self.model = model
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.probes = probes
        self._clock = clock
        self._on_change = on_change
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self._probes_left = 0

    def _set(self, state: BreakerState, why: str) -> None:
        if state is self.state:
            return
        log.warning(
            "circuit for %s %s -> %s: %s", self.model, self.state.name, state.name, why
        )
        self.state = state
        if self._on_change is not None:
            self._on_change(state)

    def cooled_down(self) -> bool:
        return self._clock() - self.opened_at >= self.cooldown_s

    def current(self) -> BreakerState:
        """The state now: an open circuit whose cool-down is over is half-open.

        (Asked by the gateway too, so that it sends the probes at all.)
        """
        if self.state is BreakerState.OPEN and self.cooled_down():
            self._probes_left = self.probes
            self._set(BreakerState.HALF_OPEN, f"cool-down of {self.cooldown_s} s over")
        return self.state

    def allow(self) -> bool:
        """May a new batch go to the engines now?"""
        if self.current() is BreakerState.OPEN:
            return False
        if self.state is BreakerState.HALF_OPEN:
            if self._probes_left <= 0:
                return False
            self._probes_left -= 1
        return True

    def record_success(self) -> None:
        # While open no batch is sent: this one went out before the circuit
        # opened. Only a probe after the cool-down closes it.
        if self.state is BreakerState.OPEN:
            return
        self.failures = 0
        self._set(BreakerState.CLOSED, "a batch succeeded")

    def record_no_verdict(self) -> None:
        """A batch ended telling nothing of the engines (they refused its
        input as invalid): while half-open, its probe is given back."""
        if self.state is BreakerState.HALF_OPEN:
            self._probes_left = min(self.probes, self._probes_left + 1)

    def record_failure(self, reason: str) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.threshold:
            self.opened_at = self._clock()
            self._set(
                BreakerState.OPEN,
                f"{self.failures} consecutive failed batches, last: {reason}",
            )

    @property
    def label(self) -> str:
        return self.current().name.lower()
