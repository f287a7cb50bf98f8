"""What `berth serve` runs where: the devices its engines own, how many
engines, gateways and batchers, the batcher mode, the CPUs each process is
pinned to and how gRPC does its socket I/O."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping

from services.cli.supervisor import Child, plan_cpus, python_module

log = logging.getLogger("berth.serve")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def parse_gpu_list(listing: str) -> list[str]:
    """The devices an engine each can own, from ``nvidia-smi -L``: a GPU's
    UUID, or, for a GPU split into MIG instances, each instance's UUID."""
    devices: list[str] = []
    gpu: str | None = None  # the last GPU line's UUID, until its MIGs show
    for line in listing.splitlines():
        found = re.search(r"\(UUID: ((?:GPU|MIG)-[^)\s]+)\)", line)
        if found is None:
            continue
        uuid = found.group(1)
        if uuid.startswith("GPU-"):
            if gpu is not None:
                devices.append(gpu)
            gpu = uuid
        else:  # a MIG instance of the GPU above: it replaces the whole GPU
            devices.append(uuid)
            gpu = None
    if gpu is not None:
        devices.append(gpu)
    return devices


def engine_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES for each engine, one GPU or MIG instance each.

    The caller's CUDA_VISIBLE_DEVICES, when set, is split among the engines
    (so "2,3" serves GPUs 2 and 3, not 0 and 1); else every GPU or MIG
    instance ``nvidia-smi -L`` lists, by UUID (CUDA shows a process only one
    MIG instance, so each engine is given its own); else CUDA's own count."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [d.strip() for d in configured.split(",") if d.strip() not in ("", "-1")]
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    return parse_gpu_list(listing) or [str(i) for i in range(_gpu_count())]


def serve_devices(device: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of serve's engines, per --device: none
    for cpu, every GPU or MIG instance for auto or cuda (engine_devices), the
    N-th of them for cuda:N. Raises ValueError naming what exists."""
    if device == "cpu":
        return []
    devices = engine_devices()
    if device == "auto" or (device == "cuda" and devices):
        return devices
    kind, _, index = device.partition(":")
    if device == "cuda":
        index = "0"  # no GPU: the error below says so
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}")
    if int(index) >= len(devices):
        raise ValueError(
            f"--device {device}: this machine shows {len(devices)} GPU(s) or MIG "
            f"instance(s){': ' + ', '.join(devices) if devices else ''}"
        )
    return [devices[int(index)]]


def cpus_available() -> int:
    """CPUs this process may run on: a cpuset's, not the host's count."""
    return len(os.sched_getaffinity(0)) or 1


def default_engines(gpus: int) -> int:
    """One engine per GPU. On a CPU-only machine one per core, up to 4, each
    on its share of the cores: on 2 cores two 1-thread engines serve as much
    as one 2-thread engine (193.5 vs 194.3 texts/s, benchmarks/e2e.py), and
    a slow or failed batch then has a second engine to be hedged or re-sent
    to."""
    if gpus:
        return gpus
    return max(1, min(4, cpus_available()))


BATCHER_MODES = ("auto", "service", "inline", "hybrid")


def batcher_mode(asked: str, gpus: int) -> str:
    """The batcher mode serve runs: ``asked``, where auto means hybrid with
    GPU engines (a lone request skips the batcher hop: on an H200 from 0.1 ms
    slower to 1.0 ms faster than through the batchers, docs/performance.md
    "Serving topology"; under load the batchers still batch) and service on
    the CPU (where a batch takes 100s of ms, a hop does not matter, and the
    batchers' larger batches do)."""
    if asked != "auto":
        return asked
    return "hybrid" if gpus else "service"


def gateway_route(
    mode: str, batcher: str, engines: list[str], batching: tuple[str, ...]
) -> tuple[str, ...]:
    """A gateway's flags for how its requests reach the engines.

    service: through ``batcher``; inline: batched in the gateway and
    streamed to ``engines`` (``batching``: the scheduler flags); hybrid:
    through the batcher, but straight to the engines when the gateway is
    idle. Every flag is given in every mode (``--engines ""``,
    ``--no-direct-when-idle``): a BERTH_ENGINES or BERTH_DIRECT_WHEN_IDLE
    set where serve runs must not change a gateway's route.
    """
    if mode == "inline":
        return ("--engines", ",".join(engines), "--no-direct-when-idle", *batching)
    if mode == "hybrid":
        return (
            *("--batcher", batcher, "--engines", ",".join(engines)),
            *("--direct-when-idle", *batching),
        )
    return ("--batcher", batcher, "--engines", "", "--no-direct-when-idle")


def default_gateways(gpus: int) -> int:
    """Gateway processes: 1 on a CPU-only machine, where the engines need
    the cores; with GPUs, 5 per 8 cores (at most 12). The gateways are the
    stack's CPU-bound stage, each one event loop at ~0.5 ms of CPU per
    single-text request on the H200 machine's Xeon, so one runs out of loop
    well before the machine runs out of cores. There (16 CPUs, load
    generator included) 8 gateways serve 13,275 of 15,000 req/s offered
    (p99 582 ms), 10 serve 14,854 with p99 20.5 ms, and 12 with 3 batchers
    take more CPU than they free (docs/performance.md, "Serving topology")."""
    if not gpus:
        return 1
    return max(1, min(12, cpus_available() * 5 // 8))


def default_batchers(gateways: int) -> int:
    """One batcher process per 4 gateways: one batcher's event loop is
    saturated near 6,000 sequences/s on the H200 machine's Xeon."""
    return max(1, gateways // 4)


# GRPC_EXPERIMENTS for each --grpc-io: "poller" turns gRPC's EventEngine
# client and listener off, so the thread that waits for completions (grpc.aio's
# poller) does the socket I/O itself instead of being handed each event by an
# EventEngine thread: one cross-thread wake-up fewer per message.
GRPC_IO = {"poller": "-event_engine_client,-event_engine_listener", "event-engine": ""}


def set_grpc_io(children: list[Child], choice: str, environ: Mapping[str, str]) -> None:
    """GRPC_EXPERIMENTS for each child, per --grpc-io, unless the caller set
    it (then theirs applies to every child, as the environment would)."""
    if "GRPC_EXPERIMENTS" in environ:
        log.info(
            "GRPC_EXPERIMENTS=%r is set: --grpc-io %s not applied",
            environ["GRPC_EXPERIMENTS"],
            choice,
        )
        return
    for child in children:
        child.env["GRPC_EXPERIMENTS"] = GRPC_IO[choice]


# CPUs a pinned GPU engine gets: its event loop and its compute thread.
ENGINE_CPUS = 2


def pin_children(children: list[Child], gpus: int) -> None:
    """--cpu-affinity spread: each gateway and batcher on a CPU of its own
    and each GPU engine on ENGINE_CPUS, from the CPUs this process may use
    (wrapping around when there are too few). A process's threads (the
    event loop, gRPC's poller) then hand work over on one CPU instead of
    waking another; on the H200 machine's virtual CPUs a cross-CPU wake-up
    is what a low-load hop mostly costs (benchmarks/grpc_floor.py: 1,361
    unary calls/s one at a time over all 16 CPUs, 2,440 on 4). CPU engines
    stay unpinned: their torch threads need every core."""
    pinned = [c for c in children if gpus or not c.name.startswith("engine")]
    shares = [ENGINE_CPUS if c.name.startswith("engine") else 1 for c in pinned]
    cpus = sorted(os.sched_getaffinity(0))
    for child, plan in zip(pinned, plan_cpus(shares, cpus), strict=True):
        child.cpus = plan
    if sum(shares) > len(cpus):
        log.warning(
            "--cpu-affinity spread: %d CPU(s) for %d processes' shares of %d: "
            "some share a CPU",
            len(cpus),
            len(pinned),
            sum(shares),
        )


def spinners() -> list[Child]:
    """--idle-cpus spin: a SCHED_IDLE spinner pinned to each CPU this process
    may use (services/idle.py says why), started first and stopped last."""
    cpus = sorted(os.sched_getaffinity(0))
    parent = ("--parent", str(os.getpid()))
    log.info(
        "--idle-cpus spin: a SCHED_IDLE spinner on each of %d CPU(s) (%s), so "
        "that idle CPUs run instead of halting and a wake-up finds them awake; "
        "every CPU will show as busy",
        len(cpus),
        ",".join(map(str, cpus)),
    )
    return [
        Child(f"idle-{cpu}", python_module("services.idle", *parent), cpus=[cpu])
        for cpu in cpus
    ]
