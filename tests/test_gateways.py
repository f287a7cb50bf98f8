"""Gateway and batcher processes: several gateways share one port, each
streams to one of several batchers; a caller's cancel reaches the batcher; a
gateway that is starting up waits for its batcher and engines instead of
answering from the fallback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.metrics import scrape, value
from tests.stack import ROOT, Stack, free_ports, health, pid_listening

CONNECTIONS = 16
CALLS_PER_CONNECTION = 3


@pytest.fixture(scope="module")
def two_gateways(repository: Path) -> Iterator[Stack]:
    stack = Stack(repository, gateways=2, batchers=2)
    try:
        stack.wait_serving()
        yield stack
    finally:
        stack.stop()


def test_connections_spread_over_gateways_and_batchers(two_gateways: Stack) -> None:
    # Separate connections (no shared subchannel pool), as separate clients
    # would open: the kernel hands each to one of the listening processes.
    batcher_urls = (two_gateways.metrics[1], two_gateways.metrics[4])
    batched_pattern = r'berth_batcher_sequences_total\{.*outcome="ok".*\}'
    # (gateways probe their batcher when they start: count from here)
    before = [value(scrape(url), batched_pattern) for url in batcher_urls]
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.insecure_channel(two_gateways.gateway, options=options)
        for _ in range(CONNECTIONS)
    ]
    try:
        for i, channel in enumerate(channels):
            stub = berth_pb2_grpc.BerthStub(channel)
            for j in range(CALLS_PER_CONNECTION):
                reply = stub.Embed(
                    berth_pb2.EmbedRequest(model="minilm", texts=[f"call {i} {j}"]),
                    timeout=60,
                )
                assert len(reply.embeddings[0].values) == 384
    finally:
        for channel in channels:
            channel.close()
    # /metrics: gateway 0, batcher 0, the engine, gateway 1, batcher 1.
    gateway_0, _, _, gateway_1, _ = two_gateways.metrics
    pattern = r'berth_gateway_requests_total\{.*model="minilm".*outcome="ok".*\}'
    counts = [value(scrape(url), pattern) for url in (gateway_0, gateway_1)]
    # Every call answered once, and both processes took some: all 16
    # connections on one process has probability 2 * 2**-16.
    assert sum(counts) == CONNECTIONS * CALLS_PER_CONNECTION, counts
    assert min(counts) > 0, counts
    # Each gateway streams to its own batcher; both fed the one engine.
    batched = [
        value(scrape(url), batched_pattern) - start
        for url, start in zip(batcher_urls, before, strict=True)
    ]
    # Each gateway's calls went through its own batcher. (With two gateways
    # on one port, SERVING can come from one while the other still sends
    # its start-up probe, a text per model, inside this window.)
    assert all(c <= b <= c + 2 for b, c in zip(batched, counts, strict=True)), (
        batched,
        counts,
    )


def cancel_behind_a_stalled_engine(
    stub: berth_pb2_grpc.BerthStub, engine: int, cancelled: Callable[[], float]
) -> None:
    """Stall the engine, fill its two slots, queue three texts in two calls
    and cancel them: ``cancelled()`` (a count of dropped sequences) grows by
    exactly 3, and once the engine resumes the blockers are answered."""
    before = cancelled()
    os.kill(engine, signal.SIGSTOP)
    try:
        # Two batches take the stalled engine's two slots...
        blockers = [
            stub.Embed.future(
                berth_pb2.EmbedRequest(model="minilm", texts=[f"blocker {i}"]),
                timeout=120,
            )
            for i in range(2)
        ]
        time.sleep(0.5)
        # ...so these stay queued until cancelled.
        calls = [
            stub.Embed.future(
                berth_pb2.EmbedRequest(model="minilm", texts=texts), timeout=120
            )
            for texts in (["cancel me"], ["and me", "and me too"])
        ]
        time.sleep(0.5)
        for call in calls:
            call.cancel()
        deadline = time.monotonic() + 20
        dropped = 0.0
        while time.monotonic() < deadline:
            dropped = cancelled() - before
            if dropped >= 3:
                break
            time.sleep(0.2)
        assert dropped == 3
    finally:
        os.kill(engine, signal.SIGCONT)
    for blocker in blockers:  # the engine resumes and answers them
        assert len(blocker.result(timeout=120).embeddings) == 1


CANCELLED = r'berth_batcher_sequences_total\{.*outcome="cancelled".*\}'


def test_a_cancelled_call_leaves_the_batcher_queue(repository: Path) -> None:
    """A caller that gives up has its texts dropped from the batcher's queue
    (not computed and thrown away), for one-text and many-text calls."""
    stack = Stack(repository)
    try:
        stack.wait_serving()
        engine = pid_listening("engine", int(stack.engines[0].rsplit(":", 1)[1]))
        stub = berth_pb2_grpc.BerthStub(grpc.insecure_channel(stack.gateway))
        cancel_behind_a_stalled_engine(
            stub, engine, lambda: value(scrape(stack.metrics[1]), CANCELLED)
        )
    finally:
        stack.stop()


class Service:
    """One `python -m <module>` process on a free port of its own, for
    tests that start a stack's pieces by hand."""

    def __init__(
        self, module: str, repository: Path, *flags: str, port: int = 0
    ) -> None:
        port = port or free_ports(1)[0]
        self.address = f"127.0.0.1:{port}"
        self.log_path = Path(os.environ.get("BERTH_TEST_LOGS", "/tmp")) / (
            f"berth-{module}-{port}.log"
        )
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module,
                    "--port",
                    str(port),
                    "--metrics-port",
                    "0",
                    "--model-repository",
                    str(repository),
                    *flags,
                ],
                cwd=ROOT,
                env={**os.environ, "BERTH_LOG_LEVEL": "INFO"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_for(self, *states: str, timeout: float = 120.0) -> None:
        """Until its health is one of ``states`` (NOT_SERVING: listening)."""
        deadline = time.monotonic() + timeout
        while health(self.address) not in states:
            assert self.proc.poll() is None, self.logs()
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.05)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


@contextlib.contextmanager
def service(
    module: str, repository: Path, *flags: str, port: int = 0
) -> Iterator[Service]:
    process = Service(module, repository, *flags, port=port)
    try:
        yield process
    finally:
        process.stop()


EMBED = berth_pb2.EmbedRequest(model="minilm", texts=["is the batcher up yet?"])
WAITING = "start-up: requests wait for the engines"


def held_call(
    processes: contextlib.ExitStack,
    repository: Path,
    flags: tuple[str, ...],
    wait_s: float,
) -> tuple[Service, Any]:
    """A gateway started with ``flags`` and one Embed sent to it, checked to
    be still unanswered ``wait_s`` later (without the start-up wait it is
    answered at once, from the fallback)."""
    gateway = processes.enter_context(service("gateway", repository, *flags))
    gateway.wait_for("NOT_SERVING")
    channel = processes.enter_context(grpc.insecure_channel(gateway.address))
    call = berth_pb2_grpc.BerthStub(channel).Embed.future(EMBED, timeout=120)
    time.sleep(wait_s)
    assert not call.done(), call.result()
    return gateway, call


def assert_answered_by_engines(call: Any) -> None:
    reply = call.result(timeout=120)
    assert not reply.degraded
    assert ("x-berth-degraded", "true") not in call.trailing_metadata()
    assert len(reply.embeddings[0].values) == 384


@pytest.mark.parametrize("mode", ["batcher", "inline"])
def test_a_starting_gateway_waits_for_its_batcher(
    two_gateways: Stack, repository: Path, mode: str
) -> None:
    """A gateway not yet connected to its batcher (inline: to its engine)
    holds a call until it connects, then answers it from the engines: the
    batcher (engine) is SIGSTOPped while the gateway starts and resumed
    after the call has waited 2 s."""
    engine = two_gateways.engines[0]
    with contextlib.ExitStack() as processes:
        if mode == "batcher":
            # A batcher of its own, connected to the stack's engine.
            batcher = processes.enter_context(
                service("batcher", repository, "--engines", engine)
            )
            batcher.wait_for("SERVING")
            address, module, flag = batcher.address, "batcher", "--batcher"
        else:
            address, module, flag = engine, "engine", "--engines"
        peer = pid_listening(module, int(address.rsplit(":", 1)[1]))
        os.kill(peer, signal.SIGSTOP)
        try:
            flags = (flag, address, "--startup-wait-s", "60")
            gateway, call = held_call(processes, repository, flags, wait_s=2)
        finally:
            os.kill(peer, signal.SIGCONT)
        assert_answered_by_engines(call)
        assert gateway.logs().count(WAITING) == 1, gateway.logs()


def test_a_gateway_started_before_its_engines_waits_for_them(
    repository: Path,
) -> None:
    """A cold start: gateway and batcher are up, the engine has not even
    started (a GPU engine loads and captures its graphs for seconds). A call
    waits for it and is answered by it, not by the fallback."""
    (port,) = free_ports(1)
    with contextlib.ExitStack() as processes:
        batcher = processes.enter_context(
            service("batcher", repository, "--engines", f"127.0.0.1:{port}")
        )
        batcher.wait_for("NOT_SERVING", "SERVING")
        flags = ("--batcher", batcher.address, "--startup-wait-s", "120")
        gateway, call = held_call(processes, repository, flags, wait_s=1)
        processes.enter_context(service("engine", repository, port=port))
        assert_answered_by_engines(call)
        gateway.wait_for("SERVING")
        assert gateway.logs().count(WAITING) == 1, gateway.logs()


def test_a_large_fallback_call_leaves_the_gateway_answering(
    repository: Path,
) -> None:
    """While the fleet fails, every call is a fallback call: a large one
    (2048 texts of 255 or 256 tokens, minilm's limit, ~1 s on the CPU model)
    runs off the event loop, and without holding the GIL for long, so small
    calls keep being answered while it computes, each in a small part of its
    time."""
    (nowhere,) = free_ports(1)
    flags = ("--batcher", f"127.0.0.1:{nowhere}", "--startup-wait-s", "0")
    texts = 2048
    long_text = "the quick brown fox jumps over the lazy dog " * 28
    big = berth_pb2.EmbedRequest(
        model="minilm", texts=[f"{i} {long_text}" for i in range(texts)]
    )
    with service("gateway", repository, *flags, "--max-texts", str(texts)) as gateway:
        gateway.wait_for("NOT_SERVING")
        with grpc.insecure_channel(gateway.address) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)
            assert stub.Embed(EMBED, timeout=30).degraded  # warm
            began = time.monotonic()
            pending = stub.Embed.future(big, timeout=60)
            answered: list[float] = []  # when each small call was answered
            waits: list[float] = []  # how long each took
            while not pending.done():  # small calls all through the big one
                sent = time.monotonic()
                assert stub.Embed(EMBED, timeout=30).degraded
                answered.append(time.monotonic() - began)
                waits.append(time.monotonic() - sent)
                time.sleep(0.02)
            assert len(pending.result().embeddings) == texts
            took = time.monotonic() - began
    # Computed on the loop, the big call answers no small call from the start
    # of its compute to its end (they all wait for it); off the loop, small
    # calls keep being answered through the middle of it, however loaded the
    # machine is (each one then just takes longer).
    middle = [t for t in answered if 0.2 * took < t < 0.8 * took]
    print(
        f"big call {took:.2f} s; small calls answered in its middle: "
        f"{len(middle)}, slowest {max(waits) * 1000:.1f} ms"
    )
    assert len(middle) >= 3, (took, answered)
    # Nor may the big call hold the GIL for long in its thread: a small call
    # waits for the GIL as it would for the loop. One numpy call over every
    # token of the call (np.add.reduceat) held it for 0.2-0.5 of the call
    # (1.3 s of 3 to 6 on the dev machine); a text at a time, the slowest
    # small call took 0.02-0.04 of it.
    assert max(waits) < 0.1 * took, (took, waits)


STARTUP_WAIT_S = 5.0


def test_with_no_batcher_the_fallback_answers_once_the_startup_bound_is_over(
    repository: Path,
) -> None:
    """Nothing listens at --batcher: a call waits, but never past its own
    deadline nor past --startup-wait-s after the gateway started; then the
    fallback answers (degraded), and from then on at once."""
    (nowhere,) = free_ports(1)
    flags = ("--batcher", f"127.0.0.1:{nowhere}")
    wait = ("--startup-wait-s", str(STARTUP_WAIT_S))
    with service("gateway", repository, *flags, *wait) as gateway:
        gateway.wait_for("NOT_SERVING")
        listening = time.monotonic()  # (its start-up window began just before)
        with grpc.insecure_channel(gateway.address) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)

            def embed(timeout: float) -> float:
                """Seconds an Embed took; its answer must be degraded."""
                t0 = time.monotonic()
                reply, call = stub.Embed.with_call(EMBED, timeout=timeout)
                took = time.monotonic() - t0
                assert reply.degraded
                assert ("x-berth-degraded", "true") in call.trailing_metadata()
                assert len(reply.embeddings[0].values) == 384
                return took

            # A deadline inside the window: it waits, but is answered in time
            # (a DEADLINE_EXCEEDED would raise here).
            assert embed(timeout=2.0) >= 1.5
            # A longer deadline: it waits out the rest of the window, not more.
            assert embed(timeout=60) >= 1.5
            assert time.monotonic() - listening < STARTUP_WAIT_S + 2
            # The start-up is over: the fallback answers at once, as it does
            # for a batcher lost after it had connected.
            assert embed(timeout=60) < 1.0
    assert gateway.logs().count(WAITING) == 1, gateway.logs()
