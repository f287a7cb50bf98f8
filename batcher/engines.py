"""Batcher-side connections to engine workers: one long-lived stream each."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterable
from typing import Any

import grpc

from batcher import discovery
from services.errors import ENGINE_LOADING
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.streams import StreamClient

log = logging.getLogger("berth.batcher")

MAX_EJECTION_S = 30.0
# How often an engine that is loading its models is asked again whether it
# is done (EngineClient._handshake): one cheap call, five times a second.
LOADING_POLL_S = 0.2
# An engine whose address left DNS takes no new batches; those it holds get
# this long to be answered before its stream is closed, which fails the rest
# over to other engines (Dispatcher._execute re-sends them).
RETIRE_GRACE_S = 5.0


class EngineClient(
    StreamClient[
        internal_pb2.EngineRequest, internal_pb2.BatchResult, internal_pb2.BatchResult
    ]
):
    """One engine: a Run stream multiplexed by batch id, reconnected on loss."""

    def __init__(self, address: str, on_change: Callable[[], None]) -> None:
        super().__init__(address, internal_pb2_grpc.EngineStub)
        self.models: set[str] = set()
        # Per model, as its Info told: (vocabulary size, max tokens), each 0
        # when not told (an engine of an older version).
        self.limits: dict[str, tuple[int, int]] = {}
        self.device = ""
        self.in_flight = 0  # batches assigned to it and not yet settled
        # Ejection: an engine that fails or stalls sits out a growing back-off
        # and is then probed with real batches again.
        self.failures = 0  # in a row, since it last connected or succeeded
        self.ejected_until = 0.0
        # Failures in a row before it last reconnected, whose ejection the
        # reconnect lifted: held against it until it answers a batch
        # (_reconnected).
        self.failures_before_reconnect = 0
        self.gpu_utilization: float | None = None
        self._on_change = on_change

    @property
    def healthy(self) -> bool:
        return self.connected

    @property
    def available(self) -> bool:
        """Connected and not sitting out an ejection."""
        return self.connected and time.monotonic() >= self.ejected_until

    def record_success(self) -> None:
        if self.failures or self.failures_before_reconnect:
            log.info("engine %s answers again: back in rotation", self.address)
        self.failures = 0
        self.failures_before_reconnect = 0

    def record_failure(self, reason: str) -> None:
        """Eject for 0.5 s, 1 s, 2 s ... up to 30 s after each failure in a row.

        Failures a reconnect forgave still count here, until a success: an
        engine that restarts and fails again resumes its back-off instead of
        starting it over at 0.5 s (see :meth:`_reconnected`).

        (The exponent is capped too: an engine failing every probe for hours
        reached 1,025 failures, and 2.0 ** 1024 overflows.)"""
        self.failures += 1
        earlier = self.failures_before_reconnect
        in_a_row = earlier + self.failures
        backoff = min(MAX_EJECTION_S, 0.5 * 2 ** min(in_a_row - 1, 16))
        self.ejected_until = time.monotonic() + backoff
        log.warning(
            "engine %s ejected for %.1f s (%d failures in a row%s): %s",
            self.address,
            backoff,
            in_a_row,
            f", {earlier} of them before it reconnected" if earlier else "",
            reason,
        )
        self._on_change()

    def _reconnected(self) -> None:
        """A new stream is up (its Info answered), most often to a restarted
        engine process: it starts with a clean slate, its failures reset and
        its ejection lifted. (They carried over, and a restarted healthy
        engine sat out the rest of a back-off of up to 30 s earned by the
        process before it.)

        A flapping engine (one that restarts and fails again, over and over)
        must still be kept out, so the slate is clean on probation only: the
        failures it had are kept aside (``failures_before_reconnect``) until
        it answers a batch. A failure before that resumes the back-off where
        it was (:meth:`record_failure`), not at 0.5 s; and while on probation
        a reconnect lifts nothing, so an engine that keeps failing between
        restarts sits out its growing back-off like any failing engine."""
        if self.failures_before_reconnect:  # on probation: no new slate
            self.failures_before_reconnect += self.failures
            self.failures = 0
            if time.monotonic() < self.ejected_until:
                log.warning(
                    "engine %s reconnected, but has failed and answered no "
                    "batch since an earlier reconnect: it stays ejected for "
                    "%.1f s (%d failures in a row)",
                    self.address,
                    self.ejected_until - time.monotonic(),
                    self.failures_before_reconnect,
                )
            return
        if self.failures:
            log.info(
                "engine %s reconnected: back in rotation, its %d failures in a "
                "row held against it until it answers a batch",
                self.address,
                self.failures,
            )
        self.failures_before_reconnect, self.failures = self.failures, 0
        self.ejected_until = 0.0

    def take_slot(self) -> None:
        """Count a batch against this engine now, before its task first runs.

        The scheduler dispatches in a loop without yielding; a slot counted
        only once the batch's task started sending let one pass hand an idle
        engine a batch per ready bucket (8 against 2 slots in
        tests/batcher/test_dispatch.py; 10 on one engine in a 2-core load run),
        and a hedge's engine one more batch than its slots
        (tests/batcher/test_stuck_engine.py)."""
        self.in_flight += 1

    def free_slot(self) -> None:
        self.in_flight -= 1

    async def run(self, batch: internal_pb2.Batch) -> internal_pb2.BatchResult:
        """Send one batch and wait for its result. The caller counts it
        against this engine (:meth:`take_slot`, :meth:`free_slot`)."""
        return await self.send(batch.id, internal_pb2.EngineRequest(batch=batch))

    def cancel(self, batch_id: int) -> None:
        self.post(
            internal_pb2.EngineRequest(cancel=internal_pb2.CancelBatch(id=batch_id))
        )

    async def _handshake(self) -> None:
        """The engine's models and device, once it has loaded them.

        While it loads (seconds on a CPU, minutes of CUDA graph capture on a
        GPU) its Info answers ENGINE_LOADING: it is up, and is asked again
        every LOADING_POLL_S. (Taken as a failed try, the stream's back-off
        grew to 2 s meanwhile, and a ready engine got its first batch up to
        2.4 s late, 1 s on average, at each start and restart; with a
        warning at each.)"""
        told = False
        while True:
            try:
                info = await self._stub.Info(
                    internal_pb2.EngineInfoRequest(), wait_for_ready=True
                )
                break
            except grpc.aio.AioRpcError as exc:
                loading = exc.code() is grpc.StatusCode.UNAVAILABLE
                if not loading or exc.details() != ENGINE_LOADING:
                    raise
            if not told:
                log.info("engine %s is loading its models: waiting", self.address)
                told = True
            await asyncio.sleep(LOADING_POLL_S)
        self.models = {m.name for m in info.models}
        self.limits = {m.name: (m.vocab_size, m.max_tokens) for m in info.models}
        self.device = f"{info.device} ({info.backend})"

    def _open(self, requests: AsyncIterator[internal_pb2.EngineRequest]) -> Any:
        return self._stub.Run(requests)

    def _items(
        self, message: internal_pb2.BatchResult
    ) -> Iterable[tuple[int, internal_pb2.BatchResult]]:
        return ((message.id, message),)

    def _connection_changed(self, connected: bool, reason: str) -> None:
        if connected:
            self._reconnected()
            log.info(
                "engine %s connected: %s on %s",
                self.address,
                ", ".join(sorted(self.models)),
                self.device,
            )
        else:
            log.warning("engine %s disconnected: %s", self.address, reason)
        self._on_change()


class EnginePool:
    """All engines of this batcher; picks where the next batch goes."""

    def __init__(
        self,
        addresses: list[str],
        slots_per_engine: int = 2,
        dns_interval_s: float = 5.0,
    ) -> None:
        """``addresses``: engine addresses, and ``dns:///NAME:PORT`` names
        whose addresses are followed, looked up every ``dns_interval_s``
        (batcher/discovery.py)."""
        # Two slots: one batch computing, one prefetched behind it.
        self.slots = slots_per_engine
        self._listeners: list[Callable[[], None]] = []
        fixed, self._names = discovery.split(addresses)
        if self._names and dns_interval_s <= 0:
            raise ValueError(f"--dns-interval-s is {dns_interval_s}: it must be > 0")
        self._dns_interval_s = dns_interval_s
        self.engines = [EngineClient(a, self._changed) for a in dict.fromkeys(fixed)]
        self._fixed = set(fixed)
        self._found: dict[str, set[str]] = {}  # per DNS name, its addresses
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()  # following, retiring
        self._rr = itertools.count()
        self._batch_ids = itertools.count(1)
        self._turns = itertools.count()  # which listener hears of a change first

    def next_batch_id(self) -> int:
        """An id no other batch of this pool has: every model's batches share
        each engine's one stream, whose answers are matched to batches by id
        (ids counted per model would collide, and a batch would get another
        model's answer)."""
        return next(self._batch_ids)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _changed(self) -> None:
        """Tell every listener, a different one first each time. The models'
        schedulers share the engines' slots, and the one woken first takes a
        freed slot: always waking the same one first would let a model with a
        backlog starve the others (tests/batcher/test_dispatch.py)."""
        listeners = self._listeners
        first = next(self._turns) % len(listeners) if listeners else 0
        for listener in listeners[first:] + listeners[:first]:
            listener()

    def start(self) -> None:
        self._started = True
        for engine in self.engines:
            engine.start()
        if self._names:
            names = self._names
            self._spawn(discovery.follow(names, self._dns_interval_s, self.follow))

    async def close(self) -> None:
        self._started = False
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in self.engines))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    # ---- engines found through DNS -------------------------------------------

    def follow(self, target: str, addresses: set[str]) -> None:
        """``target`` (a ``dns:///`` name) resolves to ``addresses`` now: a
        stream to each new one; each that is gone, unless another name or
        the fixed list still has it, is retired (:meth:`_retire`)."""
        before = self._found.get(target, set())
        if addresses == before:
            return
        self._found[target] = addresses
        wanted = self._fixed.union(*self._found.values())
        have = {engine.address: engine for engine in self.engines}
        added = sorted(addresses - have.keys())
        gone = sorted(a for a in before - addresses if a not in wanted and a in have)
        log.info(
            "%s resolves to %s%s%s",
            target,
            ", ".join(sorted(addresses)),
            f"; new: {', '.join(added)}" if added else "",
            f"; gone: {', '.join(gone)}" if gone else "",
        )
        for address in added:
            engine = EngineClient(address, self._changed)
            self.engines.append(engine)
            if self._started:
                engine.start()
        for address in gone:
            self._retire(have[address])
        self._changed()

    def _retire(self, engine: EngineClient) -> None:
        """Take ``engine`` out of the pool: no new batches; those it holds
        get RETIRE_GRACE_S to finish, then its stream closes and what is
        still on it is re-sent to other engines."""
        self.engines.remove(engine)
        log.info(
            "engine %s retired: no new batches, %d in flight get %.0f s",
            engine.address,
            engine.in_flight,
            RETIRE_GRACE_S,
        )

        async def finish() -> None:
            try:
                deadline = time.monotonic() + RETIRE_GRACE_S
                while engine.in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            finally:
                await engine.close()
            log.info("engine %s closed (retired)", engine.address)

        self._spawn(finish())

    def serving(self, model: str) -> list[EngineClient]:
        """Connected engines that have the model (ejected ones included)."""
        return [e for e in self.engines if e.healthy and model in e.models]

    def limits(self, model: str) -> tuple[int, int]:
        """The model's vocabulary size and max tokens as its connected
        engines told them (the smallest where they differ); 0 for either
        when none told it."""
        vocab = max_tokens = 0
        for engine in self.serving(model):
            told_vocab, told_max = engine.limits.get(model, (0, 0))
            if told_vocab and (not vocab or told_vocab < vocab):
                vocab = told_vocab
            if told_max and (not max_tokens or told_max < max_tokens):
                max_tokens = told_max
        return vocab, max_tokens

    def available(self, model: str) -> list[EngineClient]:
        """Engines taking batches: not ejected, unless every one is.

        Ejection routes around a bad engine while good ones exist; with all
        of them ejected there is nothing to route to, so all are tried (the
        model's circuit breaker is what stops a failing fleet being hammered).
        """
        serving = self.serving(model)
        return [e for e in serving if e.available] or serving

    def pick(
        self,
        model: str,
        exclude: Collection[EngineClient] = (),
        any_slot: bool = False,
    ) -> EngineClient | None:
        """The least-busy available engine with a free slot, or None.

        ``any_slot`` ignores the slot limit (for re-sends, which must go
        somewhere; hedges only take a free slot)."""
        start = next(self._rr)
        candidates = [
            e
            for e in self.available(model)
            if (any_slot or e.in_flight < self.slots) and e not in exclude
        ]
        if not candidates:
            return None
        n = len(self.engines)
        return min(
            candidates,
            key=lambda e: (e.in_flight, (self.engines.index(e) - start) % n),
        )

    def completed(self) -> None:
        """An engine slot freed up."""
        self._changed()


def _log_failure(task: asyncio.Task[None]) -> None:
    """Say why a pool task (following a name, retiring an engine) ended
    with an error: nobody awaits it."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("engine pool task failed", exc_info=exc)
