"""KServe v2 calls in berth's traces and metrics, called by tritonclient.

Traces: a stack exporting to a real OTLP receiver, and a caller's W3C
traceparent sent as tritonclient headers (``infer(headers=...)``,
``start_stream(headers=...)``). Metrics: a lone gateway whose batcher is
unreachable, so the CPU fallback answers (degraded) and one slot in flight
sheds the rest.

Like tests/gateway/test_kserve.py, this process imports tritonclient's `inference`
stubs, never berth's (services.proto.inference).
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests import test_observability as observability
from tests.kserve_inputs import text_input
from tests.metrics import requests, scrape, value
from tests.otlp import ReceivedSpan, Receiver
from tests.stack import Stack, free_ports
from tests.test_gateways import service
from tests.test_observability import CLIENT_SPAN, wait_for

# The traced stack of test_observability (a real OTLP receiver), started
# anew for this module.
traced = observability.traced

MODEL_INFER = "inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "inference.GRPCInferenceService/ModelStreamInfer"
STATUS_ERROR = 2  # STATUS_CODE_ERROR


def traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}


@pytest.fixture
def tc(traced: tuple[Stack, Receiver]) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url=traced[0].gateway)
    yield client
    client.close()


def root_of(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> ReceivedSpan:
    """The span's ancestor right under the caller's span; every span on the
    way is the gateway's."""
    while span.parent_id != CLIENT_SPAN:
        assert span.service == "gateway", span
        span = by_id[span.parent_id]
    return span


def wait_for_hops(
    receiver: Receiver, trace_id: str, texts: int, roots: int
) -> list[ReceivedSpan]:
    """Every span received once the trace holds ``roots`` spans under the
    caller's, ``texts`` batcher.queue spans and their gateway parents, and
    the engine ran each batch that carried them (each service exports on its
    own schedule)."""

    def ready() -> list[ReceivedSpan] | None:
        spans = receiver.snapshot()
        in_trace = [s for s in spans if s.trace_id == trace_id]
        if sum(s.parent_id == CLIENT_SPAN for s in in_trace) < roots:
            return None
        ids = {s.span_id for s in in_trace}
        queues = [s for s in in_trace if s.name == "batcher.queue"]
        if len(queues) < texts or any(q.parent_id not in ids for q in queues):
            return None
        queued = {(s.trace_id, s.span_id) for s in queues}
        batches = [
            s for s in spans if s.name == "batcher.batch" and queued & set(s.links)
        ]
        if queued - {link for b in batches for link in b.links}:
            return None
        ran = {s.parent_id for s in spans if s.name == "engine.batch"}
        if any(b.span_id not in ran for b in batches):
            return None
        return spans

    spans = wait_for(ready)
    assert spans, f"not every hop reached the receiver: {receiver.snapshot()}"
    time.sleep(0.5)  # the engine's children come in the same export or next
    return receiver.snapshot()


def assert_joined(
    spans: list[ReceivedSpan], trace_id: str, roots: dict[str, str]
) -> dict[str, ReceivedSpan]:
    """The caller's trace has one gateway span ``name`` right under the
    caller's span per model of ``roots`` (model -> name); each has the
    gateway's tokenize and infer spans under it, and batcher.queue spans
    whose batches the engine ran. Returns the root spans by model."""
    by_id = {s.span_id: s for s in spans}
    in_trace = [s for s in spans if s.trace_id == trace_id]
    top = [s for s in in_trace if s.parent_id == CLIENT_SPAN]
    assert all(s.service == "gateway" for s in top), top
    by_model = {str(s.attributes["berth.model"]): s for s in top}
    assert len(by_model) == len(top) == len(roots), top
    assert {m: s.name for m, s in by_model.items()} == roots
    for model, root in by_model.items():
        below = {
            s.name
            for s in in_trace
            if s.service == "gateway" and s is not root and root_of(s, by_id) is root
        }
        assert {"gateway.tokenize", "gateway.infer"} <= below, (model, below)
        queues = [
            q
            for q in in_trace
            if q.name == "batcher.queue" and root_of(by_id[q.parent_id], by_id) is root
        ]
        assert queues and all(q.service == "batcher" for q in queues), in_trace
        for q in queues:
            batch = next(
                s
                for s in spans
                if s.name == "batcher.batch" and (trace_id, q.span_id) in s.links
            )
            assert batch.service == "batcher"
            engine = next(
                s
                for s in spans
                if s.name == "engine.batch" and s.parent_id == batch.span_id
            )
            assert engine.service == "engine"
            stages = {s.name for s in spans if s.parent_id == engine.span_id}
            assert stages == {"engine.copy_in", "engine.compute", "engine.copy_out"}
    return by_model


def test_model_infer_joins_the_callers_trace(
    traced: tuple[Stack, Receiver], tc: triton.InferenceServerClient
) -> None:
    """A traceparent in ModelInfer's metadata: the gateway's KServe span is
    the caller's span's child, and the texts' batcher and engine hops hang
    under it, as for berth's Embed."""
    _, receiver = traced
    trace_id = "4af7651916cd43dd8448eb211c80319c"
    tag = uuid.uuid4().hex  # texts no other call sent: no cache hit
    texts = [f"{tag} kserve, traced", f"{tag} and its twin"]
    result = tc.infer("minilm", [text_input(texts)], headers=traceparent(trace_id))
    assert result.as_numpy("EMBEDDING").shape == (2, 384)
    spans = wait_for_hops(receiver, trace_id, texts=2, roots=1)
    (root,) = assert_joined(spans, trace_id, {"minilm": MODEL_INFER}).values()
    assert root.status_code != STATUS_ERROR
    queued = [s for s in spans if s.trace_id == trace_id and s.name == "batcher.queue"]
    assert len(queued) == 2


def test_model_stream_infer_joins_the_callers_trace(
    traced: tuple[Stack, Receiver], tc: triton.InferenceServerClient
) -> None:
    """A traceparent in the stream's metadata: each request on the stream
    has its own KServe span under the caller's span, with its hops."""
    _, receiver = traced
    trace_id = "5af7651916cd43dd8448eb211c80319c"
    tag = uuid.uuid4().hex
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(
        callback=lambda result, error: answers.put((result, error)),
        headers=traceparent(trace_id),
    )
    try:
        tc.async_stream_infer("minilm", [text_input([f"{tag} streamed"])])
        tc.async_stream_infer("intent", [text_input([f"{tag} set an alarm"])])
        got = [answers.get(timeout=60) for _ in range(2)]
    finally:
        tc.stop_stream()
    assert [e for _, e in got] == [None, None]
    spans = wait_for_hops(receiver, trace_id, texts=2, roots=2)
    roots = assert_joined(
        spans, trace_id, {"minilm": MODEL_STREAM_INFER, "intent": MODEL_STREAM_INFER}
    )
    assert all(r.status_code != STATUS_ERROR for r in roots.values())


def test_failed_kserve_requests_mark_their_span(
    traced: tuple[Stack, Receiver], tc: triton.InferenceServerClient
) -> None:
    """A refused ModelInfer, and a refused request on a stream (answered
    with an error message, the stream going on), mark their span ERROR;
    the stream's good request's span is not."""
    _, receiver = traced
    unary = "6af7651916cd43dd8448eb211c80319c"
    stream = "7af7651916cd43dd8448eb211c80319c"
    with pytest.raises(InferenceServerException):
        tc.infer("minilm", [text_input([""])], headers=traceparent(unary))
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tc.start_stream(
        callback=lambda result, error: answers.put((result, error)),
        headers=traceparent(stream),
    )
    try:
        tc.async_stream_infer("minilm", [text_input([""])], request_id="bad")
        tc.async_stream_infer("intent", [text_input(["flip a coin"])], request_id="ok")
        got = [answers.get(timeout=60) for _ in range(2)]
    finally:
        tc.stop_stream()
    assert [e is None for _, e in got] == [False, True]

    def roots(trace_id: str, n: int) -> list[ReceivedSpan] | None:
        spans = [
            s
            for s in receiver.snapshot()
            if s.trace_id == trace_id and s.parent_id == CLIENT_SPAN
        ]
        return spans if len(spans) >= n else None

    (refused,) = wait_for(lambda: roots(unary, 1)) or []
    assert (refused.name, refused.status_code) == (MODEL_INFER, STATUS_ERROR)
    on_stream = wait_for(lambda: roots(stream, 2)) or []
    status = {str(s.attributes["berth.model"]): s.status_code for s in on_stream}
    assert status["minilm"] == STATUS_ERROR, on_stream
    assert status["intent"] != STATUS_ERROR, on_stream


IN_FLIGHT = "berth_gateway_requests_in_flight"
# The lone gateway's start-up window: a request that comes in it waits this
# long at most for a batcher, holding its place in flight, before the
# fallback answers it.
STARTUP_WAIT_S = 6.0


def test_degraded_and_shed_kserve_requests_are_counted(repository: Path) -> None:
    """No batcher: with one request allowed in flight, a ModelInfer waiting
    out the gateway's start-up window is in the in-flight gauge, and another
    that comes meanwhile is shed (outcome shed); the CPU fallback answers
    the first, then ModelInfer and ModelStreamInfer at once (degraded)."""
    nowhere, metrics_port = free_ports(2)
    flags = (
        "--batcher",
        f"127.0.0.1:{nowhere}",
        "--startup-wait-s",
        str(STARTUP_WAIT_S),
        "--max-in-flight",
        "1",
        "--metrics-port",
        str(metrics_port),
    )
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with service("gateway", repository, *flags) as gateway:
        gateway.wait_for("NOT_SERVING")
        tc = triton.InferenceServerClient(url=gateway.address)
        try:
            before = scrape(url)
            done: queue.Queue[tuple[Any, Any]] = queue.Queue()
            tc.async_infer(
                "minilm",
                [text_input(["waits for a batcher"])],
                callback=lambda result, error: done.put((result, error)),
                client_timeout=60,
            )
            in_flight = wait_for(
                lambda: value(scrape(url), IN_FLIGHT), timeout=STARTUP_WAIT_S
            )
            assert in_flight == 1 and done.empty()
            with pytest.raises(InferenceServerException) as shed:
                tc.infer("minilm", [text_input(["shed me"])])
            assert shed.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert "--max-in-flight" in str(shed.value.message())
            waited, error = done.get(timeout=60)
            assert error is None
            assert waited.get_response().parameters["berth_degraded"].bool_param
            result = tc.infer("minilm", [text_input(["answered by the fallback"])])
            assert result.get_response().parameters["berth_degraded"].bool_param
            answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
            tc.start_stream(callback=lambda result, error: answers.put((result, error)))
            try:
                tc.async_stream_infer("minilm", [text_input(["streamed, degraded"])])
                streamed, error = answers.get(timeout=60)
            finally:
                tc.stop_stream()
            assert error is None
            assert streamed.get_response().parameters["berth_degraded"].bool_param
            after = scrape(url)
        finally:
            tc.close()

    def delta(api: str, outcome: str) -> float:
        return requests(after, "minilm", api, outcome) - requests(
            before, "minilm", api, outcome
        )

    assert delta("kserve", "degraded") == 2
    assert delta("kserve", "shed") == 1
    assert delta("kserve_stream", "degraded") == 1
    assert delta("kserve", "ok") == delta("kserve", "failed") == 0
    assert value(after, IN_FLIGHT) == 0
