"""Long-lived bidirectional streams multiplexed by id, reconnected on loss.

Both internal hops (gateway -> batcher, batcher -> engine) are one stream per
peer carrying many independent items. A :class:`StreamClient` keeps that
stream up, maps each answer to the future of the item it answers, and fails
every pending future with UNAVAILABLE when the stream breaks, so no caller
waits forever on a dead peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError

from services.channels import aio_channel
from services.errors import BerthError, InvalidInput, Unavailable, abort

log = logging.getLogger("berth.streams")

Out = TypeVar("Out")  # what we send on the stream
In = TypeVar("In")  # what the peer sends back
Item = TypeVar("Item")  # one answer inside an In message

RECONNECT_DELAY_S = 0.2


class StreamClient(Generic[Out, In, Item]):
    """One peer: a bidi stream whose answers resolve futures by id."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = aio_channel(address)
        self._pending: dict[int, asyncio.Future[Item]] = {}
        self._outbox: asyncio.Queue[Out | None] | None = None
        self._task: asyncio.Task[None] | None = None

    # ---- hooks for subclasses ----------------------------------------------

    async def _handshake(self) -> None:
        """Runs before each stream opens; waits for the peer to be up."""

    def _open(self, requests: AsyncIterator[Out]) -> Any:
        """Open the stream (a grpc.aio stream-stream call)."""
        raise NotImplementedError

    def _items(self, message: In) -> Iterable[tuple[int, Item]]:
        """The (id, answer) pairs inside one message from the peer."""
        raise NotImplementedError

    def _connection_changed(self, connected: bool, reason: str) -> None:
        """Called after the stream comes up or goes down."""

    def _merge(self, messages: list[Out]) -> list[Out]:
        """Messages queued together, as they go on the wire (default: as is).

        A subclass may fold them into fewer: each message costs the peer a
        read and a parse whatever it carries."""
        return messages

    # ---- public ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._outbox is not None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._outbox = None  # (a send now is refused, not queued for nobody)
        self._fail_pending("client closed")
        await self.channel.close()

    def send(self, key: int, message: Out) -> asyncio.Future[Item]:
        """Send one item; the future resolves with its answer."""
        return self.send_many([key], message)[0]

    def send_many(self, keys: list[int], message: Out) -> list[asyncio.Future[Item]]:
        """Send one message carrying several items; a future per item."""
        if self._outbox is None:
            raise Unavailable(f"{self.address} is not connected")
        taken = [key for key in keys if key in self._pending]
        if taken:  # its answer would go to the wrong caller: a bug upstream
            raise RuntimeError(f"{self.address}: ids {taken} already await answers")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Item]] = []
        for key in keys:
            future: asyncio.Future[Item] = loop.create_future()
            self._pending[key] = future
            future.add_done_callback(functools.partial(self._forget, key))
            futures.append(future)
        self._outbox.put_nowait(message)
        return futures

    def _forget(self, key: int, future: asyncio.Future[Item]) -> None:
        if self._pending.get(key) is future:
            del self._pending[key]

    def post(self, message: Out) -> None:
        """Send a message that gets no answer (a cancel)."""
        if self._outbox is not None:
            self._outbox.put_nowait(message)

    # ---- the connection ----------------------------------------------------

    async def _connect_forever(self) -> None:
        while True:
            try:
                await self._serve_stream()
                reason = "stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # (an answer it cannot read, a bug)
                log.exception("stream to %s failed", self.address)
                reason = f"stream failed: {exc!r}"
            was_connected = self._outbox is not None
            self._outbox = None
            self._fail_pending(reason)
            if was_connected:
                self._connection_changed(False, reason)
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _serve_stream(self) -> None:
        await self._handshake()
        outbox: asyncio.Queue[Out | None] = asyncio.Queue()
        call = self._open(_drain(outbox, self._merge))
        try:
            self._outbox = outbox
            self._connection_changed(True, "")
            async for message in call:
                if message is None:  # grpc.aio logged why it could not parse it
                    raise BerthError(f"{self.address} sent an unreadable message")
                for key, item in self._items(message):
                    future = self._pending.get(key)
                    if future is not None and not future.done():
                        future.set_result(item)
        finally:
            # Ends this stream's request writer (it waits on the outbox, and
            # grpc.aio stops it only when the call is cancelled, not when the
            # peer ends the call) and, if it is still up, the stream itself.
            outbox.put_nowait(None)
            call.cancel()

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(
                    Unavailable(f"lost {self.address} with work in flight: {reason}")
                )


# At most this many queued messages are merged into one write.
MERGE_LIMIT = 256


async def _drain(
    queue: asyncio.Queue[Out | None], merge: Callable[[list[Out]], list[Out]]
) -> AsyncIterator[Out]:
    """Everything queued since the last write, merged, as the next writes;
    ends at a None (the stream is gone)."""
    while (first := await queue.get()) is not None:
        ready = [first]
        while not queue.empty() and len(ready) < MERGE_LIMIT:
            if (message := queue.get_nowait()) is None:
                return
            ready.append(message)
        for message in merge(ready) if len(ready) > 1 else ready:
            yield message


Request = TypeVar("Request")
Response = TypeVar("Response")


async def answer_concurrently(
    requests: AsyncIterator[Request],
    answer: Callable[[Request], Awaitable[Response]],
) -> AsyncIterator[Response]:
    """Serve a bidi stream: each request runs as its own task, answers are
    yielded as they complete (out of order); the stream ends once the caller
    has closed its side and every answer is out. ``answer`` must not raise:
    it turns its own errors into a response."""
    out: asyncio.Queue[Response | None] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    async def run(request: Request) -> None:
        out.put_nowait(await answer(request))

    async def read() -> None:
        async for request in requests:
            task = asyncio.create_task(run(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks))
        out.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (response := await out.get()) is not None:
            yield response
    finally:
        reader.cancel()
        for task in tasks:
            task.cancel()


async def answer_in_order(
    requests: AsyncIterator[Request],
    answer: Callable[[Request], Awaitable[Response]],
) -> AsyncIterator[Response]:
    """Serve a bidi stream as Triton serves a non-decoupled model's: each
    request runs as its own task at once, and the answers go out in request
    order (a caller may match them by position, without ids). The stream
    ends once the caller has closed its side and every answer is out.
    ``answer`` must not raise, as for :func:`answer_concurrently`."""
    started: asyncio.Queue[asyncio.Future[Response] | None] = asyncio.Queue()
    tasks: set[asyncio.Future[Response]] = set()

    async def read() -> None:
        try:
            async for request in requests:
                task = asyncio.ensure_future(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                started.put_nowait(task)
        finally:
            started.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (task := await started.get()) is not None:
            yield await task
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()


async def until_unreadable(
    requests: AsyncIterator[Request], unreadable: list[BerthError]
) -> AsyncIterator[Request]:
    """A server stream's requests up to one that cannot be read (bad
    protobuf, a string that is not UTF-8), whose error goes to
    ``unreadable``: gRPC reads nothing past it, so the requests before it
    are answered and the handler then ends the stream with that error,
    instead of the stream waiting for requests that never come."""
    n = 0
    try:
        async for request in requests:
            n += 1
            yield request
    except Exception as exc:
        kind = InvalidInput if isinstance(exc, DecodeError) else BerthError
        unreadable.append(
            kind(
                f"message {n + 1} of this stream cannot be read ({exc}); the "
                f"{n} before it are answered, and the stream ends here"
            )
        )


async def serve_stream(
    requests: AsyncIterator[Request],
    answer: Callable[[Request], Awaitable[Response]],
    context: grpc.aio.ServicerContext,
    in_order: bool = False,
) -> AsyncIterator[Response]:
    """A server stream's answers (:func:`answer_concurrently`, or
    :func:`answer_in_order`); a request that cannot be read ends the stream
    with its error once those before it are answered (:func:`until_unreadable`)."""
    unreadable: list[BerthError] = []
    serve = answer_in_order if in_order else answer_concurrently
    async for response in serve(until_unreadable(requests, unreadable), answer):
        yield response
    if unreadable:
        await abort(context, unreadable[0])
