"""KServe v2 refusals carry google.rpc details as berth.v1's do
(services/errors.py status_details): an ErrorInfo of berth.v1's reasons and
a BadRequest naming the request field at fault, as the protocol's messages
name it (model_name, inputs[0].shape, parameters.<name>, outputs[i].name).

This process imports tritonclient's own generated `inference` stubs, never
berth's (services.proto.inference): one process can hold only one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.kserve_inputs import request, violation
from tests.stack import Stack


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(stack.gateway) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def raw(texts: list[bytes], tail: bytes = b"") -> service_pb2.ModelInferRequest:
    """TEXT as one raw_input_contents entry (length-prefixed), plus ``tail``."""
    built = service_pb2.ModelInferRequest(model_name="minilm")
    built.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    packed = b"".join(len(t).to_bytes(4, "little") + t for t in texts)
    built.raw_input_contents.append(packed + tail)
    return built


def with_parameter(name: str, **value: Any) -> service_pb2.ModelInferRequest:
    built = request()
    built.parameters[name].CopyFrom(service_pb2.InferParameter(**value))
    return built


def with_output(
    name: str, *parameters: tuple[str, dict[str, Any]]
) -> service_pb2.ModelInferRequest:
    built = request(model="intent")
    output = built.outputs.add(name=name)
    for key, value in parameters:
        output.parameters[key].CopyFrom(service_pb2.InferParameter(**value))
    return built


def two_outputs() -> service_pb2.ModelInferRequest:
    built = with_output("LABEL", ("binary_data", {"bool_param": True}))
    built.outputs.add(name="PROBABILITIES").parameters["binary_data"].bool_param = False
    return built


def two_inputs() -> service_pb2.ModelInferRequest:
    built = request()
    built.inputs.add(name="OTHER", datatype="BYTES", shape=[1])
    return built


def typed_and_raw() -> service_pb2.ModelInferRequest:
    built = request()
    built.raw_input_contents.append(b"\x04\x00\x00\x00fine")
    return built


INVALID, UNKNOWN = "INVALID_INPUT", "UNKNOWN_MODEL"
FIELD_CASES: list[tuple[str, Callable[[], Any], str, str, str]] = [
    (
        "unknown-model",
        lambda: request(model="nope"),
        "NOT_FOUND",
        UNKNOWN,
        "model_name",
    ),
    (
        "unknown-version",
        lambda: request(model_version="2"),
        "NOT_FOUND",
        UNKNOWN,
        "model_version",
    ),
    ("two-inputs", two_inputs, "INVALID_ARGUMENT", INVALID, "inputs"),
    (
        "datatype",
        lambda: request(inputs=[{"name": "TEXT", "datatype": "FP32", "shape": [1]}]),
        "INVALID_ARGUMENT",
        INVALID,
        "inputs[0].datatype",
    ),
    (
        "rank",
        lambda: request(
            inputs=[{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1]}]
        ),
        "INVALID_ARGUMENT",
        INVALID,
        "inputs[0].shape",
    ),
    (
        "count",
        lambda: request(inputs=[{"name": "TEXT", "datatype": "BYTES", "shape": [2]}]),
        "INVALID_ARGUMENT",
        INVALID,
        "inputs[0].shape",
    ),
    ("no-texts", lambda: request([]), "INVALID_ARGUMENT", INVALID, "inputs[0]"),
    (
        "empty-text",
        lambda: request([b"fine", b""]),
        "INVALID_ARGUMENT",
        INVALID,
        "inputs[0].contents.bytes_contents[1]",
    ),
    (
        "too-long",
        lambda: request([b"fine", b"fine", b"word " * 300]),
        "INVALID_ARGUMENT",
        INVALID,
        "inputs[0].contents.bytes_contents[2]",
    ),
    (
        "not-utf8",
        lambda: request([b"\xff\xfe"]),
        "INVALID_ARGUMENT",
        INVALID,
        "inputs[0].contents.bytes_contents[0]",
    ),
    (
        "raw-empty-text",
        lambda: raw([b"fine", b""]),
        "INVALID_ARGUMENT",
        INVALID,
        "raw_input_contents[0]",
    ),
    (
        "raw-cut-short",
        lambda: raw([b"fine"], tail=b"\x09\x00"),
        "INVALID_ARGUMENT",
        INVALID,
        "raw_input_contents[0]",
    ),
    ("typed-and-raw", typed_and_raw, "INVALID_ARGUMENT", INVALID, "raw_input_contents"),
    (
        "unknown-parameter",
        lambda: with_parameter("colour", string_param="blue"),
        "INVALID_ARGUMENT",
        INVALID,
        "parameters.colour",
    ),
    (
        "parameter-type",
        lambda: with_parameter("truncate", int64_param=1),
        "INVALID_ARGUMENT",
        INVALID,
        "parameters.truncate",
    ),
    (
        "dimensions",
        lambda: with_parameter("dimensions", int64_param=10_000),
        "INVALID_ARGUMENT",
        INVALID,
        "parameters.dimensions",
    ),
    (
        "timeout-type",
        lambda: with_parameter("timeout", string_param="soon"),
        "INVALID_ARGUMENT",
        INVALID,
        "parameters.timeout",
    ),
    (
        "unknown-output",
        lambda: with_output("SCORES"),
        "INVALID_ARGUMENT",
        INVALID,
        "outputs[0].name",
    ),
    (
        "classify-bytes",
        lambda: with_output("LABEL", ("classification", {"int64_param": 2})),
        "INVALID_ARGUMENT",
        INVALID,
        "outputs[0].parameters.classification",
    ),
    (
        "output-parameter",
        lambda: with_output("LABEL", ("colour", {"string_param": "blue"})),
        "INVALID_ARGUMENT",
        INVALID,
        "outputs[0].parameters.colour",
    ),
    ("mixed-binary", two_outputs, "INVALID_ARGUMENT", INVALID, "outputs"),
]


@pytest.mark.parametrize(
    ("build", "code", "reason", "field"),
    [case[1:] for case in FIELD_CASES],
    ids=[case[0] for case in FIELD_CASES],
)
def test_a_refused_infer_names_its_field(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    build: Callable[[], service_pb2.ModelInferRequest],
    code: str,
    reason: str,
    field: str,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(build(), timeout=30)
    assert caught.value.code().name == code, caught.value.details()  # type: ignore[attr-defined]
    assert violation(caught.value) == (reason, field)


@pytest.mark.parametrize(
    ("rpc", "build"),
    [
        ("ModelMetadata", service_pb2.ModelMetadataRequest),
        ("ModelConfig", service_pb2.ModelConfigRequest),
        ("ModelStatistics", service_pb2.ModelStatisticsRequest),
    ],
)
def test_a_model_rpc_names_its_name_or_version_field(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, rpc: str, build: Any
) -> None:
    for fields, field in (
        ({"name": "nope"}, "name"),
        ({"name": "minilm", "version": "2"}, "version"),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            getattr(stub, rpc)(build(**fields), timeout=10)
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert violation(caught.value) == (UNKNOWN, field)


@pytest.mark.parametrize("where", ["request", "output"])
def test_a_huge_parameter_name_is_named_short(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, where: str
) -> None:
    """The field names a prefix of the name and its length (gateway/echo.py):
    the details travel in the trailers, which gRPC caps near 16 KiB."""
    name = "p" * 100_000
    built = request() if where == "request" else with_output("LABEL")
    parameters = built.parameters if where == "request" else built.outputs[0].parameters
    parameters[name].bool_param = True
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(built, timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    reason, field = violation(caught.value)
    prefix = "parameters." if where == "request" else "outputs[0].parameters."
    assert reason == "INVALID_INPUT" and field.startswith(prefix + "'ppp")
    assert field.endswith("(100000 characters)") and len(field) < 200
