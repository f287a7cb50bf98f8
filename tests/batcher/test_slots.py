"""The batcher never gives an engine more batches than its slots.

A real engine (gRPC on loopback, a tiny random BERT on the CPU) behind the
batcher's own scheduler and engine pool. Work for many buckets arrives at
once, so every bucket is ready for the scheduler's next pass: its loop then
picks an engine and dispatches batch after batch without yielding, and must
count each against its engine as it goes.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np

from batcher.engines import EnginePool
from batcher.scheduler import ModelScheduler, SchedulerConfig
from engine.service import EngineService
from engine.torch_backend import TorchBackend
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry

BUCKETS = [4, 8, 12, 16, 24, 32, 48, 64]


def sequences(model: str, lengths: list[int]) -> internal_pb2.Sequences:
    rng = np.random.default_rng(0)
    ids = [rng.integers(100, 1000, n, dtype=np.int32) for n in lengths]
    offsets = np.zeros(len(ids) + 1, dtype="<i4")
    np.cumsum(lengths, out=offsets[1:])
    return internal_pb2.Sequences(
        model=model,
        ids=list(range(1, len(ids) + 1)),
        token_ids=np.concatenate(ids).astype("<i4").tobytes(),
        offsets=offsets.tobytes(),
    )


def test_a_burst_of_ready_buckets_waits_for_free_slots(tiny: ModelEntry) -> None:
    entry = dataclasses.replace(tiny, buckets=BUCKETS)
    backend = TorchBackend("cpu")
    backend.load(entry)
    service = EngineService(backend, {entry.name: entry})
    service.ready = True  # loaded; warm-up does not matter here

    async def scenario() -> tuple[int, list[internal_pb2.SequenceResult]]:
        server = grpc.aio.server()
        internal_pb2_grpc.add_EngineServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        pool = EnginePool([f"127.0.0.1:{port}"], slots_per_engine=2)
        scheduler = ModelScheduler(entry, pool, SchedulerConfig(max_delay_s=0.001))
        scheduler.start()
        await server.start()
        pool.start()
        while not pool.serving(entry.name):
            await asyncio.sleep(0.01)
        answers: list[internal_pb2.SequenceResult] = []
        most = 0

        async def watch() -> None:  # batches dispatched and not yet finished
            nonlocal most
            while len(answers) < len(BUCKETS):
                most = max(most, len(scheduler._inflight))
                await asyncio.sleep(0)

        # One sequence per bucket, all at once: every bucket is ready for the
        # scheduler's next pass (it dispatches eagerly to an idle engine).
        lengths = [3, 7, 11, 15, 20, 30, 40, 60]
        scheduler.submit(sequences(entry.name, lengths), answers.append)
        try:
            await asyncio.wait_for(watch(), 60)
        finally:
            await scheduler.drain()
            await pool.close()
            await server.stop(None)
        return most, answers

    most, answers = asyncio.run(scenario())
    print(f"most batches in flight on one engine with 2 slots: {most}")
    assert sorted(a.id for a in answers) == list(range(1, len(BUCKETS) + 1))
    assert all(a.code == 0 for a in answers), [a.message for a in answers]
    assert most <= 2
