"""Inputs of berth's KServe v2 models, as the stock client (tritonclient) sends.

Only for tests that import tritonclient's own `inference` stubs, never
berth's (services.proto.inference): one process can hold only one of them.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as triton
from google.rpc import error_details_pb2
from tritonclient.grpc import service_pb2

from tests.gateway.test_error_details import details_of


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("TEXT", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object))
    return tensor


def request(
    texts: list[bytes] | None = None, model: str = "minilm", **fields: Any
) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest of typed TEXT contents (``texts``) and ``fields``."""
    texts = [b"fine"] if texts is None else texts
    built = service_pb2.ModelInferRequest(model_name=model, **fields)
    if not built.inputs:
        text = built.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
        text.contents.bytes_contents.extend(texts)
    return built


def violation(error: grpc.RpcError) -> tuple[str, str]:
    """The ErrorInfo reason and the one BadRequest field of an error."""
    details = details_of(error)
    info, bad = details["ErrorInfo"], details.get("BadRequest")
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.domain == "berth"
    assert isinstance(bad, error_details_pb2.BadRequest), details
    (field,) = bad.field_violations
    assert field.description == error.details()  # type: ignore[attr-defined]
    return info.reason, field.field
