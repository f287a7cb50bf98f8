"""The ports `berth serve`'s children listen on: checked before any starts,
the gRPC ones held while serve runs.

gRPC listens with SO_REUSEPORT (what lets serve's gateways share --port): a
second stack on a port already served would join it without an error, and
the kernel would split the callers between two unrelated stacks. So serve
test-binds every port its children will listen on before it starts any
(services/sockets.py), on each address they will listen on: every address
--host resolves to, and for a wildcard host both families' wildcards. A
test bind, not a connect attempt: that would miss a listener on another
address of the same port, a firewalled one, and another serve's hold,
which never listens.

The gRPC ports are then held for as long as serve runs: serve's own
children, of the same user, still bind next to the hold, a gateway
restarted by the supervisor included, while another serve's test bind fails
even when none of the children listens (all restarting, or not started yet:
the models are built first). /metrics ports are not held: the Prometheus
server binds without SO_REUSEPORT.
"""

from __future__ import annotations

import errno
import logging
import socket
from dataclasses import dataclass
from types import TracebackType

from services.sockets import Address, bound, listen_addresses

log = logging.getLogger("berth.serve")


@dataclass(frozen=True)
class Listener:
    """A port one of serve's children listens on: ``base + offset``, where
    ``base`` is what ``flag`` says."""

    child: str
    flag: str
    base: int
    offset: int = 0
    metrics: bool = False  # a /metrics port (else a gRPC one)
    # The address it listens on, and the flag that says so ('': the host
    # reserve_ports is given, --host).
    host: str = ""
    host_flag: str = "--host"

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
    """The addresses the listener's child will listen on (at its own host,
    else ``host``), each free to a test bind; raises PortUnavailable naming
    the port and its flag."""
    host = listener.host or host
    try:
        addresses = listen_addresses(host, listener.port)
    except socket.gaierror as exc:
        message = f"{listener.host_flag} {host}: cannot resolve it ({exc.strerror})"
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
                    f"check {listener.host_flag} and {listener.flag}"
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
