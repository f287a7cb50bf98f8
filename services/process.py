"""What the three service processes (``python -m gateway``, ``batcher``,
``engine``) share: the flags every one takes, and their logging, tracing and
/metrics set-up."""

from __future__ import annotations

import argparse
import logging

from services import internal_tls
from services.config import add_flag, repository_flag
from services.internal_tls import add_internal_tls_flags
from services.logs import setup_logging
from services.metrics import serve_metrics
from services.telemetry import setup_tracing

DRAIN_TIMEOUT_S = 30.0


def service_parser(
    service: str, description: str | None, *, port: int, metrics_port: int
) -> argparse.ArgumentParser:
    """``python -m <service>``'s parser with the flags every service takes
    (--host, --port, --metrics-port, --metrics-host, --drain-timeout-s,
    --model-repository, --internal-tls-*),
    each defaulting to its BERTH_* variable, then to the value given here."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {service}", description=description
    )
    add_flag(parser, "host", "127.0.0.1", "address to listen on")
    add_flag(parser, "port", port, "port to listen on")
    add_flag(parser, "metrics-port", metrics_port, "Prometheus /metrics port (0: off)")
    add_flag(
        parser,
        "metrics-host",
        "127.0.0.1",
        "address /metrics listens on (0.0.0.0: every interface)",
    )
    add_flag(
        parser,
        "drain-timeout-s",
        DRAIN_TIMEOUT_S,
        "on SIGTERM, how long in-flight work may take",
    )
    repository_flag(parser)
    add_internal_tls_flags(parser)
    return parser


def start_service(service: str, args: argparse.Namespace) -> logging.Logger:
    """A service process's logging (BERTH_LOG_LEVEL), OTLP tracing (OTEL_*),
    Prometheus /metrics on --metrics-host:--metrics-port and the internal
    hops' TLS (--internal-tls-*); returns its logger."""
    log = setup_logging(service)
    internal_tls.configure(args)
    setup_tracing(service)
    serve_metrics(service, args.metrics_host, args.metrics_port)
    return log
