"""Several batcher streams on one engine: one device loop serves them all.

Real gRPC on loopback, a small random BERT; on the CPU backend always, and
on the CUDA one (pinned slots, pipelined submit/collect) where there is a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from engine.service import EngineService
from services.repository import ModelEntry

internal_pb2 = pytest.importorskip("services.proto.berth.v1.internal_pb2")
internal_pb2_grpc = pytest.importorskip("services.proto.berth.v1.internal_pb2_grpc")

LENGTH = 32


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="needs a CUDA GPU"
                ),
            ],
        ),
    ],
)
def service(request: pytest.FixtureRequest, tiny: ModelEntry) -> Iterator[Any]:
    if request.param == "cuda":
        from engine.cuda.backend import CudaBackend

        backend: Any = CudaBackend("cuda:0")
    else:
        from engine.torch_backend import TorchBackend

        backend = TorchBackend("cpu")
    backend.load(tiny)
    # Large enough for the 1,024-row batches of the CPU test below.
    yield EngineService(backend, {"tiny": tiny}, max_batch=1024, token_budget=32768)


def batch(batch_id: int, rows: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    ids = rng.integers(100, 1000, (rows, LENGTH), dtype=np.int32)
    lengths = rng.integers(1, LENGTH + 1, rows, dtype=np.int32)
    lengths[0] = LENGTH
    ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return internal_pb2.Batch(
        id=batch_id,
        model="tiny",
        batch_size=rows,
        length=LENGTH,
        token_ids=ids.tobytes(),
        lengths=lengths.tobytes(),
    )


def expected(service: Any, message: Any) -> np.ndarray:
    ids = np.frombuffer(message.token_ids, dtype="<i4").reshape(-1, LENGTH)
    lengths = np.frombuffer(message.lengths, dtype="<i4")
    return np.asarray(service.backend.run("tiny", ids, lengths))


async def serve(service: Any, work: Any) -> Any:
    import grpc

    server = grpc.aio.server()
    internal_pb2_grpc.add_EngineServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await asyncio.wait_for(
                work(internal_pb2_grpc.EngineStub(channel)), 60
            )
    finally:
        await server.stop(None)


async def run_stream(stub: Any, batches: list[Any], cancel: list[int]) -> dict:
    call = stub.Run()
    for message in batches:
        await call.write(internal_pb2.EngineRequest(batch=message))
    for batch_id in cancel:
        await call.write(
            internal_pb2.EngineRequest(cancel=internal_pb2.CancelBatch(id=batch_id))
        )
    await call.done_writing()
    return {result.id: result async for result in call}


def test_concurrent_streams_each_get_their_own_answers(service: Any) -> None:
    plans = [[batch(s * 100 + i, 1 + (i * 5 + s) % 9, s * 100 + i) for i in range(8)]
             for s in range(3)]  # fmt: skip

    async def work(stub: Any) -> list[dict]:
        return await asyncio.wait_for(
            asyncio.gather(*(run_stream(stub, plan, []) for plan in plans)), 120
        )

    answers = asyncio.run(serve(service, work))
    for plan, got in zip(plans, answers, strict=True):
        assert sorted(got) == [m.id for m in plan]  # all of its own, no others
        for message in plan:
            result = got[message.id]
            assert result.code == 0, result.message
            out = np.frombuffer(result.output, dtype="<f4").reshape(
                message.batch_size, result.width
            )
            np.testing.assert_allclose(
                out, expected(service, message), rtol=1e-3, atol=1e-3
            )


def test_a_stream_that_goes_away_leaves_the_engine_serving(service: Any) -> None:
    async def work(stub: Any) -> dict:
        gone = stub.Run()
        for i in range(6):  # queued work, then the caller vanishes
            await gone.write(internal_pb2.EngineRequest(batch=batch(500 + i, 8, i)))
        gone.cancel()
        await asyncio.sleep(0.2)
        after = [batch(600 + i, 1 + i, 50 + i) for i in range(6)]
        return await asyncio.wait_for(run_stream(stub, after, []), 120)

    got = asyncio.run(serve(service, work))
    assert sorted(got) == list(range(600, 606))
    assert all(result.code == 0 for result in got.values())


def test_cancelled_batches_do_not_hold_the_stream_open(service: Any) -> None:
    plan = [batch(700 + i, 4, 70 + i) for i in range(5)]

    async def work(stub: Any) -> dict:
        # The stream ends once every batch is answered or dropped.
        return await asyncio.wait_for(run_stream(stub, plan, [703, 704]), 60)

    got = asyncio.run(serve(service, work))
    assert {700, 701, 702} <= set(got) <= {700, 701, 702, 703, 704}
    assert all(result.code == 0 for result in got.values())


def test_late_cancels_are_not_kept(service: Any) -> None:
    """A cancel for a batch already answered (a hedge's loser, a batch past
    its timeout) or never sent is dropped, not remembered for the life of
    the stream (days: such ids would pile up)."""
    import grpc

    async def work(stub: Any) -> tuple[list[Any], int, int]:
        call = stub.Run()
        await call.write(internal_pb2.EngineRequest(batch=batch(800, 2, 80)))
        answers = [await call.read()]
        for batch_id in (800, 801, 802):  # answered, never sent, never sent
            cancel = internal_pb2.CancelBatch(id=batch_id)
            await call.write(internal_pb2.EngineRequest(cancel=cancel))
        # Read in order: once 803 is answered the cancels have been read.
        await call.write(internal_pb2.EngineRequest(batch=batch(803, 2, 83)))
        answers.append(await call.read())
        held = sum(len(c.cancelled) + len(c.queued) for c in service.callers)
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK  # the stream has ended
        return answers, held, len(service.callers)

    answers, held, streams_left = asyncio.run(serve(service, work))
    assert [(a.id, a.code) for a in answers] == [(800, 0), (803, 0)]
    assert held == 0
    assert streams_left == 0


def test_cpu_answers_are_not_held_for_the_next_batch(service: Any) -> None:
    """On a backend without submit/collect (eager CPU), computing is the
    whole batch: each answer goes back as soon as its batch is computed,
    not after the next queued batch has been computed too."""
    import time

    if service.backend.device != "cpu":
        pytest.skip("the CUDA backend overlaps batches on purpose")
    rows = 1024  # tens of ms each on the CPU
    plan = []
    for i in range(6):
        message = batch(900 + i, rows, 90 + i)
        message.lengths = np.full(rows, LENGTH, dtype=np.int32).tobytes()
        plan.append(message)

    async def work(stub: Any) -> list[tuple[float, Any]]:
        call = stub.Run()
        for message in plan:  # all queued at once
            await call.write(internal_pb2.EngineRequest(batch=message))
        await call.done_writing()
        return [(time.perf_counter(), result) async for result in call]

    got = asyncio.run(serve(service, work))
    assert [result.id for _, result in got] == [m.id for m in plan]
    for (before, _), (after, result) in zip(got, got[1:], strict=False):
        # Batch n+1 is computed after batch n is answered: its answer comes
        # at least (most of) its compute time later.
        assert after - before >= 0.5 * result.compute_us / 1e6, (
            f"batch {result.id} answered {1e3 * (after - before):.1f} ms after "
            f"the one before, its compute took {result.compute_us / 1e3:.1f} ms"
        )
