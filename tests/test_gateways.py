"""Gateway and batcher processes: several gateways share one port, each
streams to one of several batchers; a caller's cancel reaches the batcher."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import Stack, pid_listening
from tests.test_observability import scrape, value

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
