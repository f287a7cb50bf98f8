"""Loopback engines behind a real scheduler, for the batcher's tests.

Engines here are real gRPC engine servicers on loopback that answer each
batch after a delay (zeros; no model), so a batch can hang for seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np

from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.scheduler import ModelScheduler
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry
from tests.waits import until

ENTRY = ModelEntry(name="m", task="embed", checkpoint="", buckets=[8, 16])
WIDTH = 4
VOCAB = 1000  # the vocabulary size its engines tell


class SleepyEngine(internal_pb2_grpc.EngineServicer):
    """Answers each batch after ``delay_s`` (as it was when the batch came);
    a cancel drops a batch it still holds. Records the most batches it held
    at once."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.fails = False  # answer every batch with an engine error
        self.received = 0
        self.held: set[int] = set()
        self.most_held = 0

    def delay_of(self, batch: internal_pb2.Batch) -> float:
        """How long this batch takes (read when it comes)."""
        return self.delay_s

    def fails_batch(self, batch: internal_pb2.Batch) -> bool:
        """Whether this batch is answered with an engine error."""
        return self.fails

    async def Info(
        self, request: internal_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.EngineInfo:
        model = internal_pb2.EngineModel(
            name=ENTRY.name, task="embed", width=WIDTH, vocab_size=VOCAB
        )
        return internal_pb2.EngineInfo(models=[model], device="cpu", backend="sleep")

    async def Run(
        self,
        request_iterator: AsyncIterator[internal_pb2.EngineRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[internal_pb2.BatchResult]:
        answers: asyncio.Queue[internal_pb2.BatchResult] = asyncio.Queue()
        tasks: dict[int, asyncio.Task[None]] = {}

        async def answer(batch: internal_pb2.Batch, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            self.held.discard(batch.id)
            if self.fails_batch(batch):
                code = grpc.StatusCode.INTERNAL.value[0]
                failed = internal_pb2.BatchResult(id=batch.id, code=code, message="x")
                answers.put_nowait(failed)
                return
            output = np.zeros(batch.batch_size * WIDTH, dtype="<f4").tobytes()
            answers.put_nowait(
                internal_pb2.BatchResult(
                    id=batch.id, output=output, width=WIDTH, gpu_utilization=-1
                )
            )

        async def read() -> None:
            async for request in request_iterator:
                if request.HasField("batch"):
                    batch = request.batch
                    self.received += 1
                    self.held.add(batch.id)
                    self.most_held = max(self.most_held, len(self.held))
                    delay_s = self.delay_of(batch)
                    tasks[batch.id] = asyncio.create_task(answer(batch, delay_s))
                elif (task := tasks.pop(request.cancel.id, None)) is not None:
                    task.cancel()
                    self.held.discard(request.cancel.id)

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await answers.get()
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()


def sequence(reply_id: int, length: int, timeout_ms: int = 0) -> internal_pb2.Sequences:
    """One sequence of ``length`` tokens for the model."""
    return internal_pb2.Sequences(
        model=ENTRY.name,
        ids=[reply_id],
        token_ids=np.arange(1, length + 1, dtype="<i4").tobytes(),
        offsets=np.array([0, length], dtype="<i4").tobytes(),
        timeout_ms=timeout_ms,
    )


async def started(
    engines: list[SleepyEngine], slots: int, config: SchedulerConfig
) -> tuple[ModelScheduler, EnginePool, list[grpc.aio.Server]]:
    """These engines on loopback behind a pool and a started scheduler."""
    servers, addresses = [], []
    for servicer in engines:
        server = grpc.aio.server()
        internal_pb2_grpc.add_EngineServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    pool = EnginePool(addresses, slots_per_engine=slots)
    scheduler = ModelScheduler(ENTRY, pool, config)
    scheduler.start()
    pool.start()
    await until(
        lambda: len(pool.serving(ENTRY.name)) == len(engines), "every engine serving"
    )
    return scheduler, pool, servers


async def stopped(
    scheduler: ModelScheduler, pool: EnginePool, servers: list[grpc.aio.Server]
) -> None:
    for task in list(scheduler.dispatcher.running):
        task.cancel()
    await scheduler.drain()
    await pool.close()
    for server in servers:
        await server.stop(None)
