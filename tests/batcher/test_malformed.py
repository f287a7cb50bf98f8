"""The batcher's Submit stream given malformed Sequences entries.

The gateway never sends one, but another client of the internal API (or a
bug) may. A real batcher on loopback (BatcherService over a real scheduler
whose engine is a loopback servicer, tests/batcher/loopback.py)
gets hand-built entries: each one malformed is answered for its ids alone,
INVALID_ARGUMENT (NOT_FOUND for a model it does not serve) with a message
naming the field and its value, while a well-formed entry in the same
message and another sent after it on the same stream are answered as usual.
Unchecked, token or offset bytes that are no whole number of int32 would
raise in the stream's reader (ending the stream and everything on it),
offsets that do not start at 0 or end at the last token would be scheduled
as if they did, and an id twice would be answered twice.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
import pytest

from batcher.local import LocalBatcher
from batcher.options import SchedulerConfig
from batcher.service import BatcherService
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from tests.batcher.loopback import (
    ENTRY,
    VOCAB,
    WIDTH,
    SleepyEngine,
    sequence,
    started,
    stopped,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
MALFORMED = f"malformed Sequences for model {ENTRY.name!r}: "
GOOD, AFTER = 100, 200  # well-formed: in the bad entry's message, and after it

Answers = dict[int, list[internal_pb2.SequenceResult]]


def entry(
    ids: list[int], tokens: int | bytes, offsets: list[int] | bytes, model: str = ""
) -> internal_pb2.Sequences:
    """A hand-built entry: ``tokens`` as a count (tokens 1..n) or raw bytes,
    ``offsets`` as int32 values or raw bytes."""
    if isinstance(tokens, int):
        tokens = np.arange(1, tokens + 1, dtype="<i4").tobytes()
    if not isinstance(offsets, bytes):
        offsets = np.array(offsets, dtype="<i4").tobytes()
    return internal_pb2.Sequences(
        model=model or ENTRY.name, ids=ids, token_ids=tokens, offsets=offsets
    )


# The model's longest bucket is 16 tokens (ENTRY.buckets).
CASES = {
    "token-bytes-not-int32": (
        entry([1], b"\x01\x00\x00\x00\x02\x00", [0, 1]),
        INVALID,
        MALFORMED + "token_ids holds 6 bytes, not a whole number of int32 tokens",
    ),
    "offset-bytes-not-int32": (
        entry([1], 4, np.array([0, 4], dtype="<i4").tobytes()[:6]),
        INVALID,
        MALFORMED + "offsets holds 6 bytes, not a whole number of int32 offsets",
    ),
    "too-few-offsets": (
        entry([1, 2], 5, [0, 5]),
        INVALID,
        MALFORMED + "offsets holds 2 entries; 2 ids need len(ids) + 1 = 3",
    ),
    "too-many-offsets": (
        entry([1], 5, [0, 2, 5]),
        INVALID,
        MALFORMED + "offsets holds 3 entries; 1 ids need len(ids) + 1 = 2",
    ),
    "offsets-not-from-0": (
        entry([1], 5, [1, 5]),
        INVALID,
        MALFORMED + "offsets[0] is 1; it must be 0",
    ),
    "offsets-decrease": (
        entry([1, 2, 3], 10, [0, 6, 3, 10]),
        INVALID,
        MALFORMED
        + "offsets decrease at sequence id 2: offsets[1] = 6 > offsets[2] = 3",
    ),
    "offsets-past-the-tokens": (
        entry([1], 4, [0, 9]),
        INVALID,
        MALFORMED + "offsets[1] = 9 is past the 4 tokens of token_ids (sequence id 1)",
    ),
    "offsets-short-of-the-tokens": (
        entry([1], 6, [0, 4]),
        INVALID,
        MALFORMED + "offsets end at 4, but token_ids holds 6 tokens",
    ),
    "no-tokens": (
        entry([1, 2], 4, [0, 0, 4]),
        INVALID,
        MALFORMED + "sequence id 1 has no tokens (offsets[0] = offsets[1] = 0)",
    ),
    "too-many-tokens": (
        entry([1], 17, [0, 17]),
        INVALID,
        MALFORMED + "sequence id 1 has 17 tokens; the model takes at most 16",
    ),
    "a-token-id-outside-the-vocabulary": (
        entry([1], np.array([101, 7, 5000, 102], dtype="<i4").tobytes(), [0, 4]),
        INVALID,
        "invalid sequence for model 'm': sequence id 1 has token id 5000 at "
        "position 2, outside the model's vocabulary [0, 1000)",
    ),
    "a-negative-token-id": (
        entry([1], np.array([101, -3, 102], dtype="<i4").tobytes(), [0, 3]),
        INVALID,
        "invalid sequence for model 'm': sequence id 1 has token id -3 at "
        "position 1, outside the model's vocabulary [0, 1000)",
    ),
    "an-id-twice": (
        entry([1, 1], 6, [0, 3, 6]),
        INVALID,
        MALFORMED + "sequence id 1 appears twice in ids",
    ),
    "unknown-model": (
        entry([1], 4, [0, 4], model="nope"),
        NOT_FOUND,
        "batcher does not serve model 'nope'",
    ),
}


async def serve(
    delay_s: float = 0.0,
) -> tuple[BatcherService, str, Callable[[], Awaitable[None]]]:
    """A batcher's Submit service on loopback, its model's one engine
    answering each batch after ``delay_s``; and what stops them."""
    engine = SleepyEngine(delay_s)
    config = SchedulerConfig(max_delay_s=0.001)
    scheduler, pool, engines = await started([engine], 2, config)
    service = BatcherService(LocalBatcher(pool, {ENTRY.name: scheduler}))
    server = grpc.aio.server()
    internal_pb2_grpc.add_BatcherServicer_to_server(service, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()

    async def stop() -> None:
        await server.stop(None)
        await stopped(scheduler, pool, engines)

    return service, address, stop


async def read_until(
    call: grpc.aio.StreamStreamCall, answers: Answers, done: Callable[[], bool]
) -> None:
    """Read the stream's answers into ``answers`` (by id) until ``done``."""
    async with asyncio.timeout(10):
        while not done():
            message = await call.read()
            assert message is not grpc.aio.EOF, "the batcher ended the stream"
            for result in message.results:
                answers[result.id].append(result)


async def exchange(
    messages: list[internal_pb2.GatewayMessage],
    delay_s: float = 0.0,
    prepare: Callable[[BatcherService], None] | None = None,
) -> tuple[Answers, grpc.StatusCode]:
    """Send the messages on one Submit stream; then one more, well-formed,
    with id AFTER once GOOD is answered. Every answer by id, and the
    stream's status once the client closed its side."""
    service, address, stop = await serve(delay_s)
    if prepare is not None:
        prepare(service)
    answers: Answers = defaultdict(list)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = internal_pb2_grpc.BatcherStub(channel).Submit()
            for message in messages:
                await call.write(message)
            await read_until(call, answers, lambda: GOOD in answers)
            after = internal_pb2.GatewayMessage(sequences=[sequence(AFTER, 5)])
            await call.write(after)
            await read_until(call, answers, lambda: AFTER in answers)
            await call.done_writing()
            async with asyncio.timeout(10):
                while await call.read() is not grpc.aio.EOF:
                    pass
            return answers, await call.code()
    finally:
        await stop()


def assert_answered_ok(result: internal_pb2.SequenceResult) -> None:
    assert result.code == 0, result.message
    assert len(result.output) == 4 * WIDTH


@pytest.mark.parametrize(("bad", "code", "message"), CASES.values(), ids=CASES)
def test_a_malformed_entry_is_answered_alone_and_the_stream_carries_on(
    bad: internal_pb2.Sequences, code: int, message: str
) -> None:
    """The malformed entry comes first in a message, a well-formed one after
    it; then another message, well-formed, on the same stream. Every id of
    the bad entry gets one error answer (two for an id it holds twice)
    naming what is wrong, both good ones an output, and the stream ends OK
    when the client closes its side."""
    message_with_both = internal_pb2.GatewayMessage(sequences=[bad, sequence(GOOD, 5)])
    answers, status = asyncio.run(exchange([message_with_both]))
    assert sorted(answers) == sorted({*bad.ids, GOOD, AFTER})
    for seq_id in set(bad.ids):
        got = answers[seq_id]
        assert len(got) == list(bad.ids).count(seq_id), got
        for result in got:
            assert result.code == code, result
            assert result.message.startswith(message), result.message
    for seq_id in (GOOD, AFTER):
        (result,) = answers[seq_id]
        assert_answered_ok(result)
    assert status is grpc.StatusCode.OK


def test_an_entry_without_ids_is_ignored_and_the_stream_carries_on() -> None:
    """No id to answer: nothing is, and the rest of the stream is served."""
    empty = entry([], b"\x01\x00", [0, 7, 9])
    message = internal_pb2.GatewayMessage(sequences=[empty, sequence(GOOD, 5)])
    answers, status = asyncio.run(exchange([message]))
    assert sorted(answers) == [GOOD, AFTER]
    for seq_id in (GOOD, AFTER):
        (result,) = answers[seq_id]
        assert_answered_ok(result)
    assert status is grpc.StatusCode.OK


def test_an_id_the_stream_still_waits_on_is_refused_and_the_first_answered() -> None:
    """GOOD is queued (its engine takes 0.3 s); a second entry reusing GOOD
    (with a fresh id beside it) is refused INVALID_ARGUMENT at once, and the
    first GOOD is then answered as usual: it kept its place on the stream."""
    first = internal_pb2.GatewayMessage(sequences=[sequence(GOOD, 5)])
    reuse = entry([7, GOOD], 8, [0, 4, 8])
    second = internal_pb2.GatewayMessage(sequences=[reuse])
    answers, status = asyncio.run(exchange([first, second], delay_s=0.3))
    expected = MALFORMED + f"sequence id {GOOD} is already queued on this stream"
    (refused,) = answers[7]
    assert refused.code == INVALID and refused.message.startswith(expected)
    refused, answered = answers[GOOD]
    assert refused.code == INVALID and refused.message.startswith(expected)
    assert_answered_ok(answered)
    (result,) = answers[AFTER]
    assert_answered_ok(result)
    assert status is grpc.StatusCode.OK


def test_an_error_queuing_an_entry_fails_its_ids_alone() -> None:
    """A bug queuing one entry (here: its scheduler's submit raising) is
    answered INTERNAL for that entry's ids; the stream carries on."""

    def prepare(service: BatcherService) -> None:
        scheduler = service.batcher.schedulers[ENTRY.name]
        submit = scheduler.submit

        def buggy(
            group: internal_pb2.Sequences, deliver: object
        ) -> list[tuple[int, int]]:
            if 1 in group.ids:
                raise RuntimeError("a bug")
            return submit(group, deliver)  # type: ignore[arg-type]

        scheduler.submit = buggy  # type: ignore[method-assign]

    message = internal_pb2.GatewayMessage(
        sequences=[entry([1, 2], 8, [0, 4, 8]), sequence(GOOD, 5)]
    )
    answers, status = asyncio.run(exchange([message], prepare=prepare))
    for seq_id in (1, 2):
        (result,) = answers[seq_id]
        assert result.code == INTERNAL
        assert "RuntimeError: a bug" in result.message, result.message
    for seq_id in (GOOD, AFTER):
        (result,) = answers[seq_id]
        assert_answered_ok(result)
    assert status is grpc.StatusCode.OK


def test_the_scheduler_refuses_a_malformed_entry_it_is_handed_directly() -> None:
    """ModelScheduler.submit checks too (it is the one place every entry
    passes): answered at once through ``deliver``, nothing queued."""

    async def scenario() -> tuple[list[internal_pb2.SequenceResult], int]:
        scheduler, pool, engines = await started(
            [SleepyEngine(0.0)], 2, SchedulerConfig()
        )
        answers: list[internal_pb2.SequenceResult] = []
        try:
            keys = scheduler.submit(entry([1], 6, [0, 4]), answers.append)
            assert keys == []
            return answers, len(scheduler.core)
        finally:
            await stopped(scheduler, pool, engines)

    answers, queued = asyncio.run(scenario())
    (result,) = answers
    assert result.code == INVALID
    assert (
        result.message == MALFORMED + "offsets end at 4, but token_ids holds 6 tokens"
    )
    assert queued == 0


def test_a_sequence_outside_the_vocabulary_is_refused_alone_and_never_sent() -> None:
    """The vocabulary is what the engines' Info told (VOCAB). Of an entry of
    three, the one with an id past it is refused INVALID_ARGUMENT at once;
    the other two are queued and answered, and no batch the engine gets
    holds the bad one."""
    sent: list[np.ndarray] = []

    def prepare(service: BatcherService) -> None:
        dispatcher = service.batcher.schedulers[ENTRY.name].dispatcher
        dispatch = dispatcher.dispatch

        def recording(engine: object, batch: object) -> None:
            sent.append(np.frombuffer(bytes(batch.tokens), dtype="<i4"))  # type: ignore[attr-defined]
            dispatch(engine, batch)  # type: ignore[arg-type]

        dispatcher.dispatch = recording  # type: ignore[method-assign]

    tokens = np.array([5, 6, 7, 5, VOCAB, 7, 5, 6, 7], dtype="<i4").tobytes()
    mixed = entry([1, 2, 3], tokens, [0, 3, 6, 9])
    message = internal_pb2.GatewayMessage(sequences=[mixed, sequence(GOOD, 5)])
    answers, status = asyncio.run(exchange([message], prepare=prepare))
    (refused,) = answers[2]
    assert refused.code == INVALID
    assert refused.message == (
        "invalid sequence for model 'm': sequence id 2 has token id 1000 at "
        "position 1, outside the model's vocabulary [0, 1000)"
    )
    for seq_id in (1, 3, GOOD, AFTER):
        (result,) = answers[seq_id]
        assert_answered_ok(result)
    assert sent and all(VOCAB not in tokens for tokens in sent)
    assert status is grpc.StatusCode.OK
