"""Prometheus: each service serves /metrics on its own port."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any, Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase

log = logging.getLogger("berth.metrics")

# Seconds; from a cached answer (~50 µs) to a long CPU batch (~10 s).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


# The /metrics server (MetricsServer): how many connections it keeps open
# at once, and how long each may take to send its request. A Prometheus
# scrape sends its request at once and reads the page in milliseconds.
MAX_CONNECTIONS = 8
READ_TIMEOUT_S = 3.0
MAX_REQUEST_BYTES = 8192


def serve_metrics(service: str, host: str, port: int) -> None:
    """Start the /metrics HTTP server (port 0: disabled)."""
    if port <= 0:
        log.info("%s: metrics disabled (--metrics-port 0)", service)
        return
    from services.server import ListenError  # (services.loop.run: exit 1)

    try:
        MetricsServer(host, port).start()
    except OSError as exc:
        raise ListenError(
            f"{service}: cannot serve /metrics on {host}:{port}: {exc.strerror}; "
            "set --metrics-port to a free port (0: off)"
        ) from exc
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", service, host, port)


class MetricsServer:
    """/metrics over HTTP/1.0 on one thread of its own, with its own event
    loop: at most ``MAX_CONNECTIONS`` open at once (one more is closed at
    once), each closed if its request has not come within
    ``READ_TIMEOUT_S``. prometheus_client's own server starts a thread per
    connection and waits for its request without end, so idle connections
    would pile up threads."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry = REGISTRY,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.open = 0
        # Bound here, in the caller's thread, so that a port in use is its
        # OSError; the loop's thread only serves it.
        self.socket = socket.create_server(
            (host, port),
            family=socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0],
            backlog=64,
        )
        self.port = self.socket.getsockname()[1]

    def start(self) -> None:
        threading.Thread(
            target=asyncio.run, args=(self._serve(),), name="metrics", daemon=True
        ).start()

    async def _serve(self) -> None:
        server = await asyncio.start_server(
            self._connection, sock=self.socket, limit=MAX_REQUEST_BYTES
        )
        async with server:
            await server.serve_forever()

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self.open >= self.max_connections:
            writer.transport.abort()
            return
        self.open += 1
        try:
            async with asyncio.timeout(self.read_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._answer(head))
                writer.close()
                await writer.wait_closed()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass  # (ValueError: a request over MAX_REQUEST_BYTES)
        finally:
            self.open -= 1
            writer.transport.abort()  # (once closed, nothing to do)

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", b"", "text/plain")
        if path not in ("/", "/metrics"):
            return _response("404 Not Found", b"", "text/plain")
        headers = dict(
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(":") for line in lines[1:])
        )
        encode, content_type = choose_encoder(headers.get("accept", ""))
        body = encode(self.registry)
        return _response("200 OK", b"" if method == "HEAD" else body, content_type)


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


Metric = TypeVar("Metric", bound=MetricWrapperBase)


class Memo(Generic[Metric]):
    """A labelled metric whose children are looked up once per label set.

    ``Counter.labels`` validates and locks on every call (microseconds); on the
    per-request and per-sequence paths the children are kept here instead.
    Everything else is the wrapped metric's own.
    """

    def __init__(self, metric: Metric) -> None:
        self.metric = metric
        self._children: dict[tuple[object, ...], Metric] = {}

    def labels(self, *values: object) -> Metric:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)
