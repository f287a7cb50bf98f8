"""An in-process OTLP/gRPC trace receiver: the collector's TraceService."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)
    attributes: dict[str, object]
    status_code: int


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every span exported to it."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex())
                                for link in span.links
                            ),
                            attributes={
                                a.key: _value(a.value) for a in span.attributes
                            },
                            status_code=span.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> Receiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None
