"""A bad sequence fails alone: never its batch, never against an engine.

A real engine (gRPC on loopback, a tiny random BERT of 1,000 ids on the CPU)
behind the batcher's own scheduler and pool. When the engine tells its
vocabulary, a sequence outside it is refused at submit and never sent. When
it does not (an engine that does not tell, or ids the batcher cannot judge),
the mixed batch reaches the engine, which refuses it INVALID_ARGUMENT; the
batcher splits it until the bad sequence fails alone and answers the others,
and neither the circuit breaker nor the engine's ejection counts it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np

from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.resilience import BreakerState
from batcher.scheduler import ModelScheduler
from engine.service import EngineService
from engine.torch_backend import TorchBackend
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry
from tests.waits import until

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
BAD = 3  # the sequence with an id past the vocabulary (1,000 ids)


class SilentEngine(EngineService):
    """An engine whose Info tells no vocabulary or max tokens."""

    async def Info(
        self, request: internal_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.EngineInfo:
        info = await super().Info(request, context)
        for model in info.models:
            model.vocab_size = model.max_tokens = 0
        return info


def mixed(count: int = 6, length: int = 12) -> internal_pb2.Sequences:
    """``count`` sequences of one bucket; sequence BAD holds id 1000."""
    ids = np.random.default_rng(1).integers(100, 1000, (count, length))
    ids[BAD - 1, 5] = 1000
    return internal_pb2.Sequences(
        model="tiny",
        ids=list(range(1, count + 1)),
        token_ids=ids.astype("<i4").tobytes(),
        offsets=np.arange(0, count * length + 1, length, dtype="<i4").tobytes(),
    )


async def scenario(
    tiny: ModelEntry, kind: type[EngineService]
) -> tuple[
    list[internal_pb2.SequenceResult], ModelScheduler, EnginePool, EngineService
]:
    entry = dataclasses.replace(tiny, buckets=[16, 32])
    backend = TorchBackend("cpu")
    backend.load(entry)
    service = kind(backend, {"tiny": entry})
    service.ready = True
    server = grpc.aio.server()
    internal_pb2_grpc.add_EngineServicer_to_server(service, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    pool = EnginePool([address])
    scheduler = ModelScheduler(entry, pool, SchedulerConfig(max_delay_s=0.001))
    scheduler.start()
    pool.start()
    answers: list[internal_pb2.SequenceResult] = []
    try:
        await until(lambda: bool(pool.serving("tiny")), "the engine serving")
        scheduler.submit(mixed(), answers.append)
        await until(lambda: len(answers) >= 6, "every sequence answered", 30)
        await asyncio.sleep(0.05)  # (nothing more may come)
    finally:
        await scheduler.drain()
        await pool.close()
        await server.stop(None)
    return answers, scheduler, pool, service


def assert_only_the_bad_one_failed(answers: list[internal_pb2.SequenceResult]) -> None:
    assert sorted(a.id for a in answers) == [1, 2, 3, 4, 5, 6]
    for answer in answers:
        if answer.id == BAD:
            assert answer.code == INVALID, answer
            assert "1000" in answer.message and "vocabulary" in answer.message
        else:
            assert answer.code == 0, answer.message
            assert len(answer.output) == 4 * 32


def test_a_bad_sequence_in_a_mixed_batch_fails_alone(tiny: ModelEntry) -> None:
    answers, scheduler, pool, service = asyncio.run(scenario(tiny, SilentEngine))
    print({a.id: (a.code, a.message) for a in answers})
    assert_only_the_bad_one_failed(answers)
    assert service.refused >= 1  # the mixed batch did reach the engine
    assert service.failures == 0
    assert scheduler.breaker.current() is BreakerState.CLOSED
    assert scheduler.breaker.failures == 0
    (engine,) = pool.engines
    assert engine.failures == 0 and engine.ejected_until == 0.0


def test_a_bad_sequence_is_refused_at_submit_when_engines_tell_the_vocabulary(
    tiny: ModelEntry,
) -> None:
    answers, scheduler, pool, service = asyncio.run(scenario(tiny, EngineService))
    assert_only_the_bad_one_failed(answers)
    (bad,) = (a for a in answers if a.id == BAD)
    assert bad.message == (
        "invalid sequence for model 'tiny': sequence id 3 has token id 1000 at "
        "position 5, outside the model's vocabulary [0, 1000)"
    )
    assert service.refused == 0  # never sent
    assert scheduler.breaker.failures == 0
    assert pool.engines[0].failures == 0
