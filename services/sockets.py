"""Test binds of the addresses a gRPC service listens on.

gRPC listens with SO_REUSEPORT (on by default in gRPC core, and what lets
gateways share a port), and says no more than that a bind failed. Binding
each address a host:port stands for, as gRPC would, tells why: a port in
use, an address that is not this machine's, a port below 1024. `berth
serve` checks and holds its children's ports with the same binds
(services/cli/ports.py); a service that cannot listen says why with them
(services/server.py why_not_listening).

A test bind has SO_REUSEADDR, as the services bind, so connections a stopped
server left in TIME_WAIT do not make a port in use, and not SO_REUSEPORT, so
any listener on the port, SO_REUSEPORT or not, whatever its user, makes it
fail. A hold has SO_REUSEPORT only: it never listens (it gets no
connections), services of the same user still bind next to it, and another
test bind fails.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

Address = tuple[Any, ...]  # a socket address: (host, port), IPv6 (host, port, 0, scope)


def listen_addresses(host: str, port: int) -> list[tuple[int, Address, bool]]:
    """(family, socket address, required) a service listens on at host: the
    addresses host resolves to; for a wildcard, both families' wildcards
    (gRPC listens on 0.0.0.0 as [::]; the family host did not name is not
    required: IPv6 may be off)."""
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
