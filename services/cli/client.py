"""The client commands of `berth`: embed, classify, rerank, models and health, each
one or more calls to a running gateway (or any service, for health)."""

from __future__ import annotations

import argparse
import codecs
import json
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.channels import sync_channel
from services.config import DEFAULT_GATEWAY_PORT
from services.tls import client_credentials

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_GATEWAY_PORT}"
T = TypeVar("T")

# Texts per call when they come from stdin: the gateway's default --max-texts
# (`berth embed --per-call N` for a gateway that takes fewer).
STDIN_CHUNK = 256


def _stub(args: argparse.Namespace) -> Any:
    from services.proto.berth.v1 import berth_pb2_grpc

    channel = sync_channel(args.address, client_credentials(args))
    return berth_pb2_grpc.BerthStub(channel)


def _options(args: argparse.Namespace) -> Any:
    from services.proto.berth.v1 import berth_pb2

    options = berth_pb2.Options(
        truncate=args.truncate,
        prompt_name=args.prompt_name,
        dimensions=getattr(args, "dimensions", 0),
    )
    if args.normalize is not None:
        options.normalize = args.normalize
    if args.prompt is not None:
        options.prompt = args.prompt
    return options


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

    stub = _stub(args)
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

    stub = _stub(args)
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


def cmd_rerank(args: argparse.Namespace) -> int:
    """The texts scored against --query, best first (--top-k: the best k);
    several calls (texts from stdin) are ranked together."""
    from services.proto.berth.v1 import berth_pb2

    stub = _stub(args)
    out: list[dict[str, Any]] = []
    degraded = False
    first = 0
    for texts, lines in _texts(args):
        request = berth_pb2.RerankRequest(
            model=args.model,
            query=args.query,
            texts=texts,
            options=berth_pb2.Options(truncate=args.truncate),
            raw_scores=args.raw_scores,
        )
        response = _call(stub.Rerank, request, lines, args.timeout)
        degraded |= response.degraded
        out += [
            {"index": first + r.index, "score": r.score, "text": texts[r.index]}
            for r in response.results
        ]
        first += len(texts)
    out.sort(key=lambda item: -item["score"])
    _print(out[: args.top_k] if args.top_k else out, degraded=degraded)
    return 0


def _print(out: list[dict[str, Any]], degraded: bool) -> None:
    if degraded:
        print("warning: answered by the degraded CPU fallback", file=sys.stderr)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


def cmd_models(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from services.proto.berth.v1 import berth_pb2

    response = _stub(args).ModelInfo(berth_pb2.ModelInfoRequest(), timeout=args.timeout)
    print(json.dumps(MessageToDict(response)["models"], indent=2))
    return 0


def health_status(
    address: str,
    service: str = "",
    timeout: float = 5.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """grpc.health.v1 status of ``service`` at address ('' : the whole
    server), or why there is none (TLS with ``credentials``)."""
    stub = health_pb2_grpc.HealthStub(sync_channel(address, credentials))
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
    status = health_status(
        args.address, args.service, args.timeout, client_credentials(args)
    )
    print(status)
    return 0 if status == "SERVING" else 1
