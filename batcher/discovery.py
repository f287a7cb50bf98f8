"""Engines found through DNS: ``dns:///NAME:PORT`` entries of ``--engines``.

Such a name (a Kubernetes headless Service, say) is resolved with the
system resolver (getaddrinfo, on a worker thread) when the pool starts and
again every ``--dns-interval-s``; the pool keeps one stream to each address
it has (:meth:`batcher.engines.EnginePool.follow`). A lookup that fails
changes nothing: a resolver outage does not take engines away.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable

log = logging.getLogger("berth.batcher")

SCHEME = "dns:///"


class DnsName:
    """One ``dns:///NAME:PORT`` entry: a host name and the engines' port."""

    def __init__(self, target: str) -> None:
        """``target``: the entry as given; ValueError if it is malformed."""
        host, colon, port = target.removeprefix(SCHEME).rpartition(":")
        if not target.startswith(SCHEME) or not colon or not host:
            raise ValueError(f"{target!r}: an engine name is {SCHEME}NAME:PORT")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{target!r}: {port!r} is not a port")
        self.target = target
        self.host = host.strip("[]")
        self.port = int(port)

    async def resolve(self) -> set[str]:
        """The name's addresses now, as ``ip:port`` (``[ip]:port`` for
        IPv6); raises OSError (socket.gaierror) when the lookup fails."""
        infos = await asyncio.get_running_loop().getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM
        )
        return {join(str(info[4][0]), self.port) for info in infos}


def join(ip: str, port: int) -> str:
    """A gRPC target for one address."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split(targets: Iterable[str]) -> tuple[list[str], list[DnsName]]:
    """``--engines`` entries: (fixed addresses, names to follow)."""
    fixed: list[str] = []
    names: list[DnsName] = []
    for target in targets:
        if target.startswith("dns:"):
            names.append(DnsName(target))
        else:
            fixed.append(target)
    return fixed, names


async def follow(
    names: list[DnsName],
    interval_s: float,
    found: Callable[[str, set[str]], None],
) -> None:
    """Resolve every name now and then every ``interval_s`` seconds,
    handing each answer to ``found(target, addresses)``; runs until
    cancelled. A failed lookup is logged (once per run of failures) and
    hands nothing on."""
    failing: set[str] = set()
    while True:
        answers = await asyncio.gather(
            *(name.resolve() for name in names), return_exceptions=True
        )
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, OSError):
                    raise answer
                if name.target not in failing:
                    log.warning(
                        "cannot resolve %s (%s): keeping its engines as they "
                        "are, asking again every %.1f s",
                        name.target,
                        answer,
                        interval_s,
                    )
                failing.add(name.target)
                continue
            if name.target in failing:
                log.info("%s resolves again", name.target)
                failing.discard(name.target)
            found(name.target, answer)
        await asyncio.sleep(interval_s)
