"""The gateway's HTTP/JSON surface, on a port of its own (``--http-port``).

Served by aiohttp in the gateway's event loop, over the same request path as
berth.v1 (gateway/berth.py): the same admission, limits, response cache,
fallback and metrics (api ``http``). Its routes (gateway/http_api.py):
OpenAI's ``POST /v1/embeddings`` and ``GET /v1/models``; TEI's ``POST
/embed``, ``POST /predict``, ``POST /rerank`` and ``GET /info``; and ``GET
/health`` (200 while the gateway is SERVING, else 503).

With API keys (``--api-keys-file``), every route but /health needs the
header ``Authorization: Bearer KEY`` (what gRPC calls send as metadata),
and a key's model list applies. Each request is a server span under the caller's trace
(its ``traceparent`` header), with OpenTelemetry's HTTP attributes. A
berth error is answered with its HTTP status (:func:`http_status`) and a
body in the route's style: OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` on /v1, TEI's ``{"error", "error_type"}`` elsewhere. A
body over ``--max-message-mb`` is refused 413 unread. Each request has the
deadline ``--http-timeout-s`` from its arrival (0: none); past it, it is
answered 504 (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway import auth
from gateway.auth import ApiKeys
from gateway.berth import Berth
from gateway.echo import shown
from gateway.http_api import INLINE_JSON_VALUES, Api, Call, Reply, Route
from gateway.pipeline import TRACER, Gateway
from services.config import add_flag, env
from services.errors import BerthError, InvalidInput, Overloaded, as_berth_error
from services.server import ListenError, why_not_listening
from services.telemetry import record_error, server_span
from services.tls import TlsFiles
from services.tls import describe_certificate as describe

log = logging.getLogger("berth.gateway")

OPENAI, TEI = "openai", "tei"
# (method, path, error style, Api method): a route is one line here and
# one method of Api.
ROUTES = (
    ("POST", "/v1/embeddings", OPENAI, "embeddings"),
    ("GET", "/v1/models", OPENAI, "models"),
    ("GET", "/v1/models/{model}", OPENAI, "model"),
    ("POST", "/embed", TEI, "embed"),
    ("POST", "/predict", TEI, "predict"),
    ("POST", "/rerank", TEI, "rerank"),
    ("GET", "/info", TEI, "info"),
)
# A body up to this size is parsed on the event loop; a larger one on the
# tokenizer threads (as gateway/intake.py parses a large protobuf request).
INLINE_PARSE_BYTES = 64 * 1024

# A body whose JSON escapes a lone surrogate (protobuf takes no such string).
NOT_TEXT = InvalidInput(
    "the request holds a string that is no Unicode text (a lone surrogate "
    "escape such as \\ud800)"
)

# gRPC status code -> HTTP status.
_STATUSES = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
# ErrorInfo reasons with statuses of their own.
_REASONS = {"UNKNOWN_MODEL": 404, "BODY_TOO_LARGE": 413}
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}
_TEI_TYPES = {
    400: "Validation",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    413: "Validation",
    429: "Overloaded",
    503: "Unhealthy",
    504: "Timeout",
}


def add_http_flag(parser: argparse.ArgumentParser) -> None:
    """The gateway's --http-port and --http-timeout-s."""
    add_flag(
        parser,
        "http-port",
        0,
        "port of the HTTP/JSON surface (OpenAI /v1/embeddings, TEI /embed, "
        "/predict, /rerank), on --host beside the gRPC port (0: off)",
    )
    add_flag(
        parser,
        "http-timeout-s",
        30.0,
        "deadline of each HTTP/JSON request from its arrival, handed to the "
        "batcher as a gRPC call's is; past it the request is answered 504 "
        "(0: no deadline)",
    )


def http_flags_problem(args: argparse.Namespace) -> str | None:
    """Why --http-port or --http-timeout-s cannot be used as given, or None."""
    if not math.isfinite(args.http_timeout_s) or args.http_timeout_s < 0:
        return (
            f"--http-timeout-s {args.http_timeout_s}: give a deadline in seconds, "
            "or 0 for none"
        )
    grpc_ports = {args.port, args.own_port} - {0}
    if args.http_port and args.http_port in grpc_ports:
        return (
            f"--http-port {args.http_port} is a gRPC port of this gateway too: "
            "give HTTP a port of its own (0: off)"
        )
    return None


def http_status(error: BerthError) -> int:
    """The HTTP status a berth error is answered with."""
    return _REASONS.get(error.reason) or _STATUSES.get(error.code.name, 500)


def error_body(style: str, error: BerthError, status: int) -> dict[str, Any]:
    """The JSON body of an error, in OpenAI's or TEI's shape."""
    if style == TEI:
        return {"error": str(error), "error_type": _TEI_TYPES.get(status, "Backend")}
    kind = _OPENAI_TYPES.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    code = "model_not_found" if error.reason == "UNKNOWN_MODEL" else error.reason
    return {
        "error": {
            "message": str(error),
            "type": kind,
            "param": error.field,
            "code": code.lower(),
        }
    }


def error_response(style: str, error: BerthError) -> web.Response:
    status = http_status(error)
    headers = {}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(
        error_body(style, error, status), status=status, headers=headers
    )


class HttpsFiles:
    """HTTPS with the gRPC port's certificate files (--tls-cert, --tls-key;
    with --tls-client-ca, client certificates required), re-read when they
    change, as gRPC re-reads them (services/tls.py): :meth:`watch` looks
    every RECHECK_S and loads changed files into the context the server
    holds, so new connections get the new certificate."""

    RECHECK_S = 1.0

    def __init__(self, files: TlsFiles) -> None:
        """Loads the files; raises OSError or ssl.SSLError (a bad start is
        fatal)."""
        self.files = files
        self._stamp = self._stamps()
        self.context = self._load()

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        return tuple(
            (os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in self.files.paths
        )

    def _load(self, context: ssl.SSLContext | None = None) -> ssl.SSLContext:
        files = self.files
        if context is None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(files.cert, files.key)
        if files.client_ca:
            context.load_verify_locations(files.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def reload(self) -> None:
        """Load the files again if they changed; checked in a context of
        their own first, so files that do not load leave the certificate
        in use (and the log says why, once per change)."""
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            self._load()
            self._load(self.context)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning(
                "HTTPS: could not reload %s, still serving the previous "
                "certificate: %s",
                " / ".join(self.files.paths),
                exc,
            )
            return
        log.info("HTTPS: reloaded the certificate: %s", describe(self.files.cert))

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.RECHECK_S)
            self.reload()


class HttpSurface:
    """The HTTP/JSON server of one gateway process."""

    def __init__(
        self,
        gateway: Gateway,
        keys: ApiKeys | None,
        *,
        max_texts: int,
        max_body_bytes: int,
        serving: Callable[[], bool],
        drain_s: float,
        timeout_s: float,
    ) -> None:
        """``timeout_s``: each request's deadline from its arrival (0: none)."""
        self.gateway = gateway
        self.api = Api(Berth(gateway), max_texts, gateway.admission.limit)
        self.keys = keys
        self.timeout_s = timeout_s
        self.serving = serving
        self.max_body_bytes = max_body_bytes
        self.host = ""
        self.port = 0
        self._watch: asyncio.Task[None] | None = None
        app = web.Application(client_max_size=max_body_bytes)
        for method, path, style, name in ROUTES:
            route = getattr(Api, name)
            app.router.add_route(method, path, self._handler(path, style, route))
        app.router.add_get("/health", self._health)
        # (access_log None: no line per request, as the gRPC side logs none)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=drain_s)

    async def start(self, host: str, port: int, https: HttpsFiles | None) -> None:
        """Listen on host:port, sharing it with the other gateways
        (SO_REUSEPORT) as the gRPC port is shared (BERTH_REUSE_PORT); with
        ``https``, HTTPS."""
        reuse_port = bool(env("reuse_port", False))
        context = https.context if https is not None else None
        await self.runner.setup()
        name: str | None = host.strip("[]")
        if name in ("", "0.0.0.0", "::"):
            name = None  # every interface of both families, as gRPC listens
        site = web.TCPSite(
            self.runner,
            name,
            port,
            ssl_context=context,
            reuse_address=True,
            reuse_port=reuse_port,
        )
        try:
            await site.start()
        except OSError:
            await self.runner.cleanup()
            why = why_not_listening(f"{host}:{port}", reuse_port)
            raise ListenError(
                f"gateway: cannot listen on {host}:{port} (--http-port): {why}"
            ) from None
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or ()
        self.host, self.port = host, sockets[0].getsockname()[1] if sockets else port
        scheme = "http"
        if https is not None:
            scheme = "https"
            self._watch = asyncio.create_task(https.watch())
        log.info(
            "gateway HTTP/JSON listening on %s://%s:%d (OpenAI /v1/embeddings, "
            "TEI /embed /predict /rerank)",
            scheme,
            host,
            self.port,
        )

    async def stop(self) -> None:
        """Stop listening, then let the requests in flight finish (for up to
        ``drain_s``) before closing their connections."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        """TEI's GET /health: 200 while the gateway is SERVING, else 503."""
        status = 200 if self.serving() else 503
        return web.json_response({}, status=status)

    def _handler(
        self, path: str, style: str, route: Route
    ) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.Response:
            return await self._serve(request, path, style, route)

        return handle

    async def _serve(
        self, request: web.Request, path: str, style: str, route: Route
    ) -> web.Response:
        """One request: in a server span under the caller's trace, its key
        checked, its body parsed, its route's reply or its error answered."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        metadata = [(k.lower(), v) for k, v in request.headers.items()]
        query = {**request.query, **request.match_info}
        attributes: dict[str, str | int] = {
            "http.request.method": request.method,
            "http.route": path,
            "url.path": request.path,
            "url.scheme": request.scheme,
            "server.address": self.host.strip("[]"),
            "server.port": self.port,
            "berth.model": shown(query.get("model", "")),
        }
        name = f"{request.method} {path}"
        with server_span(TRACER, name, metadata, attributes) as span:
            token = None
            try:
                if self.keys is not None:
                    token = auth.CALLER.set(self.keys.caller(metadata))
                body = await self._body(request) if request.method == "POST" else None
                reply = await route(self.api, Call(body, query, deadline))
                response = await self._json(reply)
            except UnicodeEncodeError:  # a JSON escape of a lone surrogate
                response = error_response(style, NOT_TEXT)
            except Exception as exc:
                error = as_berth_error(exc, log, f"HTTP {name}")
                response = error_response(style, error)
                if span is not None and response.status >= 500:
                    record_error(span, error)
            finally:
                if token is not None:
                    auth.CALLER.reset(token)
            if span is not None:
                span.set_attribute("http.response.status_code", response.status)
                if response.status >= 500:
                    span.set_attribute("error.type", str(response.status))
            return response

    async def _body(self, request: web.Request) -> Any:
        """The request's JSON body; raises InvalidInput (BODY_TOO_LARGE for
        one over the limit, refused before it is read in full)."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise InvalidInput(
                f"the request body is over {self.max_body_bytes} bytes (gateway "
                "flag --max-message-mb)",
                reason="BODY_TOO_LARGE",
            ) from None
        try:
            if len(raw) <= INLINE_PARSE_BYTES:
                return json.loads(raw)
            return await self.gateway.in_threads(json.loads, raw)
        except (ValueError, RecursionError) as exc:
            # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
            raise InvalidInput(f"the request body is not JSON: {exc}") from None

    async def _json(self, reply: Reply) -> web.Response:
        """The reply as JSON, encoded off the event loop when large."""
        if reply.values <= INLINE_JSON_VALUES:
            text = json.dumps(reply.body)
        else:
            text = await self.gateway.in_threads(json.dumps, reply.body)
        return web.Response(
            text=text, content_type="application/json", headers=reply.headers
        )


async def start_http(
    args: argparse.Namespace, gateway: Gateway, serving: Callable[[], bool]
) -> HttpSurface | None:
    """The gateway's HTTP surface, listening on --host:--http-port (None
    with --http-port 0), with the gRPC side's keys, limits and TLS."""
    if not args.http_port:
        return None
    surface = HttpSurface(
        gateway,
        args.api_keys,
        max_texts=args.max_texts,
        max_body_bytes=args.max_message_mb * 2**20,
        serving=serving,
        drain_s=args.drain_timeout_s,
        timeout_s=args.http_timeout_s,
    )
    files = TlsFiles.from_args(args)
    https = HttpsFiles(files) if files is not None else None
    await surface.start(args.host, args.http_port, https)
    return surface
