"""``berth serve``: engines, batcher and gateway as supervised processes.

Start order is engines -> batcher -> gateway; stop order the reverse of
that: the gateway drains first so no new work enters, then the batcher
flushes its queues, then the engines go. A child that dies on its own is
restarted (engines are the usual case: a crashed GPU worker). Before any
starts, the ports they will listen on are checked and the gRPC ones held
(services/cli/ports.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("berth.serve")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
# A child that ran this long before dying starts its back-off afresh.
RAN_A_WHILE_S = 60.0
# Before berth first serves, a child that fails this many times in a row
# (each within RAN_A_WHILE_S of starting) cannot start: berth serve gives up.
STARTUP_ATTEMPTS = len(RESTART_BACKOFF_S)
# Past each service's own drain timeout (30 s by default), so drains finish.
STOP_TIMEOUT_S = 45.0


def _die_with_parent() -> None:
    """In the child: get SIGTERM if berth serve itself dies (Linux)."""
    os.setsid()  # own process group: a terminal's Ctrl-C reaches us only
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def plan_cpus(shares: list[int], cpus: list[int]) -> list[list[int]]:
    """Consecutive CPUs for each process, ``shares[i]`` of them, in order,
    wrapping around when there are fewer CPUs than shares (then some share)."""
    plan = []
    at = 0
    for share in shares:
        plan.append(sorted({cpus[(at + k) % len(cpus)] for k in range(share)}))
        at += share
    return plan


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # CPUs the process (every thread it starts) may run on; None: any.
    cpus: list[int] | None = None
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    # When a child that died is due to start again (None: not waiting).
    restart_at: float | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env}
        cpus = self.cpus
        if cpus is not None:
            # serve's CPU set can shrink while it runs (a cpuset changed under
            # it: Kubernetes' static CPU manager gives another pod exclusive
            # CPUs). Pinning a restarted child to a CPU no longer in it fails
            # in the fork, and the error would end serve and its whole stack.
            allowed = os.sched_getaffinity(0)
            if not allowed.intersection(cpus):
                log.warning(
                    "%s: CPU(s) %s are no longer among berth serve's (%s): it "
                    "runs on any of those",
                    self.name,
                    ",".join(map(str, cpus)),
                    ",".join(map(str, sorted(allowed))),
                )
                cpus = None

        def setup() -> None:
            _die_with_parent()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=setup)
        self.started_at = time.monotonic()
        pinned = f" on CPU(s) {','.join(map(str, cpus))}" if cpus is not None else ""
        log.info(
            "started %s (pid %d)%s: %s",
            self.name,
            self.proc.pid,
            pinned,
            shlex.join(self.argv),
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return 0
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s: killing it", self.name, timeout)
            self.proc.kill()
            return self.proc.wait()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Supervisor:
    """Starts children in order, restarts the ones that die, stops in reverse."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self._stopping = False
        # Set once berth has served: from then on children are restarted
        # for good; until then, one that cannot start makes check() give up.
        self.served = False

    def _on_signal(self, signum: int, frame: object) -> None:
        log.info("received %s: stopping berth", signal.Signals(signum).name)
        self._stopping = True

    def start(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            child.start()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def check(self) -> str | None:
        """One pass: note children that died, restart those whose back-off
        is over. Returns why berth cannot start, if a child cannot."""
        for child in self.children:
            if self._stopping:
                return None
            now = time.monotonic()
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart_at = None
                    child.restarts += 1
                    child.start()
                continue
            assert child.proc is not None
            code = child.proc.poll()
            if code is None:
                continue
            if now - child.started_at > RAN_A_WHILE_S:
                child.restarts = 0  # it ran a while: a fresh failure
            if not self.served and child.restarts + 1 >= STARTUP_ATTEMPTS:
                return (
                    f"{child.name} exited with code {code} {child.restarts + 1} "
                    "times in a row before berth served: giving up (its own log "
                    "above says why)"
                )
            backoff = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
            log.error(
                "%s exited with code %s; restarting in %.1f s",
                child.name,
                code,
                backoff,
            )
            child.restart_at = now + backoff
        return None

    def stop(self) -> int:
        """Stop in reverse start order; returns the worst exit code."""
        worst = 0
        for child in reversed(self.children):
            child.stop()
            code = child.wait(STOP_TIMEOUT_S)
            log.info("%s stopped (exit code %s)", child.name, code)
            if code not in (0, -signal.SIGTERM, None):
                worst = max(worst, abs(code))
        return worst
