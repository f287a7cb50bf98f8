"""``python -m gateway``: the public gRPC front door."""

from __future__ import annotations

import argparse
import asyncio
import logging

from batcher import add_scheduler_flags, scheduler_config
from gateway.auth import add_keys_flag, keys_of, start_keys
from gateway.batcher_client import BatcherClient, Batching
from gateway.berth import Berth
from gateway.cache import ResponseCache
from gateway.calls import STREAM_WINDOW
from gateway.http import add_http_flag, http_flags_problem, start_http
from gateway.inline import DirectWhenIdle, InlineBatcher
from gateway.intake import Intake, add_service
from gateway.kserve import SERVICE_NAME as KSERVE_SERVICE
from gateway.kserve import KServeService
from gateway.pipeline import Gateway
from gateway.service import STREAM_CAPTURES, BerthService
from gateway.tokenize import Limits
from services.config import (
    DEFAULT_BATCHER_PORT,
    DEFAULT_GATEWAY_PORT,
    add_flag,
    gpu_buckets_flag,
)
from services.errors import BerthError, Unavailable
from services.loop import freeze_startup_heap, run
from services.process import service_parser, start_service
from services.proto.berth.v1 import berth_pb2
from services.repository import load_repository
from services.server import LAME_DUCK_S, ServiceServer
from services.telemetry import set_server, shutdown_tracing
from services.tls import add_tls_flags, server_credentials, tls_flags_problem

log = logging.getLogger("berth.gateway")

PROBE_TEXT = "berth readiness probe"


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "gateway", __doc__, port=DEFAULT_GATEWAY_PORT, metrics_port=9464
    )
    add_flag(
        parser,
        "own-port",
        0,
        "a second port this gateway alone listens on, beside --port that "
        "gateways share (0: none): callers that spread their connections "
        "over the gateways themselves connect there",
    )
    add_flag(parser, "batcher", f"127.0.0.1:{DEFAULT_BATCHER_PORT}", "batcher address")
    add_flag(
        parser,
        "engines",
        "",
        "comma-separated engine addresses: batch in this process and stream to "
        "them (no batcher process; --batcher is then unused, unless "
        "--direct-when-idle)",
    )
    add_flag(
        parser,
        "direct-when-idle",
        False,
        "with --engines and --batcher both: requests go through the batcher, "
        "except one that finds this gateway with nothing in flight, which is "
        "batched here and sent straight to the engines (one hop fewer at low "
        "load, the batchers' batches under load)",
    )
    add_flag(parser, "max-texts", 256, "most texts in one call")
    add_flag(parser, "max-in-flight", 1024, "requests in flight before shedding")
    add_flag(
        parser,
        "max-message-mb",
        16,
        "largest request message accepted (gRPC refuses a larger one, "
        "RESOURCE_EXHAUSTED); 16 holds a call of --max-texts 256 texts at the "
        "character guard of a 512-token model",
    )
    add_flag(
        parser,
        "stream-window",
        STREAM_WINDOW,
        "requests of one stream (Stream, ModelStreamInfer) outstanding at "
        "once, being answered or answered and not yet written; while it is "
        "full no more are read: a caller that does not read is slowed, not "
        "buffered",
    )
    add_flag(parser, "cache-entries", 65536, "response cache entries per model; 0: off")
    add_flag(parser, "cache-mb", 128, "response cache MiB per model; 0: off")
    add_flag(
        parser,
        "startup-wait-s",
        30.0,
        "until the gateway first serves, and for at most this long after it "
        "starts, a request the engines cannot answer yet (batcher not "
        "connected, engines loading) waits for them, never past its deadline, "
        "instead of getting the CPU fallback's answer; once the gateway has "
        "served, a failing fleet falls back at once",
    )
    add_flag(
        parser,
        "lame-duck-s",
        LAME_DUCK_S,
        "on SIGTERM, how long to keep taking calls after turning NOT_SERVING: "
        "calls gRPC already received but had not handed over yet are "
        "answered, not CANCELLED, and health-checking clients move away",
    )
    add_http_flag(parser)
    add_keys_flag(parser)
    add_tls_flags(parser)
    gpu_buckets_flag(parser)
    add_scheduler_flags(parser)  # used when batching inline (--engines)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.direct_when_idle and not args.engines:
        parser.error(
            "--direct-when-idle sends an idle gateway's requests straight to "
            "the engines: it needs --engines too"
        )
    if args.stream_window < 1:
        parser.error(
            f"--stream-window {args.stream_window}: a stream needs room for at "
            "least 1 request"
        )
    if args.own_port and args.own_port == args.port:
        # Not left to the bind: it would blame "another process".
        parser.error(
            f"--own-port {args.own_port} is --port too: give the gateway a port "
            "of its own beside the shared one (0: none)"
        )
    if problem := tls_flags_problem(args) or http_flags_problem(args):
        parser.error(problem)
    args.api_keys = keys_of(parser, args.api_keys_file)
    return args


async def probe(gateway: Gateway) -> None:
    """One real request per model through the whole path; raises on failure.

    A degraded answer (from the CPU fallback) does not count: at start-up the
    gateway waits for the real engines.
    """
    berth = Berth(gateway)
    for name, model in gateway.models.items():
        response: (
            berth_pb2.EmbedResponse
            | berth_pb2.ClassifyResponse
            | berth_pb2.RerankResponse
        )
        if model.entry.task == "embed":
            response, _ = await berth.embed(
                berth_pb2.EmbedRequest(model=name, texts=[PROBE_TEXT]), timeout_s=30
            )
        elif model.entry.task == "rerank":
            asked = berth_pb2.RerankRequest(
                model=name, query=PROBE_TEXT, texts=[PROBE_TEXT]
            )
            response, _ = await berth.rerank(asked, timeout_s=30)
        else:
            response, _ = await berth.classify(
                berth_pb2.ClassifyRequest(model=name, texts=[PROBE_TEXT]), timeout_s=30
            )
        if response.degraded:
            raise Unavailable(f"model {name!r} answers only from its fallback")


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
    gateway.started = True  # from now on a failing fleet falls back at once
    await server.set_serving(True)
    log.info("gateway SERVING on %s: every model answers", server.address)
    serving = True
    while True:
        await asyncio.sleep(1.0)
        ok = await refresh_circuits(gateway)
        if ok != serving:
            serving = ok
            await server.set_serving(ok)
            log.warning("gateway health now %s", "SERVING" if ok else "NOT_SERVING")


async def refresh_circuits(gateway: Gateway) -> bool:
    """Learn which circuits are open; True while every model can answer.

    A model whose engines are all down still answers from its fallback, so
    only a model with neither makes the gateway unready.
    """
    can_fall_back = {n for n, m in gateway.models.items() if m.fallback is not None}
    try:
        reply = await gateway.batcher.models()
    except Exception:  # the batcher is unreachable
        gateway.open_circuits = set(gateway.models)
        return can_fall_back == set(gateway.models)
    gateway.open_circuits = {m.name for m in reply.models if m.state == "open"}
    engines = {m.name: m.healthy_engines for m in reply.models}
    return all(engines.get(n, 0) > 0 or n in can_fall_back for n in gateway.models)


async def main(args: argparse.Namespace) -> None:
    start_service("gateway", args)
    repository = load_repository(args.model_repository, gpu=args.gpu_buckets)
    engines = [a for a in args.engines.split(",") if a]
    batcher: Batching
    if engines and args.direct_when_idle:
        batcher = DirectWhenIdle(
            BatcherClient(args.batcher),
            InlineBatcher(repository, engines, scheduler_config(args)),
        )
        route = f"batcher {args.batcher}; straight to engines {args.engines} when idle"
    elif engines:
        batcher = InlineBatcher(repository, engines, scheduler_config(args))
        route = f"batching inline to engines {args.engines}"
    else:
        batcher = BatcherClient(args.batcher)
        route = f"batcher {args.batcher}"
    gateway = Gateway(
        repository,
        batcher,
        Limits(max_texts=args.max_texts),
        max_in_flight=args.max_in_flight,
        cache=ResponseCache(args.cache_entries, args.cache_mb * 2**20),
        startup_wait_s=args.startup_wait_s,
    )
    server = ServiceServer(
        "gateway",
        f"{args.host}:{args.port}",
        [berth_pb2.DESCRIPTOR.services_by_name["Berth"].full_name, KSERVE_SERVICE],
        max_message_bytes=args.max_message_mb * 2**20,
        also=[f"{args.host}:{args.own_port}"] if args.own_port else [],
        credentials=server_credentials(args),
    )
    set_server(server.address)  # its RPC spans' server.address and port
    # Not berth_pb2_grpc.add_BerthServicer_to_server: the requests come as
    # bytes, counted before they are parsed (gateway/intake.py), and one
    # gRPC cannot parse is INVALID_ARGUMENT.
    intake = Intake(args.max_texts, args.api_keys)
    add_service(
        server,
        berth_pb2.DESCRIPTOR.services_by_name["Berth"],
        BerthService(gateway, args.stream_window),
        intake,
        STREAM_CAPTURES,
    )
    KServeService(gateway, args.stream_window).add_to_server(server, intake)
    await server.start()
    http = await start_http(args, gateway, lambda: server.serving)
    start_keys(args.api_keys)
    freeze_startup_heap()
    log.info(
        "gateway models: %s; %s",
        ", ".join(
            f"{n} ({e.task}, max {e.max_tokens} tokens)" for n, e in repository.items()
        ),
        route,
    )
    batcher.start()
    health = asyncio.create_task(watch_health(server, gateway))

    async def drain() -> None:
        health.cancel()
        if http is not None:  # stops listening, lets its requests finish
            await http.stop()

    await server.run_until_signalled(
        drain, grace_s=args.drain_timeout_s, lame_duck_s=args.lame_duck_s
    )
    await batcher.close()
    shutdown_tracing()


if __name__ == "__main__":
    run(main(parse_args()))
