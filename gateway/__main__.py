"""``python -m gateway``: the public gRPC front door."""

from __future__ import annotations

import argparse
import asyncio
import logging

from gateway.batcher_client import BatcherClient
from gateway.service import BerthService, Gateway
from gateway.tokenize import Limits
from services.config import (
    DEFAULT_BATCHER_PORT,
    DEFAULT_GATEWAY_PORT,
    add_flag,
    repository_flag,
)
from services.errors import BerthError
from services.logs import setup_logging
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import load_repository
from services.server import ServiceServer

log = logging.getLogger("berth.gateway")

PROBE_TEXT = "berth readiness probe"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_flag(parser, "host", "127.0.0.1", "address to listen on")
    add_flag(parser, "port", DEFAULT_GATEWAY_PORT, "port to listen on")
    add_flag(parser, "batcher", f"127.0.0.1:{DEFAULT_BATCHER_PORT}", "batcher address")
    add_flag(parser, "max-texts", 256, "most texts in one call")
    add_flag(parser, "max-in-flight", 1024, "requests in flight before shedding")
    add_flag(
        parser, "drain-timeout-s", 30.0, "on SIGTERM, how long in-flight work may take"
    )
    repository_flag(parser)
    return parser.parse_args(argv)


async def probe(gateway: Gateway) -> None:
    """One real request per model through the whole path; raises on failure."""
    for name, model in gateway.models.items():
        if model.entry.task == "embed":
            await gateway.embed(
                berth_pb2.EmbedRequest(model=name, texts=[PROBE_TEXT]), timeout_s=30
            )
        else:
            await gateway.classify(
                berth_pb2.ClassifyRequest(model=name, texts=[PROBE_TEXT]), timeout_s=30
            )


async def watch_health(server: ServiceServer, gateway: Gateway) -> None:
    """SERVING once every model answered; then follow the batcher's state."""
    last = ""
    while True:
        try:
            await gateway.batcher.ready.wait()
            await probe(gateway)
            break
        except BerthError as exc:
            if str(exc) != last:
                log.info("waiting for models to answer: %s", exc)
                last = str(exc)
            await asyncio.sleep(0.2)
    await server.set_serving(True)
    log.info("gateway SERVING on %s: every model answers", server.address)
    serving = True
    while True:
        await asyncio.sleep(1.0)
        try:
            models = await gateway.batcher.models()
            ok = all(m.healthy_engines > 0 for m in models.models)
        except Exception:  # any failure to ask means not ready
            ok = False
        if ok != serving:
            serving = ok
            await server.set_serving(ok)
            log.warning("gateway health now %s", "SERVING" if ok else "NOT_SERVING")


async def main(args: argparse.Namespace) -> None:
    setup_logging("gateway")
    repository = load_repository(args.model_repository)
    batcher = BatcherClient(args.batcher)
    gateway = Gateway(
        repository,
        batcher,
        Limits(max_texts=args.max_texts),
        max_in_flight=args.max_in_flight,
    )
    server = ServiceServer(
        "gateway",
        f"{args.host}:{args.port}",
        [berth_pb2.DESCRIPTOR.services_by_name["Berth"].full_name],
    )
    berth_pb2_grpc.add_BerthServicer_to_server(BerthService(gateway), server.server)
    await server.start()
    log.info(
        "gateway models: %s; batcher %s",
        ", ".join(
            f"{n} ({e.task}, max {e.max_tokens} tokens)" for n, e in repository.items()
        ),
        args.batcher,
    )
    batcher.start()
    health = asyncio.create_task(watch_health(server, gateway))

    async def drain() -> None:
        health.cancel()

    await server.run_until_signalled(drain, grace_s=args.drain_timeout_s)
    await batcher.close()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
