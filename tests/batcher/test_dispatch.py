"""How the batcher's scheduler hands batches to engines.

Real engines (gRPC on loopback, a tiny random BERT on the CPU) behind the
batcher's own scheduler and engine pool:

- it never gives an engine more batches than its slots, even when work for
  many buckets is ready at once (its loop dispatches batch after batch
  without yielding and must count each as it goes);
- an engine busy with a long batch is not ejected when a short batch queued
  behind it loses to its hedge (only an engine slow on its only batch is);
- a hedge goes only to an engine with a free slot (one queued behind a full
  engine's work rarely wins and takes capacity the load needs);
- a batch its engine does not answer within the batch timeout fails with a
  clear status, and the engine is ejected;
- two models' batches on one engine's stream at once each get their own
  answer (batch ids are unique across the pool's models);
- queued work is always answered: when it expires while no engine is up,
  and when it arrives after the scheduler was drained;
- a model with a backlog does not starve another on the same engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from batcher import scheduler as scheduler_module
from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.scheduler import ModelScheduler
from engine.service import EngineService
from engine.torch_backend import TorchBackend
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.repository import ModelEntry
from tests.waits import until

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


def engine(*entries: ModelEntry) -> tuple[EngineService, grpc.aio.Server, str]:
    """An engine service for these models on a loopback port (not started)."""
    backend = TorchBackend("cpu")
    for entry in entries:
        backend.load(entry)
    service = EngineService(backend, {entry.name: entry for entry in entries})
    service.ready = True  # loaded; warm-up does not matter here
    server = grpc.aio.server()
    internal_pb2_grpc.add_EngineServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    return service, server, f"127.0.0.1:{port}"


async def serving(
    scheduler: ModelScheduler, pool: EnginePool, *servers: grpc.aio.Server
) -> None:
    """Start the scheduler, these engines and the pool; wait until they serve."""
    scheduler.start()
    for server in servers:
        await server.start()
    pool.start()
    await until(
        lambda: len(pool.serving(scheduler.name)) == len(servers), "engines serving"
    )


def test_a_burst_of_ready_buckets_waits_for_free_slots(tiny: ModelEntry) -> None:
    entry = dataclasses.replace(tiny, buckets=BUCKETS)

    async def scenario() -> tuple[int, list[internal_pb2.SequenceResult]]:
        _, server, address = engine(entry)
        pool = EnginePool([address], slots_per_engine=2)
        scheduler = ModelScheduler(entry, pool, SchedulerConfig(max_delay_s=0.001))
        await serving(scheduler, pool, server)
        answers: list[internal_pb2.SequenceResult] = []
        most = 0

        async def watch() -> None:  # batches dispatched and not yet finished
            nonlocal most
            while len(answers) < len(BUCKETS):
                most = max(most, len(scheduler.dispatcher.running))
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


def test_a_busy_engine_is_not_ejected_when_a_queued_batch_loses_its_hedge(
    tiny: ModelEntry,
) -> None:
    entry = dataclasses.replace(tiny, buckets=BUCKETS)
    release = threading.Event()

    async def scenario() -> tuple[int, list[internal_pb2.SequenceResult]]:
        busy_service, busy_server, busy = engine(entry)
        _, spare_server, spare = engine(entry)
        pool = EnginePool([busy, spare], slots_per_engine=2)
        config = SchedulerConfig(max_delay_s=0.001, hedge_delay_s=0.3, hedge_p95=True)
        scheduler = ModelScheduler(entry, pool, config)
        # Batches of the 64-token bucket take 10 s at p95: theirs hedge late.
        scheduler.dispatcher.latencies[BUCKETS.index(64)].extend([10.0] * 20)
        busy_service._compute.submit(release.wait)  # its device: other work
        await serving(scheduler, pool, busy_server)
        answers: list[internal_pb2.SequenceResult] = []
        # A long batch, then a short one queued behind it: both on the only
        # engine up. The spare comes up before the short one's hedge (0.3 s).
        scheduler.submit(sequences(entry.name, [60]), answers.append)
        await asyncio.sleep(0.02)
        scheduler.submit(sequences(entry.name, [3]), answers.append)
        await asyncio.sleep(0.02)
        await spare_server.start()
        try:
            # the short one, answered by its hedge
            await until(lambda: answers, "the short batch answered by its hedge")
            ejections = pool.engines[0].failures
            release.set()
            while len(answers) < 2:
                await asyncio.sleep(0.01)
        finally:
            release.set()
            await scheduler.drain()
            await pool.close()
            await busy_server.stop(None)
            await spare_server.stop(None)
        return ejections, answers

    ejections, answers = asyncio.run(scenario())
    assert all(a.code == 0 for a in answers), [a.message for a in answers]
    assert ejections == 0, "the busy engine was ejected"


def test_no_hedge_goes_to_an_engine_whose_slots_are_full(tiny: ModelEntry) -> None:
    entry = dataclasses.replace(tiny, buckets=BUCKETS)
    release = threading.Event()

    async def scenario() -> tuple[int, list[internal_pb2.SequenceResult]]:
        engines = [engine(entry) for _ in range(2)]
        pool = EnginePool([address for *_, address in engines], slots_per_engine=2)
        config = SchedulerConfig(max_delay_s=0.001, hedge_delay_s=0.05)
        scheduler = ModelScheduler(entry, pool, config)
        for service, _, _ in engines:
            service._compute.submit(release.wait)  # both devices: other work
        await serving(scheduler, pool, *(server for _, server, _ in engines))
        answers: list[internal_pb2.SequenceResult] = []
        for n in (3, 7, 11, 15):  # four batches: both engines' slots full
            scheduler.submit(sequences(entry.name, [n]), answers.append)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # every batch is past its hedge delay
        hedged = scheduler.dispatcher.hedges.sent
        release.set()
        try:
            await until(lambda: len(answers) == 4, "all 4 answered")
        finally:
            await scheduler.drain()
            await pool.close()
            for _, server, _ in engines:
                await server.stop(None)
        return hedged, answers

    hedged, answers = asyncio.run(scenario())
    assert all(a.code == 0 for a in answers), [a.message for a in answers]
    assert hedged == 0, f"{hedged} hedges sent to engines with no free slot"


def test_a_batch_its_engine_does_not_answer_in_time_fails_clearly(
    tiny: ModelEntry,
) -> None:
    """Past --batch-timeout-s the batch is answered UNAVAILABLE with a message
    that names the flag, and its engine sits out a back-off."""
    entry = dataclasses.replace(tiny, buckets=BUCKETS)
    release = threading.Event()

    async def scenario() -> tuple[list[internal_pb2.SequenceResult], int, float]:
        service, server, address = engine(entry)
        pool = EnginePool([address])
        config = SchedulerConfig(max_delay_s=0.001, batch_timeout_s=0.3)
        scheduler = ModelScheduler(entry, pool, config)
        service._compute.submit(release.wait)  # the device is stuck elsewhere
        await serving(scheduler, pool, server)
        answers: list[internal_pb2.SequenceResult] = []
        scheduler.submit(sequences(entry.name, [5]), answers.append)
        try:
            await until(lambda: answers, "the sequence answered")
            (client,) = pool.engines
            return answers, client.failures, client.ejected_until
        finally:
            release.set()
            await scheduler.drain()
            await pool.close()
            await server.stop(None)

    answers, failures, ejected_until = asyncio.run(scenario())
    (answer,) = answers
    assert answer.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "did not answer a batch" in answer.message, answer.message
    assert "--batch-timeout-s" in answer.message
    assert failures == 1 and ejected_until > 0


async def two_schedulers(
    entries: tuple[ModelEntry, ModelEntry],
    config: SchedulerConfig,
    submit: Callable[[list[ModelScheduler]], None],
    done: Callable[[], bool],
    prepare: Callable[[EnginePool], None] | None = None,
) -> None:
    """Two models' schedulers sharing one engine (2 slots) behind one pool:
    ``submit`` their work in one loop pass, wait until ``done``, then stop
    everything."""
    _, server, address = engine(*entries)
    pool = EnginePool([address], slots_per_engine=2)
    if prepare is not None:
        prepare(pool)
    schedulers = [ModelScheduler(e, pool, config) for e in entries]
    schedulers[1].start()
    await serving(schedulers[0], pool, server)
    submit(schedulers)
    try:
        await until(done, "every sequence answered", 30)
    finally:
        for scheduler in schedulers:
            await scheduler.drain()
        await pool.close()
        await server.stop(None)


def two_models_at_once(
    tiny: ModelEntry, same_ids: bool = False
) -> tuple[list[ModelEntry], dict[str, list[internal_pb2.SequenceResult]]]:
    """Two models (mean and CLS pooling) on one engine behind one pool, a
    batch of each sent in one loop pass; every caller's answer. same_ids:
    the pool hands out the same batch id twice."""
    mean = dataclasses.replace(tiny, name="mean", buckets=BUCKETS)
    cls = dataclasses.replace(tiny, name="cls", pooling="cls", buckets=BUCKETS)

    answers: dict[str, list[internal_pb2.SequenceResult]] = {"mean": [], "cls": []}

    def submit(schedulers: list[ModelScheduler]) -> None:
        for scheduler in schedulers:
            submitted = sequences(scheduler.name, TWO_LENGTHS)
            scheduler.submit(submitted, answers[scheduler.name].append)

    def one_id(pool: EnginePool) -> None:
        pool.next_batch_id = lambda: 1  # type: ignore[method-assign]

    asyncio.run(
        two_schedulers(
            (mean, cls),
            SchedulerConfig(max_delay_s=0.001, batch_timeout_s=5),
            submit,
            lambda: sum(map(len, answers.values())) >= 2 * len(TWO_LENGTHS),
            one_id if same_ids else None,
        )
    )
    return [mean, cls], answers


TWO_LENGTHS = [5, 7]  # one bucket (8): one batch per model


def test_two_models_batches_on_one_engine_get_their_own_answers(
    tiny: ModelEntry,
) -> None:
    """Every model's batches share each engine's one stream, whose answers
    are matched by batch id. Two models' first batches, sent together, each
    get their own model's output (with ids counted per model both would be
    1: one caller would get the other model's answer, the other none until
    the batch timeout ejected the engine)."""
    entries, answers = two_models_at_once(tiny)
    backend = TorchBackend("cpu")
    tokens = np.frombuffer(sequences("", TWO_LENGTHS).token_ids, dtype="<i4")
    for entry in entries:
        backend.load(entry)
        got = sorted(answers[entry.name], key=lambda a: a.id)
        assert all(a.code == 0 for a in got), [a.message for a in got]
        starts = [0, TWO_LENGTHS[0]]
        for answer, start, n in zip(got, starts, TWO_LENGTHS, strict=True):
            ids = tokens[start : start + n][None, :]
            want = backend.run(entry.name, ids, np.array([n], dtype=np.int32))[0]
            np.testing.assert_allclose(
                np.frombuffer(answer.output, dtype="<f4"), want, rtol=1e-4, atol=1e-5
            )


def test_a_batch_id_already_in_flight_fails_its_batch_clearly(
    tiny: ModelEntry,
) -> None:
    """Should two batches ever share an id on one stream, the second is
    refused (its callers answered INTERNAL, saying why), not given the
    first's answer or left unanswered."""
    _, answers = two_models_at_once(tiny, same_ids=True)
    codes = {name: {a.code for a in got} for name, got in answers.items()}
    assert sorted(codes.values(), key=min) == [{0}, {grpc.StatusCode.INTERNAL.value[0]}]
    refused = [a for got in answers.values() for a in got if a.code]
    assert len(refused) == len(TWO_LENGTHS)
    assert all("already await answers" in a.message for a in refused), refused


def test_work_expiring_while_no_engine_is_up_is_still_answered(
    tiny: ModelEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence queued when its engine goes away, whose deadline passes
    during the engine-less grace, is answered DEADLINE_EXCEEDED when the
    grace ends (the core drops it as expired while the scheduler fails what
    is queued: that drop is answered too)."""
    monkeypatch.setattr(scheduler_module, "NO_ENGINE_GRACE_S", 0.3)
    entry = dataclasses.replace(tiny, buckets=BUCKETS)
    release = threading.Event()

    async def scenario() -> list[internal_pb2.SequenceResult]:
        service, server, address = engine(entry)
        pool = EnginePool([address], slots_per_engine=1)
        scheduler = ModelScheduler(entry, pool, SchedulerConfig(max_delay_s=0.001))
        service._compute.submit(release.wait)  # the device is stuck elsewhere
        await serving(scheduler, pool, server)
        answers: list[internal_pb2.SequenceResult] = []
        scheduler.submit(sequences(entry.name, [5]), answers.append)  # the slot
        await asyncio.sleep(0.05)
        late = sequences(entry.name, [6])
        late.ids[:] = [2]
        late.timeout_ms = 100
        scheduler.submit(late, answers.append)  # queued: no free slot
        await asyncio.sleep(0.05)
        await server.stop(None)  # the engine goes away
        try:
            async with asyncio.timeout(5):
                while len(answers) < 2:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pass
        finally:
            release.set()
            await scheduler.drain()
            await pool.close()
        return answers

    answers = asyncio.run(scenario())
    codes = {a.id: a.code for a in answers}
    assert codes == {
        1: grpc.StatusCode.UNAVAILABLE.value[0],
        2: grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
    }, [(a.id, a.message) for a in answers]


def test_work_submitted_after_drain_is_refused_not_left_queued(
    tiny: ModelEntry,
) -> None:
    """Once drained, the scheduler's loop is gone, but its gateways' streams
    stay open until the server stops (up to its grace period): a sequence
    they send meanwhile is refused UNAVAILABLE at once (queued, it would
    wait where nothing ever batches it)."""
    entry = dataclasses.replace(tiny, buckets=BUCKETS)

    async def scenario() -> list[internal_pb2.SequenceResult]:
        _, server, address = engine(entry)
        pool = EnginePool([address])
        scheduler = ModelScheduler(entry, pool, SchedulerConfig(max_delay_s=0.001))
        await serving(scheduler, pool, server)
        answers: list[internal_pb2.SequenceResult] = []
        try:
            await scheduler.drain()
            scheduler.submit(sequences(entry.name, [5]), answers.append)
            async with asyncio.timeout(2):
                while not answers:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pass
        finally:
            await pool.close()
            await server.stop(None)
        return answers

    answers = asyncio.run(scenario())
    assert [a.code for a in answers] == [grpc.StatusCode.UNAVAILABLE.value[0]]
    assert "shutting down" in answers[0].message


def test_a_flooded_model_does_not_starve_another_on_the_same_engine(
    tiny: ModelEntry,
) -> None:
    """Two models' schedulers share an engine's slots. With one model's
    backlog always ready, the other's lone sequence still gets a slot soon
    (if every freed slot woke the first-subscribed scheduler first, that
    one would take it, and the other model would wait for the whole
    backlog, 400 of 400)."""
    flooded = dataclasses.replace(tiny, name="flooded", buckets=BUCKETS)
    other = dataclasses.replace(tiny, name="other", buckets=BUCKETS)

    order: list[str] = []

    def submit(schedulers: list[ModelScheduler]) -> None:
        for scheduler, n in zip(schedulers, (400, 1), strict=True):
            submitted = sequences(scheduler.name, [5] * n)
            scheduler.submit(
                submitted, lambda _, name=scheduler.name: order.append(name)
            )

    config = SchedulerConfig(max_delay_s=0.001, max_batch=4)
    asyncio.run(
        two_schedulers((flooded, other), config, submit, lambda: len(order) >= 401)
    )
    ahead = order.index("other")
    print(f"the other model's sequence answered after {ahead} of 400 flooded ones")
    assert ahead < 100
