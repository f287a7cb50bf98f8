"""An engine's failures and ejection across a restart of its process.

A real engine servicer on a loopback port (tests/batcher/loopback.py)
behind the batcher's engine pool and scheduler is stopped and a new one
started on the same port: the pool's stream to it breaks and reconnects, as
when the supervisor restarts a crashed engine.

- a restarted engine starts with a clean slate: its failures reset and its
  ejection lifted (they carried over, and a healthy restarted engine sat out
  the rest of a back-off of up to 30 s);
- a flapping one, which fails again before it answers any batch, resumes its
  back-off where it was, and its next reconnect lifts nothing;
- a batch it answers clears what was held against it;
- an engine still loading its models is asked again soon, not at the
  stream's growing back-off.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from batcher.engines import LOADING_POLL_S, EngineClient, EnginePool
from batcher.options import SchedulerConfig
from batcher.scheduler import ModelScheduler
from services.errors import ENGINE_LOADING
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from tests.batcher.loopback import ENTRY, SleepyEngine, sequence


async def engine_on(port: int = 0, fails: bool = False) -> tuple[grpc.aio.Server, int]:
    """A fresh engine (a new process, as far as the pool can tell) on
    ``port`` (0: any free one), and its port; ``fails``: it answers every
    batch with an engine error."""
    servicer = SleepyEngine(delay_s=0.0)
    servicer.fails = fails
    server = grpc.aio.server()
    internal_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert port in (0, bound), f"port {port} is taken"
    await server.start()
    return server, bound


async def restart(
    server: grpc.aio.Server, port: int, client: EngineClient, fails: bool = False
) -> grpc.aio.Server:
    """Stop the engine and start a new one on its port; return once the
    client's stream has gone down and come back up (its Info answered)."""
    await server.stop(None)
    async with asyncio.timeout(10):
        while client.connected:
            await asyncio.sleep(0.01)
        server, _ = await engine_on(port, fails)
        while not client.connected:
            await asyncio.sleep(0.01)
    return server


async def answer_to(
    scheduler: ModelScheduler, reply_id: int
) -> internal_pb2.SequenceResult:
    """Submit one sequence and wait for its answer."""
    answers: list[internal_pb2.SequenceResult] = []
    scheduler.submit(sequence(reply_id, 5), answers.append)
    async with asyncio.timeout(10):
        while not answers:
            await asyncio.sleep(0.01)
    return answers[0]


def ejected_for(client: EngineClient) -> float:
    """Seconds of ejection it has left (0: none)."""
    return max(0.0, client.ejected_until - time.monotonic())


def test_a_restarted_engine_starts_afresh_but_a_flapping_one_stays_out() -> None:
    """Five failures in a row eject the engine for 8 s. Restarted, it is
    back at once: no failures, not ejected (the five held aside). Its new
    process fails a batch before answering any: ejected for 16 s, the
    back-off of a sixth failure in a row, not the 0.5 s of a first. Restarted
    again (now healthy), it stays ejected: it has not answered a batch since
    the last restart lifted its ejection. Once it answers one (the scheduler
    sends to it: every engine of the model is ejected), nothing is held
    against it any more."""

    async def scenario() -> dict[str, tuple[int, int, float, bool]]:
        server, port = await engine_on()
        pool = EnginePool([f"127.0.0.1:{port}"])
        config = SchedulerConfig(max_delay_s=0.001, breaker_failures=100)
        scheduler = ModelScheduler(ENTRY, pool, config)
        scheduler.start()
        pool.start()
        (client,) = pool.engines
        seen: dict[str, tuple[int, int, float, bool]] = {}

        def note(moment: str) -> None:
            seen[moment] = (
                client.failures,
                client.failures_before_reconnect,
                ejected_for(client),
                client.available,
            )

        try:
            async with asyncio.timeout(10):
                while not client.connected:
                    await asyncio.sleep(0.01)
            for _ in range(5):
                client.record_failure("test")
            note("ejected")
            server = await restart(server, port, client, fails=True)
            note("restarted")
            failed = await answer_to(scheduler, 1)
            assert failed.code != 0, "the flapping engine answered"
            note("failed again")
            server = await restart(server, port, client)
            note("restarted again")
            answered = await answer_to(scheduler, 2)
            assert answered.code == 0, answered.message
            note("answered")
        finally:
            await scheduler.drain()
            await pool.close()
            await server.stop(None)
        return seen

    seen = asyncio.run(scenario())
    failures, held, ejected, available = seen["ejected"]
    assert (failures, held, available) == (5, 0, False) and 7.5 < ejected <= 8.0
    assert seen["restarted"] == (0, 5, 0.0, True), seen["restarted"]
    failures, held, ejected, available = seen["failed again"]
    assert (failures, held, available) == (1, 5, False)
    assert 15.0 < ejected <= 16.0, f"ejected for {ejected:.1f} s, not 16 s"
    failures, held, ejected, available = seen["restarted again"]
    assert (failures, held, available) == (0, 6, False)
    assert 10.0 < ejected <= 16.0, f"ejected for {ejected:.1f} s"
    failures, held, _, _ = seen["answered"]
    assert (failures, held) == (0, 0)


class LoadingEngine(SleepyEngine):
    """An engine whose Info answers as engine/service.py's does while it
    loads its models, for ``load_s`` from its start; records when it was
    asked."""

    def __init__(self, load_s: float) -> None:
        super().__init__(delay_s=0.0)
        self.ready_at = time.monotonic() + load_s
        self.asked: list[float] = []

    async def Info(
        self, request: internal_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.EngineInfo:
        self.asked.append(time.monotonic())
        if self.asked[-1] < self.ready_at:
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_LOADING)
        return await super().Info(request, context)


def test_an_engine_loading_its_models_is_asked_again_soon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine loads its models for 2 s (a restart; minutes on a GPU):
    its Info is asked every LOADING_POLL_S meanwhile, and it is connected
    within about that once ready, with no warning. (Counted as failed tries,
    the "loading" answers would grow the waits 0.05, 0.1, ... 1.6 s, the
    engine would be connected up to 2.4 s after it is ready, and the stream
    client would warn at each start.)"""

    async def scenario() -> tuple[LoadingEngine, float]:
        servicer = LoadingEngine(load_s=2.0)
        server = grpc.aio.server()
        internal_pb2_grpc.add_EngineServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = EngineClient(f"127.0.0.1:{port}", lambda: None)
        client.start()
        try:
            async with asyncio.timeout(10):
                while not client.connected:
                    await asyncio.sleep(0.01)
            return servicer, time.monotonic() - servicer.ready_at
        finally:
            await client.close()
            await server.stop(None)

    with caplog.at_level(logging.INFO):
        servicer, late = asyncio.run(scenario())
    loading = [t for t in servicer.asked if t < servicer.ready_at]
    gaps = [round(b - a, 2) for a, b in zip(loading, loading[1:], strict=False)]
    assert max(gaps) < 2 * LOADING_POLL_S, gaps
    assert late < 3 * LOADING_POLL_S, f"connected {late:.2f} s after it was ready"
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("berth.")
    ]
    assert warnings == []
    assert "is loading its models: waiting" in caplog.text
