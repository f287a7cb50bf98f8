"""The exceptions a call raises: one class per gRPC status the gateway uses.

Every one is a :class:`BerthError` and carries the status code, its details
(the gateway's message) and the trailing metadata. Errors of a request in a
stream (``StreamError`` messages) map onto the same classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

Metadata = tuple[tuple[str, str | bytes], ...]
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class BerthError(Exception):
    """A call (or one request of a stream) that ended with a status other
    than OK. ``code``: the grpc.StatusCode; ``details``: the message;
    ``trailing_metadata``: the trailers of the call (empty for a stream
    request's error); ``index``: for an error of :meth:`Client.stream`, the
    position of its request among the requests given (else None)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        trailing_metadata: Metadata = (),
        index: int | None = None,
    ) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code
        self.trailing_metadata = trailing_metadata
        self.index = index

    def __str__(self) -> str:
        where = "" if self.index is None else f" (request {self.index})"
        return f"{self.code.name}{where}: {self.details}"


class InvalidInput(BerthError):
    """INVALID_ARGUMENT: the call will never be accepted as it is (an empty
    text, too many texts, a text over the model's token limit without
    ``truncate``). Do not retry it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(BerthError):
    """NOT_FOUND: no such model; the message names the models served."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(BerthError):
    """RESOURCE_EXHAUSTED: the gateway shed the call (more requests in
    flight than it admits). ``retry_after_ms`` is the wait the gateway asked
    for (its ``grpc-retry-pushback-ms`` trailer), None when it sent none
    (as for a message over the size limit, which is RESOURCE_EXHAUSTED too)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def retry_after_ms(self) -> int | None:
        for key, value in self.trailing_metadata:
            if key == PUSHBACK_KEY:
                text = value.decode() if isinstance(value, bytes) else value
                return int(text) if text.isdigit() else None
        return None


class Unauthenticated(BerthError):
    """UNAUTHENTICATED: the gateway takes API keys and the call carried
    none, or one it does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(BerthError):
    """PERMISSION_DENIED: the API key may not use this model."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(BerthError):
    """UNAVAILABLE: no gateway could be reached (or the TLS handshake
    failed), or the gateway is draining; raised once the retry policy's
    attempts are spent."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(BerthError):
    """DEADLINE_EXCEEDED: the call's deadline passed first."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(BerthError):
    """CANCELLED: the call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class Unimplemented(BerthError):
    """UNIMPLEMENTED: the server has no such method (a gateway older than
    this client)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class ServerError(BerthError):
    """INTERNAL, UNKNOWN or DATA_LOSS: a failure in the server."""

    code = grpc.StatusCode.INTERNAL


_CLASSES: dict[grpc.StatusCode, type[BerthError]] = {
    cls.code: cls
    for cls in (
        InvalidInput,
        NotFound,
        Overloaded,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unimplemented,
        ServerError,
    )
}
_CLASSES[grpc.StatusCode.UNKNOWN] = ServerError
_CLASSES[grpc.StatusCode.DATA_LOSS] = ServerError


def error_for(
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: Metadata = (),
    index: int | None = None,
) -> BerthError:
    """The exception of a status: its class, or BerthError for a code
    without one."""
    cls = _CLASSES.get(code, BerthError)
    return cls(details, code=code, trailing_metadata=trailing_metadata, index=index)


def _metadata(items: Iterable[Any] | None) -> Metadata:
    """Trailing metadata as (key, value) pairs, from a sync call's tuple of
    _Metadatum or an asyncio call's grpc.aio.Metadata."""
    return tuple((str(key), value) for key, value in items or ())


def from_rpc_error(exc: grpc.RpcError) -> BerthError:
    """The exception of a failed call (a sync grpc.RpcError, which is also a
    grpc.Call, or a grpc.aio.AioRpcError)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
    return error_for(code, details, _metadata(trailers))


def from_stream_error(code_name: str, message: str, index: int | None) -> BerthError:
    """The exception of a StreamError: its ``code`` is a grpc.StatusCode
    name."""
    code = grpc.StatusCode.__members__.get(code_name, grpc.StatusCode.UNKNOWN)
    return error_for(code, message, index=index)
