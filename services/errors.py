"""Typed errors and their gRPC status codes.

Services raise these; the servers' handlers turn them into statuses with a
message that says what was wrong and which setting to change, and with the
richer error model's details (google.rpc.Status in the
``grpc-status-details-bin`` trailer, :func:`status_details`): an ErrorInfo
whose ``reason`` is stable (a caller may branch on it; the message may
change), a BadRequest naming the request field at fault where one is, and a
RetryInfo saying when to retry an overloaded gateway.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

# ErrorInfo.domain of every berth error.
DOMAIN = "berth"
# The trailer gRPC's richer error model puts the google.rpc.Status in.
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class BerthError(Exception):
    """Base of berth's errors; ``code`` is the gRPC status it maps to,
    ``reason`` the stable ErrorInfo reason (the class's, unless given);
    ``field``, where given, the request field at fault (e.g. "texts[3]")."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"

    def __init__(
        self, message: str = "", *, field: str | None = None, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.field = field
        if reason:
            self.reason = reason


class InvalidInput(BerthError):
    """The caller sent something we will never accept (never a failure)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_INPUT"


class UnknownModel(BerthError):
    """The named model is not in the repository."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "UNKNOWN_MODEL"


class Overloaded(BerthError):
    """Admission refused: too much work in flight; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "OVERLOADED"

    def __init__(self, message: str, retry_after_ms: int = 100) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unavailable(BerthError):
    """A hop we depend on is down or draining."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


# What an engine's Info answers, UNAVAILABLE, while it loads its models (the
# batcher's handshake, batcher/engines.py, asks again soon on this one).
ENGINE_LOADING = "engine is loading models"


class DeadlineExceeded(BerthError):
    """The caller's deadline passed before the work was done."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class Cancelled(BerthError):
    """The caller gave up."""

    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class EngineFailure(BerthError):
    """An engine failed to compute a batch."""

    code = grpc.StatusCode.INTERNAL
    reason = "ENGINE_FAILURE"


_BY_CODE: dict[int, type[BerthError]] = {
    cls.code.value[0]: cls
    for cls in (
        InvalidInput,
        UnknownModel,
        Overloaded,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        EngineFailure,
    )
}


def from_code(code: int, message: str) -> BerthError:
    """The error for a numeric status code carried inside a stream message."""
    return _BY_CODE.get(code, BerthError)(message)


def status_code(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


def status_details(error: BerthError) -> status_pb2.Status:
    """The google.rpc.Status of ``error``: its code and message, an
    ErrorInfo (reason, domain "berth"), a BadRequest when it names the
    field at fault, a RetryInfo when it is an overload."""
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN)
    details = [info]
    if error.field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=str(error)
        )
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(error, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        message = any_pb2.Any()
        message.Pack(detail)
        packed.append(message)
    return status_pb2.Status(
        code=error.code.value[0], message=str(error), details=packed
    )


async def abort(context: grpc.aio.ServicerContext, error: BerthError) -> None:
    """End the call with the error's status, its google.rpc.Status details
    and, for an overload, gRPC's retry push-back."""
    trailers: list[tuple[str, str | bytes]] = [
        (STATUS_DETAILS_KEY, status_details(error).SerializeToString())
    ]
    if isinstance(error, Overloaded):
        trailers.append(("grpc-retry-pushback-ms", str(error.retry_after_ms)))
    await context.abort(error.code, str(error), trailing_metadata=tuple(trailers))


def as_berth_error(exc: Exception, log: logging.Logger, what: str) -> BerthError:
    """The error to answer ``what`` with: a BerthError as it is; any other
    exception is a bug, logged with its traceback and answered INTERNAL, so
    that no caller is left unanswered."""
    if isinstance(exc, BerthError):
        return exc
    log.exception("%s failed", what)
    return BerthError(f"unexpected {type(exc).__name__}: {exc}")
