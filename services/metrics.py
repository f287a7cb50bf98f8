"""Prometheus: each service serves /metrics on its own port."""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

from prometheus_client import start_http_server
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


def serve_metrics(service: str, host: str, port: int) -> None:
    """Start the /metrics HTTP server (port 0: disabled)."""
    if port <= 0:
        log.info("%s: metrics disabled (--metrics-port 0)", service)
        return
    from services.server import ListenError  # (services.loop.run: exit 1)

    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise ListenError(
            f"{service}: cannot serve /metrics on {host}:{port}: {exc.strerror}; "
            "set --metrics-port to a free port (0: off)"
        ) from exc
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", service, host, port)


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
