"""``python -m batcher``: the batcher of one model group."""

from __future__ import annotations

import argparse
import asyncio

from batcher.core import IMPLEMENTATION
from batcher.local import LocalBatcher
from batcher.options import add_scheduler_flags, scheduler_config
from batcher.service import BatcherService
from services import internal_tls
from services.config import DEFAULT_BATCHER_PORT, add_flag, gpu_buckets_flag
from services.loop import freeze_startup_heap, run
from services.process import service_parser, start_service
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import load_repository
from services.server import ServiceServer
from services.telemetry import shutdown_tracing


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "batcher", __doc__, port=DEFAULT_BATCHER_PORT, metrics_port=9465
    )
    add_flag(
        parser,
        "engines",
        "127.0.0.1:50070",
        "comma-separated engine addresses; dns:///NAME:PORT follows every "
        "address NAME resolves to",
    )
    add_scheduler_flags(parser)
    gpu_buckets_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    log = start_service("batcher", args)
    repository = load_repository(args.model_repository, gpu=args.gpu_buckets)
    engines = [a for a in args.engines.split(",") if a]
    batcher = LocalBatcher.connect(repository, engines, scheduler_config(args))
    server = ServiceServer(
        "batcher",
        f"{args.host}:{args.port}",
        [internal_pb2.DESCRIPTOR.services_by_name["Batcher"].full_name],
        credentials=internal_tls.server_credentials(),
    )
    internal_pb2_grpc.add_BatcherServicer_to_server(
        BatcherService(batcher), server.server
    )
    await server.start()
    freeze_startup_heap()
    log.info(
        "batcher core: %s; models %s; buckets %s; engines %s",
        IMPLEMENTATION,
        ", ".join(batcher.models),
        {n: e.buckets for n, e in repository.items()},
        args.engines,
    )
    batcher.start()

    async def became_ready() -> None:
        while not batcher.serves_all():
            await asyncio.sleep(0.1)
        await server.set_serving(True)
        log.info("batcher SERVING: every model has an engine")

    ready = asyncio.create_task(became_ready())

    async def drain() -> None:
        ready.cancel()
        await batcher.drain()

    await server.run_until_signalled(drain, grace_s=args.drain_timeout_s)
    await batcher.close()
    shutdown_tracing()


if __name__ == "__main__":
    run(main(parse_args()))
