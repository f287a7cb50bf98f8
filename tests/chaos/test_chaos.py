"""Chaos against `berth serve --engines 2` under steady bounded load.

Every request is accounted for: OK, a clear error, or (never) lost. Each
test prints its counts.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.load import run_load, run_load_while
from tests.stack import Stack, pid_listening


@pytest.fixture
def fleet(repository: Path) -> Iterator[Stack]:
    stack = Stack(
        repository,
        engines=2,
        extra_args=["--chaos"],
        env={"BERTH_BREAKER_COOLDOWN_S": "2"},
    )
    try:
        stack.wait_serving()
        yield stack
    finally:
        stack.stop()


def engine_pid(stack: Stack, index: int) -> int:
    return pid_listening("engine", int(stack.engines[index].rsplit(":", 1)[1]))


def metric(url: str, pattern: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line and not line.startswith("#") and re.fullmatch(pattern, name):
            total += float(value)
    return total


def test_engine_killed_mid_run_loses_nothing(fleet: Stack) -> None:
    victim = engine_pid(fleet, 0)

    result = run_load_while(
        fleet.gateway, 10_000, 32, (3.0, lambda: os.kill(victim, signal.SIGKILL))
    )
    print(result.summary("SIGKILL one engine"))
    assert result.sent == 10_000
    assert result.answered == result.sent, "requests were lost"
    assert result.ok_ratio >= 0.9997
    # berth serve restarted the killed engine.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if engine_pid(fleet, 0) != victim:
                break
        except LookupError:
            pass
        time.sleep(0.5)
    assert engine_pid(fleet, 0) != victim
    assert "engine-0 exited with code -9; restarting" in fleet.logs()


def test_stalled_engine_is_hedged_around(fleet: Stack) -> None:
    healthy = asyncio.run(run_load(fleet.gateway, requests=1500, concurrency=8))
    print(healthy.summary("healthy"))
    batcher_metrics = fleet.metrics[1]
    batches_before = metric(batcher_metrics, r"berth_batcher_batches_total\{.*\}")
    hedges_before = metric(
        batcher_metrics, r'berth_batcher_hedges_total\{.*event="sent".*\}'
    )
    won_before = metric(
        batcher_metrics, r'berth_batcher_hedges_total\{.*event="won".*\}'
    )
    victim = engine_pid(fleet, 1)

    stalled = run_load_while(
        fleet.gateway,
        1500,
        8,
        (0.5, lambda: os.kill(victim, signal.SIGSTOP)),
        (3.0, lambda: os.kill(victim, signal.SIGCONT)),
    )
    print(stalled.summary("SIGSTOP one engine for 3 s"))
    batches = (
        metric(batcher_metrics, r"berth_batcher_batches_total\{.*\}") - batches_before
    )
    hedges = (
        metric(batcher_metrics, r'berth_batcher_hedges_total\{.*event="sent".*\}')
        - hedges_before
    )
    won = (
        metric(batcher_metrics, r'berth_batcher_hedges_total\{.*event="won".*\}')
        - won_before
    )
    slowest = max(stalled.latencies)
    print(
        f"batches {batches:.0f}, hedges {hedges:.0f} ({hedges / batches:.1%}), "
        f"won by the hedge {won:.0f}; slowest call {slowest:.2f} s"
    )
    assert stalled.answered == stalled.sent and stalled.ok_ratio == 1.0
    # The batches the stalled engine held were hedged, and their hedges won:
    # no call waited out the 3 s stall (unhedged, those calls took >= 2.5 s).
    assert won >= 1, "no batch was rescued by a hedge"
    assert slowest < 1.5, f"a call waited {slowest:.2f} s: it was not hedged"
    assert stalled.p(99) <= 2 * healthy.p(99)
    # ...and hedges stayed within their budget (--hedge-ratio 0.1).
    assert hedges / batches <= 0.10


def test_all_engines_failing_degrades_then_recovers(fleet: Stack) -> None:
    pids = [engine_pid(fleet, i) for i in range(2)]
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)  # every batch now fails
    failing = asyncio.run(run_load(fleet.gateway, requests=200, concurrency=4))
    print(failing.summary("every engine failing"))
    assert failing.answered == failing.sent and failing.ok_ratio == 1.0
    assert failing.degraded >= failing.sent - 3 * 4  # all but the first failures
    state = metric(fleet.metrics[1], r'berth_batcher_breaker_state\{model="minilm"\}')
    assert state in (1, 2)  # open, or half-open probing
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)  # engines recover
    # After the breaker's cool-down (BERTH_BREAKER_COOLDOWN_S=2) its probes
    # close it: wait until a real (not degraded) answer comes back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = asyncio.run(run_load(fleet.gateway, requests=1, concurrency=1))
        if probe.outcomes["OK"] and not probe.degraded:
            break
        time.sleep(0.5)
    recovered = asyncio.run(run_load(fleet.gateway, requests=200, concurrency=4))
    print(recovered.summary("after recovery"))
    tail = recovered.degraded
    assert recovered.ok_ratio == 1.0
    assert tail <= 8, "answers still degraded after the engines recovered"


def test_gateway_sigterm_mid_load_finishes_in_flight(fleet: Stack) -> None:
    signalled: list[float] = []

    def sigterm() -> None:
        signalled.append(time.perf_counter())
        fleet.proc.send_signal(signal.SIGTERM)

    result = run_load_while(
        fleet.gateway, 100_000, 16, (1.5, sigterm), max_duration_s=4
    )
    print(result.summary("SIGTERM berth serve mid-load"))
    assert result.answered == result.sent
    # Every call in flight when the signal came finished OK; calls sent while
    # the gateway drained were refused with a clear status.
    in_flight = [outcome for start, outcome in result.calls if start < signalled[0]]
    print(f"in flight at SIGTERM: {len(in_flight)}, OK: {in_flight.count('OK')}")
    assert in_flight and set(in_flight) == {"OK"}
    later_outcomes = {o for start, o in result.calls if start >= signalled[0]}
    assert later_outcomes <= {"OK", "UNAVAILABLE", "CANCELLED"}
    assert fleet.proc.wait(60) == 0


def test_batcher_killed_mid_run_loses_nothing_and_is_reconnected(fleet: Stack) -> None:
    """The gateway's one Submit stream dies with the batcher: what was in
    flight is answered (the CPU fallback, or a clear error), none is lost,
    and once berth serve restarted the batcher the gateway streams to it
    again (not degraded)."""
    victim = pid_listening("batcher", int(fleet.batcher.rsplit(":", 1)[1]))

    result = run_load_while(
        fleet.gateway, 3000, 16, (2.0, lambda: os.kill(victim, signal.SIGKILL))
    )
    print(result.summary("SIGKILL the batcher"))
    assert result.sent == 3000
    assert result.answered == result.sent, "requests were lost"
    assert "batcher exited with code -9; restarting" in fleet.logs()
    deadline = time.monotonic() + 60
    while True:
        after = asyncio.run(run_load(fleet.gateway, requests=200, concurrency=4))
        if after.ok_ratio == 1.0 and after.degraded == 0:
            break
        assert time.monotonic() < deadline, after.summary("after the restart")
        time.sleep(1.0)
