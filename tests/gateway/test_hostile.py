"""Callers who mean harm, or send what no caller should: the gateway bounds
what one call costs it and what it echoes back (through `berth serve`).

KServe messages are built with tritonclient's stubs: a test process holds
only one set of the `inference` protobuf names (see test_kserve.py).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2 as kserve_pb2
from tritonclient.grpc import service_pb2_grpc as kserve_grpc

from gateway.calls import windowed
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.metrics import scrape, value
from tests.stack import Stack, pid_listening

MB = 2**20


def gateway_rss(stack: Stack) -> int:
    """The gateway process's resident memory, in bytes."""
    pid = pid_listening("gateway", int(stack.gateway.rsplit(":", 1)[1]))
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError("no VmRSS")


def raw_unary(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        method,
        request_serializer=lambda raw: raw,
        response_deserializer=lambda raw: raw,
    )


# An EmbedRequest of model "minilm" and 2 million empty texts, as a hostile
# caller writes it (4 MB; every text costs the caller two bytes).
MANY_EMPTY_TEXTS = b"\x0a\x06minilm" + b"\x12\x00" * 2_000_000
# As many bytes in one text: as dear to send, cheap to refuse (over the
# character guard), so small calls beside it wait only for the transfer.
ONE_LONG_TEXT = berth_pb2.EmbedRequest(
    model="minilm", texts=["a" * 4_000_000]
).SerializeToString()


def while_sending(
    stack: Stack, message: bytes, times: int
) -> tuple[list[float], list[grpc.RpcError], int]:
    """Embed ``message`` ``times`` times on one channel while small calls
    go on another: the small calls' latencies, the big calls' errors, and
    the gateway's largest growth in memory meanwhile."""
    with (
        grpc.insecure_channel(stack.gateway) as big,
        grpc.insecure_channel(stack.gateway) as small,
    ):
        hostile = raw_unary(big, "/berth.v1.Berth/Embed")
        other = berth_pb2_grpc.BerthStub(small)
        probe = berth_pb2.ModelInfoRequest(model="minilm")
        other.ModelInfo(probe, timeout=30)
        rss0 = gateway_rss(stack)
        errors: list[grpc.RpcError] = []

        def send() -> None:
            for _ in range(times):
                with pytest.raises(grpc.RpcError) as info:
                    hostile(message, timeout=60)
                errors.append(info.value)

        thread = threading.Thread(target=send)
        thread.start()
        waits, peak = [], rss0
        while thread.is_alive():
            t0 = time.perf_counter()
            other.ModelInfo(probe, timeout=30)
            waits.append(time.perf_counter() - t0)
            peak = max(peak, gateway_rss(stack))
        thread.join()
    return waits, errors, peak - rss0


def test_millions_of_texts_are_refused_before_they_are_built(stack: Stack) -> None:
    benign, errors, _ = while_sending(stack, ONE_LONG_TEXT, 6)
    assert {e.code() for e in errors} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert "characters, over the limit" in (errors[0].details() or "")
    during, errors, grown = while_sending(stack, MANY_EMPTY_TEXTS, 6)
    assert len(errors) == 6
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-texts" in (error.details() or "")
    assert len(during) >= 3, f"only {len(during)} small calls during the attack"
    # Parsed on the event loop, each small call waited behind a big one; as
    # it is, no longer than beside a message of one long text, as large.
    ratio = statistics.median(during) / statistics.median(benign)
    assert ratio < 3, (
        f"small calls took {ratio:.1f}x as long as beside a benign message of "
        f"the size (median {statistics.median(during) * 1e3:.1f} ms)"
    )
    assert grown < 48 * MB, f"the gateway grew {grown / MB:.0f} MiB"


def test_millions_of_kserve_elements_are_refused(stack: Stack) -> None:
    raw = b"".join([b"\x00\x00\x00\x00"] * 1_000_000)
    request = kserve_pb2.ModelInferRequest(
        model_name="minilm",
        inputs=[
            kserve_pb2.ModelInferRequest.InferInputTensor(
                name="TEXT", datatype="BYTES", shape=[1_000_000]
            )
        ],
        raw_input_contents=[raw],
    )
    typed = kserve_pb2.ModelInferRequest(
        model_name="minilm",
        inputs=[
            kserve_pb2.ModelInferRequest.InferInputTensor(
                name="TEXT",
                datatype="BYTES",
                shape=[1_000_000],
                contents=kserve_pb2.InferTensorContents(
                    bytes_contents=[b""] * 1_000_000
                ),
            )
        ],
    )
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        rss0 = gateway_rss(stack)
        for message in (request, typed, request, typed):
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(message, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-texts" in (info.value.details() or "")
        assert gateway_rss(stack) - rss0 < 48 * MB


def test_a_stream_message_over_the_limit_is_answered_in_the_stream(
    stack: Stack,
) -> None:
    over = berth_pb2.StreamRequest(
        classify=berth_pb2.ClassifyRequest(
            model="intent", texts=["x"] * 300, request_id=41
        )
    )
    fine = berth_pb2.StreamRequest(
        embed=berth_pb2.EmbedRequest(model="minilm", texts=["x"], request_id=42)
    )
    with grpc.insecure_channel(stack.gateway) as channel:
        stream = berth_pb2_grpc.BerthStub(channel).Stream(iter([over, fine]))
        answers = {a.WhichOneof("response"): a for a in stream}
    assert answers["error"].error.request_id == 41
    assert answers["error"].error.code == "INVALID_ARGUMENT"
    assert "too many texts: 300 in one call" in answers["error"].error.message
    assert answers["embed"].embed.request_id == 42


# ---- streams: a caller that does not read is slowed, not buffered -----------


@pytest.mark.parametrize("in_order", [False, True])
def test_a_stream_reads_no_more_than_its_window_ahead(in_order: bool) -> None:
    async def scenario() -> tuple[int, int, list[int]]:
        pulled = 0

        async def requests() -> AsyncIterator[int]:
            nonlocal pulled
            for i in range(1000):
                pulled += 1
                yield i

        async def answer(request: int) -> int:
            await asyncio.sleep(0)
            return request

        answers = windowed(requests(), answer, window=8, in_order=in_order)
        first = [await anext(answers)]  # then the caller stops reading
        await asyncio.sleep(0.2)
        ahead = pulled
        first += [a async for a in answers]  # it reads again: all answered
        return ahead, pulled, first

    ahead, pulled, answers = asyncio.run(scenario())
    # The window, the answer taken among them: it counts until the caller
    # comes back for the next (gRPC does once it has written it).
    assert ahead == 8
    assert pulled == 1000 and sorted(answers) == list(range(1000))
    if in_order:
        assert answers == list(range(1000))


def test_a_stream_that_is_not_read_stops_being_read(stack: Stack) -> None:
    text = f"unread stream {uuid.uuid4().hex}"
    with grpc.insecure_channel(stack.gateway) as channel:
        client = berth_pb2_grpc.BerthStub(channel)
        client.Embed(berth_pb2.EmbedRequest(model="minilm", texts=[text]), timeout=30)
        sent = 3000
        per_request = 16  # cached texts: cheap to answer, ~25 KB an answer
        pulled = [0]

        def requests() -> Iterator[berth_pb2.StreamRequest]:
            for i in range(sent):
                pulled[0] += 1
                yield berth_pb2.StreamRequest(
                    embed=berth_pb2.EmbedRequest(
                        model="minilm", texts=[text] * per_request, request_id=i
                    )
                )

        def texts_in() -> float:
            samples = scrape(stack.metrics[0])
            return value(samples, r'berth_gateway_texts_total\{model="minilm"\}')

        before, rss0 = texts_in(), gateway_rss(stack)
        call = client.Stream(requests(), timeout=120)  # never read
        last, still_since = -1.0, time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = texts_in()
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since > 1.5:
                break
        read = (last - before) / per_request
        grown = gateway_rss(stack) - rss0
        call.cancel()
    # What the gateway took in is its window (64) plus the answers the
    # transport holds for the caller; everything the caller sent, without one.
    assert read < sent / 3, f"the gateway read {read:.0f} of {sent} requests"
    assert grown < 48 * MB, f"the gateway grew {grown / MB:.0f} MiB"


# ---- errors echo a short prefix of what the caller sent ----------------------

LONG_NAME = "m" * (8 * MB)


def assert_short(error: grpc.RpcError, code: grpc.StatusCode) -> None:
    assert error.code() == code, (error.code(), (error.details() or "")[:200])
    details = error.details() or ""
    assert len(details) < 400, f"{len(details)} characters of details"
    assert f"({8 * MB} characters)" in details


@pytest.mark.parametrize("method", ["Embed", "Classify", "Tokenize", "ModelInfo"])
def test_a_huge_model_name_is_not_echoed(stack: Stack, method: str) -> None:
    make = {
        "Embed": lambda: berth_pb2.EmbedRequest(model=LONG_NAME, texts=["hi"]),
        "Classify": lambda: berth_pb2.ClassifyRequest(model=LONG_NAME, texts=["hi"]),
        "Tokenize": lambda: berth_pb2.TokenizeRequest(model=LONG_NAME, texts=["hi"]),
        "ModelInfo": lambda: berth_pb2.ModelInfoRequest(model=LONG_NAME),
    }
    with (
        grpc.insecure_channel(stack.gateway) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        getattr(berth_pb2_grpc.BerthStub(channel), method)(make[method](), timeout=60)
    assert_short(info.value, grpc.StatusCode.INVALID_ARGUMENT)


def test_a_huge_model_name_in_a_stream_is_not_echoed(stack: Stack) -> None:
    request = berth_pb2.StreamRequest(
        embed=berth_pb2.EmbedRequest(model=LONG_NAME, texts=["hi"], request_id=5)
    )
    with grpc.insecure_channel(stack.gateway) as channel:
        answers = list(berth_pb2_grpc.BerthStub(channel).Stream(iter([request])))
    assert [a.WhichOneof("response") for a in answers] == ["error"]
    assert answers[0].error.request_id == 5
    assert answers[0].error.code == "INVALID_ARGUMENT"
    assert len(answers[0].error.message) < 400


def kserve_request(**fields: object) -> kserve_pb2.ModelInferRequest:
    tensor = kserve_pb2.ModelInferRequest.InferInputTensor(
        name="TEXT",
        datatype="BYTES",
        shape=[1],
        contents=kserve_pb2.InferTensorContents(bytes_contents=[b"hi"]),
    )
    request = kserve_pb2.ModelInferRequest(model_name="minilm", inputs=[tensor])
    for name, content in fields.items():
        if name == "parameter":
            request.parameters[str(content)].bool_param = True
        elif name == "input_name":
            request.inputs[0].name = str(content)
        elif name == "output":
            request.outputs.add(name=str(content))
        else:
            setattr(request, name, content)
    return request


@pytest.mark.parametrize(
    ("field", "code"),
    [
        ("model_name", grpc.StatusCode.NOT_FOUND),
        ("model_version", grpc.StatusCode.NOT_FOUND),
        ("parameter", grpc.StatusCode.INVALID_ARGUMENT),
        ("input_name", grpc.StatusCode.INVALID_ARGUMENT),
        ("output", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_kserve_errors_do_not_echo_huge_input(
    stack: Stack, field: str, code: grpc.StatusCode
) -> None:
    request = kserve_request(**{field: LONG_NAME})
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=60)
    assert_short(info.value, code)


def test_kserve_metadata_of_a_huge_name_is_not_echoed(stack: Stack) -> None:
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelMetadata(
                kserve_pb2.ModelMetadataRequest(name=LONG_NAME), timeout=60
            )
    assert_short(info.value, grpc.StatusCode.NOT_FOUND)
