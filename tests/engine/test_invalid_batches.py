"""An engine takes its batches as if a stranger sent them.

Real gRPC on loopback, a tiny random BERT (1,000 ids, 64 positions) on the
CPU backend. A batch the engine will not compute is answered at once,
INVALID_ARGUMENT (NOT_FOUND for a model it does not serve) with what is
wrong, before any work or allocation that grows with the size it claims,
never counted as an engine failure; the engine serves on.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from engine.service import EngineService
from engine.torch_backend import TorchBackend
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry
from tests.engine.test_engine_streams import serve

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
MAX_BATCH, TOKEN_BUDGET = 64, 2048


@pytest.fixture(scope="module")
def service(tiny: ModelEntry) -> Iterator[EngineService]:
    backend = TorchBackend("cpu")
    backend.load(tiny)
    yield EngineService(backend, {"tiny": tiny}, MAX_BATCH, TOKEN_BUDGET)


def batch(
    batch_id: int,
    rows: int,
    length: int,
    ids: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    **fields: Any,
) -> internal_pb2.Batch:
    """A good batch (ids 100..999, full rows) unless told otherwise."""
    if ids is None:
        ids = np.random.default_rng(batch_id).integers(100, 1000, (rows, length))
    if lengths is None:
        lengths = np.full(rows, length)
    values: dict[str, Any] = {
        "id": batch_id,
        "model": "tiny",
        "batch_size": rows,
        "length": length,
        "token_ids": np.asarray(ids, dtype="<i4").tobytes(),
        "lengths": np.asarray(lengths, dtype="<i4").tobytes(),
    }
    values.update(fields)
    return internal_pb2.Batch(**values)


def with_id(value: int, row: int = 1, position: int = 3) -> np.ndarray:
    ids = np.full((4, 16), 500)
    ids[row, position] = value
    return ids


HUGE = batch(1, 1_000_000, 32, ids=np.ones(4), lengths=np.ones(2))
BAD = {
    "a huge batch claimed in a few bytes": (
        HUGE,
        INVALID,
        "batch of 1000000 rows of 32 tokens is over the 64 rows",
    ),
    "more tokens than the budget": (
        batch(2, 48, 64),
        INVALID,
        "batch of 48 rows of 64 tokens is over the 32 rows this engine takes",
    ),
    "bytes short of the shape": (
        batch(3, 4, 16, ids=np.ones((3, 16))),
        INVALID,
        "batch 4 x 16 needs 256 bytes of token ids and 16 of lengths, got 192 and 16",
    ),
    "no rows": (batch(4, 0, 16, ids=np.ones(0)), INVALID, "batch is 0 x 16"),
    "longer than the model": (
        batch(5, 1, 65),
        INVALID,
        "padded length 65 is over the model's 64 tokens",
    ),
    "a length over the row": (
        batch(6, 2, 16, lengths=[16, 17]),
        INVALID,
        "lengths must lie in [1, 16], got 16 to 17",
    ),
    "an empty row": (
        batch(7, 2, 16, lengths=[16, 0]),
        INVALID,
        "lengths must lie in [1, 16], got 0 to 16",
    ),
    "an id past the vocabulary": (
        batch(8, 4, 16, ids=with_id(1000)),
        INVALID,
        "token ids must lie in [0, 1000) (the model's vocabulary), got 1000 in "
        "row 1 at position 3",
    ),
    "a negative id": (
        batch(9, 4, 16, ids=with_id(-7, 3, 0)),
        INVALID,
        "token ids must lie in [0, 1000) (the model's vocabulary), got -7 in "
        "row 3 at position 0",
    ),
    "a model it does not serve": (
        batch(10, 1, 16, model="nope"),
        NOT_FOUND,
        "engine does not serve model 'nope' (it serves tiny)",
    ),
}


async def timed(call: Any, message: internal_pb2.Batch) -> tuple[float, Any]:
    """One batch's round trip on an open Run stream: seconds and answer."""
    start = time.perf_counter()
    await call.write(internal_pb2.EngineRequest(batch=message))
    result = await call.read()
    return time.perf_counter() - start, result


@pytest.mark.parametrize(("bad", "code", "message"), BAD.values(), ids=BAD)
def test_a_bad_batch_is_refused_and_the_engine_serves_on(
    service: EngineService, bad: internal_pb2.Batch, code: int, message: str
) -> None:
    failures = service.failures

    async def work(stub: Any) -> list[Any]:
        call = stub.Run()
        answers = [
            (await timed(call, bad))[1],
            (await timed(call, batch(99, 4, 16)))[1],
        ]
        await call.done_writing()
        return answers

    refused, good = asyncio.run(serve(service, work))
    assert (refused.id, refused.code) == (bad.id, code), refused
    assert message in refused.message, refused.message
    assert (good.id, good.code, good.width) == (99, 0, 32), good.message
    assert service.failures == failures  # not an engine failure


def test_a_huge_claim_is_refused_at_once_without_allocating(
    service: EngineService,
) -> None:
    """batch_size 1,000,000 in 12 bytes: refused faster than the engine runs
    a normal batch, ahead of a large batch queued before it, and its check
    allocates nothing like the 128 MB the claim would need."""

    async def work(stub: Any) -> tuple[float, float, list[int]]:
        call = stub.Run()
        normal, answer = await timed(call, batch(20, 32, 64))  # its largest shape
        assert answer.code == 0, answer.message
        refused, answer = await timed(call, HUGE)
        assert answer.code == INVALID, answer
        # A large batch, then the huge claim: the claim is answered first.
        order = []
        for message in (batch(21, 32, 64), HUGE):
            await call.write(internal_pb2.EngineRequest(batch=message))
        for _ in range(2):
            order.append((await call.read()).id)
        await call.done_writing()
        return normal, refused, order

    normal, refused, order = asyncio.run(serve(service, work))
    print(
        f"normal batch {1e3 * normal:.1f} ms, huge claim refused {1e3 * refused:.1f} ms"
    )
    assert refused < normal
    assert order == [HUGE.id, 21]
    tracemalloc.start()
    try:
        answer = service.refusal(HUGE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer is not None and answer.code == INVALID
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


def test_info_tells_the_vocabulary_and_max_tokens(service: EngineService) -> None:
    service.ready = True

    async def work(stub: Any) -> Any:
        return await stub.Info(internal_pb2.EngineInfoRequest())

    (model,) = asyncio.run(serve(service, work)).models
    assert (model.name, model.vocab_size, model.max_tokens) == ("tiny", 1000, 64)
