"""The batcher's schedulers inside the gateway process: one hop fewer.

``python -m gateway --engines A,B`` (``berth serve --batcher-mode inline``)
queues a request's sequences straight into this process's own per-model
schedulers, which stream batches to the engines; there is no batcher process
and no gateway -> batcher stream. Each gateway then batches only its own
traffic, so with several gateways the batches are smaller than one shared
batcher would form; what it saves is a gRPC round trip per request and the
batcher process's CPU (benchmarks/latency.py, benchmarks/e2e.py measure both
modes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import grpc
import numpy as np

from batcher import LocalBatcher, SchedulerConfig
from gateway.batcher_client import BatcherClient, results_of, sequences
from gateway.metrics import ROUTES
from services.errors import DeadlineExceeded, EngineFailure, Unavailable
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry

log = logging.getLogger("berth.gateway")


class InlineBatcher:
    """The batcher's work in this process (batcher.LocalBatcher), behind the
    gateway's batcher interface (gateway.batcher_client.Batching)."""

    def __init__(
        self,
        entries: dict[str, ModelEntry],
        engines: list[str],
        config: SchedulerConfig,
    ) -> None:
        self.local = LocalBatcher.connect(entries, engines, config)
        self._ids = itertools.count(1)
        self.ready = asyncio.Event()
        self.local.subscribe(self._engines_changed)

    @property
    def connected(self) -> bool:
        """Always: with no engine up, the schedulers refuse with UNAVAILABLE
        (and the gateway falls back) instead of the stream being down."""
        return True

    def _engines_changed(self) -> None:
        """Ready once every model has an engine (the gateway's start-up probe
        waits for it)."""
        if not self.ready.is_set() and self.local.serves_all():
            log.info("every model has an engine: batching in this gateway")
            self.ready.set()

    def start(self) -> None:
        self.local.start()
        log.info(
            "batching inline for %s; engines %s",
            ", ".join(self.local.models),
            ", ".join(self.local.engines),
        )

    async def close(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self.local.drain()
        await self.local.close()

    async def models(self) -> internal_pb2.BatcherModels:
        return self.local.describe()

    def any_engine(self) -> bool:
        """Whether some model has an engine connected."""
        return self.local.serves_any()

    def accepts(self, model: str) -> bool:
        """Whether ``model`` has a scheduler here taking work (an engine
        connected, its circuit not open), a slot free or not."""
        return self.local.accepts(model)

    def can_take(self, model: str) -> bool:
        """Whether a request for ``model`` would be batched at once: it has
        a scheduler taking work, with an engine slot free."""
        return self.local.can_take(model)

    async def run(
        self,
        model: str,
        ids: list[np.ndarray],
        timeout_ms: int,
        trace_context: dict[str, str] | None = None,
    ) -> list[internal_pb2.SequenceResult]:
        """Run every sequence through the model; raises the first failure."""
        keys = [next(self._ids) for _ in ids]
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key in keys}

        def deliver(result: internal_pb2.SequenceResult) -> None:
            future = futures.get(result.id)
            if future is not None and not future.done():
                future.set_result(result)

        queued = self.local.submit(
            sequences(model, keys, ids, timeout_ms, trace_context), deliver
        )

        def cancel(left: list[int]) -> None:
            """Free the sequences nobody waits for any more."""
            scheduled = dict(queued)
            for seq_id in left:
                if (key := scheduled.get(seq_id)) is not None:
                    self.local.cancel(model, key)

        return await results_of(keys, list(futures.values()), cancel)


class DirectWhenIdle:
    """The batchers for the load; straight to the engines when idle.

    ``python -m gateway --batcher A --engines B,C --direct-when-idle``
    (``berth serve --batcher-mode hybrid``). A request that finds this
    gateway with nothing else in flight has no one here to be batched with:
    it is queued into the gateway's own schedulers (as when batching
    inline), one hop fewer. Every other request goes to the batcher process,
    where the gateways' traffic is batched together. At low load nearly
    every request goes direct; under load nearly none does, so the engines
    get the batchers' large batches, not many small ones from each gateway
    (which is what costs inline batching its throughput).

    While the batcher is connected it is the authority on the models'
    state: readiness and the circuits are its. A direct attempt that finds
    no engine or fails on one is sent through the batcher (which hedges and
    re-sends in its own way) with what is left of its deadline, so going
    direct never loses a request that the batcher would have answered.

    While the batcher is unreachable (it crashed; `berth serve` restarts it
    in seconds) every request goes straight to the engines, and a request
    the batcher's stream took down with it is sent there again: the gateway
    batches inline until the batcher is back, instead of answering from the
    CPU fallback.
    """

    def __init__(self, batcher: BatcherClient, direct: InlineBatcher) -> None:
        self.batcher = batcher
        self.direct = direct
        self.ready = batcher.ready
        self.in_flight = 0
        self._batcher_lost = False  # (its first connection changes no route)
        batcher.listeners.append(self._batcher_changed)

    @property
    def connected(self) -> bool:
        """Requests can reach an engine: through the batcher, or directly."""
        return self.batcher.connected or self.direct.any_engine()

    def start(self) -> None:
        self.batcher.start()
        self.direct.start()

    async def close(self) -> None:
        await self.direct.close()
        await self.batcher.close()

    async def models(self) -> internal_pb2.BatcherModels:
        """The batcher's view of the models; the gateway's own schedulers'
        while the batcher is unreachable."""
        if self.batcher.connected:
            with contextlib.suppress(grpc.aio.AioRpcError):
                return await self.batcher.models()
        return await self.direct.models()

    async def run(
        self,
        model: str,
        ids: list[np.ndarray],
        timeout_ms: int,
        trace_context: dict[str, str] | None = None,
    ) -> list[internal_pb2.SequenceResult]:
        """Run every sequence through the model; raises the first failure."""
        if not self.batcher.connected:
            ROUTES.labels(model, "direct_batcher_down").inc()
            return await self.direct.run(model, ids, timeout_ms, trace_context)
        direct = self.in_flight == 0 and self.direct.can_take(model)
        ROUTES.labels(model, "direct" if direct else "batcher").inc()
        began = time.monotonic()
        self.in_flight += 1
        try:
            if direct:
                try:
                    return await self.direct.run(model, ids, timeout_ms, trace_context)
                except (Unavailable, EngineFailure) as exc:
                    ROUTES.labels(model, "retried").inc()
                    log.info(
                        "a direct batch of %s failed (%s): sent via the batcher",
                        model,
                        exc,
                    )
                    timeout_ms = deadline_left(timeout_ms, began, model, exc)
            try:
                return await self.batcher.run(model, ids, timeout_ms, trace_context)
            except Unavailable as exc:
                if self.batcher.connected or not self.direct.accepts(model):
                    raise  # (the batcher's own answer, or no engine either)
                # The batcher's stream went down with this request on it.
                ROUTES.labels(model, "direct_batcher_down").inc()
                timeout_ms = deadline_left(timeout_ms, began, model, exc)
                return await self.direct.run(model, ids, timeout_ms, trace_context)
        finally:
            self.in_flight -= 1

    def _batcher_changed(self, connected: bool) -> None:
        """Say when the route changes because the batcher came or went."""
        if not connected:
            self._batcher_lost = True
            log.warning(
                "batcher unreachable: every request goes straight to the "
                "engines until it is back"
            )
        elif self._batcher_lost:
            self._batcher_lost = False
            log.info("batcher connected: requests go through it again")


def deadline_left(timeout_ms: int, began: float, model: str, exc: Exception) -> int:
    """What is left of a request's deadline (0: none) for a second try;
    DeadlineExceeded when nothing is."""
    if not timeout_ms:
        return 0
    spent_ms = int((time.monotonic() - began) * 1000)
    if spent_ms >= timeout_ms:
        raise DeadlineExceeded(
            f"deadline passed while {model!r} was tried ({exc})"
        ) from exc
    return timeout_ms - spent_ms
