"""Engines followed through DNS (batcher/discovery.py, EnginePool.follow):
real engine servicers on loopback, the system resolver for ``localhost``.

The netns test (tests/chaos/test_hosts.py) follows a name whose hosts-file
entry changes under load; these check the pool's side in one process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from batcher import engines as engines_module
from batcher.discovery import DnsName, split
from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.scheduler import ModelScheduler
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from tests.batcher.loopback import ENTRY, SleepyEngine, sequence
from tests.waits import until


@pytest.mark.parametrize(
    "target",
    ["dns:///engines", "dns:///:50070", "dns:///engines:http", "dns://8.8.8.8/e:1"],
)
def test_a_malformed_name_is_refused(target: str) -> None:
    with pytest.raises(ValueError, match="engine name|not a port"):
        split([target])


def test_fixed_addresses_and_names_are_told_apart() -> None:
    fixed, names = split(["10.0.0.1:50070", "dns:///engines.berth.svc:50071"])
    assert fixed == ["10.0.0.1:50070"]
    assert [(n.host, n.port) for n in names] == [("engines.berth.svc", 50071)]


async def serve(servicer: SleepyEngine, host: str = "127.0.0.1") -> tuple[Any, int]:
    server = grpc.aio.server()
    internal_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, port


def test_a_name_gets_a_stream_to_each_of_its_addresses() -> None:
    """``dns:///localhost:PORT``: one engine client per address the system
    resolver gives for localhost, each connected to the engine listening on
    all of them."""

    async def scenario() -> tuple[set[str], set[str], int]:
        server, port = await serve(SleepyEngine(0.0), "localhost")
        expected = await DnsName(f"dns:///localhost:{port}").resolve()
        pool = EnginePool([f"dns:///localhost:{port}"], dns_interval_s=0.2)
        pool.start()
        try:
            await until(
                lambda: len(pool.serving(ENTRY.name)) == len(expected),
                "a connected engine per address of localhost",
            )
            return {e.address for e in pool.engines}, expected, port
        finally:
            await pool.close()
            await server.stop(None)

    have, expected, port = asyncio.run(scenario())
    assert have == expected and f"127.0.0.1:{port}" in have


@pytest.mark.parametrize("delay_s", [0.3, 60.0])
def test_an_address_that_leaves_dns_takes_no_new_batches_and_loses_none(
    delay_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A holds a batch when its address leaves the name (B stays). A
    takes nothing new; its batch is answered by A when A answers within the
    grace, else re-sent to B when A's stream is closed. Either way the
    sequence is answered OK and A's stream ends."""
    monkeypatch.setattr(engines_module, "RETIRE_GRACE_S", 1.0)

    async def scenario() -> tuple[int, int, int, bool, int]:
        slow, fast = SleepyEngine(delay_s), SleepyEngine(0.0)
        (server_a, port_a), (server_b, port_b) = await serve(slow), await serve(fast)
        a, b = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
        pool = EnginePool([])
        config = SchedulerConfig(max_delay_s=0.001, hedge_ratio=0.0)
        scheduler = ModelScheduler(ENTRY, pool, config)
        scheduler.start()
        pool.start()
        answers: list[internal_pb2.SequenceResult] = []
        try:
            pool.follow("dns:///engines:1", {a})
            await until(lambda: pool.serving(ENTRY.name), "A connected")
            scheduler.submit(sequence(1, 5), answers.append)
            await until(lambda: slow.received, "A holds the batch")
            (client_a,) = pool.engines
            pool.follow("dns:///engines:1", {b})
            await until(lambda: pool.serving(ENTRY.name), "B connected")
            scheduler.submit(sequence(2, 5), answers.append)
            await until(lambda: len(answers) == 2, "both answered", timeout_s=20)
            await until(lambda: not client_a.connected, "A's stream closed")
            return (
                slow.received,
                fast.received,
                len(pool.engines),
                all(e.address == b for e in pool.engines),
                sum(r.code != 0 for r in answers),
            )
        finally:
            await scheduler.drain()
            await pool.close()
            await server_a.stop(None)
            await server_b.stop(None)

    slow_got, fast_got, engines, only_b, failed = asyncio.run(scenario())
    assert failed == 0
    assert slow_got == 1 and engines == 1 and only_b
    # A's batch went to B only when A did not answer within the grace.
    assert fast_got == (1 if delay_s < 1.0 else 2)
