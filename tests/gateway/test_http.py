"""The gateway's HTTP/JSON surface (--http-port): the stock `openai` client
and plain HTTP against a real stack, whose answers must equal berth.v1's
over gRPC; its errors, its API keys, its spans and its metrics."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from services.cli.parser import build_parser
from services.cli.plan import plan_stack
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.metrics import requests, scrape
from tests.otlp import Receiver
from tests.pki import Pki, issue
from tests.stack import ROOT, Stack, free_ports, pid_listening, serving
from tests.test_gateways import Service
from tests.test_observability import exporting_to, wait_for

FULL = "http-test-key-full-0123456789"
INTENT_ONLY = "http-test-key-intent-0123456789"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def served(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Receiver]]:
    """A stack with HTTP on, API keys on, every span exported."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{FULL}\n{INTENT_ONLY} intent\n")
    receiver = Receiver().start()
    stack = Stack(
        repository,
        http=True,
        extra_args=["--api-keys-file", str(keys)],
        env=exporting_to(receiver),
    )
    try:
        stack.wait_serving()
        yield stack, receiver
    finally:
        code = stack.stop()
        receiver.stop()
        assert code == 0, stack.logs()


@pytest.fixture(scope="module")
def stack(served: tuple[Stack, Receiver]) -> Stack:
    return served[0]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=FULL, base_url=f"{stack.http}/v1", max_retries=0)


def grpc_embed(stack: Stack, texts: list[str], **options: Any) -> np.ndarray:
    with grpc.insecure_channel(stack.gateway) as channel:
        reply = berth_pb2_grpc.BerthStub(channel).Embed(
            berth_pb2.EmbedRequest(
                model="minilm", texts=texts, options=berth_pb2.Options(**options)
            ),
            metadata=(("authorization", f"Bearer {FULL}"),),
            timeout=30,
        )
    return np.array([e.values for e in reply.embeddings])


def post(
    stack: Stack,
    path: str,
    body: Any,
    key: str | None = FULL,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    """POST ``body`` (JSON, or bytes as they are): status, JSON reply, headers."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    return _call(urllib.request.Request(f"{stack.http}{path}", data, sent))


def get(stack: Stack, path: str, key: str | None = FULL) -> tuple[int, Any, Any]:
    sent = {"authorization": f"Bearer {key}"} if key is not None else {}
    return _call(urllib.request.Request(f"{stack.http}{path}", headers=sent))


def _call(request: urllib.request.Request) -> tuple[int, Any, dict[str, str]]:
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, raw, headers = reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as error:
        status, raw, headers = error.code, error.read(), dict(error.headers)
    return status, json.loads(raw) if raw else None, headers


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


TEXTS = ["hello world", "你好", "an HTTP surface for berth"]


def test_the_openai_client_embeds_as_grpc_does(
    stack: Stack, client: openai.OpenAI
) -> None:
    expected = grpc_embed(stack, TEXTS)
    # Without encoding_format the client asks for base64 (little-endian
    # float32) and decodes it itself.
    listed = client.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in listed.data] == [0, 1, 2]
    assert listed.model == "minilm"
    assert listed.usage.prompt_tokens == listed.usage.total_tokens > len(TEXTS)
    vectors = np.array([d.embedding for d in listed.data])
    assert vectors.shape == (3, 384)
    assert np.all(cosines(vectors, expected) > 0.9999)
    floats = client.embeddings.create(
        model="minilm", input=TEXTS, encoding_format="float"
    )
    assert np.allclose([d.embedding for d in floats.data], vectors, atol=1e-6)
    packed = client.embeddings.create(
        model="minilm", input=TEXTS, encoding_format="base64"
    )
    decoded = [
        np.frombuffer(base64.b64decode(str(d.embedding)), "<f4") for d in packed.data
    ]
    assert np.array_equal(decoded, vectors.astype(np.float32))
    one = client.embeddings.create(model="minilm", input=TEXTS[0])
    assert len(one.data) == 1
    assert cosines(np.array([one.data[0].embedding]), expected[:1])[0] > 0.9999


def test_dimensions_keep_the_first_values_normalized(
    stack: Stack, client: openai.OpenAI
) -> None:
    expected = grpc_embed(stack, TEXTS, dimensions=64)
    reply = client.embeddings.create(model="minilm", input=TEXTS, dimensions=64)
    vectors = np.array([d.embedding for d in reply.data])
    assert vectors.shape == (3, 64)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.all(cosines(vectors, expected) > 0.9999)


def test_the_openai_client_lists_the_embedding_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["minilm"]
    assert client.models.retrieve("minilm").owned_by == "berth"


def test_the_openai_client_gets_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="nope", input="x")
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model="minilm", input=[])
    assert "texts is empty" in empty.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as ids:
        client.embeddings.create(model="minilm", input=[[101, 7592, 102]])
    assert ids.value.body["param"] == "input[0]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as intent:
        client.embeddings.create(model="intent", input="x")
    assert "classify model" in intent.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            api_key="not-a-key-of-the-file", base_url=client.base_url, max_retries=0
        ).embeddings.create(model="minilm", input="x")


def test_tei_embed_equals_grpc(stack: Stack) -> None:
    status, vectors, _ = post(stack, "/embed", {"inputs": TEXTS})
    assert status == 200
    assert np.all(cosines(np.array(vectors), grpc_embed(stack, TEXTS)) > 0.9999)
    status, single, _ = post(stack, "/embed", {"inputs": "hello world"})
    assert status == 200 and len(single) == 1 and len(single[0]) == 384
    # TEI's normalize: false leaves the pooled vector as it is.
    status, raw, _ = post(stack, "/embed", {"inputs": TEXTS, "normalize": False})
    expected = grpc_embed(stack, TEXTS, normalize=False)
    assert status == 200 and np.allclose(raw, expected, atol=1e-4)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)


def test_tei_predict_ranks_every_label(stack: Stack) -> None:
    status, labels, _ = post(stack, "/predict", {"inputs": "set an alarm for 7 am"})
    assert status == 200
    assert labels[0]["label"] == "alarm", labels
    scores = [item["score"] for item in labels]
    assert scores == sorted(scores, reverse=True) and len(scores) > 2
    assert abs(sum(scores) - 1.0) < 1e-3  # every label's probability
    status, batch, _ = post(
        stack, "/predict", {"inputs": ["set an alarm for 7 am", "hello"]}
    )
    assert status == 200 and len(batch) == 2 and batch[0] == labels


def test_tei_info_and_health(stack: Stack) -> None:
    status, info, _ = get(stack, "/info")
    assert status == 200 and info["model_id"] == "minilm"
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 256
    status, info, _ = get(stack, "/info?model=intent")
    assert "alarm" in info["model_type"]["classifier"]["label2id"]
    assert get(stack, "/health", key=None)[0] == 200  # open, as gRPC's health


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/embed", b"{not json", 400, "not JSON"),
        ("/embed", b"[" * 100_000 + b"]" * 100_000, 400, "not JSON"),
        ("/embed", [1, 2], 400, "JSON object"),
        ("/embed", {"inputs": []}, 400, "texts is empty"),
        ("/embed", {"inputs": ["a"] * 300}, 400, "--max-texts"),
        ("/embed", {"inputs": "x", "colour": 1}, 400, "unknown field 'colour'"),
        ("/embed", {"inputs": "word " * 400}, 400, "256"),
        ("/embed?model=nope", {"inputs": "x"}, 404, "unknown model 'nope'"),
        ("/predict", {"inputs": "x", "raw_scores": True}, 400, "raw_scores"),
        ("/embed", {"inputs": "x", "truncate": "yes"}, 400, "truncate must be"),
        ("/embed", b'{"inputs": "a\\ud800b"}', 400, "lone surrogate"),
        ("/embed", {"inputs": "x" * (17 * 2**20)}, 413, "--max-message-mb"),
    ],
)
def test_bad_requests_get_tei_errors_and_the_gateway_serves_on(
    stack: Stack, path: str, body: Any, status: int, says: str
) -> None:
    got, reply, _ = post(stack, path, body)
    assert got == status, reply
    assert says in reply["error"], reply
    assert reply["error_type"] in ("Validation", "NotFound")
    assert post(stack, "/embed", {"inputs": "still here"})[0] == 200


def test_an_over_limit_text_is_cut_with_truncate(stack: Stack) -> None:
    status, vectors, _ = post(
        stack, "/embed", {"inputs": "word " * 400, "truncate": True}
    )
    assert status == 200 and len(vectors[0]) == 384


def test_api_keys_apply_as_on_grpc(stack: Stack) -> None:
    status, reply, headers = post(stack, "/embed", {"inputs": "x"}, key=None)
    assert status == 401 and reply["error_type"] == "Unauthorized"
    assert headers.get("WWW-Authenticate") == "Bearer"
    assert post(stack, "/embed", {"inputs": "x"}, key="wrong-key-0123456789")[0] == 401
    # A key for intent alone: classifies, may not embed, lists no models.
    status, reply, _ = post(stack, "/embed", {"inputs": "x"}, key=INTENT_ONLY)
    assert status == 403 and "may not use model 'minilm'" in reply["error"]
    assert post(stack, "/predict", {"inputs": "x"}, key=INTENT_ONLY)[0] == 200
    assert get(stack, "/v1/models", key=INTENT_ONLY)[1]["data"] == []


def test_a_request_is_a_span_in_the_callers_trace(
    served: tuple[Stack, Receiver],
) -> None:
    stack, receiver = served
    traceparent = f"00-{TRACE}-{PARENT}-01"
    status, _, _ = post(
        stack, "/embed", {"inputs": "trace me"}, headers={"traceparent": traceparent}
    )
    assert status == 200

    def http_span() -> list[Any]:
        return [
            s
            for s in receiver.snapshot()
            if s.trace_id == TRACE and s.parent_id == PARENT
        ]

    (span,) = wait_for(http_span)
    assert span.service == "gateway" and span.name == "POST /embed"
    port = int(stack.http.rsplit(":", 1)[1])
    assert span.attributes == {
        **span.attributes,
        "http.request.method": "POST",
        "http.route": "/embed",
        "url.path": "/embed",
        "http.response.status_code": 200,
        "server.address": "127.0.0.1",
        "server.port": port,
    }
    # The hops behind it joined the trace under it.
    below = wait_for(
        lambda: [
            s
            for s in receiver.snapshot()
            if s.trace_id == TRACE and s.name == "gateway.infer"
        ]
    )
    assert below and below[0].parent_id == span.span_id
    # The batcher got the request's deadline (--http-timeout-s, 30 s).
    queued = wait_for(
        lambda: [
            s
            for s in receiver.snapshot()
            if s.trace_id == TRACE and s.name == "batcher.queue"
        ]
    )
    assert queued and 25_000 < int(queued[0].attributes["berth.timeout_ms"]) <= 30_000


def test_http_calls_are_counted(stack: Stack) -> None:
    before = scrape(stack.metrics[0])
    assert post(stack, "/embed", {"inputs": "count me"})[0] == 200
    assert post(stack, "/embed", {"inputs": []})[0] == 400
    after = scrape(stack.metrics[0])
    for outcome in ("ok", "invalid"):
        grew = requests(after, "minilm", "http", outcome) - requests(
            before, "minilm", "http", outcome
        )
        assert grew == 1, outcome


def test_serve_shares_an_http_port_on_8080_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BERTH_HTTP_PORT", raising=False)
    args = build_parser().parse_args(["serve", "--gateways", "2", "--device", "cpu"])
    plan = plan_stack(args, devices=[])
    gateways = [c.argv for c in plan.children if c.name.startswith("gateway")]
    assert len(gateways) == 2
    assert all(argv[argv.index("--http-port") + 1] == "8080" for argv in gateways)
    assert any(
        listener.flag == "--http-port" and listener.port == 8080
        for listener in plan.listeners
    )
    off = plan_stack(build_parser().parse_args(["serve", "--http-port", "0"]), [])
    assert not any(listener.flag == "--http-port" for listener in off.listeners)


def test_a_gateway_refuses_http_on_its_grpc_port() -> None:
    """Refused before anything starts. (In a process of its own: the
    gateway's modules hold berth's KServe stubs, which cannot share a
    process with the tritonclient that other tests import.)"""
    command = [sys.executable, "-m", "gateway", "--port", "7000"]
    done = subprocess.run(
        [*command, "--http-port", "7000"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert "--http-port" in done.stderr


def test_http_timeout_s_takes_0_for_no_deadline() -> None:
    """0 is taken (no deadline); a negative or infinite deadline is refused
    before anything starts. (In a process of its own, as above.)"""
    parse = (
        "import sys; from gateway.__main__ import parse_args; "
        "print(parse_args(sys.argv[1:]).http_timeout_s)"
    )

    def run(value: str) -> subprocess.CompletedProcess[str]:
        argv = ["--http-port", "7001", "--http-timeout-s", value]
        return subprocess.run(
            [sys.executable, "-c", parse, *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )

    taken = run("0")
    assert taken.returncode == 0 and taken.stdout.strip() == "0.0", taken.stderr
    for value in ("-1", "inf"):
        refused = run(value)
        assert refused.returncode == 2 and "--http-timeout-s" in refused.stderr


def test_a_request_past_its_deadline_is_504_and_the_gateway_serves_on(
    repository: Path,
) -> None:
    """--http-timeout-s 1 (BERTH_HTTP_TIMEOUT_S under serve): with the
    batcher stopped (SIGSTOP; its stream stays up, so neither the batcher's
    deadline nor the fallback answers) a call waits; it is answered 504 in
    the route's style soon after its deadline, counted as failed, and once
    the batcher resumes the next call is answered by the engines."""
    stack = Stack(repository, http=True, env={"BERTH_HTTP_TIMEOUT_S": "1"})
    with serving(stack):
        assert post(stack, "/embed", {"inputs": "before the stop"})[0] == 200
        batcher = pid_listening("batcher", int(stack.batcher.rsplit(":", 1)[1]))
        before = scrape(stack.metrics[0])
        calls = [
            ("/embed", {"inputs": "waits for a stopped batcher"}),
            ("/v1/embeddings", {"model": "minilm", "input": "and so does this"}),
        ]
        os.kill(batcher, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with ThreadPoolExecutor(2) as pool:  # (_call waits up to 60 s)
                tei, openai_style = pool.map(lambda c: post(stack, *c), calls)
            took = time.monotonic() - t0
        finally:
            os.kill(batcher, signal.SIGCONT)
        # Without the deadline they would wait until the stream's keepalive
        # gives the stopped batcher up (5 s and more), then get the
        # fallback's answer.
        assert took < 4, (took, tei, openai_style)
        assert tei[0] == 504 and tei[1]["error_type"] == "Timeout", tei
        assert "--http-timeout-s" in tei[1]["error"]
        assert openai_style[0] == 504, openai_style
        error = openai_style[1]["error"]
        assert error["type"] == "server_error"
        assert error["code"] == "deadline_exceeded"
        assert "--http-timeout-s" in error["message"]
        after = scrape(stack.metrics[0])
        failed = requests(after, "minilm", "http", "failed")
        assert failed - requests(before, "minilm", "http", "failed") == 2
        status, vectors, headers = post(stack, "/embed", {"inputs": "after it"})
        assert status == 200 and len(vectors[0]) == 384
        assert "x-berth-degraded" not in {k.lower() for k in headers}


def test_tei_rerank_answers_as_the_cross_encoder(tmp_path: Path) -> None:
    from tests.test_rerank import QUERY, cross_encoder_scores, write_cross_encoder

    checkpoint = tmp_path / "ranker"
    write_cross_encoder(checkpoint, "bert")
    texts = ["A cross-encoder reads both.", "Bananas are yellow.", "a"]
    theirs = cross_encoder_scores(checkpoint, QUERY, texts)
    stack = Stack(
        tmp_path / "repo",
        http=True,
        env={"BERTH_CACHE_DIR": str(tmp_path / "cache")},
        extra_args=["--model", f"ranker={checkpoint}"],
    )
    with serving(stack):
        body = {"query": QUERY, "texts": texts, "return_text": True}
        status, ranked, _ = post(stack, "/rerank", body)
        assert status == 200, ranked
        order = list(np.argsort(-theirs, kind="stable"))
        assert [r["index"] for r in ranked] == order
        assert [r["text"] for r in ranked] == [texts[i] for i in order]
        scores = np.array([r["score"] for r in ranked])
        assert np.abs(scores - theirs[order]).max() <= 1e-4
        body = {"query": QUERY, "texts": texts, "raw_scores": True}
        status, raw, _ = post(stack, "/rerank", body)
        logits = np.log(theirs / (1 - theirs))[order]
        assert status == 200 and "text" not in raw[0]
        assert np.abs(np.array([r["score"] for r in raw]) - logits).max() <= 1e-3
        # The rerank model is no embedding model, and /embed has none.
        status, reply, _ = post(stack, "/embed", {"inputs": "x"})
        assert status == 400 and "?model=" in reply["error"], reply


LONG = " ".join(["a long enough sentence to take the engine a while"] * 25)


def test_overload_is_429_and_sigterm_finishes_requests_in_flight(
    repository: Path,
) -> None:
    """--max-in-flight 2: of many calls at once some are refused 429 with
    Retry-After; then calls in flight when SIGTERM comes are answered."""
    stack = Stack(repository, http=True, env={"BERTH_MAX_IN_FLIGHT": "2"})
    body = {"inputs": [f"{i} {LONG}" for i in range(20)]}
    try:
        stack.wait_serving()
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: post(stack, "/embed", body), range(8)))
        statuses = sorted(status for status, _, _ in replies)
        assert 200 in statuses and 429 in statuses, statuses
        shed = next(r for r in replies if r[0] == 429)
        assert shed[1]["error_type"] == "Overloaded"
        assert shed[2]["Retry-After"] == "1"

        # (Texts of their own: the cache holds the first ones.)
        fresh = [{"inputs": [f"{i} {j} {LONG}" for i in range(20)]} for j in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(post, stack, "/embed", b) for b in fresh]
            time.sleep(0.5)  # in flight
            signalled = time.monotonic()
            stack.proc.send_signal(signal.SIGTERM)
            answered = [call.result(timeout=90) for call in calls]
            after = time.monotonic() - signalled
        code = stack.proc.wait(90)
    finally:
        stack.stop()
    assert [status for status, _, _ in answered] == [200, 200], answered
    assert all(len(vectors) == 20 for _, vectors, _ in answered)
    assert after > 0.5, "no call outlived the lame duck: the test proves nothing"
    assert code == 0, stack.logs()


def test_https_serves_the_grpc_port_s_certificate_and_its_rotation(
    repository: Path, tmp_path: Path
) -> None:
    """With --tls-cert the HTTP port is HTTPS with the same certificate, and
    takes a rotated one without a restart (no batcher: the CPU fallback
    answers, saying so in a header)."""
    ca, other = issue("berth test CA"), issue("another CA")
    pki = Pki(
        tmp_path,
        ca,
        issue("berth gateway", ca, server=True),
        issue("client", ca),
        other,
        issue("stranger", other),
    )
    ca_file = pki.write("ca.pem", ca.cert_pem)
    cert = pki.write("server.pem", pki.server.cert_pem)
    key = pki.write("server.key", pki.server.key_pem)
    (port,) = free_ports(1)
    gateway = Service(
        "gateway",
        repository,
        *("--batcher", "127.0.0.1:1", "--startup-wait-s", "0"),
        *("--tls-cert", cert, "--tls-key", key, "--http-port", str(port)),
    )
    trusting = ssl.create_default_context(cafile=ca_file)

    def subject() -> str:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            trusting.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            return str(tls.getpeercert()["subject"])

    try:
        wait_for(lambda: "HTTP/JSON listening on https://" in gateway.logs(), 120)
        request = urllib.request.Request(
            f"https://127.0.0.1:{port}/embed",
            json.dumps({"inputs": "over HTTPS"}).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60, context=trusting) as reply:
            assert reply.status == 200
            assert reply.headers["x-berth-degraded"] == "true"
            assert len(json.loads(reply.read())[0]) == 384
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert "berth gateway" in subject()
        rotated = issue("rotated gateway", ca, server=True)
        pki.write("server.pem", rotated.cert_pem)  # (key and cert differ a moment)
        pki.write("server.key", rotated.key_pem)
        assert wait_for(lambda: "rotated gateway" in subject(), 20), gateway.logs()
    finally:
        gateway.stop()
