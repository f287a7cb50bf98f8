"""Fuzzed requests to every RPC of the gateway's public services (berth.v1
and KServe v2, read from the gateway by server reflection, so a new RPC is
fuzzed as it is served): every call ends with a status a caller can act on,
and the gateway goes on serving, within bounded memory.

Requests are generated from the descriptors (tests/protofuzz.py), with the
served models' names, the KServe tensor contract's names and a few valid
requests mixed in, so that calls get past the model lookup and reach
validation and inference. A stream sends a few fuzzed messages; its in-stream
errors (berth's StreamError.code, KServe's error_message) count as statuses.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, descriptor_pb2, struct_pb2, type_pb2
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.gateway.test_api_keys import FULL, KEYS, MINILM_ONLY, bearer
from tests.gateway.test_hostile import MB, gateway_rss
from tests.protofuzz import Fuzz, Method, Wire, served
from tests.stack import ROOT, Stack, health, serving

# What a caller may be told; anything else (UNKNOWN, INTERNAL, a deadline
# passed) is a bug of the gateway.
ALLOWED = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "RESOURCE_EXHAUSTED",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
    }
)
DEADLINE = {"DEADLINE_EXCEEDED"}
MODELS = ("minilm", "intent")
# Names the gateway's checks look for (gateway/kserve_tensors.py).
VOCABULARY = (
    *MODELS,
    "1",
    "TEXT",
    "BYTES",
    "FP32",
    "EMBEDDING",
    "PROBABILITIES",
    "LABEL",
    "truncate",
    "normalize",
    "binary_data_output",
    "binary_data",
    "classification",
    "timeout",
    "priority",
    "true",
    "false",
)
# Valid messages, sent as they are and with a field or two fuzzed; those of
# nested types stand inside fuzzed requests.
TENSOR = 'name: "TEXT" datatype: "BYTES" shape: 1 contents { bytes_contents: "%s" }'
SEEDS = {
    "berth.v1.EmbedRequest": (
        'model: "minilm" texts: "a fuzzed text" request_id: 7',
        'model: "minilm" texts: ["one", "two", "one"] options { normalize: false }',
    ),
    "berth.v1.ClassifyRequest": ('model: "intent" texts: "book a flight" top_k: 3',),
    "berth.v1.TokenizeRequest": ('model: "intent" texts: "tokens, please"',),
    "berth.v1.ModelInfoRequest": ('model: "minilm"',),
    "berth.v1.Options": ("truncate: true", "normalize: true"),
    "berth.v1.StreamRequest": (
        'embed { model: "minilm" texts: "streamed" request_id: 1 }',
        'classify { model: "intent" texts: "streamed" request_id: 2 }',
    ),
    "inference.ModelInferRequest": (
        f'model_name: "minilm" id: "x" inputs {{ {TENSOR % "typed text"} }}',
        'model_name: "intent" inputs { name: "TEXT" datatype: "BYTES" shape: 2 } '
        'raw_input_contents: "\\003\\000\\000\\000one\\003\\000\\000\\000two" '
        'outputs { name: "PROBABILITIES" parameters { key: "classification" '
        "value { int64_param: 2 } } }",
    ),
    "inference.ModelInferRequest.InferInputTensor": (TENSOR % "a tensor text",),
    "inference.ModelInferRequest.InferRequestedOutputTensor": (
        'name: "LABEL"',
        'name: "EMBEDDING" parameters { key: "binary_data" value { bool_param: 0 } }',
    ),
    "inference.InferParameter": ("bool_param: true", "int64_param: 3"),
}
NAMES = st.sampled_from(MODELS)
VERSIONS = st.sampled_from(["", "1"])
TENSOR_FIELD = "inference.ModelInferRequest.InferInputTensor."
# Fields named so (or of these full names) hold these values half the time.
HINTS = {
    "model": NAMES,
    "model_name": NAMES,
    "name": NAMES,
    "model_version": VERSIONS,
    "version": VERSIONS,
    f"{TENSOR_FIELD}name": st.just("TEXT"),
    f"{TENSOR_FIELD}datatype": st.just("BYTES"),
    "inference.ModelInferRequest.InferRequestedOutputTensor.name": st.sampled_from(
        ["EMBEDDING", "PROBABILITIES", "LABEL"]
    ),
}
FUZZ = Fuzz(VOCABULARY, HINTS, SEEDS)
# A call's deadline: the largest fuzzed call takes about a second (the
# texts of a long list repeat a few drawn ones), and a call that hangs costs
# this much each time Hypothesis shrinks it.
CALL_TIMEOUT_S = 15
# Fuzzed calls per method: unary, and streams of up to STREAM_MESSAGES.
EXAMPLES = 100
STREAM_EXAMPLES = 30
STREAM_MESSAGES = 4
# No deadline per example (a call may wait for inference), and no example
# database: each run draws afresh, a failure shows its request.
SETTINGS = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Responses of a long Tokenize or ModelInfer exceed gRPC's 4 MB default.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * MB)]
# The gateway's growth in resident memory over the fuzz (about 1,300 calls),
# after a warm-up round. Measured on the dev machine: 0.7 to 15 MiB in 7
# runs; over 26,000 fuzzed calls (20 times as many examples) the gateway
# stayed within 21 MiB of its start. A leak of 25 KB a call passes this.
MAX_GROWTH = 32 * MB

# The public services' sources (the others are the hops behind the gateway).
PUBLIC_PROTOS = ("berth/v1/berth.proto", "inference/grpc_service.proto")

Metadata = tuple[tuple[str, str], ...]


def declared_rpcs() -> set[str]:
    """/service/method of every RPC of the public API's protos."""
    found = set()
    for proto in PUBLIC_PROTOS:
        text = (ROOT / "protos" / proto).read_text()
        package = re.search(r"^package ([\w.]+);", text, re.M)
        for service, body in re.findall(
            r"^service (\w+) \{(.*?)^\}", text, re.M | re.S
        ):
            prefix = f"{package.group(1)}." if package else ""
            for rpc in re.findall(r"^\s*rpc (\w+)\(", body, re.M):
                found.add(f"/{prefix}{service}/{rpc}")
    return found


def stream_errors(answer: Message) -> list[tuple[str, str]]:
    """The errors a stream's answer carries, as (status name, message):
    berth.v1's StreamError, KServe's error_message ("CODE: message",
    gateway/kserve.py)."""
    if "error" in answer.DESCRIPTOR.fields_by_name and answer.HasField("error"):
        return [(answer.error.code, answer.error.message)]
    text = getattr(answer, "error_message", "")
    return [(text.split(":", 1)[0], text)] if text else []


def own_deadline(request: Wire) -> bool:
    """Whether a request sets KServe's parameter ``timeout`` (tritonclient's,
    in microseconds; gateway/kserve_tensors.py): a deadline of its own, which
    may pass while the request is queued (DEADLINE_EXCEEDED, as asked)."""
    message = request.message
    if message is None or "parameters" not in message.DESCRIPTOR.fields_by_name:
        return False
    timeout = message.parameters.get("timeout")
    return timeout is not None and timeout.int64_param > 0


def call(
    channel: grpc.Channel, method: Method, requests: list[Wire], metadata: Metadata
) -> tuple[list[str], str]:
    """The statuses one call ended with (in-stream errors, then the call's
    own), and the details of the last that is not OK."""

    def identity(raw: bytes) -> bytes:
        return raw

    codes, details = [], ""
    try:
        if method.streaming:
            stream = channel.stream_stream(method.path, identity, method.response)
            answers = stream(
                iter([r.raw for r in requests]),
                timeout=CALL_TIMEOUT_S,
                metadata=metadata,
            )
            for answer in answers:
                for code, message in stream_errors(answer):
                    codes.append(code)
                    details = message if code != "OK" else details
        else:
            unary = channel.unary_unary(method.path, identity, identity)
            unary(requests[0].raw, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        codes.append(exc.code().name)
        details = exc.details() or ""
    else:
        codes.append("OK")
    return codes, details


def fuzz(
    channel: grpc.Channel,
    methods: list[Method],
    metadata: st.SearchStrategy[Metadata],
    scale: float = 1.0,
) -> collections.Counter[str]:
    """Fuzz each method in turn (Hypothesis shrinks a call that ends with a
    status outside ALLOWED); how often each status came back."""
    seen: collections.Counter[str] = collections.Counter()
    for method in methods:
        fuzz_method(channel, method, metadata, scale, seen)
    return seen


def fuzz_method(
    channel: grpc.Channel,
    method: Method,
    metadata: st.SearchStrategy[Metadata],
    scale: float,
    seen: collections.Counter[str],
) -> None:
    wire = FUZZ.wire(method.descriptor.input_type)
    if method.streaming:
        requests = st.lists(wire, max_size=STREAM_MESSAGES)
        examples = STREAM_EXAMPLES
    else:
        requests, examples = st.lists(wire, min_size=1, max_size=1), EXAMPLES

    @settings(SETTINGS, max_examples=max(2, int(examples * scale)))
    @given(requests=requests, metadata=metadata)
    def one(requests: list[Wire], metadata: Metadata) -> None:
        codes, details = call(channel, method, requests, metadata)
        seen.update(codes)
        allowed = ALLOWED | (DEADLINE if any(map(own_deadline, requests)) else set())
        wrong = [c for c in codes if c not in allowed]
        assert not wrong, f"{method.path} answered {wrong}: {details[:500]}"

    one()


def warm_up(channel: grpc.Channel, methods: list[Method]) -> None:
    """Every method once with an empty request and once with each seed, so
    that what the gateway allocates once is in place before memory counts."""
    for method in methods:
        seeds = FUZZ.seeded(method.descriptor.input_type)
        for request in [
            Wire(b""),
            *(Wire(m.SerializeToString(), m) for m in seeds),
        ]:
            call(channel, method, [request], ())


def assert_serving(stack: Stack, metadata: Metadata = ()) -> None:
    """Health SERVING, and an Embed answered by the engines."""
    assert health(stack.gateway) == "SERVING", stack.logs()
    with grpc.insecure_channel(stack.gateway) as channel:
        reply = berth_pb2_grpc.BerthStub(channel).Embed(
            berth_pb2.EmbedRequest(model="minilm", texts=["still serving?"]),
            timeout=CALL_TIMEOUT_S,
            metadata=metadata,
        )
    assert len(reply.embeddings[0].values) == 384
    assert not reply.degraded


# Between them every field type: maps, oneofs and a recursive type (Struct),
# open and closed (proto2) enums, 64-bit ints, doubles, bytes.
KINDS = (
    struct_pb2.Struct,
    type_pb2.Type,
    descriptor_pb2.FieldDescriptorProto,
    descriptor_pb2.UninterpretedOption,
    any_pb2.Any,
)


@settings(SETTINGS, max_examples=100)
@given(st.sampled_from(KINDS).flatmap(lambda kind: FUZZ.message(kind.DESCRIPTOR)))
def test_the_strategies_make_messages_of_every_field_type(message: Message) -> None:
    raw = message.SerializeToString()
    again = type(message).FromString(raw)
    assert [f.name for f, _ in again.ListFields()] == [
        f.name for f, _ in message.ListFields()
    ]


@pytest.fixture(scope="module")
def methods(stack: Stack) -> list[Method]:
    with grpc.insecure_channel(stack.gateway) as channel:
        return served(channel)


def test_the_fuzz_covers_every_declared_rpc(methods: list[Method]) -> None:
    paths = {m.path for m in methods}
    assert declared_rpcs() <= paths, declared_rpcs() - paths
    assert "/berth.v1.Berth/Stream" in paths
    assert "/inference.GRPCInferenceService/ModelStreamInfer" in paths


def test_fuzzed_calls_end_with_statuses_a_caller_can_act_on(
    stack: Stack, methods: list[Method]
) -> None:
    log_start = len(stack.logs(tail=None))
    with grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS) as channel:
        warm_up(channel, methods)
        rss0 = gateway_rss(stack)
        seen = fuzz(channel, methods, st.just(()))
        grown = gateway_rss(stack) - rss0
    print(f"statuses {dict(seen)}; the gateway grew {grown / MB:.1f} MiB")
    assert_serving(stack)
    assert grown < MAX_GROWTH, f"the gateway grew {grown / MB:.0f} MiB"
    assert seen["OK"] and seen["INVALID_ARGUMENT"], seen
    assert "Traceback" not in stack.logs(tail=None)[log_start:]


@pytest.fixture(scope="module")
def keyed(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """`berth serve --api-keys-file` with test_api_keys.py's keys."""
    keys = tmp_path_factory.mktemp("fuzz-keys") / "keys"
    keys.write_text(KEYS)
    with serving(Stack(repository, extra_args=["--api-keys-file", str(keys)])) as s:
        yield s


# No key, a key of no file, a key without its scheme, a key of every model,
# and a key of minilm alone.
CREDENTIALS = st.sampled_from(
    [
        (),
        bearer("not-a-key-of-the-file-0123"),
        (("authorization", FULL),),
        bearer(FULL),
        bearer(MINILM_ONLY),
    ]
)


def test_fuzzed_calls_with_api_keys(keyed: Stack) -> None:
    """Half as many calls, each with one of CREDENTIALS (reflection stays
    open without a key)."""
    with grpc.insecure_channel(keyed.gateway, options=CHANNEL_OPTIONS) as channel:
        seen = fuzz(channel, served(channel), CREDENTIALS, scale=0.5)
    print(f"statuses {dict(seen)}")
    assert seen["UNAUTHENTICATED"] and seen["PERMISSION_DENIED"], seen
    assert_serving(keyed, bearer(FULL))
    assert "Traceback" not in keyed.logs(tail=None)
