"""How the public APIs' calls are served: traced, their errors made answers.

berth.v1 and KServe v2 alike: a unary call's error ends it with its status;
in a bidirectional stream, a request's error is answered in the stream,
which stays open, and a message that cannot be read ends the stream with its
status once the requests before it are answered. A stream has at most its
window of requests outstanding (being answered, or answered and not yet
written to the caller): while it is full, no more are read, so a caller that
does not read its answers is slowed, not buffered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import grpc

from gateway import auth
from gateway.echo import shown
from gateway.intake import Refused
from gateway.pipeline import TRACER
from services.errors import BerthError, abort, as_berth_error
from services.streams import until_unreadable
from services.telemetry import (
    record_error,
    rpc_attributes,
    server_span,
    set_status_code,
)

log = logging.getLogger("berth.gateway")

Request = TypeVar("Request")
Response = TypeVar("Response")

# Requests of one stream outstanding at once (gateway flag --stream-window).
STREAM_WINDOW = 64


def tenant_of(context: grpc.aio.ServicerContext) -> str:
    """The tenant a call belongs to, which keeps response cache entries
    apart: with API keys on, a digest of the caller's key (gateway/auth.py);
    without, every caller is the one tenant ''."""
    return auth.CALLER.get().tenant


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
    attributes = rpc_attributes(method, **{"berth.model": shown(model)})
    metadata = context.invocation_metadata() or ()
    with server_span(TRACER, method, metadata, attributes) as span:
        try:
            response = await work
        except BerthError as error:
            set_status_code(span, error.code.value[0])
            await abort(context, error)
            raise  # (abort raises; this is never reached)
        set_status_code(span, 0)
        return response


async def serve_requests(
    requests: AsyncIterator[Request | Refused[Any]],
    context: grpc.aio.ServicerContext,
    method: str,
    call: Callable[[Request], Awaitable[Response]],
    failed: Callable[[Request, BerthError], Response],
    model_of: Callable[[Request], str],
    named: Callable[[Request], str],
    in_order: bool = False,
    window: int = STREAM_WINDOW,
) -> AsyncIterator[Response]:
    """A bidirectional stream's answers: ``call``'s for each request, or,
    where it raises, ``failed``'s for the request and its error (and for a
    message refused unread, gateway.intake.Refused, its stand-in's).

    Each request runs in a span of its own under the caller's trace (the
    stream's metadata), so the hops behind it join that trace: ``model_of``
    gives the span its model, ``named`` says which request a log line of an
    unexpected error is about. ``in_order``: the answers go out in request
    order, else as they are ready; at most ``window`` outstanding
    (:func:`windowed`)."""
    metadata = context.invocation_metadata() or ()

    async def answer(item: Request | Refused[Any]) -> Response:
        request = item.request if isinstance(item, Refused) else item
        attributes = rpc_attributes(method, **{"berth.model": shown(model_of(request))})
        with server_span(TRACER, method, metadata, attributes) as span:
            try:
                if isinstance(item, Refused):
                    raise item.error
                response = await call(request)
            except Exception as exc:  # answered, and the stream stays open
                error = as_berth_error(exc, log, named(request))
                if span is not None:  # the error is answered, not raised
                    record_error(span, error)
                    set_status_code(span, error.code.value[0])
                return failed(request, error)
            set_status_code(span, 0)
            return response

    unreadable: list[BerthError] = []
    readable = until_unreadable(requests, unreadable)
    async for response in windowed(readable, answer, window, in_order):
        yield response
    if unreadable:
        await abort(context, unreadable[0])


async def windowed(
    requests: AsyncIterator[Request],
    answer: Callable[[Request], Awaitable[Response]],
    window: int,
    in_order: bool = False,
) -> AsyncIterator[Response]:
    """A bidi stream's answers, each request answered in a task of its own,
    with at most ``window`` requests outstanding: read and not yet taken
    from here. gRPC takes the next answer once it has written the last, so
    while the caller does not read, the window stays full and no request is
    read. ``in_order``: the answers go out in request order (as Triton
    answers a non-decoupled model's stream, so a caller may match them by
    position), else as they are ready. The stream ends once the caller has
    closed its side and every answer is out. ``answer`` must not raise."""
    slots = asyncio.Semaphore(window)
    ready: asyncio.Queue[asyncio.Future[Response] | None] = asyncio.Queue()
    tasks: set[asyncio.Future[Response]] = set()

    async def read() -> None:
        try:
            source = aiter(requests)
            while True:
                await slots.acquire()
                try:
                    request = await anext(source)
                except StopAsyncIteration:
                    break
                task = asyncio.ensure_future(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if in_order:
                    ready.put_nowait(task)
                else:
                    task.add_done_callback(ready.put_nowait)
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            ready.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (task := await ready.get()) is not None:
            yield await task
            slots.release()
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()
