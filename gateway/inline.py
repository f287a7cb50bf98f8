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

import grpc
import numpy as np

from batcher.engines import EnginePool
from batcher.scheduler import ModelScheduler, SchedulerConfig
from batcher.service import describe
from gateway.batcher_client import raise_first_failure, sequences
from services.errors import from_code
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry

log = logging.getLogger("berth.gateway")


class InlineBatcher:
    """Per-model schedulers and an engine pool, behind the gateway's
    batcher interface (gateway.batcher_client.Batching)."""

    def __init__(
        self,
        entries: dict[str, ModelEntry],
        engines: list[str],
        config: SchedulerConfig,
    ) -> None:
        self.pool = EnginePool(engines)
        self.schedulers = {
            name: ModelScheduler(entry, self.pool, config)
            for name, entry in entries.items()
        }
        self._ids = itertools.count(1)
        self.ready = asyncio.Event()
        self.pool.subscribe(self._engines_changed)

    @property
    def connected(self) -> bool:
        """Always: with no engine up, the schedulers refuse with UNAVAILABLE
        (and the gateway falls back) instead of the stream being down."""
        return True

    def _engines_changed(self) -> None:
        """Ready once every model has an engine (the gateway's start-up probe
        waits for it)."""
        if not self.ready.is_set() and all(
            self.pool.serving(name) for name in self.schedulers
        ):
            log.info("every model has an engine: batching inline")
            self.ready.set()

    def start(self) -> None:
        self.pool.start()
        for scheduler in self.schedulers.values():
            scheduler.start()
        log.info(
            "batching inline for %s; engines %s",
            ", ".join(self.schedulers),
            ", ".join(e.address for e in self.pool.engines),
        )

    async def close(self) -> None:
        for scheduler in self.schedulers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await scheduler.drain()
        await self.pool.close()

    async def models(self) -> internal_pb2.BatcherModels:
        return describe(self.schedulers)

    async def run(
        self,
        model: str,
        ids: list[np.ndarray],
        timeout_ms: int,
        trace_context: dict[str, str] | None = None,
    ) -> list[internal_pb2.SequenceResult]:
        """Run every sequence through the model; raises the first failure."""
        scheduler = self.schedulers.get(model)
        if scheduler is None:
            raise from_code(
                grpc.StatusCode.NOT_FOUND.value[0],
                f"no scheduler for model {model!r}",
            )
        keys = [next(self._ids) for _ in ids]
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key in keys}

        def deliver(result: internal_pb2.SequenceResult) -> None:
            future = futures.get(result.id)
            if future is not None and not future.done():
                future.set_result(result)

        queued = scheduler.submit(
            sequences(model, keys, ids, timeout_ms, trace_context), deliver
        )
        try:
            if len(keys) == 1:
                results = [await futures[keys[0]]]
            else:
                results = list(await asyncio.gather(*futures.values()))
        except BaseException:
            # The caller went away or one sequence failed: free the rest.
            for seq_id, key in queued:
                if not futures[seq_id].done() or futures[seq_id].cancelled():
                    scheduler.cancel(key)
            for future in futures.values():
                future.cancel()
            raise
        raise_first_failure(results)
        return results
