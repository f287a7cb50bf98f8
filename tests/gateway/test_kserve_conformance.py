"""KServe v2 conformance: every RPC of inference.GRPCInferenceService, called
with the stock tritonclient.grpc client against a real stack, its answers
checked field by field against the protocol (protos/inference/ and Triton's
grpc_service.proto and model_config.proto, which tritonclient's stubs are).

The RPCs berth serves answer as the protocol says; the ones it does not
serve answer UNIMPLEMENTED, naming themselves and why. Refused requests
carry google.rpc details naming the request field at fault, with berth.v1's
ErrorInfo reasons.

This process imports tritonclient's own generated `inference` stubs, never
berth's (services.proto.inference): one process can hold only one of them.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from google.rpc import error_details_pb2
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.gateway.test_error_details import details_of
from tests.kserve_inputs import request, text_input, violation
from tests.stack import Stack, free_ports
from tests.test_gateways import service

# What berth's ModelMetadata says of its default models (docs/kserve.md).
INPUTS = [("TEXT", "BYTES", [-1])]
OUTPUTS = {
    "minilm": [("EMBEDDING", "FP32", [-1, 384])],
    "intent": [("PROBABILITIES", "FP32", [-1, 157]), ("LABEL", "BYTES", [-1])],
}
CONFIG_TYPES = {
    "FP32": model_config_pb2.TYPE_FP32,
    "BYTES": model_config_pb2.TYPE_STRING,
}
SERVED = [
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
]
EXTENSIONS = [
    "classification",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "parameters",
]


@pytest.fixture(scope="module")
def tc(stack: Stack) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url=stack.gateway)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(stack.gateway) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def refused(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str]:
    """The status and message of tritonclient's exception for a call."""
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return str(info.value.status()), str(info.value.message())


def tensors(response: Any) -> list[tuple[str, str, list[int]]]:
    return [(o.name, o.datatype, list(o.shape)) for o in response.outputs]


def test_server_live_ready_and_metadata(tc: triton.InferenceServerClient) -> None:
    assert tc.is_server_live() is True
    assert tc.is_server_ready() is True
    meta = tc.get_server_metadata()
    assert meta.name == "berth"
    assert meta.version == metadata.version("berth")
    assert list(meta.extensions) == EXTENSIONS


def test_model_ready_per_model_and_version(tc: triton.InferenceServerClient) -> None:
    for name in OUTPUTS:
        assert tc.is_model_ready(name) is True
        assert tc.is_model_ready(name, "1") is True
        assert tc.is_model_ready(name, "2") is False
    assert tc.is_model_ready("no-such-model") is False


@pytest.mark.parametrize("model", sorted(OUTPUTS))
@pytest.mark.parametrize("version", ["", "1"])
def test_model_metadata(
    tc: triton.InferenceServerClient, model: str, version: str
) -> None:
    meta = tc.get_model_metadata(model, version)
    assert (meta.name, list(meta.versions), meta.platform) == (model, ["1"], "berth")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == INPUTS
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == OUTPUTS[model]


def test_model_config(tc: triton.InferenceServerClient) -> None:
    for model, outputs in OUTPUTS.items():
        config = tc.get_model_config(model, "1").config
        assert (config.name, config.platform, config.max_batch_size) == (
            model,
            "berth",
            0,  # the shapes are whole tensors: [-1] is the texts
        )
        assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
            ("TEXT", model_config_pb2.TYPE_STRING, [-1])
        ]
        assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
            (n, CONFIG_TYPES[d], s) for n, d, s in outputs
        ]
        assert config.HasField("dynamic_batching")
        assert config.dynamic_batching.preserve_ordering is True
        assert config.HasField("response_cache") and config.response_cache.enable
        task = "embed" if model == "minilm" else "classify"
        assert config.parameters["task"].string_value == task
        assert config.parameters["max_tokens"].string_value == "256"
        assert not config.HasField("sequence_batching")
        assert not config.HasField("ensemble_scheduling")


def test_repository_index_lists_every_model_ready(
    tc: triton.InferenceServerClient,
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    index = tc.get_model_repository_index()
    listed = [(m.name, m.version, m.state, m.reason) for m in index.models]
    assert [m[0] for m in listed] == sorted(m[0] for m in listed)
    assert set(OUTPUTS) <= {m[0] for m in listed}
    assert all(m[1:] == ("1", "READY", "") for m in listed), listed
    for name, *_ in listed:  # each one is a model the other RPCs know
        assert tc.get_model_metadata(name).name == name
    ready = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
    assert [m.name for m in ready.models] == [m[0] for m in listed]
    with pytest.raises(grpc.RpcError) as caught:
        stub.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(repository_name="elsewhere"),
            timeout=10,
        )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert violation(caught.value) == ("INVALID_INPUT", "repository_name")


def test_a_gateway_without_its_batcher_says_nothing_is_ready(
    repository: Path,
) -> None:
    """Live, but neither it nor any model ready; RepositoryIndex lists every
    model UNAVAILABLE with a reason, and none where only ready ones are
    asked for."""
    (nowhere,) = free_ports(1)
    flags = ("--batcher", f"127.0.0.1:{nowhere}")
    with service("gateway", repository, *flags) as gateway:
        gateway.wait_for("NOT_SERVING")
        client = triton.InferenceServerClient(url=gateway.address)
        try:
            assert client.is_server_live() is True
            assert client.is_server_ready() is False
            assert client.is_model_ready("minilm") is False
            index = client.get_model_repository_index().models
            assert set(OUTPUTS) <= {m.name for m in index}
            for model in index:
                assert (model.version, model.state) == ("1", "UNAVAILABLE")
                assert "no engine" in model.reason
            with grpc.insecure_channel(gateway.address) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                ready = service_pb2.RepositoryIndexRequest(ready=True)
                assert list(stub.RepositoryIndex(ready, timeout=10).models) == []
        finally:
            client.close()


def shapes(outputs: list[tuple[str, str, list[int]]], n: int) -> list[Any]:
    """The metadata's outputs, -1 (the number of texts) set to n."""
    return [(name, d, [n if x == -1 else x for x in s]) for name, d, s in outputs]


def test_infer_answers_as_the_metadata_says(tc: triton.InferenceServerClient) -> None:
    texts = [f"{uuid.uuid4().hex} conformance", "set an alarm for 7 am"]
    for model, outputs in OUTPUTS.items():
        result = tc.infer(
            model,
            [text_input(texts)],
            model_version="1",
            outputs=[triton.InferRequestedOutput(n) for n, *_ in outputs],
            request_id="conformance-7",
            parameters={"truncate": True},
        )
        response = result.get_response()
        assert (response.model_name, response.model_version, response.id) == (
            model,
            "1",
            "conformance-7",
        )
        assert tensors(response) == shapes(outputs, len(texts))
        assert len(response.raw_output_contents) == len(outputs)
        assert dict(response.parameters) == {}  # not degraded
        for name, datatype, shape in outputs:
            values = result.as_numpy(name)
            assert values.shape == (len(texts), *shape[1:]), name
            assert values.dtype == (np.float32 if datatype == "FP32" else object)
    probabilities = tc.infer("intent", [text_input(texts)]).as_numpy("PROBABILITIES")
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-4)


def test_typed_outputs_answer_as_the_metadata_says(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    """binary_data_output false (which tritonclient reserves for itself):
    the same tensors, in typed contents, none raw."""
    for model, outputs in OUTPUTS.items():
        asked = request([b"one text", b"and another"], model=model, id="typed-1")
        asked.parameters["binary_data_output"].bool_param = False
        response = stub.ModelInfer(asked, timeout=30)
        assert (response.model_name, response.model_version, response.id) == (
            model,
            "1",
            "typed-1",
        )
        assert tensors(response) == shapes(outputs, 2)
        assert list(response.raw_output_contents) == []
        for tensor in response.outputs:
            filled = [f.name for f, _ in tensor.contents.ListFields()]
            size = int(np.prod(tensor.shape))
            if tensor.datatype == "FP32":
                assert (filled, len(tensor.contents.fp32_contents)) == (
                    ["fp32_contents"],
                    size,
                )
            else:
                assert (filled, len(tensor.contents.bytes_contents)) == (
                    ["bytes_contents"],
                    size,
                )


def test_async_infer_answers_through_its_callback(
    tc: triton.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    texts = ["hello world", "你好"]
    tc.async_infer(
        "minilm",
        [text_input(texts)],
        lambda result, error: answers.put((result, error)),
        request_id="async-1",
    )
    result, error = answers.get(timeout=60)
    assert error is None
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == (
        "async-1",
        "minilm",
        "1",
    )
    expected = tc.infer("minilm", [text_input(texts)]).as_numpy("EMBEDDING")
    np.testing.assert_allclose(result.as_numpy("EMBEDDING"), expected, atol=1e-6)
    tc.async_infer(
        "no-such-model",
        [text_input(texts)],
        lambda result, error: answers.put((result, error)),
    )
    result, error = answers.get(timeout=60)
    assert result is None and error.status() == "StatusCode.NOT_FOUND"


def test_stream_answers_each_request_in_order(
    tc: triton.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, model in enumerate(["minilm", "intent", "minilm"]):
            tc.async_stream_infer(
                model,
                [text_input([f"stream {i}"])],
                request_id=f"s{i}",
                enable_empty_final_response=i == 2,
            )
        tc.async_stream_infer("minilm", [text_input([""])], request_id="bad")
        got = [answers.get(timeout=60) for _ in range(4)]
    finally:
        tc.stop_stream()
    responses = [r.get_response() for r, e in got[:3]]
    assert [e for _, e in got[:3]] == [None] * 3
    assert [(r.id, r.model_name, r.model_version) for r in responses] == [
        ("s0", "minilm", "1"),
        ("s1", "intent", "1"),
        ("s2", "minilm", "1"),
    ]
    assert tensors(responses[0]) == [("EMBEDDING", "FP32", [1, 384])]
    assert [o.name for o in responses[1].outputs] == ["PROBABILITIES", "LABEL"]
    final = responses[2].parameters["triton_final_response"]
    assert final.WhichOneof("parameter_choice") == "bool_param" and final.bool_param
    assert "triton_final_response" not in responses[0].parameters
    result, error = got[3]
    assert result is None and "INVALID_ARGUMENT" in error.message()


def statistics(tc: triton.InferenceServerClient, model: str) -> Any:
    (stats,) = tc.get_inference_statistics(model, "1").model_stats
    assert (stats.name, stats.version) == (model, "1")
    return stats


def test_statistics_count_exactly_the_calls_made(
    tc: triton.InferenceServerClient,
) -> None:
    """Four answered requests (sync, async, stream, and a repeat answered
    from the cache), one refused: success, fail, the counts and the cache
    durations move by exactly those, the other model's not at all."""
    before, other = statistics(tc, "minilm"), statistics(tc, "intent")
    tag = uuid.uuid4().hex
    first = [f"{tag} one", f"{tag} two"]
    tc.infer("minilm", [text_input(first)])
    answers: queue.Queue[Any] = queue.Queue()
    tc.async_infer(
        "minilm",
        [text_input([f"{tag} three"])],
        lambda result, error: answers.put(error),
    )
    assert answers.get(timeout=60) is None
    tc.start_stream(callback=lambda result, error: answers.put(error))
    try:
        tc.async_stream_infer("minilm", [text_input([f"{tag} four"])])
        assert answers.get(timeout=60) is None
    finally:
        tc.stop_stream()
    tc.infer("minilm", [text_input(first)])  # both texts from the cache
    status, _ = refused(tc.infer, "minilm", [text_input([""])])
    assert status == "StatusCode.INVALID_ARGUMENT"
    after = statistics(tc, "minilm")
    s0, s1 = before.inference_stats, after.inference_stats

    def moved(stage: str) -> int:
        return int(getattr(s1, stage).count - getattr(s0, stage).count)

    assert {s: moved(s) for s in ("success", "fail", "queue")} == {
        "success": 4,
        "fail": 1,
        "queue": 4,
    }
    for stage in ("compute_input", "compute_infer", "compute_output"):
        assert moved(stage) == 3, stage
    assert (moved("cache_hit"), moved("cache_miss")) == (1, 3)
    assert after.inference_count - before.inference_count == 4  # texts computed
    assert after.execution_count - before.execution_count == 3
    assert s1.success.ns > s0.success.ns and s1.fail.ns > s0.fail.ns
    assert after.last_inference >= before.last_inference > 0
    assert statistics(tc, "intent") == other
    every = tc.get_inference_statistics().model_stats
    assert set(OUTPUTS) <= {s.name for s in every}


def test_the_response_cache_is_reported_as_configured(
    stack: Stack, repository: Path
) -> None:
    """A gateway with --cache-entries 0 says so in ModelConfig and reports
    no cache durations; the stack's gateway (cache on) reports both."""
    flags = ("--batcher", stack.batcher, "--cache-entries", "0")
    with service("gateway", repository, *flags) as gateway:
        gateway.wait_for("SERVING")
        client = triton.InferenceServerClient(url=gateway.address)
        try:
            config = client.get_model_config("minilm").config
            assert config.HasField("response_cache")
            assert config.response_cache.enable is False
            client.infer("minilm", [text_input(["cache off"])])
            (stats,) = client.get_inference_statistics("minilm").model_stats
            assert not stats.inference_stats.HasField("cache_hit")
            assert not stats.inference_stats.HasField("cache_miss")
        finally:
            client.close()
    on = triton.InferenceServerClient(url=stack.gateway)
    try:
        assert on.get_model_config("minilm").config.response_cache.enable is True
        (stats,) = on.get_inference_statistics("minilm").model_stats
        assert stats.inference_stats.HasField("cache_miss")
    finally:
        on.close()


UNSERVED: list[tuple[str, str, Callable[[triton.InferenceServerClient], Any]]] = [
    ("RepositoryModelLoad", "load", lambda c: c.load_model("minilm")),
    ("RepositoryModelUnload", "load", lambda c: c.unload_model("minilm")),
    (
        "SystemSharedMemoryStatus",
        "shared memory",
        lambda c: c.get_system_shared_memory_status(),
    ),
    (
        "SystemSharedMemoryRegister",
        "shared memory",
        lambda c: c.register_system_shared_memory("r", "/berth", 64),
    ),
    (
        "SystemSharedMemoryUnregister",
        "shared memory",
        lambda c: c.unregister_system_shared_memory(),
    ),
    (
        "CudaSharedMemoryStatus",
        "shared memory",
        lambda c: c.get_cuda_shared_memory_status(),
    ),
    (
        "CudaSharedMemoryRegister",
        "shared memory",
        lambda c: c.register_cuda_shared_memory("r", b"aGFuZGxl", 0, 64),
    ),
    (
        "CudaSharedMemoryUnregister",
        "shared memory",
        lambda c: c.unregister_cuda_shared_memory(),
    ),
    ("TraceSetting", "OTEL_", lambda c: c.get_trace_settings()),
    ("TraceSetting", "OTEL_", lambda c: c.update_trace_settings(settings={})),
    ("LogSettings", "BERTH_LOG_LEVEL", lambda c: c.get_log_settings()),
    ("LogSettings", "BERTH_LOG_LEVEL", lambda c: c.update_log_settings({})),
]


@pytest.mark.parametrize(
    ("rpc", "why", "call"),
    UNSERVED,
    ids=[f"{rpc}-{i}" for i, (rpc, *_) in enumerate(UNSERVED)],
)
def test_unserved_rpcs_answer_unimplemented_saying_why(
    tc: triton.InferenceServerClient,
    rpc: str,
    why: str,
    call: Callable[[triton.InferenceServerClient], Any],
) -> None:
    status, message = refused(call, tc)
    assert status == "StatusCode.UNIMPLEMENTED", message
    assert f"inference.GRPCInferenceService/{rpc} is not served" in message
    assert why in message
    assert ", ".join(SERVED) in message
    assert tc.is_server_live()


def test_every_rpc_of_the_protocol_is_served_or_unimplemented(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, stack: Stack
) -> None:
    """Triton's service (tritonclient's descriptor) against berth's: each
    method berth does not serve ends UNIMPLEMENTED at once, with an
    ErrorInfo, never a hang or INTERNAL."""
    methods = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
    unserved = [m for m in methods if m.name not in SERVED]
    assert {m.name for m in methods} >= set(SERVED)
    assert {m.name for m in unserved} == {rpc for rpc, *_ in UNSERVED}
    with grpc.insecure_channel(stack.gateway) as channel:
        for method in unserved:
            call = channel.unary_unary(
                f"/inference.GRPCInferenceService/{method.name}",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=bytes,
            )
            request = getattr(service_pb2, method.input_type.name)()
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=10)
            error = caught.value
            assert error.code() is grpc.StatusCode.UNIMPLEMENTED, method.name  # type: ignore[attr-defined]
            info = details_of(error)["ErrorInfo"]
            assert isinstance(info, error_details_pb2.ErrorInfo)
            assert (info.reason, info.domain) == ("UNIMPLEMENTED", "berth")
