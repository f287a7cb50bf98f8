"""``berth serve``: engines, batcher and gateway as supervised processes.

Start order is engines -> batcher -> gateway; stop order the reverse of
that: the gateway drains first so no new work enters, then the batcher
flushes its queues, then the engines go. A child that dies on its own is
restarted (engines are the usual case: a crashed GPU worker). Before any
starts, the ports they will listen on are checked and the gRPC ones held
(reserve_ports).
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

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


# ---- the children's ports ---------------------------------------------------
#
# gRPC listens with SO_REUSEPORT (on by default in gRPC core, and what lets
# serve's gateways share --port): a second stack on a port already served
# joins it without an error, and the kernel splits the callers between two
# unrelated stacks. So serve checks every port its children will listen on
# before it starts any, with a test bind:
# - without SO_REUSEPORT, so that any listener on the port, SO_REUSEPORT or
#   not, whatever its user, makes the bind fail (a connect attempt would miss
#   a listener on another address of the same port, a firewalled one, and
#   another serve's hold, below, which never listens);
# - with SO_REUSEADDR, as the services bind: connections a stopped server
#   left in TIME_WAIT do not make a port in use;
# - on each address the children will listen on: every address --host
#   resolves to, and for a wildcard host both families' wildcards (gRPC
#   listens on 0.0.0.0 as [::], IPv4 and IPv6).
# The gRPC ports are then held for as long as serve runs, by a socket bound
# with SO_REUSEPORT but never listening (it gets no connections): serve's
# own children, of the same user, still bind next to it, a gateway restarted
# by the supervisor included, while another serve's test bind fails even
# when none of the children listens (all restarting, or not started yet:
# the models are built first).
# The hold has no SO_REUSEADDR: that would let a test bind pass. /metrics
# ports are not held: the Prometheus server binds without SO_REUSEPORT.


@dataclass(frozen=True)
class Listener:
    """A port one of serve's children listens on: ``base + offset``, where
    ``base`` is what ``flag`` says."""

    child: str
    flag: str
    base: int
    offset: int = 0
    metrics: bool = False  # a /metrics port (else a gRPC one)

    @property
    def port(self) -> int:
        return self.base + self.offset

    def __str__(self) -> str:
        what = "/metrics port" if self.metrics else "port"
        source = (
            f"{self.flag} {self.base} + {self.offset}" if self.offset else self.flag
        )
        return f"{self.child}'s {what} {self.port} ({source})"


class PortUnavailable(OSError):
    """A port serve's children need is in use, or cannot be listened on."""


def check_listeners(listeners: list[Listener]) -> None:
    """Raises ValueError for a port out of range or two of serve's listeners
    on one port (gRPC ports would be shared silently, SO_REUSEPORT)."""
    seen: dict[int, Listener] = {}
    for listener in listeners:
        if not 0 < listener.port < 65536:
            raise ValueError(
                f"{listener} is not a port (1-65535): change {listener.flag}"
            )
        other = seen.setdefault(listener.port, listener)
        if other is not listener:
            raise ValueError(
                f"{listener} is also {other}: give each its own "
                f"({listener.flag} or {other.flag})"
            )


Address = tuple[Any, ...]  # a socket address: (host, port), IPv6 (host, port, 0, scope)


def listen_addresses(host: str, port: int) -> list[tuple[int, Address, bool]]:
    """(family, socket address, required) the children listen on at host:
    the addresses host resolves to; for a wildcard, both families' wildcards
    (the one host did not name is not required: IPv6 may be off)."""
    name = host.strip("[]")  # an IPv6 address may come bracketed
    infos = socket.getaddrinfo(
        name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    found: set[tuple[int, Address, bool]] = {
        (family, tuple(addr), True) for family, _, _, _, addr in infos
    }
    if any(ipaddress.ip_address(str(a[0])).is_unspecified for _, a, _ in found):
        for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            if not any(f == family for f, _, _ in found):
                found.add((family, (wildcard, port), False))
    return sorted(found)


def bound(
    family: int, address: Address, *, hold: bool, share: bool = False
) -> socket.socket:
    """A socket bound to address: a test bind (SO_REUSEADDR, not
    SO_REUSEPORT), or a hold (SO_REUSEPORT only); see above. ``share``: a
    test bind with SO_REUSEPORT as well, as a service that shares its port
    binds (services/server.py why_not_listening)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        option = socket.SO_REUSEPORT if hold else socket.SO_REUSEADDR
        sock.setsockopt(socket.SOL_SOCKET, option, 1)
        if share and not hold:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # [::] takes IPv4 too, as gRPC's does
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class PortReservation:
    """The gRPC ports serve holds for its children while it runs."""

    def __init__(self, held: list[socket.socket]) -> None:
        self.held = held

    def close(self) -> None:
        for sock in self.held:
            sock.close()
        self.held = []

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _free_addresses(host: str, listener: Listener) -> list[tuple[int, Address]]:
    """The addresses the listener's child will listen on, each free to a test
    bind; raises PortUnavailable naming the port and its flag."""
    try:
        addresses = listen_addresses(host, listener.port)
    except socket.gaierror as exc:
        message = f"--host {host}: cannot resolve it ({exc.strerror})"
        raise PortUnavailable(message) from exc
    free = []
    for family, address, required in addresses:
        try:
            bound(family, address, hold=False).close()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                off = " (0: no /metrics)" if listener.metrics else ""
                raise PortUnavailable(
                    f"{listener} is in use on {address[0]} by another process "
                    f"(another berth serve?): stop it, or set {listener.flag} to a "
                    f"free port{off}"
                ) from exc
            if required:
                raise PortUnavailable(
                    f"{listener}: cannot listen on {address[0]} ({exc.strerror}): "
                    f"check --host and {listener.flag}"
                ) from exc
            continue  # the wildcard of a family that is off here
        free.append((family, address))
    return free


def reserve_ports(host: str, listeners: list[Listener]) -> PortReservation:
    """Checks that no other process listens on a port of ``listeners`` at
    host (PortUnavailable if one does), then holds the gRPC ones."""
    # Every test bind first: a hold on 0.0.0.0 would fail the one on [::].
    free = [(listener, _free_addresses(host, listener)) for listener in listeners]
    held = []
    for listener, addresses in free:
        if listener.metrics:
            continue  # the Prometheus server binds without SO_REUSEPORT
        for family, address in addresses:
            try:
                held.append(bound(family, address, hold=True))
            except OSError as exc:
                # Free to a test bind yet not to a hold (a TIME_WAIT left by
                # a socket without SO_REUSEPORT): checked, not held.
                log.debug("%s on %s not held: %s", listener, address[0], exc)
    return PortReservation(held)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Supervisor:
    """Starts children in order, restarts the ones that die, stops in reverse."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self._stopping = False
        # Set once berth has served: from then on children are restarted
        # for good; before, one that cannot start makes check() give up.
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
