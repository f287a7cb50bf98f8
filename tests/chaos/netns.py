"""Hosts for tests: Linux network namespaces on a bridge made for the test.

Each host is a network namespace with its own address, linked to the bridge
by a veth pair whose bridge-side end the test can take down (a cut link: no
FIN, no RST, packets dropped) and up again. Processes start in a host with
``ip netns exec``, which bind-mounts ``/etc/netns/<namespace>/hosts`` over
``/etc/hosts`` for them: a test gives a host its own hosts file and
rewrites it in place to change what a name resolves to.

Names carry a random tag (parallel runs do not collide), and everything
made is removed by :meth:`Network.close`, also when the test fails.
Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def missing() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip (the Makefile installs it)"
    return None


def ip(*args: str) -> str:
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    """One namespace on the bridge."""

    namespace: str
    address: str
    link: str  # the veth end on the bridge, in the root namespace
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def hosts_file(self) -> Path:
        return NETNS_ETC / self.namespace / "hosts"

    def write_hosts(self, text: str) -> None:
        """Rewrite the hosts file in place (its bind mount follows the
        inode: a new file renamed over it would not be seen)."""
        with self.hosts_file.open("r+") as f:
            f.truncate(0)
            f.write(text)

    def start(
        self, argv: list[str], log: Path, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(proc)
        return proc

    def cut(self) -> None:
        ip("link", "set", self.link, "down")

    def restore(self) -> None:
        ip("link", "set", self.link, "up")


class Network:
    """A bridge in the root namespace (address .1 of a free /24) and hosts."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"bb{self.tag}"
        self.hosts: list[Host] = []
        self.subnet = self._free_subnet()
        self.gateway_ip = str(self.subnet.network_address + 1)
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = ip("-4", "-o", "addr")
        for _ in range(100):
            net = ipaddress.IPv4Network(
                f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24"
            )
            if str(net.network_address)[:-1] not in used:
                return net
        raise RuntimeError("no free 10.x.y.0/24")

    def add(self, name: str) -> Host:
        """A new namespace with the next address, linked to the bridge."""
        n = len(self.hosts) + 10
        namespace = f"berth-{self.tag}-{name}"
        outer, inner = f"h{self.tag}{n}", f"n{self.tag}{n}"
        address = str(self.subnet.network_address + n)
        ip("netns", "add", namespace)
        host = Host(namespace, address, outer)
        self.hosts.append(host)
        (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
        host.hosts_file.write_text(f"127.0.0.1 localhost\n{address} {name}\n")
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", outer, "master", self.bridge, "up")
        ip("link", "set", inner, "netns", namespace)
        inside = ("netns", "exec", namespace, "ip")
        ip(*inside, "addr", "add", f"{address}/24", "dev", inner)
        ip(*inside, "link", "set", inner, "up")
        ip(*inside, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        """Stop every process, remove every namespace, link and file made."""
        for host in self.hosts:
            for proc in host.processes:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(30)
        for host in self.hosts:
            # (A bridge-side veth end goes with its peer's namespace.)
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", host.namespace)
            with contextlib.suppress(RuntimeError):
                ip("link", "del", host.link)
            shutil.rmtree(NETNS_ETC / host.namespace, ignore_errors=True)
        with contextlib.suppress(RuntimeError):
            ip("link", "del", self.bridge)
