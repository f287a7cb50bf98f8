"""``python -m engine``: one engine worker process (one per GPU)."""

from __future__ import annotations

import argparse
import asyncio
import signal

from engine import settings as engine_settings
from engine.backend import Backend
from engine.backends_by_model import ModelRouter, create_model_router
from engine.cuda.graphs import bucket_shapes
from engine.service import EngineService
from services import internal_tls
from services.config import DEFAULT_ENGINE_PORT, add_flag
from services.loop import freeze_startup_heap, run
from services.process import service_parser, start_service
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry, RepositoryError, load_repository
from services.server import ServiceServer
from services.telemetry import shutdown_tracing


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "engine", __doc__, port=DEFAULT_ENGINE_PORT, metrics_port=9466
    )
    add_flag(parser, "backend", "torch", "inference backend")
    add_flag(parser, "device", "auto", "cpu, cuda, cuda:N or auto")
    add_flag(parser, "models", "", "comma-separated models to serve (default: all)")
    # The batcher's limits (same flags and defaults): they bound the batch
    # shapes that can arrive, so the engine captures a CUDA graph for each.
    add_flag(parser, "max-batch", 256, "the batcher's max rows per batch")
    add_flag(parser, "token-budget", 16384, "the batcher's max padded tokens per batch")
    add_flag(parser, "chaos", False, "fault injection: SIGUSR1 toggles failing batches")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    log = start_service("engine", args)
    log.info("engine settings: %s", engine_settings.current().describe())
    repository = load_repository(args.model_repository)
    wanted = [m for m in args.models.split(",") if m] or list(repository)
    unknown = [m for m in wanted if m not in repository]
    if unknown:
        raise RepositoryError(
            f"--models names {', '.join(map(repr, unknown))}, not in the model "
            f"repository {args.model_repository} (it has {', '.join(repository)}); "
            "fix --models or --model-repository"
        )
    models = {name: repository[name] for name in wanted}
    server = ServiceServer(
        "engine",
        f"{args.host}:{args.port}",
        [internal_pb2.DESCRIPTOR.services_by_name["Engine"].full_name],
        credentials=internal_tls.server_credentials(),
    )
    # Each model's repository entry picks its backend; --backend is the
    # fallback for one that cannot start here.
    router = create_model_router(models, args.backend, args.device)
    models = as_served(models, router)
    chosen = set(router.chosen.values())
    # One backend for every model (the usual case): use it directly, so its
    # fast paths (the CUDA backend's pipelined submit/collect) stay visible.
    backend: Backend = router.backends[chosen.pop()] if len(chosen) == 1 else router
    service = EngineService(backend, models, args.max_batch, args.token_budget)
    internal_pb2_grpc.add_EngineServicer_to_server(service, server.server)
    await server.start()
    if args.chaos:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGUSR1, service.toggle_failing
        )
        log.warning("chaos hooks on: SIGUSR1 toggles failing every batch")
    for name, entry in models.items():
        own = router.backend_for(name)  # this model's, when models differ
        log.info(
            "loading %s (%s) from %s on %s with %s",
            name,
            entry.task,
            entry.checkpoint_dir,
            own.device,
            own.name,
        )
        await asyncio.to_thread(backend.load, entry)
        shapes = warmup_shapes(own.device, entry, args.max_batch, args.token_budget)
        await asyncio.to_thread(backend.warmup, name, shapes)
    freeze_startup_heap()  # (the models and their warm-up included)
    service.ready = True
    await server.set_serving(True)
    log.info("engine SERVING %s on %s", ", ".join(models), server.address)
    await server.run_until_signalled(grace_s=args.drain_timeout_s)
    shutdown_tracing()


def as_served(
    models: dict[str, ModelEntry], router: ModelRouter
) -> dict[str, ModelEntry]:
    """Each model as this engine serves it: one its backend runs on a GPU in
    its gpu_buckets (the lengths it captures graphs for, and what batchers
    started with --gpu-buckets send), one on the CPU in its buckets."""
    return {
        name: entry if router.backend_for(name).device == "cpu" else entry.for_gpu()
        for name, entry in models.items()
    }


def warmup_shapes(
    device: str, entry: ModelEntry, max_batch: int, token_budget: int
) -> list[tuple[int, int]]:
    """What a model is warmed up with before SERVING, by its own backend's
    device (in an engine serving one model on the CPU and another on a GPU,
    each gets its own): on a GPU every shape the batcher may send (a CUDA
    graph each); on the CPU one small batch per length (eager)."""
    if device == "cpu":
        return [(1, length) for length in entry.buckets]
    return bucket_shapes(entry.buckets, max_batch, token_budget)


if __name__ == "__main__":
    arguments = parse_args()
    try:
        engine_settings.load()  # every BERTH_* setting, read once
    except engine_settings.SettingsError as exc:
        raise SystemExit(f"python -m engine: {exc}") from None
    run(main(arguments))
