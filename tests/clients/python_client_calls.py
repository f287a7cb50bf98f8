"""Calls made with berth_client, run by tests/clients/test_python_client.py
in a virtual environment that holds only the client and what it requires
(python -I: nothing of berth's is importable). Each scenario asserts as it
goes and prints a JSON line of what the test checks outside.

    python -I python_client_calls.py SCENARIO '{"address": ...}'
"""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import importlib.util
import json
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

import berth_client
from berth_client import (
    AsyncClient,
    BerthError,
    ClassifyResult,
    Client,
    DeadlineExceeded,
    EmbedResult,
    InvalidInput,
    NotFound,
    Overloaded,
    PermissionDenied,
    Ranked,
    RerankResult,
    Retry,
    Tls,
    Unauthenticated,
    Unavailable,
    berth_pb2,
    berth_pb2_grpc,
    classify_request,
    embed_request,
    rerank_request,
)

SERVER_PACKAGES = ("torch", "numpy", "onnxruntime", "tokenizers", "services")


def raises(kind: type[BerthError], call: Callable[[], Any]) -> BerthError:
    try:
        call()
    except kind as exc:
        return exc
    raise AssertionError(f"no {kind.__name__} raised")


def installed(args: dict[str, Any]) -> dict[str, Any]:
    versions = {
        d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
    }
    present = [m for m in SERVER_PACKAGES if importlib.util.find_spec(m)]
    return {
        "distributions": versions,
        "present": present,
        "modules": sorted(sys.modules),
    }


def calls(args: dict[str, Any]) -> dict[str, Any]:
    """Every unary method of the real gateway, and the errors it answers."""
    with Client(args["address"], api_key=args["key"], timeout=60) as berth:
        two = berth.embed(["hello world", "你好"], model="minilm")
        assert len(two.vectors) == 2 and len(two.vectors[0]) == 384, two
        assert all(abs(math.hypot(*v) - 1) < 1e-3 for v in two.vectors)
        assert two.model == "minilm" and not two.degraded and two.tokens[0] == 4
        raw = berth.embed(["hello world"], model="minilm", normalize=False)
        assert abs(math.hypot(*raw.vectors[0]) - 1) > 1e-2
        long = ["word " * 2000]
        raises(InvalidInput, lambda: berth.embed(long, model="minilm"))
        cut = berth.embed(long, model="minilm", truncate=True)
        labels = berth.classify(["set an alarm for 7 am"], model="intent", top_k=3)
        scores = [label.score for label in labels.labels[0]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)
        tokens = berth.tokenize(["hello world"], model="minilm")
        assert tokens.tokens == [["[CLS]", "hello", "world", "[SEP]"]], tokens
        models = berth.model_info()
        (minilm,) = berth.model_info("minilm")
        assert minilm.dimension == 384 and minilm.task == "embed"
        # Any unary method by name; any request field passed through.
        request = berth_pb2.EmbedRequest(model="minilm", texts=["by name"])
        assert len(berth.call("Embed", request).embeddings) == 1
        echoed = berth.embed(["an id"], model="minilm", request_id=7)
        assert echoed.response.request_id == 7
        # Options' fields too: a prompt, and the first 8 values renormalized.
        short = berth.embed(["hello"], model="minilm", prompt="q: ", dimensions=8)
        assert len(short.vectors[0]) == 8 and short.tokens[0] == 5, short
        assert abs(math.hypot(*short.vectors[0]) - 1) < 1e-3
        raises(
            InvalidInput, lambda: berth.embed(["x"], model="minilm", prompt_name="?")
        )
        raises_type(lambda: berth.embed(["x"], model="minilm", no_such_field=1))
        raises_type(lambda: berth.embed("one string", model="minilm"))
        raises(InvalidInput, lambda: berth.embed([], model="minilm"))
        unknown = raises(BerthError, lambda: berth.embed(["x"], model="nope"))
        assert isinstance(unknown, InvalidInput | NotFound), unknown
        assert "minilm" in unknown.details, unknown.details
        late = raises(
            DeadlineExceeded, lambda: berth.embed(["x"], model="minilm", timeout=1e-4)
        )
    for key in (None, "not-a-key-of-the-file"):
        with Client(args["address"], api_key=key) as stranger:
            error = raises(Unauthenticated, lambda: stranger.model_info())
            assert error.details == "missing or invalid API key", error.details
    with Client(args["address"], api_key=args["limited_key"]) as limited:
        limited.embed(["allowed"], model="minilm")
        denied = raises(
            PermissionDenied, lambda: limited.classify(["x"], model="intent")
        )
        assert "intent" in denied.details
    return {
        "models": sorted(m.name for m in models),
        "best": labels.best[0].label,
        "truncated_tokens": cut.tokens[0],
        "max_tokens": minilm.max_tokens,
        "deadline": late.code.name,
    }


def raises_type(call: Callable[[], Any]) -> None:
    try:
        call()
    except TypeError:
        return
    raise AssertionError("no TypeError raised")


def requests(n: int, bad: int | None = None) -> list[Any]:
    """n requests, every third a Classify; each text names its request."""
    out: list[Any] = []
    for i in range(n):
        texts = [f"request {i}: " + "more words " * (i % 5)]
        model = "nope" if i == bad else None
        if i % 3 == 2:
            out.append(classify_request(texts, model=model or "intent", top_k=2))
        else:
            out.append(embed_request(texts, model=model or "minilm"))
    return out


def expected(berth: Client, batch: list[Any]) -> list[Any]:
    """Each request's answer by a unary call, in order."""
    answers = []
    for request in batch:
        if isinstance(request, berth_pb2.EmbedRequest):
            answers.append(berth.embed(request.texts, model="minilm").vectors[0])
        else:
            answers.append(berth.classify(request.texts, model="intent").best[0].label)
    return answers


def matches(results: list[Any], answers: list[Any]) -> None:
    assert len(results) == len(answers)
    for i, (result, answer) in enumerate(zip(results, answers, strict=True)):
        if isinstance(result, EmbedResult):
            cosine = sum(a * b for a, b in zip(result.vectors[0], answer, strict=True))
            assert cosine > 0.999, (i, cosine)
        else:
            assert isinstance(result, ClassifyResult), (i, result)
            assert result.best[0].label == answer, (i, result, answer)


def stream(args: dict[str, Any]) -> dict[str, Any]:
    """100 requests pipelined over one Stream, 8 in flight, sync and async;
    answers in request order; a request's error in its place."""
    batch = requests(100)
    with Client(args["address"], api_key=args["key"], timeout=60) as berth:
        # Streamed first: the unary calls then get the cached answers, each
        # text's own, which the streamed answer in its place must match.
        started = time.monotonic()
        results = list(berth.stream(iter(batch), window=8, timeout=120))
        took = time.monotonic() - started
        answers = expected(berth, batch)
        matches(results, answers)
        mixed = list(berth.stream(requests(20, bad=10), return_exceptions=True))
        assert [isinstance(r, BerthError) for r in mixed] == [
            i == 10 for i in range(20)
        ]
        assert mixed[10].index == 10, mixed[10]
        seen: list[Any] = []
        error = raises(
            BerthError, lambda: seen.extend(berth.stream(requests(20, bad=10)))
        )
        assert error.index == 10 and len(seen) == 10, (error, len(seen))
        # Left early: the stream is cancelled, the client goes on.
        early = berth.stream(requests(50), window=4)
        assert isinstance(next(early), EmbedResult)
        early.close()

        def broken() -> Iterator[Any]:
            yield from batch[:3]
            raise ValueError("the source broke")

        got: list[Any] = []
        try:
            got.extend(berth.stream(broken()))
            raise AssertionError("the source's error was not raised")
        except ValueError:
            assert len(got) == 3, got
    asyncio.run(async_calls(args, batch, answers))
    return {"seconds": took, "answers": len(results)}


async def async_calls(
    args: dict[str, Any], batch: list[Any], answers: list[Any]
) -> None:
    async with AsyncClient(args["address"], api_key=args["key"], timeout=60) as berth:
        one = await berth.embed(["hello world"], model="minilm")
        assert len(one.vectors[0]) == 384
        labels = await berth.classify(["wake me at 7"], model="intent", top_k=2)
        assert len(labels.labels[0]) == 2
        assert (await berth.tokenize(["hi"], model="minilm")).ids[0][0] == 101
        assert {m.name for m in await berth.model_info()} >= {"minilm", "intent"}
        try:
            await berth.embed([], model="minilm")
            raise AssertionError("no InvalidInput raised")
        except InvalidInput:
            pass

        async def source() -> AsyncIterator[Any]:
            for request in batch:
                await asyncio.sleep(0)
                yield request

        results = [r async for r in berth.stream(source(), window=8)]
        matches(results, answers)
        plain = [r async for r in berth.stream(batch[:10], window=3)]
        matches(plain, answers[:10])
        early = berth.stream(requests(50), window=4)
        assert isinstance(await anext(early), EmbedResult)
        await early.aclose()  # type: ignore[attr-defined]
        mixed = [
            r async for r in berth.stream(requests(12, bad=4), return_exceptions=True)
        ]
        assert [isinstance(r, BerthError) for r in mixed] == [i == 4 for i in range(12)]


def ranked(result: RerankResult) -> list[list[Any]]:
    """A RerankResult's items as JSON: [index, score, tokens, text] each."""
    assert all(isinstance(r, Ranked) for r in result.results), result
    assert result.indices == [r.index for r in result.results]
    assert result.scores == [r.score for r in result.results]
    assert result.tokens == [r.tokens for r in result.results]
    assert result.texts == [r.text for r in result.results]
    return [[r.index, r.score, r.tokens, r.text] for r in result.results]


def details(error: BerthError) -> str:
    """The error's grpc-status-details-bin trailer (a google.rpc.Status),
    base64: the test decodes it, having google.rpc's messages."""
    (found,) = [v for k, v in error.trailing_metadata if k.endswith("-bin")]
    assert isinstance(found, bytes), found
    return base64.b64encode(found).decode()


def rerank(args: dict[str, Any]) -> dict[str, Any]:
    """Rerank calls to a cross-encoder ("ranker"): unary, sync and async,
    streamed among Embed requests; refused ones with their errors."""
    query, texts = args["query"], args["texts"]
    out: dict[str, Any] = {}
    with Client(args["address"], api_key=args["key"], timeout=60) as berth:
        plain = berth.rerank(query, texts, model="ranker")
        assert plain.model == "ranker" and not plain.degraded, plain
        assert plain.indices == list(range(len(texts))), plain
        assert set(plain.texts) == {""}, plain
        best = berth.rerank(query, texts, model="ranker", top_k=3, return_text=True)
        assert best.texts == [texts[i] for i in best.indices], best
        assert best.scores == sorted(plain.scores, reverse=True)[:3], best
        raw = berth.rerank(query, texts, model="ranker", sort=True, raw_scores=True)
        assert raw.indices == best.indices + raw.indices[3:], (raw, best)
        long = ["fine", "word " * 300]
        cut = berth.rerank(query, long, model="ranker", truncate=True)
        out.update(plain=ranked(plain), best=ranked(best), raw=ranked(raw))
        out["cut_tokens"] = cut.tokens
        refused = raises(
            InvalidInput, lambda: berth.rerank(query, long, model="ranker")
        )
        out["refused"] = {"details": details(refused), "message": refused.details}
        option = raises(
            InvalidInput,
            lambda: berth.rerank(query, texts, model="ranker", dimensions=8),
        )
        out["option_refused"] = details(option)
        wrong = raises(InvalidInput, lambda: berth.rerank(query, texts, model="minilm"))
        assert "call Embed" in wrong.details, wrong.details
        raises_type(lambda: berth.rerank(texts, texts, model="ranker"))  # type: ignore[arg-type]
        raises_type(lambda: berth.rerank(query, "one text", model="ranker"))
        # Streamed among Embed requests, answered in order; one refused in
        # its place.
        batch = [
            rerank_request(query, texts, model="ranker"),
            embed_request(["between the reranks"], model="minilm"),
            rerank_request(query, texts, model="ranker", top_k=3, return_text=True),
            rerank_request(query, ["fine", "word " * 300], model="ranker"),
            rerank_request(query, texts, model="ranker", sort=True, raw_scores=True),
        ]
        streamed = list(berth.stream(batch, window=2, return_exceptions=True))
        assert isinstance(streamed[1], EmbedResult), streamed[1]
        error = streamed[3]
        assert isinstance(error, InvalidInput) and error.index == 3, error
        out["streamed"] = [ranked(streamed[i]) for i in (0, 2, 4)]
    with Client(args["address"], api_key=args["limited_key"]) as limited:
        raises(PermissionDenied, lambda: limited.rerank(query, texts, model="ranker"))
    out["async"] = asyncio.run(async_rerank(args, batch))
    return out


async def async_rerank(args: dict[str, Any], batch: list[Any]) -> dict[str, Any]:
    query, texts = args["query"], args["texts"]
    async with AsyncClient(args["address"], api_key=args["key"], timeout=60) as berth:
        plain = await berth.rerank(query, texts, model="ranker")
        best = await berth.rerank(
            query, texts, model="ranker", top_k=3, return_text=True
        )
        try:
            await berth.rerank(query, ["fine", "word " * 300], model="ranker")
            raise AssertionError("no InvalidInput raised")
        except InvalidInput as exc:
            refused = details(exc)
        streamed = [r async for r in berth.stream(batch, return_exceptions=True)]
        assert isinstance(streamed[3], InvalidInput), streamed[3]
    return {
        "plain": ranked(plain),
        "best": ranked(best),
        "refused": refused,
        "streamed": [ranked(streamed[i]) for i in (0, 2, 4)],
    }


def round_robin(args: dict[str, Any]) -> dict[str, Any]:
    """Calls spread over several gateways: the test counts each one's."""
    with Client(args["addresses"], api_key=args["key"], timeout=60) as berth:
        for i in range(args["calls"]):
            berth.embed([f"round robin {i} {time.time()}"], model="minilm")
    return {"calls": args["calls"]}


def tls(args: dict[str, Any]) -> dict[str, Any]:
    """A gateway with mutual TLS: answered with the CA and a client
    certificate (files or PEM bytes), refused without one or in plaintext."""
    mutual = Tls(ca=args["ca"], cert=args["cert"], key=args["key"])
    with Client(args["address"], tls=mutual, timeout=30) as berth:
        assert len(berth.embed(["over TLS"], model="minilm").vectors) == 1
    pem = Tls(
        ca=Path(args["ca"]).read_bytes(),
        cert=Path(args["cert"]).read_bytes(),
        key=Path(args["key"]).read_bytes(),
        server_name="localhost",
    )
    with Client(args["address"], tls=pem, timeout=30) as berth:
        assert len(berth.model_info()) >= 1
    refused = []
    for settings in (Tls(ca=args["ca"]), Tls(ca=args["other_ca"]), False):
        with Client(args["address"], tls=settings, timeout=10) as stranger:
            started = time.monotonic()
            raises(Unavailable, lambda: stranger.embed(["x"], model="minilm"))  # noqa: B023
            refused.append(time.monotonic() - started)

    async def call() -> int:
        async with AsyncClient(args["address"], tls=mutual) as berth:
            return len((await berth.embed(["async TLS"], model="minilm")).vectors)

    assert asyncio.run(call()) == 1
    return {"refused_seconds": refused}


class Fake(berth_pb2_grpc.BerthServicer):
    """A gateway that fails as told: Embed ends ``codes[n]`` at its n-th
    call (OK past the list), with ``pushback`` ms asked for; Stream answers
    ``stream_cut`` requests on its first call, then ends UNAVAILABLE."""

    def __init__(self, codes: list[grpc.StatusCode] = (), pushback: str = "") -> None:
        self.codes = list(codes)
        self.pushback = pushback
        self.embeds = 0
        self.streams: list[int] = []
        self.keys: list[str] = []
        self.stream_cut = 5
        self.delay = 0.0

    def Embed(self, request: Any, context: Any) -> Any:
        self.embeds += 1
        self.keys += [
            v for k, v in context.invocation_metadata() if k == "authorization"
        ]
        time.sleep(self.delay)
        if self.embeds <= len(self.codes):
            if self.pushback:
                context.set_trailing_metadata(
                    (("grpc-retry-pushback-ms", self.pushback),)
                )
            context.abort(self.codes[self.embeds - 1], f"attempt {self.embeds} fails")
        return berth_pb2.EmbedResponse(
            model=request.model,
            embeddings=[berth_pb2.Embedding(values=[1.0]) for _ in request.texts],
        )

    def Stream(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        """Answers in pairs, the second of each pair first."""
        self.streams.append(0)
        held = None
        for request in requests:
            self.streams[-1] += 1
            answer = berth_pb2.StreamResponse(
                embed=berth_pb2.EmbedResponse(
                    request_id=request.embed.request_id,
                    embeddings=[
                        berth_pb2.Embedding(values=[float(request.embed.texts[0])])
                    ],
                )
            )
            if len(self.streams) == 1 and self.streams[-1] > self.stream_cut:
                context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            if held is None:
                held = answer
                continue
            yield answer
            yield held
            held = None
        if held is not None:
            yield held


def serve(fake: Fake, port: int = 0) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(8))
    berth_pb2_grpc.add_BerthServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def retries(args: dict[str, Any]) -> dict[str, Any]:
    """The channel's retry policy, against fake gateways."""
    out: dict[str, Any] = {}
    unavailable = grpc.StatusCode.UNAVAILABLE
    fake = Fake([unavailable, unavailable])
    server, address = serve(fake)
    with Client(address, api_key="k" * 16) as berth:
        assert berth.embed(["a"], model="m").vectors == [[1.0]]
    out["unavailable_attempts"] = fake.embeds
    assert fake.keys == ["Bearer " + "k" * 16] * 3, fake.keys
    server.stop(None)

    fake = Fake([unavailable])
    server, address = serve(fake)
    with Client(address, retry=None) as berth:
        raises(Unavailable, lambda: berth.embed(["a"], model="m"))
    out["no_retry_attempts"] = fake.embeds
    server.stop(None)

    shed = grpc.StatusCode.RESOURCE_EXHAUSTED
    fake = Fake([shed], pushback="300")
    server, address = serve(fake)
    with Client(address) as berth:
        error = raises(Overloaded, lambda: berth.embed(["a"], model="m"))
    out["overloaded"] = {
        "attempts": fake.embeds,
        "retry_after_ms": error.retry_after_ms,
    }
    fake.embeds = 0
    opted = Retry(codes=("UNAVAILABLE", "RESOURCE_EXHAUSTED"))
    with Client(address, retry=opted) as berth:
        started = time.monotonic()
        berth.embed(["a"], model="m")
        out["overloaded_retried"] = {
            "attempts": fake.embeds,
            "seconds": time.monotonic() - started,
        }
    fake.embeds = 0
    out["overloaded_async_retry_after_ms"] = asyncio.run(shed_async(address))
    fake.embeds, fake.codes, fake.delay = 0, [], 2.0
    with Client(address) as berth:
        raises(DeadlineExceeded, lambda: berth.embed(["a"], model="m", timeout=0.3))
    server.stop(None)

    nowhere = f"127.0.0.1:{free_port()}"
    with Client(nowhere) as berth:
        started = time.monotonic()
        raises(Unavailable, lambda: berth.embed(["a"], model="m"))
        out["nothing_listening_seconds"] = time.monotonic() - started
    out["waited_seconds"] = wait_for_gateway()
    out["stream"] = reopened_stream()
    return out


async def shed_async(address: str) -> int | None:
    async with AsyncClient(address) as berth:
        try:
            await berth.embed(["a"], model="m")
        except Overloaded as exc:
            return exc.retry_after_ms
    raise AssertionError("no Overloaded raised")


def wait_for_gateway() -> float:
    """wait_for_ready: a call made before the gateway listens is answered
    once it does."""
    port = free_port()
    later: list[grpc.Server] = []
    timer = threading.Timer(1.0, lambda: later.append(serve(Fake(), port)[0]))
    timer.start()
    with Client(f"127.0.0.1:{port}", wait_for_ready=True, timeout=20) as berth:
        started = time.monotonic()
        assert berth.embed(["a"], model="m").vectors == [[1.0]]
        waited = time.monotonic() - started
    timer.join()
    later[0].stop(None)
    return waited


def reopened_stream() -> dict[str, Any]:
    """A stream that ends UNAVAILABLE after 5 answers is opened again and
    the unanswered requests resent; answers stay in order."""
    fake = Fake()
    server, address = serve(fake)
    batch = [embed_request([str(i)], model="m") for i in range(40)]
    with Client(address) as berth:
        values = [r.vectors[0][0] for r in berth.stream(batch, window=6)]
    server.stop(None)
    assert values == [float(i) for i in range(40)], values
    return {"streams": fake.streams}


SCENARIOS = {
    f.__name__: f for f in (installed, calls, stream, rerank, round_robin, tls, retries)
}

if __name__ == "__main__":
    assert berth_client.__file__ is not None
    result = SCENARIOS[sys.argv[1]](
        json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    )
    print(json.dumps(result))
