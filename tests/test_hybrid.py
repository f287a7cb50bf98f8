"""`berth serve --batcher-mode hybrid`: a gateway's requests go through the
batcher, except one that finds the gateway idle, which the gateway batches
itself and sends straight to the engines (gateway.inline.DirectWhenIdle)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.cli.topology import batcher_mode, gateway_route
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.chaos.load import run_load, run_load_while
from tests.metrics import scrape, value
from tests.stack import Stack, free_ports, pid_listening, serving
from tests.test_gateways import service


def route(name: str) -> str:
    """The pattern of the gateway's count of requests that took ``name``."""
    return rf'berth_gateway_routes_total\{{.*model="minilm".*route="{name}".*\}}'


OK = r'berth_batcher_sequences_total\{.*model="minilm".*outcome="ok".*\}'


@pytest.fixture(scope="module")
def hybrid(repository: Path) -> Iterator[Stack]:
    stack = Stack(
        repository,
        engines=2,
        extra_args=["--batcher-mode", "hybrid", "--chaos"],
        env={"BERTH_BREAKER_COOLDOWN_S": "1"},
    )
    with serving(stack):
        yield stack


def counts(stack: Stack) -> dict[str, float]:
    """Routes taken (the gateway's /metrics) and sequences the batcher
    process answered (its own /metrics)."""
    gateway, batcher = scrape(stack.metrics[0]), scrape(stack.metrics[1])
    found = {r: value(gateway, route(r)) for r in ("direct", "batcher")}
    found["retried"] = value(gateway, route("retried"))
    found["batcher process ok"] = value(batcher, OK)
    return found


def embed(stub: berth_pb2_grpc.BerthStub, text: str) -> berth_pb2.EmbedResponse:
    return stub.Embed(berth_pb2.EmbedRequest(model="minilm", texts=[text]), timeout=60)


def test_an_idle_gateways_requests_go_straight_to_the_engines(hybrid: Stack) -> None:
    with grpc.insecure_channel(hybrid.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        # The gateway is SERVING through the batcher before its own streams
        # to the engines are up: wait until a request goes direct.
        deadline = time.monotonic() + 30
        for attempt in itertools.count():  # distinct texts: no cache hit
            warm = counts(hybrid)["direct"]
            assert not embed(stub, f"warming the direct route {attempt}").degraded
            if counts(hybrid)["direct"] > warm:
                break
            assert time.monotonic() < deadline, "no request went direct in 30 s"
            time.sleep(0.25)
        before = counts(hybrid)
        for i in range(12):
            assert not embed(stub, f"one at a time, number {i}").degraded
    after = counts(hybrid)
    assert after["direct"] - before["direct"] == 12
    assert after["batcher"] == before["batcher"]
    assert after["batcher process ok"] == before["batcher process ok"]


def test_under_load_the_batcher_batches_and_answers_agree(
    hybrid: Stack, client: berth_pb2_grpc.BerthStub
) -> None:
    texts = [f"concurrent text {i} " + "word " * (i % 7) for i in range(96)]
    before = counts(hybrid)
    with grpc.insecure_channel(hybrid.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda t: embed(stub, t), texts))
    after = counts(hybrid)
    direct = after["direct"] - before["direct"]
    via_batcher = after["batcher"] - before["batcher"]
    assert direct + via_batcher == len(texts)
    # 24 callers at once: a request rarely finds its gateway idle.
    assert via_batcher > len(texts) / 2, (direct, via_batcher)
    assert after["batcher process ok"] - before["batcher process ok"] == via_batcher
    # Both routes answer alike (the default stack's answers, cache aside).
    want = client.Embed(
        berth_pb2.EmbedRequest(model="minilm", texts=texts[:8]), timeout=60
    )
    for got, expected in zip(answers[:8], want.embeddings, strict=True):
        assert not got.degraded
        np.testing.assert_allclose(got.embeddings[0].values, expected.values, atol=1e-5)


def test_a_failed_direct_batch_is_answered_via_the_batcher(
    hybrid: Stack, repository: Path
) -> None:
    """A gateway sending direct to an engine that fails every batch (SIGUSR1
    toggles --chaos's fault), and through the stack's batcher, which has a
    healthy engine too: each failed direct attempt is answered via the
    batcher, and no caller sees the failure or a fallback."""
    failing = hybrid.engines[0]
    engine = pid_listening("engine", int(failing.rsplit(":", 1)[1]))
    (metrics_port,) = free_ports(1)
    flags = (
        *("--batcher", hybrid.batcher, "--engines", failing, "--direct-when-idle"),
        *("--metrics-port", str(metrics_port)),
    )
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with service("gateway", repository, *flags) as gateway:
        gateway.wait_for("SERVING")
        before = scrape(url)  # (its readiness probe went direct)
        os.kill(engine, signal.SIGUSR1)
        try:
            with grpc.insecure_channel(gateway.address) as channel:
                stub = berth_pb2_grpc.BerthStub(channel)
                replies = [embed(stub, f"a failing engine, {i}") for i in range(6)]
        finally:
            os.kill(engine, signal.SIGUSR1)
        found = scrape(url)
        logs = gateway.logs()
    assert not [r for r in replies if r.degraded]

    def taken(name: str) -> float:
        return value(found, route(name)) - value(before, route(name))

    # Tried direct until the gateway's own circuit for it opened (3 failures).
    assert 1 <= taken("retried") <= 3, logs
    assert taken("direct") == taken("retried")
    assert taken("batcher") == len(replies) - taken("retried")
    assert "a direct batch of minilm failed" in logs


def test_a_retry_via_the_batcher_gets_what_is_left_of_the_deadline() -> None:
    """A direct batch that failed goes via the batcher with the rest of its
    deadline; one that failed after spending all of it ends as
    DEADLINE_EXCEEDED, naming the failure; no deadline stays none."""
    from gateway.inline import deadline_left
    from services.errors import DeadlineExceeded, EngineFailure

    failure = EngineFailure("engine 127.0.0.1:1 failed the batch")
    now = time.monotonic()
    assert 700 <= deadline_left(1000, now - 0.2, "minilm", failure) <= 800
    assert deadline_left(0, now - 60.0, "minilm", failure) == 0
    with pytest.raises(DeadlineExceeded, match=r"while 'minilm' was tried \(engine"):
        deadline_left(100, now - 0.2, "minilm", failure)


def test_direct_when_idle_needs_engines(repository: Path) -> None:
    with service("gateway", repository, "--direct-when-idle", "--engines", "") as g:
        assert g.proc.wait(60) == 2
        assert "--direct-when-idle sends an idle gateway's requests" in g.logs()


def test_serve_batches_hybrid_on_gpus_and_through_batchers_on_cpus() -> None:
    assert batcher_mode("auto", gpus=1) == "hybrid"
    assert batcher_mode("auto", gpus=0) == "service"
    assert batcher_mode("inline", gpus=1) == "inline"
    engines = ["127.0.0.1:1", "127.0.0.1:2"]
    hybrid = gateway_route("hybrid", "127.0.0.1:9", engines, ())
    assert hybrid == (
        *("--batcher", "127.0.0.1:9", "--engines", "127.0.0.1:1,127.0.0.1:2"),
        "--direct-when-idle",
    )
    # Every mode sets every flag: a BERTH_* variable cannot change the route.
    service_flags = gateway_route("service", "127.0.0.1:9", engines, ())
    assert service_flags[-3:] == ("--engines", "", "--no-direct-when-idle")
    inline_flags = gateway_route("inline", "", engines, ("--max-delay-ms", "50"))
    assert inline_flags[:3] == (
        "--engines",
        "127.0.0.1:1,127.0.0.1:2",
        "--no-direct-when-idle",
    )


def test_while_the_batcher_is_down_requests_go_straight_to_the_engines(
    hybrid: Stack,
) -> None:
    """The batcher SIGKILLed under 8 callers (whose requests went through
    it): what was on its stream and what comes until serve has restarted it
    go straight to the engines; nothing is lost, nothing falls back to the
    CPU model, and afterwards requests go through the batcher again."""
    batcher = pid_listening("batcher", int(hybrid.batcher.rsplit(":", 1)[1]))
    before = counts(hybrid)

    result = run_load_while(
        hybrid.gateway, 1200, 8, (1.5, lambda: os.kill(batcher, signal.SIGKILL))
    )
    print(result.summary("hybrid, SIGKILL the batcher"))
    assert result.answered == result.sent == 1200, "requests were lost"
    assert result.outcomes["OK"] == result.sent, result.summary("hybrid")
    assert result.degraded == 0, result.summary("hybrid")
    found = scrape(hybrid.metrics[0])
    assert value(found, route("direct_batcher_down")) > 0
    logs = hybrid.logs(None)
    assert "batcher exited with code -9; restarting" in logs
    assert "batcher unreachable: every request goes straight to the engines" in logs
    # Back through the batcher once it is up again.
    deadline = time.monotonic() + 60
    while "batcher connected: requests go through it again" not in hybrid.logs(None):
        assert time.monotonic() < deadline, hybrid.logs()
        asyncio.run(run_load(hybrid.gateway, requests=8, concurrency=8))
    middle = counts(hybrid)
    asyncio.run(run_load(hybrid.gateway, requests=200, concurrency=8))
    assert counts(hybrid)["batcher"] - middle["batcher"] > 100
    assert before["batcher"] < middle["batcher"]


def test_an_engine_killed_mid_run_loses_no_direct_request(hybrid: Stack) -> None:
    """One caller, one call at a time, so requests go direct, and one
    engine SIGKILLed under it: every request is answered OK (a direct
    batch on the dead engine is re-sent to the other, by the gateway's
    scheduler or via the batcher), and serve restarts the engine. (Last in
    this module: the stack's engine 0 is a new process after it.)"""
    victim = pid_listening("engine", int(hybrid.engines[0].rsplit(":", 1)[1]))
    before = counts(hybrid)

    result = run_load_while(
        hybrid.gateway, 800, 1, (2.0, lambda: os.kill(victim, signal.SIGKILL))
    )
    print(result.summary("hybrid, SIGKILL one engine"))
    after = counts(hybrid)
    assert result.sent == 800
    assert result.answered == result.sent, "requests were lost"
    assert result.outcomes["OK"] == result.sent, result.summary("hybrid")
    assert result.degraded <= 3, result.summary("hybrid")  # (no batch failed)
    assert after["direct"] - before["direct"] > 600  # the direct route was in use
    assert "engine-0 exited with code -9; restarting" in hybrid.logs(None)
