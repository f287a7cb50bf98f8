"""Errors carry gRPC's richer error model: a google.rpc.Status in the
``grpc-status-details-bin`` trailer with an ErrorInfo of a stable reason,
a BadRequest naming the field at fault, and a RetryInfo for an overload
(services/errors.py status_details)."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from services.errors import (
    STATUS_DETAILS_KEY,
    InvalidInput,
    Overloaded,
    status_details,
)
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc


def details_of(exc: grpc.RpcError) -> dict[str, object]:
    """The error's details by type name, from its trailer."""
    trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
    status = status_pb2.Status.FromString(trailers[STATUS_DETAILS_KEY])
    assert status.code == exc.code().value[0]  # type: ignore[attr-defined]
    assert status.message == exc.details()  # type: ignore[attr-defined]
    found: dict[str, object] = {}
    for packed in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
        ):
            if packed.Is(kind.DESCRIPTOR):
                detail = kind()
                packed.Unpack(detail)
                found[kind.DESCRIPTOR.name] = detail
    return found


@pytest.mark.parametrize(
    ("request_", "code", "reason", "field"),
    [
        (
            berth_pb2.EmbedRequest(model="minilm", texts=["fine", ""]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT",
            "texts[1]",
        ),
        (
            berth_pb2.EmbedRequest(model="minilm", texts=["fine", "word " * 300]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT",
            "texts[1]",
        ),
        (
            berth_pb2.EmbedRequest(model="minilm", texts=[]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT",
            "texts",
        ),
        (  # (berth.v1 answers an unknown model INVALID_ARGUMENT)
            berth_pb2.EmbedRequest(model="no-such-model", texts=["hi"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "UNKNOWN_MODEL",
            "model",
        ),
        (
            berth_pb2.EmbedRequest(
                model="minilm",
                texts=["hi"],
                options=berth_pb2.Options(prompt_name="query"),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT",
            "options.prompt_name",
        ),
        (
            berth_pb2.EmbedRequest(
                model="minilm", texts=["hi"], options=berth_pb2.Options(dimensions=999)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT",
            "options.dimensions",
        ),
    ],
    ids=[
        "empty-text",
        "too-long",
        "no-texts",
        "unknown-model",
        "unknown-prompt",
        "too-wide",
    ],
)
def test_a_refused_call_carries_its_reason_and_field(
    client: berth_pb2_grpc.BerthStub,
    request_: berth_pb2.EmbedRequest,
    code: grpc.StatusCode,
    reason: str,
    field: str,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        client.Embed(request_, timeout=30)
    assert caught.value.code() is code  # type: ignore[attr-defined]
    details = details_of(caught.value)
    info = details["ErrorInfo"]
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain) == (reason, "berth")
    bad = details["BadRequest"]
    assert isinstance(bad, error_details_pb2.BadRequest)
    assert [v.field for v in bad.field_violations] == [field]


def test_the_field_at_fault_and_when_to_retry_are_told() -> None:
    bad = status_details(InvalidInput("texts[1] is empty", field="texts[1]"))
    (violation,) = unpacked(bad, error_details_pb2.BadRequest).field_violations
    assert (violation.field, violation.description) == (
        "texts[1]",
        "texts[1] is empty",
    )
    busy = status_details(Overloaded("too much in flight", retry_after_ms=250))
    delay = unpacked(busy, error_details_pb2.RetryInfo).retry_delay
    assert delay.ToMilliseconds() == 250
    assert unpacked(busy, error_details_pb2.ErrorInfo).reason == "OVERLOADED"
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def unpacked(status: status_pb2.Status, kind: type) -> object:
    (match,) = [d for d in status.details if d.Is(kind.DESCRIPTOR)]
    detail = kind()
    match.Unpack(detail)
    return detail
