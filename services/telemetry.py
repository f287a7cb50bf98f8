"""OpenTelemetry set-up and W3C trace-context helpers for every service.

Configured by the standard variables: OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*,
OTEL_SERVICE_NAME. With no endpoint set, no exporter runs: spans are not
recorded, but incoming trace context is still passed on to the next hop.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("berth.telemetry")

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: object | None = None

__all__ = [
    "Context",
    "Span",
    "SpanKind",
    "extract",
    "inject",
    "record_error",
    "recording",
    "server_span",
    "span_if_recording",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
]


def setup_tracing(service: str) -> Tracer:
    """Install an OTLP/gRPC exporting provider when an endpoint is configured."""
    global _provider
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint and _provider is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME", service)
        # The sampler comes from OTEL_TRACES_SAMPLER[_ARG]; the batch processor
        # from OTEL_BSP_*; the exporter from OTEL_EXPORTER_OTLP_*.
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
        log.info("tracing: exporting spans of %s over OTLP to %s", name, endpoint)
    elif not endpoint:
        log.info("tracing: no OTEL_EXPORTER_OTLP_ENDPOINT, spans are not exported")
    return trace.get_tracer(f"berth.{service}")


def tracer(service: str) -> Tracer:
    return trace.get_tracer(f"berth.{service}")


def recording() -> bool:
    """Whether this process exports spans (setup_tracing found an endpoint).

    Per-request and per-sequence spans are made only then: a span that is
    never exported still costs microseconds on the request path."""
    return _provider is not None


_NOT_RECORDING = contextlib.nullcontext()


def span_if_recording(
    tracer: Tracer, name: str, **kwargs: Any
) -> AbstractContextManager[Any]:
    """``tracer.start_as_current_span(name, ...)``, or nothing when not
    recording (the current context, which inject() passes on, is unchanged)."""
    if _provider is None:
        return _NOT_RECORDING
    return tracer.start_as_current_span(name, **kwargs)


TRACE_HEADERS = ("traceparent", "tracestate")


def server_span(
    tracer: Tracer,
    name: str,
    metadata: Iterable[tuple[str, str | bytes]],
    attributes: Mapping[str, str],
) -> AbstractContextManager[Any]:
    """A server span under the caller's trace context. When not recording,
    the caller's context alone becomes current, so the next hop still joins
    the caller's trace; a call without one costs nothing."""
    carrier = _carrier(metadata)
    if _provider is None:
        if not carrier:
            return _NOT_RECORDING
        return _attached(_PROPAGATOR.extract(carrier))
    return tracer.start_as_current_span(
        name,
        context=_PROPAGATOR.extract(carrier),
        kind=SpanKind.SERVER,
        attributes=attributes,
    )


@contextlib.contextmanager
def _attached(ctx: Context) -> Iterator[None]:
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def shutdown_tracing() -> None:
    """Flush spans still buffered (called on drain)."""
    if _provider is not None:
        _provider.shutdown()  # type: ignore[attr-defined]


def inject(ctx: Context | None = None) -> dict[str, str]:
    """The W3C traceparent/tracestate of ``ctx`` (default: current) as a dict."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> Context:
    """A context from a dict or from gRPC invocation metadata."""
    if not isinstance(carrier, Mapping):
        carrier = _carrier(carrier)
    return _PROPAGATOR.extract(carrier)


def _carrier(metadata: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    """The trace headers of gRPC metadata (the propagator reads no others)."""
    return {
        k: v.decode() if isinstance(v, bytes) else v
        for k, v in metadata
        if k in TRACE_HEADERS
    }


def record_error(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)))


def current_context() -> Context:
    return otel_context.get_current()
