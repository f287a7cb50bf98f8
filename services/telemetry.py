"""OpenTelemetry set-up and W3C trace-context helpers for every service.

Configured by the standard variables: OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*,
OTEL_SERVICE_NAME; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn
export off (see tracing_off_reason). With no endpoint set, or export off, no
exporter runs: spans are not recorded, but incoming trace context is still
passed on to the next hop.

A caller's context is read from its call's metadata by the propagators
OTEL_PROPAGATORS names (default: W3C tracecontext and baggage), as
OpenTelemetry's SDKs do. Between berth's own processes the context always
travels as W3C tracecontext inside the messages (inject/extract): what a
caller's propagator is does not change the internal protocol.

A gateway's RPC spans follow OpenTelemetry's RPC conventions: rpc.system,
rpc.service, rpc.method, rpc.grpc.status_code, server.address and
server.port (rpc_attributes).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
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
    "rpc_attributes",
    "server_span",
    "set_server",
    "set_status_code",
    "span_if_recording",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
    "tracing_off_reason",
]


def setup_tracing(service: str) -> Tracer:
    """Install an OTLP/gRPC exporting provider when an endpoint is configured
    and export is not switched off; say which, and why, once."""
    global _provider
    if _provider is not None:
        return trace.get_tracer(f"berth.{service}")
    off = tracing_off_reason(os.environ)
    if off is not None:
        log.info(
            "tracing off: %s; spans are not exported, callers' trace context "
            "is still passed on",
            off,
        )
        return trace.get_tracer(f"berth.{service}")
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
    log.info(
        "tracing on: exporting spans of %s over OTLP to %s", name, _endpoint(os.environ)
    )
    return trace.get_tracer(f"berth.{service}")


def _endpoint(environ: Mapping[str, str]) -> str:
    """The OTLP endpoint for traces ('': none; an empty value counts as unset)."""
    return environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


# OTEL_TRACES_EXPORTER's values berth acts on: "otlp" (the default, and the
# only exporter berth has) and "none".
_OTLP, _NONE = "otlp", "none"


def tracing_off_reason(environ: Mapping[str, str]) -> str | None:
    """Why this process exports no spans, or None when it exports them.

    As the OpenTelemetry specification defines the variables
    (configuration/sdk-environment-variables.md): OTEL_SDK_DISABLED is a
    Boolean, true only for the case-insensitive "true" (stripped, as the
    Python SDK's TracerProvider reads it, which then hands out no-op
    tracers); any other value but "false" or empty is false with a warning.
    OTEL_TRACES_EXPORTER is a comma-separated, case-insensitive list whose
    "none" means no exporter; a name berth has no exporter for is warned of
    and ignored, as the specification says of unknown enum values. berth
    needs an endpoint besides (it does not default to localhost:4317).
    """
    disabled = environ.get("OTEL_SDK_DISABLED", "")
    if disabled.strip().lower() == "true":
        return f"OTEL_SDK_DISABLED={disabled}"
    if disabled.strip().lower() not in ("", "false"):
        log.warning(
            "OTEL_SDK_DISABLED=%r is neither true nor false: taken as false", disabled
        )
    exporters = environ.get("OTEL_TRACES_EXPORTER", "")
    names = [n.strip().lower() for n in exporters.split(",") if n.strip()]
    unknown = [n for n in names if n not in (_OTLP, _NONE)]
    if unknown:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s: berth has no %s exporter (it exports over "
            "OTLP only); ignored",
            exporters,
            ", ".join(unknown),
        )
    if _NONE in names:
        if len(names) > 1:
            log.warning(
                "OTEL_TRACES_EXPORTER=%s names 'none' with other exporters: "
                "'none' wins, spans are not exported",
                exporters,
            )
        return f"OTEL_TRACES_EXPORTER={exporters}"
    if not _endpoint(environ):
        return (
            "no OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set"
        )
    return None


def tracer(service: str) -> Tracer:
    return trace.get_tracer(f"berth.{service}")


def recording() -> bool:
    """Whether this process exports spans (setup_tracing installed an exporter).

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

# Where this process's RPC server listens (set_server): its spans'
# server.address and server.port.
_server: dict[str, str | int] = {}


def set_server(address: str) -> None:
    """The "host:port" this process serves its RPCs on, for its spans."""
    host, _, port = address.rpartition(":")
    _server.clear()
    _server["server.address"] = host.strip("[]")
    if port.isdigit():
        _server["server.port"] = int(port)


def rpc_attributes(method: str, **extra: str) -> dict[str, str | int]:
    """OpenTelemetry's RPC span attributes of ``method``
    ("package.Service/Method"), with this server's address and ``extra``."""
    service, _, name = method.rpartition("/")
    return {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": name,
        **_server,
        **extra,
    }


def set_status_code(span: Span | None, code: int) -> None:
    """Record the gRPC status ``code`` (0: OK) the call ``span`` serves
    ended with, as ``rpc.grpc.status_code`` (errors also mark the span
    itself: record_error)."""
    if span is not None:
        span.set_attribute("rpc.grpc.status_code", code)


def server_span(
    tracer: Tracer,
    name: str,
    metadata: Iterable[tuple[str, str | bytes]],
    attributes: Mapping[str, str | int],
) -> AbstractContextManager[Any]:
    """A server span under the caller's trace context (read by the
    OTEL_PROPAGATORS propagators). When not recording, the caller's context
    alone becomes current, so the next hop still joins the caller's trace; a
    call without one costs nothing."""
    propagator = propagate.get_global_textmap()
    carrier = _carrier(metadata, propagator.fields)
    if _provider is None:
        if not carrier:
            return _NOT_RECORDING
        return _attached(propagator.extract(carrier))
    return tracer.start_as_current_span(
        name,
        context=propagator.extract(carrier),
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
        carrier = _carrier(carrier, set(TRACE_HEADERS))
    return _PROPAGATOR.extract(carrier)


def _carrier(
    metadata: Iterable[tuple[str, str | bytes]], fields: set[str]
) -> dict[str, str]:
    """The metadata entries a propagator reads (``fields``: its headers)."""
    return {
        k: v.decode() if isinstance(v, bytes) else v for k, v in metadata if k in fields
    }


def record_error(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)))


def current_context() -> Context:
    return otel_context.get_current()
