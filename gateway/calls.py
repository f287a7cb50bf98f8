"""How the public APIs' calls are served: traced, their errors made answers.

berth.v1 and KServe v2 alike: a unary call's error ends it with its status;
in a bidirectional stream, a request's error is answered in the stream,
which stays open, and a message that cannot be read ends the stream with its
status once the requests before it are answered.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TypeVar

import grpc

from gateway.pipeline import TRACER
from services.errors import BerthError, abort, as_berth_error
from services.streams import serve_stream
from services.telemetry import record_error, server_span

log = logging.getLogger("berth.gateway")

Request = TypeVar("Request")
Response = TypeVar("Response")


class AbortOnError:
    """``async with AbortOnError(context):`` a BerthError raised in the block
    ends the call with its status (:func:`services.errors.abort`)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if isinstance(error, BerthError):
            await abort(self.context, error)


async def serve_unary(
    context: grpc.aio.ServicerContext,
    method: str,
    model: str,
    work: Awaitable[Response],
) -> Response:
    """One unary call's answer, in a span under the caller's trace; a
    BerthError ends the call with its status."""
    with server_span(
        TRACER, method, context.invocation_metadata() or (), {"berth.model": model}
    ):
        async with AbortOnError(context):
            return await work


async def serve_requests(
    requests: AsyncIterator[Request],
    context: grpc.aio.ServicerContext,
    method: str,
    call: Callable[[Request], Awaitable[Response]],
    failed: Callable[[Request, BerthError], Response],
    model_of: Callable[[Request], str],
    named: Callable[[Request], str],
    in_order: bool = False,
) -> AsyncIterator[Response]:
    """A bidirectional stream's answers: ``call``'s for each request, or,
    where it raises, ``failed``'s for the request and its error.

    Each request runs in a span of its own under the caller's trace (the
    stream's metadata), so the hops behind it join that trace: ``model_of``
    gives the span its model, ``named`` says which request a log line of an
    unexpected error is about. ``in_order``: the answers go out in request
    order, else as they are ready (:func:`services.streams.serve_stream`)."""
    metadata = context.invocation_metadata() or ()

    async def answer(request: Request) -> Response:
        attributes = {"berth.model": model_of(request)}
        with server_span(TRACER, method, metadata, attributes) as span:
            try:
                return await call(request)
            except Exception as exc:  # answered, and the stream stays open
                error = as_berth_error(exc, log, named(request))
                if span is not None:  # the error is answered, not raised
                    record_error(span, error)
                return failed(request, error)

    async for response in serve_stream(requests, answer, context, in_order=in_order):
        yield response
