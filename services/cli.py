"""The ``berth`` command: serve, call a running gateway, build models."""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.channels import sync_channel
from services.config import (
    DEFAULT_BATCHER_PORT,
    DEFAULT_ENGINE_PORT,
    DEFAULT_GATEWAY_PORT,
    add_flag,
    repository_flag,
)
from services.idle import IDLE_CHOICES, cpu_quota

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_GATEWAY_PORT}"
T = TypeVar("T")


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


# ---- berth serve ------------------------------------------------------------


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
    GPU engines (a lone request skips the batcher hop: 0.5-1.0 ms off a
    ~2-ms p50 in two H200 leases of four, within 0.1 ms in the others; under
    load the batchers batch as before) and service on the CPU (where a batch
    takes 100s of ms, a hop does not matter, and the batchers' larger
    batches do)."""
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
    generator included, benchmarks/results/e2e_h200_bert-base_stream_10_gateways.json)
    8 gateways served 13,275 of 15,000 req/s offered (p99 582 ms; the
    busiest gateway used 4.6 CPU-s in a 4-s step), 10 served 14,854 with
    p99 20.5 ms; 12 with 3 batchers took more CPU than they freed."""
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


def set_grpc_io(children: list[Any], choice: str, environ: Mapping[str, str]) -> None:
    """GRPC_EXPERIMENTS for each child, per --grpc-io, unless the caller set
    it (then theirs applies to every child, as the environment would)."""
    if "GRPC_EXPERIMENTS" in environ:
        logging.getLogger("berth.serve").info(
            "GRPC_EXPERIMENTS=%r is set: --grpc-io %s not applied",
            environ["GRPC_EXPERIMENTS"],
            choice,
        )
        return
    for child in children:
        child.env["GRPC_EXPERIMENTS"] = GRPC_IO[choice]


# CPUs a pinned GPU engine gets: its event loop and its compute thread.
ENGINE_CPUS = 2


def pin_children(children: list[Any], gpus: int) -> None:
    """--cpu-affinity spread: each gateway and batcher on a CPU of its own
    and each GPU engine on ENGINE_CPUS, from the CPUs this process may use
    (wrapping around when there are too few). A process's threads (the
    event loop, gRPC's poller) then hand work over on one CPU instead of
    waking another; on the H200 machine's virtual CPUs a cross-CPU wake-up
    is what a low-load hop mostly costs (benchmarks/grpc_floor.py: 1,361
    unary calls/s one at a time over all 16 CPUs, 2,440 on 4). CPU engines
    stay unpinned: their torch threads need every core."""
    from services.supervisor import plan_cpus

    pinned = [c for c in children if gpus or not c.name.startswith("engine")]
    shares = [ENGINE_CPUS if c.name.startswith("engine") else 1 for c in pinned]
    cpus = sorted(os.sched_getaffinity(0))
    for child, plan in zip(pinned, plan_cpus(shares, cpus), strict=True):
        child.cpus = plan
    if sum(shares) > len(cpus):
        logging.getLogger("berth.serve").warning(
            "--cpu-affinity spread: %d CPU(s) for %d processes' shares of %d: "
            "some share a CPU",
            len(cpus),
            len(pinned),
            sum(shares),
        )


def try_hint(repo: Path, gateway: str) -> str:
    """' (try: berth embed ...)' with a model the repository serves (an
    embedding model first), or '' if it cannot be read now."""
    from services.repository import load_repository

    try:
        entries = sorted(load_repository(repo).values(), key=lambda e: e.name)
    except Exception:  # the gateway read it; a hint is not worth failing for
        return ""
    if not entries:
        return ""
    entry = next((e for e in entries if e.task == "embed"), entries[0])
    address = "" if gateway == DEFAULT_ADDRESS else f" --address {gateway}"
    return f" (try: berth {entry.task} --model {entry.name}{address} 'hello world')"


def spinners() -> list[Any]:
    """--idle-cpus spin: a SCHED_IDLE spinner pinned to each CPU this process
    may use (services/idle.py says why), started first and stopped last."""
    from services.supervisor import Child, python_module

    cpus = sorted(os.sched_getaffinity(0))
    parent = ("--parent", str(os.getpid()))
    logging.getLogger("berth.serve").info(
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


def cmd_serve(args: argparse.Namespace) -> int:
    from services.logs import setup_logging
    from services.supervisor import (
        Child,
        Listener,
        PortUnavailable,
        Supervisor,
        check_listeners,
        python_module,
        reserve_ports,
    )

    log = setup_logging("serve")
    # Every check comes before the models are built: a first build (a GPU
    # export) takes minutes, and a bad flag should not wait for it.
    for flag, value, allowed in (
        ("--batcher-mode", args.batcher_mode, BATCHER_MODES),
        ("--grpc-io", args.grpc_io, tuple(GRPC_IO)),
        ("--cpu-affinity", args.cpu_affinity, ("none", "spread")),
        ("--idle-cpus", args.idle_cpus, IDLE_CHOICES),
    ):
        if value not in allowed:
            log.error("%s must be one of %s, not %r", flag, ", ".join(allowed), value)
            return 2
    quota = cpu_quota() if args.idle_cpus == "spin" else None
    if quota is not None and quota < cpus_available():
        # A quota counts SCHED_IDLE time too: the spinners would spend it on
        # every idle CPU, and the cgroup, berth with them, would be throttled.
        log.error(
            "--idle-cpus spin: berth serve runs under a CPU quota of %.2f CPU(s) "
            "for its %d CPU(s) (its cgroup's, e.g. Kubernetes CPU limits); the "
            "spinners would spend it and berth would be throttled: use "
            "--idle-cpus sleep here, or lift the quota",
            quota,
            cpus_available(),
        )
        return 2
    for flag, count in (
        ("--engines", args.engines),
        ("--gateways", args.gateways),
        ("--batchers", args.batchers),
    ):
        if count < 0:
            log.error("%s must be 0 (the default count) or more, not %d", flag, count)
            return 2
    try:
        devices = serve_devices(args.device)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    gpus = len(devices)
    engines = args.engines or default_engines(gpus)
    repo = Path(args.model_repository)
    common = ["--model-repository", str(repo)]
    # Every port a child listens on, checked before any starts.
    listeners = [Listener("gateway", "--port", args.port)]

    def metrics_port(child: str, offset: int) -> str:
        # gateway base, batcher base+1, engines base+2...; 0 turns them off.
        if not args.metrics_port:
            return "0"
        listeners.append(
            Listener(child, "--metrics-port", args.metrics_port, offset, metrics=True)
        )
        return str(args.metrics_port + offset)

    children = []
    engine_addresses = []
    for i in range(engines):
        port = args.engine_port + i
        listeners.append(Listener(f"engine-{i}", "--engine-port", args.engine_port, i))
        engine_addresses.append(f"{args.host}:{port}")
        env = {}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = devices[i % gpus]
        elif engines > 1:
            # Share the CPU cores between engines instead of oversubscribing.
            env["BERTH_TORCH_THREADS"] = str(max(1, cpus_available() // engines))
        children.append(
            Child(
                f"engine-{i}",
                python_module(
                    "engine",
                    "--host",
                    args.host,
                    "--port",
                    str(port),
                    "--backend",
                    args.backend,
                    "--device",
                    "cuda:0" if gpus else "cpu",
                    "--metrics-port",
                    metrics_port(f"engine-{i}", 2 + i),
                    *("--chaos",) * args.chaos,
                    *common,
                ),
                env,
            )
        )
    gateways = args.gateways or default_gateways(gpus)
    mode = batcher_mode(args.batcher_mode, gpus)
    inline = mode == "inline"
    batchers = (
        0
        if inline
        else max(1, min(args.batchers or default_batchers(gateways), gateways))
    )
    # CPU batches take 100s of ms: hedge on the measured p95, not after 50
    # ms, let batches grow to what keeps a CPU busy, and wait up to 50 ms for
    # one to fill (small on that scale).
    cpu_batching = ("--hedge-p95", "--latency-target-ms", "500", "--max-delay-ms", "50")
    batching = () if gpus else cpu_batching
    # Batchers and gateways batch to the lengths GPU engines capture graphs
    # for (each model's gpu_buckets); --no-gpu-buckets as well, so that a
    # BERTH_GPU_BUCKETS set where serve runs cannot disagree with its engines.
    buckets = ("--gpu-buckets",) if gpus else ("--no-gpu-buckets",)
    # /metrics: gateway 0 on the base port, batcher 0 next, the engines, then
    # the other gateways, then the other batchers.
    batcher_metrics = [1] + [engines + gateways + i for i in range(1, batchers)]
    batcher_addresses = []
    for i in range(batchers):
        port = args.batcher_port + i
        name = "batcher" if batchers == 1 else f"batcher-{i}"
        listeners.append(Listener(name, "--batcher-port", args.batcher_port, i))
        batcher_addresses.append(f"{args.host}:{port}")
        children.append(
            Child(
                name,
                python_module(
                    "batcher",
                    "--host",
                    args.host,
                    "--port",
                    str(port),
                    "--engines",
                    ",".join(engine_addresses),
                    "--metrics-port",
                    metrics_port(name, batcher_metrics[i]),
                    *batching,
                    *buckets,
                    *common,
                ),
            )
        )
    gateway = f"{args.host}:{args.port}"
    own_ports = []
    for i in range(gateways):
        # Every gateway listens on the same port (SO_REUSEPORT: the kernel
        # spreads connections over them); each has its own stream to one
        # batcher, gateways spread evenly over the batchers.
        name = "gateway" if gateways == 1 else f"gateway-{i}"
        # --own-port 0 as well: a BERTH_OWN_PORT set where serve runs must
        # not put every gateway on one port that serve neither checked nor
        # holds.
        own = ("--own-port", "0")
        if args.gateway_own_port:
            # ...and, asked to, on a port of its own (see the flag's help).
            listeners.append(
                Listener(name, "--gateway-own-port", args.gateway_own_port, i)
            )
            own_ports.append(args.gateway_own_port + i)
            own = ("--own-port", str(own_ports[-1]))
        children.append(
            Child(
                name,
                python_module(
                    "gateway",
                    "--host",
                    args.host,
                    "--port",
                    str(args.port),
                    *gateway_route(
                        mode,
                        batcher_addresses[i % batchers] if batchers else "",
                        engine_addresses,
                        batching,
                    ),
                    "--metrics-port",
                    metrics_port(name, 0 if i == 0 else 1 + engines + i),
                    *own,
                    *buckets,
                    *common,
                ),
            )
        )
    try:
        check_listeners(listeners)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        # Held until serve exits: see services/supervisor.py on the ports.
        reservation = reserve_ports(args.host, listeners)
    except PortUnavailable as exc:
        log.error("%s; nothing was started", exc)
        return 1
    with reservation:
        if args.build_models and not any(repo.glob("*/berth.json")):
            # Only an empty repository gets the defaults: a user's own
            # entries, whatever their names, are never rewritten.
            build_models(repo)
        set_grpc_io(children, args.grpc_io, os.environ)
        for child in children:
            # Gateways share --port, and every child binds next to serve's
            # hold on its port (services/supervisor.py): SO_REUSEPORT.
            child.env["BERTH_REUSE_PORT"] = "1"
        if args.cpu_affinity == "spread":
            pin_children(children, gpus)
        if args.idle_cpus == "spin":
            children = spinners() + children
        supervisor = Supervisor(children)
        supervisor.start()
        log.info(
            "starting %d engine(s) on %s, %s, %d gateway process(es) on %s",
            engines,
            f"GPUs {', '.join(devices)}" if gpus else args.device,
            "batching inline in each gateway"
            if inline
            else f"{batchers} batcher(s) on {', '.join(batcher_addresses)}"
            + (
                " (an idle gateway's requests straight to the engines)"
                if mode == "hybrid"
                else ""
            ),
            gateways,
            gateway
            + (
                f", each also alone on {args.host}:{own_ports[0]}"
                + (f"-{own_ports[-1]}" if len(own_ports) > 1 else "")
                if own_ports
                else ""
            ),
        )
        while not supervisor.stopping:
            if not supervisor.served and _health(gateway, timeout=1.0) == "SERVING":
                hint = try_hint(repo, gateway)
                print(f"berth is serving on {gateway}{hint}", flush=True)
                supervisor.served = True
            failure = supervisor.check()
            if failure is not None:
                log.error("%s", failure)
                return supervisor.stop() or 1
            time.sleep(0.2 if supervisor.served else 0.5)
        return supervisor.stop()


# ---- client commands --------------------------------------------------------


def _stub(address: str) -> Any:
    from services.proto.berth.v1 import berth_pb2_grpc

    return berth_pb2_grpc.BerthStub(sync_channel(address))


def _options(args: argparse.Namespace) -> Any:
    from services.proto.berth.v1 import berth_pb2

    options = berth_pb2.Options(truncate=args.truncate)
    if args.normalize is not None:
        options.normalize = args.normalize
    return options


# Texts per call when they come from stdin: the gateway's default --max-texts
# (`berth embed --per-call N` for a gateway that takes fewer).
STDIN_CHUNK = 256


def _positive(raw: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of 1 or more")
    return value


def _texts(args: argparse.Namespace) -> list[tuple[list[str], list[int]]]:
    """The command's texts, in calls, each with the stdin line of each text:
    the arguments in one call (no lines), or with the one argument ``-``,
    stdin's lines (blank ones skipped) in calls of ``args.per_call``.

    Stdin is read as UTF-8 whatever the locale (a gRPC string is UTF-8), a
    leading byte-order mark dropped: a file saved with one would otherwise
    send U+FEFF as the first text's first character, and a file in another
    encoding would end in a traceback."""
    if args.texts != ["-"]:
        return [(args.texts, [])]
    data = sys.stdin.buffer.read()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SystemExit(
            f"berth: stdin is not UTF-8 text: line {line} has the byte "
            f"0x{data[exc.start]:02x} (convert it, e.g. iconv -t UTF-8)"
        ) from None
    numbered = [
        (n, line.rstrip("\r")) for n, line in enumerate(text.split("\n"), start=1)
    ]
    kept = [(n, line) for n, line in numbered if line.strip()]
    if not kept:
        raise SystemExit("berth: no texts on stdin (one text per line)")
    return [
        (
            [line for _, line in kept[i : i + args.per_call]],
            [n for n, _ in kept[i : i + args.per_call]],
        )
        for i in range(0, len(kept), args.per_call)
    ]


def _call(
    method: Callable[..., T], request: Any, lines: list[int], timeout: float
) -> T:
    """method(request), one call of the command's texts. When they came from
    stdin, an error names the stdin line it is about: the gateway's texts[i]
    counts from the call's first text, which is stdin's line 1 only in the
    first call (and blank lines are skipped)."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        if not lines:
            raise
        details = exc.details() or ""
        named = re.sub(
            r"texts\[(\d+)\]",
            lambda m: (
                f"stdin line {lines[int(m[1])]}" if int(m[1]) < len(lines) else m[0]
            ),
            details,
        )
        if named == details:
            named += f" (the call of stdin lines {lines[0]}-{lines[-1]})"
        raise SystemExit(f"error: {exc.code().name}: {named}") from None


def cmd_embed(args: argparse.Namespace) -> int:
    from services.proto.berth.v1 import berth_pb2

    stub = _stub(args.address)
    out: list[dict[str, Any]] = []
    degraded = False
    for texts, lines in _texts(args):
        request = berth_pb2.EmbedRequest(
            model=args.model, texts=texts, options=_options(args)
        )
        response = _call(stub.Embed, request, lines, args.timeout)
        degraded |= response.degraded
        out += [
            {"embedding": list(e.values), "tokens": e.tokens}
            for e in response.embeddings
        ]
    _print(out, degraded=degraded)
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    from services.proto.berth.v1 import berth_pb2

    stub = _stub(args.address)
    out = []
    degraded = False
    for texts, lines in _texts(args):
        request = berth_pb2.ClassifyRequest(
            model=args.model, texts=texts, options=_options(args), top_k=args.top_k
        )
        response = _call(stub.Classify, request, lines, args.timeout)
        degraded |= response.degraded
        for result in response.results:
            item: dict[str, Any] = {
                "label": result.labels[0].label,
                "score": result.labels[0].score,
            }
            if args.top_k > 1:
                item["top"] = [
                    {"label": s.label, "score": s.score} for s in result.labels
                ]
            out.append(item)
    _print(out, degraded=degraded)
    return 0


def _print(out: list[dict[str, Any]], degraded: bool) -> None:
    if degraded:
        print("warning: answered by the degraded CPU fallback", file=sys.stderr)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


def cmd_models(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from services.proto.berth.v1 import berth_pb2

    response = _stub(args.address).ModelInfo(
        berth_pb2.ModelInfoRequest(), timeout=args.timeout
    )
    print(json.dumps(MessageToDict(response)["models"], indent=2))
    return 0


def _health(address: str, service: str = "", timeout: float = 5.0) -> str:
    stub = health_pb2_grpc.HealthStub(sync_channel(address))
    try:
        response = stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # the server answered
            return f"SERVICE_UNKNOWN (no service {service!r}; '' is the whole server)"
        return f"UNREACHABLE ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def cmd_health(args: argparse.Namespace) -> int:
    status = _health(args.address, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


def build_models(root: Path, force: bool = False) -> list[Path]:
    """The default models, then every model's CPU fallback (level 3)."""
    from engine.build.fallback import build_fallbacks
    from services.default_models import build_default_repository

    built = build_default_repository(root, force=force)
    return built + build_fallbacks(root, force=force)


def cmd_build_models(args: argparse.Namespace) -> int:
    from services.default_models import DefaultModelsError
    from services.repository import RepositoryError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        built = build_models(Path(args.model_repository), force=args.force)
    except (RepositoryError, DefaultModelsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in built:
        print(path)
    return 0


# ---- argument parsing -------------------------------------------------------


def _client_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "address", DEFAULT_ADDRESS, "gateway address")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="berth", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start gateway, batcher and engines")
    serve.add_argument(
        "--engines",
        type=int,
        default=0,
        help="engine workers (default: one per GPU, else one per core, at most 4)",
    )
    add_flag(serve, "host", "127.0.0.1", "address every service listens on")
    add_flag(serve, "port", DEFAULT_GATEWAY_PORT, "gateway port")
    add_flag(
        serve,
        "gateways",
        0,
        "gateway processes sharing --port (0: 1 without a GPU, else 5 per 8 "
        "cores, at most 12)",
    )
    add_flag(
        serve,
        "batchers",
        0,
        "batcher processes (ports from --batcher-port on); each gateway "
        "streams to one, every batcher to every engine (0: 1 per 4 gateways)",
    )
    add_flag(
        serve,
        "batcher-mode",
        "auto",
        "auto: hybrid with GPU engines, else service; "
        "service: batcher processes between the gateways and the engines; "
        "inline: each gateway batches its own requests and streams to the "
        "engines (one hop fewer; --batchers is then unused); hybrid: through "
        "the batchers, except a request that finds its gateway idle, which "
        "goes straight to the engines (inline's latency at low load, the "
        "batchers' batches under load)",
    )
    add_flag(serve, "batcher-port", DEFAULT_BATCHER_PORT, "first batcher port")
    add_flag(serve, "engine-port", DEFAULT_ENGINE_PORT, "first engine port")
    add_flag(serve, "backend", "torch", "engine backend")
    add_flag(
        serve,
        "device",
        "auto",
        "auto or cuda: an engine per GPU or MIG instance (auto: else cpu); "
        "cuda:N: the N-th only",
    )
    add_flag(serve, "build-models", True, "build the default models if missing")
    add_flag(
        serve,
        "metrics-port",
        9464,
        "gateway's /metrics port; batcher +1, engines +2..., then further "
        "gateways, then further batchers (0: off)",
    )
    add_flag(
        serve,
        "grpc-io",
        "poller",
        "poller: gRPC's own poller thread does each process's socket I/O; "
        "event-engine: gRPC's default EventEngine threads do (GRPC_EXPERIMENTS, "
        "when set, wins)",
    )
    add_flag(
        serve,
        "cpu-affinity",
        "none",
        "none: processes run on any CPU; spread: each gateway and batcher on "
        "a CPU of its own, each GPU engine on two",
    )
    add_flag(
        serve,
        "gateway-own-port",
        0,
        "gateway i also listens alone on this port + i (0: no own ports), "
        "for callers that spread their connections over the gateways "
        "themselves (gRPC's round_robin over the addresses, a layer-4 "
        "balancer): on the shared --port the kernel picks a gateway for each "
        "connection by a hash, and a few busy connections can land on one",
    )
    add_flag(
        serve,
        "idle-cpus",
        "sleep",
        "sleep: idle CPUs halt, as usual; spin: a SCHED_IDLE spinner per CPU "
        "keeps them running, so a request's many wake-ups are cheap (lower "
        "latency at low load; costs power; refused under a CPU quota)",
    )
    serve.add_argument(
        "--chaos", action="store_true", help="engines take SIGUSR1 to fail batches"
    )
    repository_flag(serve)
    serve.set_defaults(func=cmd_serve)

    for name, func, default_model in (
        ("embed", cmd_embed, "minilm"),
        ("classify", cmd_classify, "intent"),
    ):
        p = sub.add_parser(name, help=f"{name} texts through a running gateway")
        p.add_argument(
            "texts",
            nargs="+",
            metavar="TEXT",
            help="texts; a lone - reads one text per line from stdin (UTF-8, "
            "blank lines skipped)",
        )
        p.add_argument("--model", default=default_model)
        p.add_argument(
            "--per-call",
            type=_positive,
            default=STDIN_CHUNK,
            help="texts per call when they come from stdin (the gateway's "
            "--max-texts, default %(default)s)",
        )
        p.add_argument(
            "--truncate", action="store_true", help="cut texts over the limit"
        )
        p.add_argument(
            "--normalize", action=argparse.BooleanOptionalAction, default=None
        )
        if name == "classify":
            p.add_argument("--top-k", type=int, default=1)
        _client_flags(p)
        p.set_defaults(func=func)

    models = sub.add_parser("models", help="list the models a gateway serves")
    _client_flags(models)
    models.set_defaults(func=cmd_models)

    health = sub.add_parser("health", help="grpc.health.v1 status of a service")
    health.add_argument("--service", default="", help="service name ('' = overall)")
    _client_flags(health)
    health.set_defaults(func=cmd_health)

    build = sub.add_parser("build-models", help="build the default model repository")
    build.add_argument("--force", action="store_true")
    repository_flag(build)
    build.set_defaults(func=cmd_build_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
