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
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError

from services import internal_tls
from services.channels import aio_channel
from services.errors import BerthError, InvalidInput, Unavailable, abort

log = logging.getLogger("berth.streams")

Out = TypeVar("Out")  # what we send on the stream
In = TypeVar("In")  # what the peer sends back
Item = TypeVar("Item")  # one answer inside an In message

# Reconnecting (see reconnect_delay): the first retry comes at once, as a
# restarted peer should be streamed to again promptly; each failure in a row
# doubles the wait, up to RECONNECT_MAX_S, so a peer that keeps refusing is
# not tried five times a second forever.
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0
RECONNECT_JITTER = 0.2  # each wait is spread +-20% at random
# A stream that stayed up this long worked: the next loss starts the back-off
# afresh. (One that failed sooner counts as a failure in a row: a peer that
# accepts each stream and drops it at once is backed off too.)
STABLE_STREAM_S = 5.0
# How often a client without a stream looks whether its internal TLS files
# changed (services/internal_tls.py).
TLS_RECHECK_S = 1.0
# While a peer keeps failing, say so at most this often.
FAILURE_LOG_EVERY_S = 60.0


def reconnect_delay(
    failures: int, uniform: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before the next try after ``failures`` (1 or more)
    failures in a row: RECONNECT_FIRST_S, doubling with each further
    failure, up to RECONNECT_MAX_S; each spread by RECONNECT_JITTER at
    random (``uniform``: a number in [0, 1)), so that the clients of one
    restarted peer do not all come back in step."""
    doublings = min(max(failures, 1) - 1, 16)  # (2.0 ** 1024 overflows)
    base = min(RECONNECT_MAX_S, RECONNECT_FIRST_S * 2**doublings)
    return base * (1 + RECONNECT_JITTER * (2 * uniform() - 1))


class StreamClient(Generic[Out, In, Item]):
    """One peer: a bidi stream whose answers resolve futures by id."""

    def __init__(self, address: str, stub: Callable[[grpc.aio.Channel], Any]) -> None:
        """A client of ``address``; ``stub`` makes the generated stub of its
        service over a channel (``self._stub``)."""
        self.address = address
        self._make_stub = stub
        self._tls_stamp = internal_tls.stamp()
        self.channel = aio_channel(address)
        self._stub: Any = stub(self.channel)
        self._tls_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Item]] = {}
        self._outbox: asyncio.Queue[Out | None] | None = None
        self._task: asyncio.Task[None] | None = None
        # Reconnecting: tries in a row that gave no lasting stream, when
        # the current stream opened, when a failure was last logged.
        self._failed_tries = 0
        self._opened_at: float | None = None
        self._failure_logged = 0.0

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
        if internal_tls.current() is not None:
            self._tls_task = asyncio.create_task(self._watch_tls())

    async def close(self) -> None:
        for task in (self._task, self._tls_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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
            self._opened_at = None
            unexpected: Exception | None = None
            try:
                await self._serve_stream()
                reason = "stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # (close())
                # A call on a channel _watch_tls closed: grpc.aio cancels it.
                reason = "its channel was replaced"
            except Exception as exc:  # (an answer it cannot read, a bug)
                unexpected = exc
                reason = f"stream failed: {exc!r}"
            was_connected = self._outbox is not None
            self._outbox = None
            self._fail_pending(reason)
            if was_connected:
                self._connection_changed(False, reason)
            lasted = (
                time.monotonic() - self._opened_at
                if self._opened_at is not None
                else 0.0
            )
            self._failed_tries = (
                1 if lasted >= STABLE_STREAM_S else self._failed_tries + 1
            )
            delay = reconnect_delay(self._failed_tries)
            self._log_failure(reason, delay, was_connected, unexpected)
            await asyncio.sleep(delay)

    def _log_failure(
        self,
        reason: str,
        delay: float,
        was_connected: bool,
        unexpected: Exception | None,
    ) -> None:
        """Say why there is no stream: at the first failure of a run, then
        at most every FAILURE_LOG_EVERY_S while the run goes on (each try
        only at DEBUG), not five lines a second about a peer that is down."""
        now = time.monotonic()
        first = self._failed_tries == 1
        if not first and now - self._failure_logged < FAILURE_LOG_EVERY_S:
            log.debug(
                "stream to %s: %d tries in a row failed (%s); next in %.2f s",
                self.address,
                self._failed_tries,
                reason,
                delay,
            )
            return
        self._failure_logged = now
        if unexpected is not None:  # a bug or a garbled answer: say where
            log.error(
                "stream to %s failed (%d tries in a row); retrying in %.2f s",
                self.address,
                self._failed_tries,
                delay,
                exc_info=unexpected,
            )
        elif not first:  # (the run's first said it; this says it goes on)
            log.warning(
                "stream to %s: %d tries in a row failed (last: %s); "
                "retrying, next in %.2f s",
                self.address,
                self._failed_tries,
                reason,
                delay,
            )
        elif not was_connected:  # (a stream that was up going down is the
            # subclass's to tell, in _connection_changed)
            log.warning(
                "no stream to %s (%s); retrying with back-off", self.address, reason
            )

    async def _renew_channel(self) -> None:
        """A new channel (and stub) when the internal TLS files changed since
        the channel was made: its next handshake would present the old
        certificate and trust the old CA. A stream that is up keeps its
        connection; this runs before each (re)connect."""
        stamp = internal_tls.stamp()
        if not stamp or stamp == self._tls_stamp:
            return
        try:
            channel = aio_channel(self.address)
        except OSError as exc:  # half-written: the next try reads it again
            log.warning(
                "stream to %s: cannot read the internal TLS files: %s",
                self.address,
                exc,
            )
            return
        old, self.channel = self.channel, channel
        self._stub, self._tls_stamp = self._make_stub(channel), stamp
        log.info(
            "stream to %s: internal TLS files changed: connecting with them",
            self.address,
        )
        await old.close()

    async def _watch_tls(self) -> None:
        """While no stream is up, renew the channel as soon as the internal
        TLS files change: closing the old channel ends a connection attempt
        that waits on it (a handshake the peer refuses is retried inside
        the channel, under wait_for_ready, for ever)."""
        while True:
            await asyncio.sleep(TLS_RECHECK_S)
            if not self.connected:
                await self._renew_channel()

    async def _serve_stream(self) -> None:
        await self._renew_channel()
        await self._handshake()
        outbox: asyncio.Queue[Out | None] = asyncio.Queue()
        call = self._open(_drain(outbox, self._merge))
        self._opened_at = time.monotonic()
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
