"""Typed errors and their gRPC status codes.

Services raise these; the servers' handlers turn them into statuses with a
message that says what was wrong and which setting to change.
"""

from __future__ import annotations

import logging

import grpc


class BerthError(Exception):
    """Base of berth's errors; ``code`` is the gRPC status it maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidInput(BerthError):
    """The caller sent something we will never accept (never a failure)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownModel(BerthError):
    """The named model is not in the repository."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(BerthError):
    """Admission refused: too much work in flight; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int = 100) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unavailable(BerthError):
    """A hop we depend on is down or draining."""

    code = grpc.StatusCode.UNAVAILABLE


# What an engine's Info answers, UNAVAILABLE, while it loads its models (the
# batcher's handshake, batcher/engines.py, asks again soon on this one).
ENGINE_LOADING = "engine is loading models"


class DeadlineExceeded(BerthError):
    """The caller's deadline passed before the work was done."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(BerthError):
    """The caller gave up."""

    code = grpc.StatusCode.CANCELLED


class EngineFailure(BerthError):
    """An engine failed to compute a batch."""

    code = grpc.StatusCode.INTERNAL


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


async def abort(context: grpc.aio.ServicerContext, error: BerthError) -> None:
    """End the call with the error's status (and retry push-back if any)."""
    if isinstance(error, Overloaded):
        context.set_trailing_metadata(
            (("grpc-retry-pushback-ms", str(error.retry_after_ms)),)
        )
    await context.abort(error.code, str(error))


def as_berth_error(exc: Exception, log: logging.Logger, what: str) -> BerthError:
    """The error to answer ``what`` with: a BerthError as it is; any other
    exception is a bug, logged with its traceback and answered INTERNAL, so
    that no caller is left unanswered."""
    if isinstance(exc, BerthError):
        return exc
    log.exception("%s failed", what)
    return BerthError(f"unexpected {type(exc).__name__}: {exc}")
