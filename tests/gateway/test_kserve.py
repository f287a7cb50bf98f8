"""KServe v2 over the gateway, called by the stock tritonclient.grpc client.

This process imports tritonclient's own generated `inference` stubs, so it
never imports berth's (services.proto.inference): both define the same
protobuf names, and one process can hold only one of them.
"""

from __future__ import annotations

import queue
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import load_entry
from tests.kserve_inputs import text_input
from tests.metrics import requests, scrape, value
from tests.stack import Stack, health, stream_raw
from tests.texts import VARIED


@pytest.fixture(scope="module")
def tc(stack: Stack) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url=stack.gateway)
    yield client
    client.close()


def status_of(call: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return str(info.value.status()), str(info.value.message())


def test_server_and_model_metadata(tc: triton.InferenceServerClient) -> None:
    assert tc.is_server_live()
    assert tc.is_server_ready()
    meta = tc.get_server_metadata(as_json=True)
    assert meta["name"] == "berth" and "statistics" in meta["extensions"]
    assert "classification" in meta["extensions"]
    assert tc.is_model_ready("minilm") and tc.is_model_ready("intent")
    assert not tc.is_model_ready("nope")
    model = tc.get_model_metadata("minilm", as_json=True)
    assert model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": ["-1"]}]
    assert model["outputs"] == [
        {"name": "EMBEDDING", "datatype": "FP32", "shape": ["-1", "384"]}
    ]
    intent = tc.get_model_metadata("intent", as_json=True)
    assert [o["name"] for o in intent["outputs"]] == ["PROBABILITIES", "LABEL"]
    assert intent["outputs"][0]["shape"] == ["-1", "157"]


def test_model_config_parses_in_the_stock_client(
    tc: triton.InferenceServerClient,
) -> None:
    config = tc.get_model_config("intent").config
    assert config.name == "intent" and config.platform == "berth"
    assert config.backend == "auto" and config.max_batch_size == 0  # the entry's
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("TEXT", 13, [-1])  # TYPE_STRING
    ]
    assert [(o.name, list(o.dims)) for o in config.output] == [
        ("PROBABILITIES", [-1, 157]),
        ("LABEL", [-1]),
    ]
    assert config.parameters["max_tokens"].string_value == "256"


def test_embedding_equals_berth_api(
    tc: triton.InferenceServerClient, client: berth_pb2_grpc.BerthStub
) -> None:
    texts = [t for t in VARIED if t.strip()]
    result = tc.infer("minilm", [text_input(texts)], parameters={"truncate": True})
    ours = result.as_numpy("EMBEDDING")
    assert ours.dtype == np.float32 and ours.shape == (len(texts), 384)
    cut = berth_pb2.Options(truncate=True)  # VARIED's last text is over 256
    berth = client.Embed(
        berth_pb2.EmbedRequest(model="minilm", texts=texts, options=cut)
    )
    reference = np.array([e.values for e in berth.embeddings], dtype=np.float32)
    np.testing.assert_allclose(ours, reference, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_classifier_outputs_and_requested_outputs(
    tc: triton.InferenceServerClient,
) -> None:
    texts = ["set an alarm for 7 am", "tell me a joke"]
    result = tc.infer("intent", [text_input(texts)])
    probs = result.as_numpy("PROBABILITIES")
    labels = result.as_numpy("LABEL")
    assert probs.shape == (2, 157)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    assert labels.tolist() == [b"alarm", b"tell_joke"]
    only = tc.infer(
        "intent", [text_input(texts)], outputs=[triton.InferRequestedOutput("LABEL")]
    )
    assert only.as_numpy("PROBABILITIES") is None
    assert only.as_numpy("LABEL").tolist() == labels.tolist()


def test_parameters_map_to_options(tc: triton.InferenceServerClient) -> None:
    raw = tc.infer(
        "minilm", [text_input(["hello world"])], parameters={"normalize": False}
    ).as_numpy("EMBEDDING")
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3
    long = "word " * 600
    status, message = status_of(tc.infer, "minilm", [text_input([long])])
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert "over the limit of 256" in message and "truncate" in message
    cut = tc.infer("minilm", [text_input([long])], parameters={"truncate": True})
    assert cut.as_numpy("EMBEDDING").shape == (1, 384)


def test_typed_contents_in_and_out(stack: Stack) -> None:
    """bytes_contents in, fp32/bytes contents out, with tritonclient's stubs."""
    import grpc

    request = service_pb2.ModelInferRequest(model_name="intent", id="typed-1")
    request.parameters["binary_data_output"].bool_param = False
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([b"set an alarm for 7 am", b"flip a coin"])
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=30)
    assert response.id == "typed-1" and not response.raw_output_contents
    probs, labels = response.outputs
    assert list(probs.shape) == [2, 157] and len(probs.contents.fp32_contents) == 314
    assert list(labels.contents.bytes_contents) == [b"alarm", b"flip_coin"]


def top_k(values: np.ndarray, k: int, labels: list[str] | None = None) -> Any:
    """Triton's classification strings for each row: the k highest entries,
    ties by index, as "score:index[:label]" with the score as C's %f."""
    rows = []
    for row in values:
        order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
        rows.append(
            [
                (
                    f"{float(row[i]):f}:{i}" + (f":{labels[i]}" if labels else "")
                ).encode()
                for i in order
            ]
        )
    return np.array(rows, dtype=object)


@pytest.fixture(scope="module")
def intent_labels(repository: Path) -> list[str]:
    return load_entry(repository / "intent").label_names()


def test_classification_gives_triton_top_k_strings(
    tc: triton.InferenceServerClient, intent_labels: list[str]
) -> None:
    """tritonclient's class_count: the output becomes BYTES [N, k] of
    "score:index:label", best first; k past the class count gives them all."""
    texts = ["set an alarm for 7 am", "tell me a joke"]
    probs = tc.infer("intent", [text_input(texts)]).as_numpy("PROBABILITIES")
    result = tc.infer(
        "intent",
        [text_input(texts)],
        outputs=[
            triton.InferRequestedOutput("PROBABILITIES", class_count=3),
            triton.InferRequestedOutput("LABEL"),
        ],
    )
    top = result.as_numpy("PROBABILITIES")
    assert result.get_output("PROBABILITIES").datatype == "BYTES"
    assert top.shape == (2, 3)
    assert top.tolist() == top_k(probs, 3, intent_labels).tolist()
    assert re.fullmatch(rb"\d\.\d{6}:\d+:alarm", top[0, 0])
    assert result.as_numpy("LABEL").tolist() == [b"alarm", b"tell_joke"]
    every = tc.infer(
        "intent",
        [text_input(texts[:1])],
        outputs=[triton.InferRequestedOutput("PROBABILITIES", class_count=1000)],
    ).as_numpy("PROBABILITIES")
    assert every.shape == (1, 157)
    assert every.tolist() == top_k(probs[:1], 157, intent_labels).tolist()


def test_classification_of_embeddings_has_no_labels(
    tc: triton.InferenceServerClient,
) -> None:
    """An output without labels, as in Triton without a label file: the top
    entries of the (normalized) embedding as "score:index"."""
    texts = ["hello world", "classification of an embedding"]
    embeddings = tc.infer("minilm", [text_input(texts)]).as_numpy("EMBEDDING")
    top = tc.infer(
        "minilm",
        [text_input(texts)],
        outputs=[triton.InferRequestedOutput("EMBEDDING", class_count=5)],
    ).as_numpy("EMBEDDING")
    assert top.shape == (2, 5)
    assert top.tolist() == top_k(embeddings, 5).tolist()


def test_classification_in_typed_contents(
    stack: Stack, tc: triton.InferenceServerClient, intent_labels: list[str]
) -> None:
    import grpc

    texts = ["set an alarm for 7 am", "flip a coin"]
    probs = tc.infer("intent", [text_input(texts)]).as_numpy("PROBABILITIES")
    request = service_pb2.ModelInferRequest(model_name="intent", id="typed-top")
    request.parameters["binary_data_output"].bool_param = False
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend(t.encode() for t in texts)
    wanted = request.outputs.add(name="PROBABILITIES")
    wanted.parameters["classification"].int64_param = 2
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=30)
    assert not response.raw_output_contents
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == (
        "PROBABILITIES",
        "BYTES",
        [2, 2],
    )
    expected = top_k(probs, 2, intent_labels).ravel().tolist()
    assert list(output.contents.bytes_contents) == expected


def test_classification_on_the_stream(
    tc: triton.InferenceServerClient, intent_labels: list[str]
) -> None:
    texts = ["set an alarm for 7 am"]
    probs = tc.infer("intent", [text_input(texts)]).as_numpy("PROBABILITIES")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, count in enumerate([4, -1]):
            output = triton.InferRequestedOutput("PROBABILITIES", class_count=count)
            tc.async_stream_infer(
                "intent", [text_input(texts)], outputs=[output], request_id=str(i)
            )
        (good, ok), (_, error) = [answers.get(timeout=60) for _ in range(2)]
    finally:
        tc.stop_stream()
    assert ok is None and good.get_response().id == "0"
    assert (
        good.as_numpy("PROBABILITIES").tolist()
        == top_k(probs, 4, intent_labels).tolist()
    )
    assert "INVALID_ARGUMENT" in error.message()
    assert "'PROBABILITIES'" in error.message() and "-1" in error.message()


@pytest.mark.parametrize(
    ("output", "kind", "value", "fragment"),
    [
        ("PROBABILITIES", "int64_param", -2, "classification -2"),
        ("PROBABILITIES", "int64_param", 0, "classification 0"),
        ("PROBABILITIES", "string_param", "3", "string_param '3'"),
        ("PROBABILITIES", "double_param", 2.5, "double_param 2.5"),
        ("LABEL", "int64_param", 2, "type 'BYTES'"),
    ],
)
def test_bad_classification_is_refused_clearly(
    stack: Stack, output: str, kind: str, value: Any, fragment: str
) -> None:
    import grpc

    request = service_pb2.ModelInferRequest(model_name="intent")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"set an alarm for 7 am")
    wanted = request.outputs.add(name=output)
    setattr(wanted.parameters["classification"], kind, value)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = info.value.details() or ""
    assert f"output {output!r}" in message and fragment in message, message


@pytest.mark.parametrize(
    ("model", "name", "datatype", "shape", "kwargs", "status", "fragment"),
    [
        ("nope", "TEXT", "BYTES", [1], {}, "NOT_FOUND", "unknown model 'nope'"),
        ("minilm", "TEXT", "BYTES", [1], {"model_version": "7"}, "NOT_FOUND", "no "),
        ("minilm", "TXT", "BYTES", [1], {}, "INVALID_ARGUMENT", "inputs 'TXT'"),
        ("minilm", "TEXT", "FP32", [1], {}, "INVALID_ARGUMENT", "datatype 'FP32'"),
        ("minilm", "TEXT", "BYTES", [1, 1], {}, "INVALID_ARGUMENT", "shape [1, 1]"),
        (
            "minilm",
            "TEXT",
            "BYTES",
            [1],
            {"outputs": ["LABEL"]},
            "INVALID_ARGUMENT",
            "no output 'LABEL'",
        ),
        (
            "minilm",
            "TEXT",
            "BYTES",
            [1],
            {"parameters": {"normalise": True}},
            "INVALID_ARGUMENT",
            "parameter 'normalise'",
        ),
    ],
)
def test_bad_requests_are_refused_clearly(
    tc: triton.InferenceServerClient,
    model: str,
    name: str,
    datatype: str,
    shape: list[int],
    kwargs: dict[str, Any],
    status: str,
    fragment: str,
) -> None:
    tensor = triton.InferInput(name, shape, datatype)
    if datatype == "BYTES":
        tensor.set_data_from_numpy(np.array(["hi"], dtype=object).reshape(shape))
    else:
        tensor.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
    outputs = [triton.InferRequestedOutput(o) for o in kwargs.pop("outputs", [])]
    got, message = status_of(
        tc.infer, model, [tensor], outputs=outputs or None, **kwargs
    )
    assert got == f"StatusCode.{status}", message
    assert fragment in message
    assert tc.is_server_ready()


def test_stream_answers_each_request(tc: triton.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, text in enumerate(["a b c", "set an alarm for 7 am", ""]):
            model = "intent" if i == 1 else "minilm"
            tc.async_stream_infer(model, [text_input([text])], request_id=str(i))
        got = [answers.get(timeout=60) for _ in range(3)]
    finally:
        tc.stop_stream()
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [e for r, e in got if e is not None]
    assert results["0"].as_numpy("EMBEDDING").shape == (1, 384)
    assert results["1"].as_numpy("LABEL").tolist() == [b"alarm"]
    assert len(errors) == 1 and "texts[0] is empty" in errors[0].message()


@pytest.mark.parametrize("enabled", [True, False])
def test_unary_takes_the_final_response_flag_perf_analyzer_sends(
    stack: Stack, enabled: bool
) -> None:
    """perf_analyzer (tritonclient's C++ library) sets Triton's reserved
    parameter triton_enable_empty_final_response on every ModelInfer request,
    raw TEXT contents, shape [1]; Triton checks its type and ignores it."""
    import grpc

    request = service_pb2.ModelInferRequest(model_name="minilm", id="pa-1")
    request.parameters["triton_enable_empty_final_response"].bool_param = enabled
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.outputs.add(name="EMBEDDING")
    text = b"hello world"
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=30)
        request.parameters["triton_enable_empty_final_response"].string_param = "1"
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
    assert response.id == "pa-1" and list(response.outputs[0].shape) == [1, 384]
    assert "triton_final_response" not in response.parameters
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected bool_param" in str(info.value.details())


def test_stream_marks_final_responses_where_asked(
    tc: triton.InferenceServerClient,
) -> None:
    """With triton_enable_empty_final_response (perf_analyzer --streaming
    sets it), each request's one response carries triton_final_response
    true, as Triton's do; without it, no such parameter."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, enabled in enumerate([True, False, True]):
            text = "" if i == 2 else "a b c"  # the last one fails
            tc.async_stream_infer(
                "minilm",
                [text_input([text])],
                request_id=str(i),
                enable_empty_final_response=enabled,
            )
        got = [answers.get(timeout=60) for _ in range(3)]
    finally:
        tc.stop_stream()
    (first, e0), (second, e1), (_, e2) = got
    assert e0 is None and e1 is None and e2 is not None
    final = first.get_response().parameters["triton_final_response"]
    assert final.bool_param is True
    assert first.as_numpy("EMBEDDING").shape == (1, 384)
    assert "triton_final_response" not in second.get_response().parameters


def test_stream_with_a_malformed_message_ends_with_invalid_argument(
    stack: Stack,
) -> None:
    """A ModelStreamInfer message that cannot be read (a model name that is
    not UTF-8) ends the stream with INVALID_ARGUMENT at once; the request
    before it is answered (before: the stream hung to its deadline)."""
    import grpc

    request = service_pb2.ModelInferRequest(model_name="minilm", id="good")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"one good text")
    good = request.SerializeToString()
    bad = good.replace(b"minilm", b"min\xfflm")
    answers, error, took = stream_raw(
        stack.gateway,
        "/inference.GRPCInferenceService/ModelStreamInfer",
        [good, bad],
        service_pb2.ModelStreamInferResponse.FromString,
    )
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message 2 of this stream" in (error.details() or "")
    assert took < 10
    assert [(a.error_message, a.infer_response.id) for a in answers] == [("", "good")]


def test_a_unary_request_that_cannot_be_parsed_is_invalid_argument(
    stack: Stack, tc: triton.InferenceServerClient
) -> None:
    """A ModelInfer request gRPC cannot parse (a model name that is not
    UTF-8) is the caller's mistake: INVALID_ARGUMENT naming the message type
    (before: UNKNOWN from gRPC's deserializer), and the gateway serves on."""
    import grpc

    request = service_pb2.ModelInferRequest(model_name="minilm")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"a text")
    bad = request.SerializeToString().replace(b"minilm", b"min\xfflm")
    with grpc.insecure_channel(stack.gateway) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,  # the bytes go as they are
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            call(bad, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert "could not be parsed as inference.ModelInferRequest" in details, details
    result = tc.infer("minilm", [text_input(["after a bad call"])])
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    assert health(stack.gateway) == "SERVING"


def busy_texts(n: int = 32) -> list[str]:
    """Texts no other call sent, long enough to keep the engine busy a while."""
    tag = uuid.uuid4().hex
    return [f"{tag} {i} " + "busy words " * 60 for i in range(n)]


def test_stream_answers_in_request_order(tc: triton.InferenceServerClient) -> None:
    """Like Triton for a non-decoupled model: the n-th answer on the stream is
    the n-th request's, even when a later one (a cache hit) finishes first."""
    cached = f"stream order {uuid.uuid4().hex}"
    tc.infer("minilm", [text_input([cached])])
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        sent = [busy_texts(8), [cached], [""], [cached]]
        for i, texts in enumerate(sent):
            tc.async_stream_infer("minilm", [text_input(texts)], request_id=str(i))
        got = [answers.get(timeout=60) for _ in sent]
    finally:
        tc.stop_stream()
    assert [e is None for _, e in got] == [True, True, False, True]
    ok = [r for r, e in got if e is None]
    assert [r.get_response().id for r in ok] == ["0", "1", "3"]
    assert [r.as_numpy("EMBEDDING").shape[0] for r in ok] == [8, 1, 1]
    assert "texts[0] is empty" in got[2][1].message()


def test_a_timeout_of_zero_means_none(tc: triton.InferenceServerClient) -> None:
    """tritonclient's `timeout` (µs) of 0 is Triton's 'no timeout', not a
    deadline that has already passed: queued behind a busy engine, it waits."""
    done: queue.Queue[Any] = queue.Queue()
    tc.async_infer(
        "minilm",
        [text_input(busy_texts())],
        callback=lambda result, error: done.put(error),
    )
    time.sleep(0.2)  # the busy call is on the engine
    text = f"timeout zero {uuid.uuid4().hex}"
    result = tc.infer("minilm", [text_input([text])], timeout=0, client_timeout=60)
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    assert done.get(timeout=60) is None


def test_very_long_timeouts_are_accepted(tc: triton.InferenceServerClient) -> None:
    """A deadline past the internal hops' uint32 milliseconds (~50 days) is
    as good as none: answered, not UNKNOWN (unary) or dropped (stream)."""
    far = 2**32 * 1000  # µs: 2**32 ms
    text = f"far deadline {uuid.uuid4().hex}"
    result = tc.infer("minilm", [text_input([text])], timeout=far)
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        tc.async_stream_infer(
            "minilm", [text_input([text + " stream"])], request_id="far", timeout=far
        )
        got, error = answers.get(timeout=30)
    finally:
        tc.stop_stream()
    assert error is None and got.get_response().id == "far"


def test_statistics_count_requests_and_cache_hits(
    tc: triton.InferenceServerClient,
) -> None:
    """Counted as Triton counts (docs/protocol/extension_statistics.md): a
    request answered from the cache counts in success, queue and cache_hit,
    not in inference_count, execution_count or the compute stages."""

    def stats() -> Any:
        reply = tc.get_inference_statistics("minilm")
        (model,) = reply.model_stats
        return model

    before = stats()
    text = "statistics probe: a text no other test sends"
    for _ in range(3):
        tc.infer("minilm", [text_input([text, "and a second one"])])
    after = stats()
    assert after.inference_count - before.inference_count == 2  # 1 request computed
    assert after.execution_count - before.execution_count == 1
    s0, s1 = before.inference_stats, after.inference_stats
    assert s1.success.count - s0.success.count == 3
    assert s1.success.ns > s0.success.ns
    assert s1.queue.count - s0.queue.count == 3
    for stage in ("compute_input", "compute_infer", "compute_output"):
        assert getattr(s1, stage).count - getattr(s0, stage).count == 1, stage
    assert s1.cache_hit.count - s0.cache_hit.count == 2
    assert s1.cache_miss.count - s0.cache_miss.count == 1
    assert after.last_inference >= before.last_inference and after.last_inference > 0
    status, message = status_of(tc.get_inference_statistics, "nope")
    assert status == "StatusCode.NOT_FOUND" and "unknown model" in message


def test_health_and_reflection_know_the_service(stack: Stack) -> None:
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert health(stack.gateway, "inference.GRPCInferenceService") == "SERVING"
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    names = {s.name for s in reply.list_services_response.service}
    assert "inference.GRPCInferenceService" in names


def stage_count(samples: dict[str, float], model: str, stage: str) -> float:
    labels = f'(?=.*model="{model}")(?=.*stage="{stage}")'
    return value(samples, rf"berth_gateway_stage_seconds_count\{{{labels}.*\}}")


def test_prometheus_counts_kserve_requests_by_api_and_outcome(
    stack: Stack, tc: triton.InferenceServerClient
) -> None:
    """ModelInfer and ModelStreamInfer are in berth's request metrics, with
    api "kserve" and "kserve_stream", the outcomes of berth's own API, and
    the stage times of the answered ones."""
    url = stack.metrics[0]  # the gateway's /metrics
    before = scrape(url)
    tag = uuid.uuid4().hex
    tc.infer("minilm", [text_input([f"{tag} one", f"{tag} two"])])
    tc.infer("minilm", [text_input([f"{tag} one"])])  # a cache hit: ok too
    status, _ = status_of(tc.infer, "minilm", [text_input([""])])
    assert status == "StatusCode.INVALID_ARGUMENT"
    status, _ = status_of(tc.infer, "nope", [text_input(["who?"])])
    assert status == "StatusCode.NOT_FOUND"
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        tc.async_stream_infer("intent", [text_input([f"{tag} set an alarm"])])
        tc.async_stream_infer("minilm", [text_input([""])])
        got = [answers.get(timeout=60) for _ in range(2)]
    finally:
        tc.stop_stream()
    assert [e is None for _, e in got] == [True, False]
    after = scrape(url)

    def delta(model: str, api: str, outcome: str) -> float:
        return requests(after, model, api, outcome) - requests(
            before, model, api, outcome
        )

    assert delta("minilm", "kserve", "ok") == 2
    assert delta("minilm", "kserve", "invalid") == 1
    assert delta("unknown", "kserve", "invalid") == 1
    assert delta("intent", "kserve_stream", "ok") == 1
    assert delta("minilm", "kserve_stream", "invalid") == 1
    for outcome in ("degraded", "shed", "failed"):
        assert delta("minilm", "kserve", outcome) == 0
    # Berth's own API labels are untouched by KServe calls.
    for api in ("embed", "classify", "stream"):
        assert delta("minilm", api, "ok") == delta("intent", api, "ok") == 0
    for stage in ("tokenize", "queue", "inference", "total"):
        minilm = stage_count(after, "minilm", stage) - stage_count(
            before, "minilm", stage
        )
        intent = stage_count(after, "intent", stage) - stage_count(
            before, "intent", stage
        )
        assert (minilm, intent) == (2, 1), stage
    assert value(after, "berth_gateway_requests_in_flight") == 0

    def texts(samples: dict[str, float], model: str) -> float:
        return value(samples, rf'berth_gateway_texts_total\{{model="{model}"\}}')

    assert texts(after, "minilm") - texts(before, "minilm") == 5  # refused too
    assert texts(after, "intent") - texts(before, "intent") == 1


def test_statistics_count_berth_api_calls_too(
    tc: triton.InferenceServerClient, client: berth_pb2_grpc.BerthStub
) -> None:
    """Triton's statistics are the model's, whatever protocol the request
    came by (docs/protocol/extension_statistics.md: "all activity occurring
    for a specific model"): berth's Embed, Classify and Stream count too."""
    import grpc

    def stats(name: str) -> Any:
        (model,) = tc.get_inference_statistics(name).model_stats
        return model

    before = {name: stats(name) for name in ("minilm", "intent")}
    tag = uuid.uuid4().hex
    client.Embed(berth_pb2.EmbedRequest(model="minilm", texts=[f"{tag} a", f"{tag} b"]))
    client.Classify(berth_pb2.ClassifyRequest(model="intent", texts=[f"{tag} alarm"]))
    (reply,) = client.Stream(
        iter(
            [
                berth_pb2.StreamRequest(
                    embed=berth_pb2.EmbedRequest(model="minilm", texts=[f"{tag} a"])
                )
            ]
        ),
        timeout=30,
    )
    assert reply.WhichOneof("response") == "embed"
    with pytest.raises(grpc.RpcError):
        client.Embed(berth_pb2.EmbedRequest(model="minilm", texts=[""]))
    after = {name: stats(name) for name in ("minilm", "intent")}
    m0, m1 = before["minilm"], after["minilm"]
    s0, s1 = m0.inference_stats, m1.inference_stats
    assert s1.success.count - s0.success.count == 2  # Embed and Stream
    assert s1.fail.count - s0.fail.count == 1
    assert s1.cache_hit.count - s0.cache_hit.count == 1  # the Stream's text
    assert m1.inference_count - m0.inference_count == 2  # the hit is not one
    assert m1.execution_count - m0.execution_count == 1
    i0, i1 = before["intent"], after["intent"]
    assert i1.inference_stats.success.count - i0.inference_stats.success.count == 1
    assert i1.inference_count - i0.inference_count == 1
