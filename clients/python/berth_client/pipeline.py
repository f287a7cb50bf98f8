"""The bookkeeping of one ``stream()`` call, shared by the sync and the
asyncio client (which add the locking and the I/O).

Requests are numbered 1, 2, ... in the order given (the number is the
request_id the gateway echoes; the gateway answers a stream's requests as
they are ready, not in order). At most ``window`` requests are numbered and
not yet handed back. Answers are handed back in request order. Each request
stays kept until it is answered, so that a stream that fails (UNAVAILABLE)
after answering some can be opened again with the unanswered ones resent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from berth_client._proto.berth.v1 import berth_pb2
from berth_client.errors import BerthError, from_stream_error
from berth_client.results import (
    ClassifyResult,
    EmbedResult,
    RerankResult,
    StreamResult,
)

Answer = StreamResult | BerthError


def stream_request(request: Any) -> berth_pb2.StreamRequest:
    """A StreamRequest of its own holding ``request``: an EmbedRequest, a
    ClassifyRequest, a RerankRequest or a StreamRequest holding one (copied,
    as the request id is set in it)."""
    message = berth_pb2.StreamRequest()
    if isinstance(request, berth_pb2.StreamRequest):
        message.CopyFrom(request)
    elif isinstance(request, berth_pb2.EmbedRequest):
        message.embed.CopyFrom(request)
    elif isinstance(request, berth_pb2.ClassifyRequest):
        message.classify.CopyFrom(request)
    elif isinstance(request, berth_pb2.RerankRequest):
        message.rerank.CopyFrom(request)
    else:
        raise TypeError(
            "stream() takes EmbedRequest, ClassifyRequest, RerankRequest or "
            "StreamRequest messages (berth_client.embed_request, "
            f"classify_request, rerank_request), not {type(request).__name__}"
        )
    if _inner(message) is None:
        raise TypeError("a StreamRequest holding no embed, classify or rerank")
    return message


def _inner(message: Any) -> Any:
    """The Embed/Classify/Rerank request (or response) inside a stream
    message."""
    kind = message.WhichOneof(message.DESCRIPTOR.oneofs[0].name)
    return None if kind is None else getattr(message, kind)


@dataclass
class Pipeline:
    """The state of one stream() call; the caller holds its lock around
    every method."""

    window: int
    numbered: int = 0  # requests taken from the source: ids 1..numbered
    handed: int = 0  # answers handed back: ids 1..handed
    unanswered: dict[int, berth_pb2.StreamRequest] = field(default_factory=dict)
    pending: deque[int] = field(default_factory=deque)  # to send, in order
    answers: dict[int, Answer] = field(default_factory=dict)
    exhausted: bool = False  # the source has no more requests
    pulling: bool = False  # a sender is taking the next request from the source
    failure: BaseException | None = None  # what the source raised
    generation: int = 0  # streams opened again after one failed
    answered_here: int = 0  # answers on the current stream

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window={self.window}: at least 1 request in flight")

    def may_pull(self) -> bool:
        """A sender may take the next request from the source now."""
        return (
            not self.exhausted
            and not self.pulling
            and self.numbered - self.handed < self.window
        )

    def ready(self) -> bool:
        """A sender has something to do (:meth:`step`)."""
        return bool(self.pending) or self.exhausted or self.may_pull()

    def step(self) -> tuple[str, berth_pb2.StreamRequest | None]:
        """What a sender does next: ('send', message); ('pull', None), take
        the next request from the source (no other sender does meanwhile);
        ('end', None), close the sending side; ('wait', None)."""
        message = self.next_to_send()
        if message is not None:
            return "send", message
        if self.exhausted:
            return "end", None
        if self.may_pull():
            self.pulling = True
            return "pull", None
        return "wait", None

    def add(self, message: berth_pb2.StreamRequest) -> None:
        """Number the next request of the source (a message of its own, from
        :func:`stream_request`) and queue it to be sent."""
        self.numbered += 1
        _inner(message).request_id = self.numbered
        self.unanswered[self.numbered] = message
        self.pending.append(self.numbered)

    def next_to_send(self) -> berth_pb2.StreamRequest | None:
        while self.pending:
            number = self.pending.popleft()
            if number in self.unanswered:
                return self.unanswered[number]
        return None

    def take(self, response: berth_pb2.StreamResponse) -> list[Answer]:
        """Record an answer; returns the answers now due, in request order."""
        kind = response.WhichOneof("response")
        inner = _inner(response)
        number = 0 if inner is None else inner.request_id
        if number not in self.unanswered:
            if kind == "error":  # about a request it could not tell
                error = response.error
                raise from_stream_error(error.code, error.message, None)
            raise BerthError(f"the gateway answered request_id {number}, not one sent")
        del self.unanswered[number]
        self.answered_here += 1
        if kind == "embed":
            self.answers[number] = EmbedResult.of(response.embed)
        elif kind == "classify":
            self.answers[number] = ClassifyResult.of(response.classify)
        elif kind == "rerank":
            self.answers[number] = RerankResult.of(response.rerank)
        else:
            error = response.error
            self.answers[number] = from_stream_error(
                error.code, error.message, number - 1
            )
        due = []
        while self.handed + 1 in self.answers:
            self.handed += 1
            due.append(self.answers.pop(self.handed))
        return due

    def reopen(self) -> bool:
        """After the current stream failed: whether to open another, which
        then sends the unanswered requests first. Only when the failed one
        answered something: a stream that answers nothing is not retried
        here (gRPC's retry policy has retried its start already)."""
        if not self.answered_here:
            return False
        self.generation += 1
        self.answered_here = 0
        self.pending = deque(sorted(self.unanswered))
        return True

    def finished(self) -> None:
        """The stream ended OK: raise what the source raised, or an error
        when requests are left unanswered."""
        if self.failure is not None:
            raise self.failure
        if self.unanswered:
            raise BerthError(
                f"the stream ended with {len(self.unanswered)} requests unanswered"
            )
