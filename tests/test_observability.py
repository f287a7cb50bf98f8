"""Tracing across every hop (real OTLP receiver) and /metrics on every service."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.telemetry import tracing_off_reason
from tests.metrics import scrape, value
from tests.otlp import ReceivedSpan, Receiver
from tests.stack import Stack, free_ports

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def exporting_to(receiver: Receiver) -> dict[str, str]:
    """A stack's environment for exporting every span to the receiver soon."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def traced_stack(
    repository: Path, *extra_args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[Stack, Receiver]]:
    """A serving stack that exports every span to a receiver of its own."""
    receiver = Receiver().start()
    stack = Stack(
        repository,
        extra_args=list(extra_args),
        env={**exporting_to(receiver), **(env or {})},
    )
    try:
        stack.wait_serving()
        yield stack, receiver
    finally:
        stack.stop()
        receiver.stop()


@pytest.fixture(scope="module")
def traced(repository: Path) -> Iterator[tuple[Stack, Receiver]]:
    yield from traced_stack(repository)


def wait_for(predicate, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return predicate()


def test_one_request_is_one_connected_trace(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    metadata = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        stub.Embed(
            berth_pb2.EmbedRequest(model="minilm", texts=["trace me", "and me too"]),
            metadata=metadata,
            timeout=30,
        )

    def engine_spans() -> list[ReceivedSpan]:
        spans = receiver.snapshot()
        request = {s.span_id for s in spans if s.trace_id == CLIENT_TRACE}
        batches = [
            s
            for s in spans
            if s.name == "batcher.batch" and any(sid in request for _, sid in s.links)
        ]
        ids = {b.span_id for b in batches}
        return [s for s in spans if s.name == "engine.batch" and s.parent_id in ids]

    assert wait_for(engine_spans), f"no engine span reached: {receiver.snapshot()}"
    time.sleep(0.5)  # the engine's children come in the same export or next
    spans = receiver.snapshot()
    by_id = {s.span_id: s for s in spans}
    in_request = [s for s in spans if s.trace_id == CLIENT_TRACE]
    services = {s.service for s in in_request}
    assert {"gateway", "batcher"} <= services, services

    # The gateway's server span is the child of the caller's span.
    root = [s for s in in_request if s.parent_id == CLIENT_SPAN]
    assert len(root) == 1 and root[0].service == "gateway", root
    assert {"gateway.tokenize", "gateway.infer"} <= {
        s.name for s in in_request if s.service == "gateway"
    }
    # Each text waited in a bucket: a queue span under a gateway span.
    queues = [s for s in in_request if s.name == "batcher.queue"]
    assert len(queues) == 2
    for q in queues:
        assert by_id[q.parent_id].service == "gateway"
        # The caller's 30 s deadline reached the batcher (gRPC rounds the
        # deadline it carries, so a little over 30,000 ms is the same one).
        assert 20_000 < q.attributes["berth.timeout_ms"] <= 30_500, q.attributes
    # The batch links to every request span it carries...
    batch = next(
        s
        for s in spans
        if s.name == "batcher.batch"
        and {(CLIENT_TRACE, q.span_id) for q in queues} <= set(s.links)
    )
    assert batch.attributes["berth.batch_size"] == 2
    assert batch.attributes["berth.bucket"] == 12  # the smallest that fits
    assert 0 < batch.attributes["berth.padded_ratio"] <= 1
    # ...and the engine's work hangs under the batch.
    engine = next(
        s for s in spans if s.name == "engine.batch" and s.parent_id == batch.span_id
    )
    assert engine.service == "engine"
    stages = {s.name for s in spans if s.parent_id == engine.span_id}
    assert stages == {"engine.copy_in", "engine.compute", "engine.copy_out"}


def test_a_stream_call_joins_the_callers_trace(
    traced: tuple[Stack, Receiver],
) -> None:
    """The bidi Stream carries the caller's traceparent on as Embed does."""
    stack, receiver = traced
    trace_id = "2af7651916cd43dd8448eb211c80319c"
    metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(model="minilm", texts=["streamed, traced"])
        )
        (reply,) = stub.Stream(iter([request]), metadata=metadata, timeout=30)
        assert reply.WhichOneof("response") == "embed"

    def in_request() -> list[ReceivedSpan]:
        return [s for s in receiver.snapshot() if s.trace_id == trace_id]

    # Both the queue span and the gateway's own: services export on their
    # own schedules, so the one seen first says nothing of the other.
    names = wait_for(lambda: {s.name for s in in_request()} >= STREAM_SPANS)
    assert names, f"not in the caller's trace: {STREAM_SPANS - seen(in_request())}"
    spans = in_request()
    by_id = {s.span_id: s for s in spans}
    root = [s for s in spans if s.parent_id == CLIENT_SPAN]
    assert len(root) == 1 and root[0].service == "gateway", spans
    # The batcher's queue span hangs under the gateway's Stream span: the
    # context crossed the gateway -> batcher stream.
    (queue,) = [s for s in spans if s.name == "batcher.queue"]
    assert queue.service == "batcher"
    assert ancestors(queue, by_id)[-1] is root[0]


STREAM_SPANS = {"batcher.queue", "berth.v1.Berth/Stream"}


def seen(spans: list[ReceivedSpan]) -> set[str]:
    return {s.name for s in spans}


def ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[ReceivedSpan]:
    """The span's parents up to the last one received, nearest first."""
    found = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        found.append(span)
    return found


@pytest.fixture(scope="module")
def traced_hybrid(repository: Path) -> Iterator[tuple[Stack, Receiver]]:
    yield from traced_stack(repository, "--batcher-mode", "hybrid")


def test_a_direct_request_is_one_connected_trace(
    traced_hybrid: tuple[Stack, Receiver],
) -> None:
    """`--batcher-mode hybrid` on an idle gateway: the gateway batches the
    request itself and streams it straight to the engine. The queue span,
    the batch that links to it and the engine's work under that batch all
    belong to the caller's trace, as on the path through the batcher."""
    stack, receiver = traced_hybrid
    direct = r'berth_gateway_routes_total\{.*model="minilm".*route="direct".*\}'
    # The gateway goes direct once its own streams to the engines are up,
    # which SERVING (reached through the batcher) does not wait for. Each
    # attempt sends texts of its own: a cached answer takes no route at all.
    for attempt in range(60):
        trace_id = f"4af7651916cd43dd8448eb211c8031{attempt:02x}"
        metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
        before = scrape(stack.metrics[0])
        with grpc.insecure_channel(stack.gateway) as channel:
            reply = berth_pb2_grpc.BerthStub(channel).Embed(
                berth_pb2.EmbedRequest(
                    model="minilm", texts=[f"direct {attempt}", f"traced {attempt}"]
                ),
                metadata=metadata,
                timeout=30,
            )
        assert len(reply.embeddings) == 2 and not reply.degraded
        if value(scrape(stack.metrics[0]), direct) - value(before, direct) == 1:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("no request went straight to the engines in 30 s")

    def engine_span() -> list[ReceivedSpan]:
        spans = receiver.snapshot()
        queues = {s.span_id for s in spans if s.trace_id == trace_id}
        batches = {
            s.span_id
            for s in spans
            if s.name == "batcher.batch" and any(q in queues for _, q in s.links)
        }
        return [s for s in spans if s.name == "engine.batch" and s.parent_id in batches]

    found = wait_for(engine_span)
    assert found, f"no engine span under a batch of the trace: {receiver.snapshot()}"
    spans = receiver.snapshot()
    by_id = {s.span_id: s for s in spans}
    in_request = [s for s in spans if s.trace_id == trace_id]
    (root,) = [s for s in in_request if s.parent_id == CLIENT_SPAN]
    queues = [s for s in in_request if s.name == "batcher.queue"]
    assert len(queues) == 2, in_request
    for queue in queues:  # batched in the gateway, under its request span
        assert queue.service == "gateway"
        assert ancestors(queue, by_id)[-1] is root
    batch = by_id[found[0].parent_id]
    assert {(trace_id, q.span_id) for q in queues} <= set(batch.links)
    assert found[0].service == "engine"


def test_a_failed_stream_request_marks_its_span(
    traced: tuple[Stack, Receiver],
) -> None:
    """A Stream request answered with an error (the stream stays open) marks
    its span as an error, as a failed Embed call does."""
    stack, receiver = traced
    trace_id = "3af7651916cd43dd8448eb211c80319c"
    metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(model="minilm", texts=[""])
        )
        (reply,) = stub.Stream(iter([request]), metadata=metadata, timeout=30)
        assert reply.error.code == "INVALID_ARGUMENT"
    spans = wait_for(
        lambda: [
            s
            for s in receiver.snapshot()
            if s.trace_id == trace_id and s.name == "berth.v1.Berth/Stream"
        ]
    )
    assert [s.status_code for s in spans] == [2]  # STATUS_CODE_ERROR


def test_errors_mark_the_span(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    trace_id = "1af7651916cd43dd8448eb211c80319c"
    metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.Embed(
                berth_pb2.EmbedRequest(model="minilm", texts=[""]),
                metadata=metadata,
                timeout=30,
            )
    spans = wait_for(lambda: [s for s in receiver.snapshot() if s.trace_id == trace_id])
    assert spans and any(s.status_code == 2 for s in spans)  # STATUS_CODE_ERROR


def test_rpc_spans_carry_the_rpc_conventions(traced: tuple[Stack, Receiver]) -> None:
    """A gateway's RPC spans carry OpenTelemetry's RPC attributes, the status
    code of the call's answer included (0: OK, 3: INVALID_ARGUMENT)."""
    stack, receiver = traced
    trace_id = "6af7651916cd43dd8448eb211c80319c"
    metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        for texts in (["conventions"], [""]):
            try:
                stub.Embed(
                    berth_pb2.EmbedRequest(model="minilm", texts=texts),
                    metadata=metadata,
                    timeout=30,
                )
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT

    def rpc_spans() -> list[ReceivedSpan]:
        return [
            s
            for s in receiver.snapshot()
            if s.trace_id == trace_id and s.name == "berth.v1.Berth/Embed"
        ]

    spans = wait_for(lambda: len(rpc_spans()) == 2 and rpc_spans())
    assert spans, receiver.snapshot()
    host, port = stack.gateway.rsplit(":", 1)
    for span in spans:
        assert span.attributes["rpc.system"] == "grpc"
        assert span.attributes["rpc.service"] == "berth.v1.Berth"
        assert span.attributes["rpc.method"] == "Embed"
        assert span.attributes["server.address"] == host
        assert span.attributes["server.port"] == int(port)
    assert sorted(s.attributes["rpc.grpc.status_code"] for s in spans) == [0, 3]


def test_the_callers_context_is_read_by_the_propagators_otel_names(
    repository: Path,
) -> None:
    """OTEL_PROPAGATORS=baggage: a caller's traceparent is not read, so the
    gateway's span starts a trace of its own; the hops behind it still join
    the gateway's trace (berth's own hops always carry W3C trace context)."""
    stacks = traced_stack(repository, env={"OTEL_PROPAGATORS": "baggage"})
    stack, receiver = next(stacks)
    try:
        metadata = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)
        with grpc.insecure_channel(stack.gateway) as channel:
            berth_pb2_grpc.BerthStub(channel).Embed(
                berth_pb2.EmbedRequest(model="minilm", texts=["propagators"]),
                metadata=metadata,
                timeout=30,
            )

        def exported() -> bool:
            spans = receiver.snapshot()
            roots = {s.trace_id for s in spans if s.name == "berth.v1.Berth/Embed"}
            return any(s.name == "batcher.queue" and s.trace_id in roots for s in spans)

        assert wait_for(exported), receiver.snapshot()
        spans = receiver.snapshot()
        (root,) = [s for s in spans if s.name == "berth.v1.Berth/Embed"]
        assert root.trace_id != CLIENT_TRACE and root.parent_id != CLIENT_SPAN
        assert all(s.trace_id != CLIENT_TRACE for s in spans)
        # (The gateway's start-up probe has batcher spans of its own trace.)
        assert any(
            s.name == "batcher.queue" and s.trace_id == root.trace_id for s in spans
        ), spans
    finally:
        next(stacks, None)


def test_an_unreachable_collector_stalls_no_request(repository: Path) -> None:
    """Spans for a collector that refuses connections are dropped in the
    background: calls answer at their usual speed and berth stops cleanly."""
    (dead,) = free_ports(1)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    stack = Stack(repository, env=env)
    try:
        stack.wait_serving()
        metadata = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)
        with grpc.insecure_channel(stack.gateway) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)
            for i in range(10):
                start = time.monotonic()
                reply = stub.Embed(
                    berth_pb2.EmbedRequest(model="minilm", texts=[f"untraced {i}"]),
                    metadata=metadata,
                    timeout=10,
                )
                assert len(reply.embeddings) == 1 and not reply.degraded
                # An export waiting on the collector would hold the call for
                # the exporter's timeout (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s).
                assert time.monotonic() - start < 5.0
                time.sleep(0.1)  # exports (failing) in between
    finally:
        code = stack.stop()
    assert code == 0, stack.logs()
    assert "Failed to export" in stack.logs()  # it did try


# The standard off-switches, as the OpenTelemetry specification defines them
# (configuration/sdk-environment-variables.md): a Boolean is true only for the
# case-insensitive "true"; OTEL_TRACES_EXPORTER is a case-insensitive list
# whose "none" means no exporter.
SWITCHES = [
    pytest.param({}, None, id="no switch"),
    pytest.param(
        {"OTEL_SDK_DISABLED": "True"},
        "tracing off: OTEL_SDK_DISABLED=True",
        id="OTEL_SDK_DISABLED",
    ),
    pytest.param(
        {"OTEL_TRACES_EXPORTER": "None"},
        "tracing off: OTEL_TRACES_EXPORTER=None",
        id="OTEL_TRACES_EXPORTER=none",
    ),
]


@pytest.mark.parametrize(("switch", "reason"), SWITCHES)
def test_the_standard_switches_turn_span_export_off(
    repository: Path, switch: dict[str, str], reason: str | None
) -> None:
    """With an OTLP endpoint configured, every service exports spans; with
    OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none as well, none, and
    each says why once at start-up. Spans still buffered go out when berth
    stops (shutdown_tracing), so after stop() the receiver has them all."""
    receiver = Receiver().start()
    stack = Stack(repository, env={**exporting_to(receiver), **switch})
    try:
        stack.wait_serving()
        metadata = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)
        with grpc.insecure_channel(stack.gateway) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)
            reply = stub.Embed(
                berth_pb2.EmbedRequest(model="minilm", texts=["switched?"]),
                metadata=metadata,
                timeout=30,
            )
            assert len(reply.embeddings) == 1 and not reply.degraded
    finally:
        code = stack.stop()
        receiver.stop()
    logs = stack.log_path.read_text(errors="replace")
    assert code == 0, logs
    spans = receiver.snapshot()
    if reason is None:
        assert {"gateway", "batcher", "engine"} <= {s.service for s in spans}
        assert any(s.trace_id == CLIENT_TRACE for s in spans)
    else:
        exported = sorted({(s.service, s.name) for s in spans})
        assert spans == [], f"{len(spans)} spans exported: {exported}"
    # Each service process (gateway, batcher, engine) says once what
    # tracing does and why.
    said = [line for line in logs.splitlines() if "berth.telemetry: tracing " in line]
    assert sorted(line.split()[2] for line in said) == ["batcher", "engine", "gateway"]
    expected = reason or "tracing on: exporting spans"
    assert all(expected in line for line in said), said


ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


@pytest.mark.parametrize(
    ("environ", "off", "warns"),
    [
        ({}, "no OTEL_EXPORTER_OTLP_ENDPOINT", False),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4317"}, None, False),
        (ENDPOINT, None, False),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_ENDPOINT": ""}, "no OTEL_EXPORTER", False),
        # A Boolean: true only for the case-insensitive "true".
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, "OTEL_SDK_DISABLED=true", False),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, "OTEL_SDK_DISABLED=TRUE", False),
        ({"OTEL_SDK_DISABLED": "true"}, "OTEL_SDK_DISABLED=true", False),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, None, False),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": ""}, None, False),
        # Not a Boolean: false, with a warning (the specification's SHOULD).
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "1"}, None, True),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "yes"}, None, True),
        # An enum list, case-insensitive; "none" is no exporter.
        (
            {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"},
            "OTEL_TRACES_EXPORTER=none",
            False,
        ),
        (
            {**ENDPOINT, "OTEL_TRACES_EXPORTER": "NONE"},
            "OTEL_TRACES_EXPORTER=NONE",
            False,
        ),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp"}, None, False),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "OTLP"}, None, False),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": ""}, None, False),
        # "none" with others: the off-switch wins, with a warning.
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp,none"}, "=otlp,none", True),
        # An exporter berth does not have: warned of and ignored (the default,
        # OTLP, applies), as the specification says of unknown enum values.
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "zipkin"}, None, True),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp, console"}, None, True),
    ],
)
def test_tracing_off_reason_follows_the_specification(
    environ: dict[str, str],
    off: str | None,
    warns: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="berth.telemetry"):
        reason = tracing_off_reason(environ)
    if off is None:
        assert reason is None
    else:
        assert reason is not None and off in reason, reason
    assert bool(caplog.records) == warns, caplog.text


def test_metrics_count_known_calls(traced: tuple[Stack, Receiver]) -> None:
    stack, _ = traced
    gateway, batcher, engine = (scrape(u) for u in stack.metrics)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        for i in range(3):  # distinct texts: the response cache must miss
            stub.Embed(
                berth_pb2.EmbedRequest(model="minilm", texts=[f"x {i}", f"y z {i}"])
            )
        stub.Embed(berth_pb2.EmbedRequest(model="minilm", texts=["x 0"]))  # a hit
        with pytest.raises(grpc.RpcError):
            stub.Embed(berth_pb2.EmbedRequest(model="minilm", texts=[]))
    after = [scrape(u) for u in stack.metrics]
    ok = r'berth_gateway_requests_total\{.*model="minilm".*outcome="ok".*\}'
    bad = r'berth_gateway_requests_total\{.*model="minilm".*outcome="invalid".*\}'
    assert value(after[0], ok) - value(gateway, ok) == 4
    assert value(after[0], bad) - value(gateway, bad) == 1
    seqs = r'berth_batcher_sequences_total\{model="minilm",outcome="ok"\}'
    assert value(after[1], seqs) - value(batcher, seqs) == 6
    assert value(after[1], r"berth_batcher_batch_size_count\{.*\}") > 0
    assert value(after[1], r'berth_batcher_breaker_state\{model="minilm"\}') == 0
    batches = r'berth_engine_batches_total\{model="minilm",outcome="ok"\}'
    assert value(after[2], batches) > value(engine, batches)
    assert (
        value(after[0], r"berth_gateway_stage_seconds_count\{.*stage=\"tokenize\".*\}")
        > 0
    )
