"""Edges of the public berth.v1 API, through `berth serve`."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import Stack, health, stream_raw


def test_tokenize_refuses_a_text_far_over_the_limit(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    huge = "hello world " * 100_000
    request = berth_pb2.TokenizeRequest(model="minilm", texts=["fine", huge])
    with pytest.raises(grpc.RpcError) as info:
        client.Tokenize(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "texts[1] has 1200000 characters, over the limit of 8192" in (
        info.value.details() or ""
    )
    # A text over the token limit but not the character guard is tokenized:
    # Tokenize is how a caller learns how long a text is.
    request = berth_pb2.TokenizeRequest(model="minilm", texts=["word " * 600])
    assert len(client.Tokenize(request, timeout=30).results[0].ids) == 602


def test_large_tokenize_call_does_not_stall_other_calls(stack: Stack) -> None:
    options = [("grpc.max_receive_message_length", 64 * 2**20)]
    with (
        grpc.insecure_channel(stack.gateway, options=options) as big,
        grpc.insecure_channel(stack.gateway) as small,
    ):
        tokenizer = berth_pb2_grpc.BerthStub(big)
        other = berth_pb2_grpc.BerthStub(small)
        # 256 texts just under the character guard (8192 for minilm's 256
        # tokens): ~400k tokens.
        texts = [f"hello world {i} " * 500 for i in range(256)]
        request = berth_pb2.TokenizeRequest(model="minilm", texts=texts)
        done: list[berth_pb2.TokenizeResponse] = []
        call = threading.Thread(
            target=lambda: done.append(tokenizer.Tokenize(request, timeout=60))
        )
        began = time.perf_counter()
        call.start()
        time.sleep(0.2)
        waits: list[float] = []
        while call.is_alive():
            t0 = time.perf_counter()
            other.ModelInfo(berth_pb2.ModelInfoRequest(model="minilm"), timeout=30)
            waits.append(time.perf_counter() - t0)
        call.join(60)
        took = time.perf_counter() - began
    assert len(done) == 1 and len(done[0].results) == 256
    # Tokenized on the event loop, a ModelInfo call waited for most of the
    # Tokenize call; off it, each waits a small part of it, however loaded
    # the machine is (both slow down alike).
    assert len(waits) >= 3, f"only {len(waits)} ModelInfo calls in {took:.2f} s"
    assert max(waits) < 0.4 * took, (
        f"ModelInfo waited {max(waits):.2f} s behind a {took:.2f} s Tokenize call"
    )


def test_stream_with_a_malformed_message_ends_with_invalid_argument(
    stack: Stack,
) -> None:
    """A message that is not a StreamRequest (here: a string with bad UTF-8)
    ends the stream with INVALID_ARGUMENT; what came before is answered."""
    good = berth_pb2.StreamRequest(
        embed=berth_pb2.EmbedRequest(model="minilm", texts=["abc"], request_id=1)
    ).SerializeToString()
    bad = good.replace(b"abc", b"a\xffc")
    answers, error, took = stream_raw(
        stack.gateway,
        "/berth.v1.Berth/Stream",
        [good, bad],
        berth_pb2.StreamResponse.FromString,
    )
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message 2 of this stream" in (error.details() or "")
    assert "UTF-8" in (error.details() or "")
    assert took < 10
    assert [a.WhichOneof("response") for a in answers] == ["embed"]
    assert answers[0].embed.request_id == 1


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        ("Embed", berth_pb2.EmbedRequest(model="nope", texts=["hi"])),
        ("Classify", berth_pb2.ClassifyRequest(model="nope", texts=["hi"])),
        ("Tokenize", berth_pb2.TokenizeRequest(model="nope", texts=["hi"])),
        ("ModelInfo", berth_pb2.ModelInfoRequest(model="nope")),
    ],
)
def test_unknown_model_names_the_served_ones_on_every_rpc(
    client: berth_pb2_grpc.BerthStub, method: str, request_: Any
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        getattr(client, method)(request_, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "unknown model 'nope'; this gateway serves intent, minilm"
    )


def _unparseable(request: Any, how: str) -> bytes:
    """``request`` serialized, then broken: its ``model`` string made
    invalid UTF-8, or its last field cut short."""
    raw = request.SerializeToString()
    if how == "bad UTF-8":
        return raw.replace(b"MARK", b"M\xffR\xfe")
    return raw[:-2]


@pytest.mark.parametrize("how", ["bad UTF-8", "truncated"])
@pytest.mark.parametrize(
    ("method", "request_", "response_type", "good"),
    [
        pytest.param(
            "Embed",
            berth_pb2.EmbedRequest(texts=["hello"], model="MARK"),
            berth_pb2.EmbedResponse,
            berth_pb2.EmbedRequest(model="minilm", texts=["after a bad call"]),
            id="Embed",
        ),
        pytest.param(
            "Classify",
            berth_pb2.ClassifyRequest(texts=["hello"], model="MARK"),
            berth_pb2.ClassifyResponse,
            berth_pb2.ClassifyRequest(model="intent", texts=["after a bad call"]),
            id="Classify",
        ),
        pytest.param(
            "Tokenize",
            berth_pb2.TokenizeRequest(texts=["hello"], model="MARK"),
            berth_pb2.TokenizeResponse,
            berth_pb2.TokenizeRequest(model="minilm", texts=["after a bad call"]),
            id="Tokenize",
        ),
        pytest.param(
            "ModelInfo",
            berth_pb2.ModelInfoRequest(model="MARK"),
            berth_pb2.ModelInfoResponse,
            berth_pb2.ModelInfoRequest(model="minilm"),
            id="ModelInfo",
        ),
    ],
)
def test_unary_call_that_cannot_be_parsed_is_invalid_argument(
    stack: Stack, method: str, request_: Any, response_type: Any, good: Any, how: str
) -> None:
    """Bytes that are not the method's request message are the caller's
    mistake: INVALID_ARGUMENT naming the message type and the parse error
    (not UNKNOWN from gRPC's deserializer), and the gateway serves on."""
    with grpc.insecure_channel(stack.gateway) as channel:
        call = channel.unary_unary(
            f"/berth.v1.Berth/{method}",
            request_serializer=None,  # the bytes go as they are
            response_deserializer=response_type.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            call(_unparseable(request_, how), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details() or ""
        name = type(request_).DESCRIPTOR.full_name
        assert f"could not be parsed as {name}" in details, details
        reason = "bad UTF-8" if how == "bad UTF-8" else "corrupt"
        assert reason in details, details
        # The gateway is unharmed: the next good call on the same channel
        # is answered, and it is still SERVING.
        stub = berth_pb2_grpc.BerthStub(channel)
        assert getattr(stub, method)(good, timeout=30).ByteSize() > 0
    assert health(stack.gateway) == "SERVING"
