"""The processes `berth serve` starts: each child's command line and
environment, in start order (engines, batchers, gateways), and every port
they will listen on."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from services.cli.ports import Listener
from services.cli.supervisor import Child, python_module
from services.cli.topology import (
    batcher_mode,
    cpus_available,
    default_batchers,
    default_engines,
    default_gateways,
    gateway_route,
)

# CPU batches take 100s of ms: hedge on the measured p95, not after 50 ms,
# let batches grow to what keeps a CPU busy, and wait up to 50 ms for one to
# fill (small on that scale).
CPU_BATCHING = ("--hedge-p95", "--latency-target-ms", "500", "--max-delay-ms", "50")


@dataclass
class Plan:
    """What serve starts, from its flags and the devices its engines own."""

    args: argparse.Namespace
    devices: list[str]  # CUDA_VISIBLE_DEVICES of each GPU engine
    mode: str  # the batcher mode (topology.batcher_mode)
    gateways: int
    children: list[Child] = field(default_factory=list)
    # Every port a child listens on, checked before any starts.
    listeners: list[Listener] = field(default_factory=list)
    engine_addresses: list[str] = field(default_factory=list)
    batcher_addresses: list[str] = field(default_factory=list)
    own_ports: list[int] = field(default_factory=list)  # --gateway-own-port's
    # With TLS: the files each gateway marks its readiness in (serve.py).
    ready_files: list[Path] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return len(self.devices)

    @property
    def gateway(self) -> str:
        """The address every gateway shares."""
        return f"{self.args.host}:{self.args.port}"

    @property
    def common(self) -> tuple[str, ...]:
        """Every child's flags."""
        return (
            *("--model-repository", str(Path(self.args.model_repository))),
            *("--metrics-host", self.args.metrics_host),
            *internal_tls_flags(self.args),
        )

    @property
    def batching(self) -> tuple[str, ...]:
        """The scheduler flags of batchers, and of gateways that batch."""
        return () if self.gpus else CPU_BATCHING

    @property
    def buckets(self) -> tuple[str, ...]:
        """Batchers and gateways batch to the lengths GPU engines capture
        graphs for (each model's gpu_buckets); --no-gpu-buckets as well, so
        that a BERTH_GPU_BUCKETS set where serve runs cannot disagree with
        its engines."""
        return ("--gpu-buckets",) if self.gpus else ("--no-gpu-buckets",)

    def metrics_port(self, child: str, offset: int) -> str:
        """``child``'s --metrics-port: the base port + offset, 0 (off) for
        all when the base is 0. /metrics: gateway 0 on the base port, batcher
        0 next, the engines, then the other gateways, then the other
        batchers."""
        base = self.args.metrics_port
        if not base:
            return "0"
        self.listeners.append(
            Listener(
                child,
                "--metrics-port",
                base,
                offset,
                metrics=True,
                host=self.args.metrics_host,
                host_flag="--metrics-host",
            )
        )
        return str(base + offset)


def plan_stack(args: argparse.Namespace, devices: list[str]) -> Plan:
    """The children of serve: its engines, batchers and gateways."""
    gpus = len(devices)
    gateways = args.gateways or default_gateways(gpus)
    plan = Plan(args, devices, batcher_mode(args.batcher_mode, gpus), gateways)
    plan.listeners.append(Listener("gateway", "--port", args.port))
    if args.http_port:
        plan.listeners.append(Listener("gateway", "--http-port", args.http_port))
    engines = args.engines or default_engines(gpus)
    for i in range(engines):
        plan.children.append(_engine(plan, i, engines))
    batchers = (
        0
        if plan.mode == "inline"
        else max(1, min(args.batchers or default_batchers(gateways), gateways))
    )
    batcher_metrics = [1] + [engines + gateways + i for i in range(1, batchers)]
    for i in range(batchers):
        name = "batcher" if batchers == 1 else f"batcher-{i}"
        plan.children.append(_batcher(plan, name, i, batcher_metrics[i]))
    for i in range(gateways):
        name = "gateway" if gateways == 1 else f"gateway-{i}"
        plan.children.append(_gateway(plan, name, i, 0 if i == 0 else 1 + engines + i))
    return plan


def _engine(plan: Plan, i: int, engines: int) -> Child:
    """Engine i of ``engines``: on GPU i (wrapping around), else on its share
    of the CPU cores."""
    args = plan.args
    port = args.engine_port + i
    plan.listeners.append(
        internal(Listener(f"engine-{i}", "--engine-port", args.engine_port, i), args)
    )
    plan.engine_addresses.append(dial_address(args.internal_host, port))
    env: dict[str, str] = {}
    if plan.gpus:
        env["CUDA_VISIBLE_DEVICES"] = plan.devices[i % plan.gpus]
    elif engines > 1:
        # Share the CPU cores between engines instead of oversubscribing.
        env["BERTH_TORCH_THREADS"] = str(max(1, cpus_available() // engines))
    argv = python_module(
        "engine",
        *("--host", args.internal_host, "--port", str(port)),
        *("--backend", args.backend),
        *("--device", "cuda:0" if plan.gpus else "cpu"),
        *("--metrics-port", plan.metrics_port(f"engine-{i}", 2 + i)),
        *("--chaos",) * args.chaos,
        *plan.common,
    )
    return Child(f"engine-{i}", argv, env)


def _batcher(plan: Plan, name: str, i: int, metrics_offset: int) -> Child:
    """Batcher i, streaming to every engine."""
    args = plan.args
    port = args.batcher_port + i
    plan.listeners.append(
        internal(Listener(name, "--batcher-port", args.batcher_port, i), args)
    )
    plan.batcher_addresses.append(dial_address(args.internal_host, port))
    argv = python_module(
        "batcher",
        *("--host", args.internal_host, "--port", str(port)),
        *("--engines", ",".join(plan.engine_addresses)),
        *("--metrics-port", plan.metrics_port(name, metrics_offset)),
        *plan.batching,
        *plan.buckets,
        *plan.common,
    )
    return Child(name, argv)


def _gateway(plan: Plan, name: str, i: int, metrics_offset: int) -> Child:
    """Gateway i. Every gateway listens on the same port (SO_REUSEPORT: the
    kernel spreads connections over them); each has its own stream to one
    batcher, gateways spread evenly over the batchers."""
    args = plan.args
    # --own-port 0 as well: a BERTH_OWN_PORT set where serve runs must not
    # put every gateway on one port that serve neither checked nor holds.
    own = ("--own-port", "0")
    if args.gateway_own_port:
        # ...and, asked to, on a port of its own (see the flag's help).
        plan.listeners.append(
            Listener(name, "--gateway-own-port", args.gateway_own_port, i)
        )
        plan.own_ports.append(args.gateway_own_port + i)
        own = ("--own-port", str(plan.own_ports[-1]))
    batchers = plan.batcher_addresses
    keys = args.api_keys_file
    argv = python_module(
        "gateway",
        *("--host", args.host, "--port", str(args.port)),
        *("--http-port", str(args.http_port)),
        *gateway_route(
            plan.mode,
            batchers[i % len(batchers)] if batchers else "",
            plan.engine_addresses,
            plan.batching,
        ),
        *("--metrics-port", plan.metrics_port(name, metrics_offset)),
        *own,
        *("--api-keys-file", keys and os.path.abspath(keys)),
        *tls_flags(args),
        *plan.buckets,
        *plan.common,
    )
    return Child(name, argv)


def internal(listener: Listener, args: argparse.Namespace) -> Listener:
    """``listener`` on the internal host (--internal-host)."""
    return dataclasses.replace(
        listener, host=args.internal_host, host_flag="--internal-host"
    )


def dial_address(host: str, port: int) -> str:
    """The address a sibling process dials to reach a listener on ``host``:
    loopback for a wildcard (every interface includes it), brackets around
    an IPv6 address."""
    name = host.strip("[]")
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return f"{name}:{port}"  # a host name
    if ip.is_unspecified:
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def internal_tls_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """Every child's --internal-tls-* flags, serve's own ('' too, as for
    tls_flags)."""
    return (
        *path_flags(
            ("--internal-tls-cert", args.internal_tls_cert),
            ("--internal-tls-key", args.internal_tls_key),
            ("--internal-tls-ca", args.internal_tls_ca),
        ),
        *("--internal-tls-server-name", args.internal_tls_server_name),
    )


def tls_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """A gateway's --tls-* flags, serve's own ('' too: a BERTH_TLS_* set
    where serve runs must not turn TLS on behind serve's back)."""
    return path_flags(
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-client-ca", args.tls_client_ca),
    )


def path_flags(*flags: tuple[str, str]) -> tuple[str, ...]:
    """Each (flag, path) as the flag and the absolute path ('' stays '')."""
    return tuple(
        item for flag, path in flags for item in (flag, path and os.path.abspath(path))
    )


def summary(plan: Plan) -> str:
    """What serve started, for its log."""
    args = plan.args
    engines = len(plan.engine_addresses)
    where = f"GPUs {', '.join(plan.devices)}" if plan.gpus else args.device
    if plan.mode == "inline":
        batching = "batching inline in each gateway"
    else:
        batching = (
            f"{len(plan.batcher_addresses)} batcher(s) on "
            f"{', '.join(plan.batcher_addresses)}"
        )
        if plan.mode == "hybrid":
            batching += " (an idle gateway's requests straight to the engines)"
    gateways = plan.gateway
    if plan.own_ports:
        span = f"-{plan.own_ports[-1]}" if len(plan.own_ports) > 1 else ""
        gateways += f", each also alone on {args.host}:{plan.own_ports[0]}{span}"
    if args.http_port:
        gateways += f", HTTP/JSON on {args.host}:{args.http_port}"
    return (
        f"starting {engines} engine(s) on {where}, {batching}, "
        f"{plan.gateways} gateway process(es) on {gateways}"
    )
