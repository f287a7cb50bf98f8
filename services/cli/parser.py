"""The `berth` command line: its subcommands, their flags, and main."""

from __future__ import annotations

import argparse
import sys

import grpc

from services.cli.client import (
    DEFAULT_ADDRESS,
    STDIN_CHUNK,
    cmd_classify,
    cmd_embed,
    cmd_health,
    cmd_models,
    cmd_rerank,
)
from services.cli.default_models import cmd_build_models
from services.cli.serve import cmd_serve
from services.config import (
    DEFAULT_BATCHER_PORT,
    DEFAULT_ENGINE_PORT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_HTTP_PORT,
    add_flag,
    repository_flag,
)
from services.internal_tls import add_internal_tls_flags
from services.tls import add_client_tls_flags, add_tls_flags

DESCRIPTION = "The ``berth`` command: serve, call a running gateway, build models."

Subcommands = argparse._SubParsersAction  # what add_subparsers returns


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="berth", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start gateway, batcher and engines")
    _serve_process_flags(serve)
    _serve_runtime_flags(serve)
    serve.set_defaults(func=cmd_serve)
    _client_parsers(sub)
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


def _serve_process_flags(serve: argparse.ArgumentParser) -> None:
    """serve's processes: how many, where they listen, on what device."""
    serve.add_argument(
        "--engines",
        type=int,
        default=0,
        help="engine workers (default: one per GPU, else one per core, at most 4)",
    )
    add_flag(serve, "host", "127.0.0.1", "address the gateways listen on")
    add_flag(
        serve,
        "internal-host",
        "127.0.0.1",
        "address the batchers and engines listen on: berth's internal hops, "
        "kept on loopback whatever --host is (another address: protect the "
        "hops with --internal-tls-*)",
    )
    add_flag(serve, "port", DEFAULT_GATEWAY_PORT, "gateway port")
    add_flag(
        serve,
        "http-port",
        DEFAULT_HTTP_PORT,
        "the gateways' HTTP/JSON port (OpenAI /v1/embeddings, TEI /embed, "
        "/predict, /rerank) on --host, shared like --port (0: off)",
    )
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


def _serve_runtime_flags(serve: argparse.ArgumentParser) -> None:
    """serve's models, metrics ports, and how its processes use the CPUs."""
    add_flag(serve, "build-models", True, "build the default models if missing")
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="serve this Hugging Face checkpoint directory as it is (repeat "
        "for more): its task, pooling, limits and labels read from it, named "
        "NAME or after the directory; served next to --model-repository's "
        "models",
    )
    add_flag(
        serve,
        "metrics-port",
        9464,
        "gateway's /metrics port; batcher +1, engines +2..., then further "
        "gateways, then further batchers (0: off)",
    )
    add_flag(
        serve,
        "metrics-host",
        "127.0.0.1",
        "address every process's /metrics listens on (0.0.0.0: every interface)",
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
    add_flag(
        serve,
        "api-keys-file",
        "",
        "every gateway's --api-keys-file: calls must carry one of its keys "
        "('': no keys)",
    )
    serve.add_argument(
        "--chaos", action="store_true", help="engines take SIGUSR1 to fail batches"
    )
    add_tls_flags(serve)  # every gateway's
    add_internal_tls_flags(serve)  # every process's
    repository_flag(serve)


def _client_parsers(sub: Subcommands) -> None:
    """embed, classify, rerank, models and health: calls to a running gateway."""
    for name, func, default_model in (
        ("embed", cmd_embed, "minilm"),
        ("classify", cmd_classify, "intent"),
        ("rerank", cmd_rerank, None),
    ):
        p = sub.add_parser(name, help=f"{name} texts through a running gateway")
        p.add_argument(
            "texts",
            nargs="+",
            metavar="TEXT",
            help="texts; a lone - reads one text per line from stdin (UTF-8, "
            "blank lines skipped)",
        )
        if default_model is None:
            p.add_argument("--model", required=True)
        else:
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
        if name == "rerank":
            p.add_argument("--query", required=True, help="what the texts answer")
            p.add_argument(
                "--top-k", type=_whole, default=0, help="the best k only (0: all)"
            )
            p.add_argument(
                "--raw-scores",
                action="store_true",
                help="the model's raw scores, without its activation",
            )
            _client_flags(p)
            p.set_defaults(func=func)
            continue
        p.add_argument(
            "--normalize", action=argparse.BooleanOptionalAction, default=None
        )
        p.add_argument(
            "--prompt-name",
            default="",
            help="prepend the model's prompt of this name to every text",
        )
        p.add_argument(
            "--prompt",
            default=None,
            help="prepend this string to every text ('': no prompt)",
        )
        if name == "embed":
            p.add_argument(
                "--dimensions",
                type=_whole,
                default=0,
                help="keep the first N values of each embedding (0: all)",
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


def _client_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "address", DEFAULT_ADDRESS, "gateway address")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
    add_client_tls_flags(parser)


def _whole(raw: str) -> int:
    """An argparse type: a whole number of 0 or more (a uint32)."""
    if not raw.isascii() or not raw.isdigit() or int(raw) >= 2**32:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of 0 or more")
    return int(raw)


def _positive(raw: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of 1 or more")
    return value
