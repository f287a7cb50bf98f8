"""Batcher-side connections to engine workers: one long-lived stream each."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.streams import StreamClient

log = logging.getLogger("berth.batcher")


class EngineClient(
    StreamClient[
        internal_pb2.EngineRequest, internal_pb2.BatchResult, internal_pb2.BatchResult
    ]
):
    """One engine: a Run stream multiplexed by batch id, reconnected on loss."""

    def __init__(self, address: str, on_change: Callable[[], None]) -> None:
        super().__init__(address)
        self.models: set[str] = set()
        self.device = ""
        self.in_flight = 0
        self._on_change = on_change
        self._stub = internal_pb2_grpc.EngineStub(self.channel)

    @property
    def healthy(self) -> bool:
        return self.connected

    async def run(self, batch: internal_pb2.Batch) -> internal_pb2.BatchResult:
        """Send one batch and wait for its result."""
        future = self.send(batch.id, internal_pb2.EngineRequest(batch=batch))
        self.in_flight += 1
        try:
            return await future
        finally:
            self.in_flight -= 1

    def cancel(self, batch_id: int) -> None:
        self.post(
            internal_pb2.EngineRequest(cancel=internal_pb2.CancelBatch(id=batch_id))
        )

    async def _handshake(self) -> None:
        info = await self._stub.Info(
            internal_pb2.EngineInfoRequest(), wait_for_ready=True
        )
        self.models = {m.name for m in info.models}
        self.device = f"{info.device} ({info.backend})"

    def _open(self, requests: AsyncIterator[internal_pb2.EngineRequest]) -> Any:
        return self._stub.Run(requests)

    def _items(
        self, message: internal_pb2.BatchResult
    ) -> Iterable[tuple[int, internal_pb2.BatchResult]]:
        return ((message.id, message),)

    def _connection_changed(self, connected: bool, reason: str) -> None:
        if connected:
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

    def __init__(self, addresses: list[str], slots_per_engine: int = 2) -> None:
        # Two slots: one batch computing, one prefetched behind it.
        self.slots = slots_per_engine
        self._listeners: list[Callable[[], None]] = []
        self.engines = [EngineClient(a, self._changed) for a in addresses]
        self._rr = itertools.count()

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    def serving(self, model: str) -> list[EngineClient]:
        return [e for e in self.engines if e.healthy and model in e.models]

    def pick(
        self, model: str, exclude: EngineClient | None = None
    ) -> EngineClient | None:
        """The least-busy healthy engine with a free slot, or None."""
        start = next(self._rr)
        candidates = [
            e
            for e in self.serving(model)
            if e.in_flight < self.slots and e is not exclude
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
