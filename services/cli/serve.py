"""`berth serve`: check the flags, plan the processes, hold their ports,
build the default models where there are none, then start and supervise
the processes until a signal stops them."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from services.cli.checkpoints import generated_names, plan_models, write_repository
from services.cli.client import DEFAULT_ADDRESS, health_status
from services.cli.default_models import build_models
from services.cli.plan import Plan, plan_stack, summary
from services.cli.ports import PortUnavailable, check_listeners, reserve_ports
from services.cli.supervisor import Child, Supervisor
from services.cli.topology import (
    BATCHER_MODES,
    GRPC_IO,
    cpus_available,
    pin_children,
    serve_devices,
    set_grpc_io,
    spinners,
)
from services.idle import IDLE_CHOICES, cpu_quota
from services.internal_tls import internal_tls_problem
from services.logs import setup_logging
from services.tls import tls_flags_problem

log = logging.getLogger("berth.serve")


def cmd_serve(args: argparse.Namespace) -> int:
    setup_logging("serve")
    # Every check comes before the models are built: a first build (a GPU
    # export) takes minutes, and a bad flag should not wait for it.
    try:
        check_flags(args)
        if args.model:
            args.model_repository = str(checkpoint_repository(args))
        plan = plan_stack(args, serve_devices(args.device))
        check_listeners(plan.listeners)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        # Held until serve exits: see services/cli/ports.py.
        reservation = reserve_ports(args.host, plan.listeners)
    except PortUnavailable as exc:
        log.error("%s; nothing was started", exc)
        return 1
    with reservation:
        try:
            return supervise(launch(plan), plan)
        finally:
            if plan.ready_files:
                shutil.rmtree(plan.ready_files[0].parent, ignore_errors=True)


def check_flags(args: argparse.Namespace) -> None:
    """Raises ValueError for a flag serve cannot run with."""
    for flag, value, allowed in (
        ("--batcher-mode", args.batcher_mode, BATCHER_MODES),
        ("--grpc-io", args.grpc_io, tuple(GRPC_IO)),
        ("--cpu-affinity", args.cpu_affinity, ("none", "spread")),
        ("--idle-cpus", args.idle_cpus, IDLE_CHOICES),
    ):
        if value not in allowed:
            raise ValueError(
                f"{flag} must be one of {', '.join(allowed)}, not {value!r}"
            )
    quota = cpu_quota() if args.idle_cpus == "spin" else None
    if quota is not None and quota < cpus_available():
        # A quota counts SCHED_IDLE time too: the spinners would spend it on
        # every idle CPU, and the cgroup, berth with them, would be throttled.
        raise ValueError(
            f"--idle-cpus spin: berth serve runs under a CPU quota of {quota:.2f} "
            f"CPU(s) for its {cpus_available()} CPU(s) (its cgroup's, e.g. "
            "Kubernetes CPU limits); the spinners would spend it and berth would "
            "be throttled: use --idle-cpus sleep here, or lift the quota"
        )
    if problem := tls_flags_problem(args) or internal_tls_problem(args):
        raise ValueError(problem)
    for flag, count in (
        ("--engines", args.engines),
        ("--gateways", args.gateways),
        ("--batchers", args.batchers),
    ):
        if count < 0:
            raise ValueError(
                f"{flag} must be 0 (the default count) or more, not {count}"
            )


def checkpoint_repository(args: argparse.Namespace) -> Path:
    """The generated repository of the --model checkpoints and the
    --model-repository's entries (services/cli/checkpoints.py)."""
    from engine.settings import current

    models = plan_models(args.model)
    root = write_repository(models, Path(args.model_repository), current().cache_dir)
    for model in models:
        log.info(
            "--model %s: %s, served as %r", model.directory, model.task, model.name
        )
    return root


def launch(plan: Plan) -> Supervisor:
    """Builds the default models into an empty repository, then starts the
    planned children (and the --idle-cpus spinners before them)."""
    args = plan.args
    repo = Path(args.model_repository)
    if args.build_models and args.model:
        # The fallbacks of the --model checkpoints, as build-models builds
        # them (cached beside their generated entries).
        from engine.build.fallback import build_fallbacks

        build_fallbacks(repo, names=generated_names(repo))
    elif args.build_models and not any(repo.glob("*/berth.json")):
        # Only an empty repository gets the defaults: a user's own entries,
        # whatever their names, are never rewritten.
        build_models(repo)
    children = plan.children
    set_grpc_io(children, args.grpc_io, os.environ)
    for child in children:
        # Gateways share --port, and every child binds next to serve's hold
        # on its port (services/cli/ports.py): SO_REUSEPORT.
        child.env["BERTH_REUSE_PORT"] = "1"
    if args.tls_cert:
        plan.ready_files = ready_files(children)
    if args.cpu_affinity == "spread":
        pin_children(children, plan.gpus)
    if args.idle_cpus == "spin":
        children = spinners() + children
    supervisor = Supervisor(children)
    supervisor.start()
    log.info("%s", summary(plan))
    return supervisor


def supervise(supervisor: Supervisor, plan: Plan) -> int:
    """Says once when berth serves, restarts children that die, and stops
    them all on a signal or when one cannot start; returns the exit code."""
    gateway = plan.gateway
    while not supervisor.stopping:
        if not supervisor.served and gateway_serving(plan):
            hint = try_hint(Path(plan.args.model_repository), gateway)
            if plan.args.http_port:
                hint = f", HTTP/JSON on {plan.args.host}:{plan.args.http_port}{hint}"
            print(f"berth is serving on {gateway}{hint}", flush=True)
            supervisor.served = True
        failure = supervisor.check()
        if failure is not None:
            log.error("%s", failure)
            return supervisor.stop() or 1
        time.sleep(0.2 if supervisor.served else 0.5)
    return supervisor.stop()


def ready_files(children: list[Child]) -> list[Path]:
    """With TLS, serve cannot call its gateways' health (it has no client
    certificate they would take, nor their CA): each gateway marks its own
    readiness in a file instead (services/server.py mark_ready)."""
    folder = Path(tempfile.mkdtemp(prefix="berth-serve-ready-"))
    files = []
    for child in children:
        if child.name.startswith("gateway"):
            child.env["BERTH_READY_FILE"] = str(folder / child.name)
            files.append(folder / child.name)
    return files


def gateway_serving(plan: Plan) -> bool:
    """Whether a gateway serves: its health answers SERVING, or with TLS its
    ready file exists."""
    if plan.ready_files:
        return any(path.exists() for path in plan.ready_files)
    return health_status(plan.gateway, timeout=1.0) == "SERVING"


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
