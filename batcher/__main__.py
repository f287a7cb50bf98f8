"""``python -m batcher``: the batcher of one model group."""

from __future__ import annotations

import argparse
import asyncio

from batcher.core import IMPLEMENTATION
from batcher.engines import EnginePool
from batcher.options import add_scheduler_flags, scheduler_config
from batcher.scheduler import ModelScheduler
from batcher.service import BatcherService
from services.config import (
    DEFAULT_BATCHER_PORT,
    add_flag,
    gpu_buckets_flag,
    repository_flag,
)
from services.logs import setup_logging
from services.loop import freeze_startup_heap, run
from services.metrics import serve_metrics
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import load_repository
from services.server import ServiceServer
from services.telemetry import setup_tracing, shutdown_tracing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m batcher", description=__doc__)
    add_flag(parser, "host", "127.0.0.1", "address to listen on")
    add_flag(parser, "port", DEFAULT_BATCHER_PORT, "port to listen on")
    add_flag(parser, "engines", "127.0.0.1:50070", "comma-separated engine addresses")
    add_scheduler_flags(parser)
    add_flag(parser, "metrics-port", 9465, "Prometheus /metrics port (0: off)")
    add_flag(
        parser, "drain-timeout-s", 30.0, "on SIGTERM, how long in-flight work may take"
    )
    repository_flag(parser)
    gpu_buckets_flag(parser)
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    log = setup_logging("batcher")
    setup_tracing("batcher")
    serve_metrics("batcher", args.host, args.metrics_port)
    repository = load_repository(args.model_repository, gpu=args.gpu_buckets)
    config = scheduler_config(args)
    pool = EnginePool([a for a in args.engines.split(",") if a])
    schedulers = {
        name: ModelScheduler(entry, pool, config) for name, entry in repository.items()
    }
    server = ServiceServer(
        "batcher",
        f"{args.host}:{args.port}",
        [internal_pb2.DESCRIPTOR.services_by_name["Batcher"].full_name],
    )
    internal_pb2_grpc.add_BatcherServicer_to_server(
        BatcherService(schedulers), server.server
    )
    await server.start()
    freeze_startup_heap()
    log.info(
        "batcher core: %s; models %s; buckets %s; engines %s",
        IMPLEMENTATION,
        ", ".join(schedulers),
        {n: e.buckets for n, e in repository.items()},
        args.engines,
    )
    pool.start()
    for scheduler in schedulers.values():
        scheduler.start()

    async def became_ready() -> None:
        while not all(pool.serving(name) for name in schedulers):
            await asyncio.sleep(0.1)
        await server.set_serving(True)
        log.info("batcher SERVING: every model has an engine")

    ready = asyncio.create_task(became_ready())

    async def drain() -> None:
        ready.cancel()
        await asyncio.gather(*(s.drain() for s in schedulers.values()))

    await server.run_until_signalled(drain, grace_s=args.drain_timeout_s)
    await pool.close()
    shutdown_tracing()


if __name__ == "__main__":
    run(main(parse_args()))
