"""The batcher's work in one process: a scheduler per model over one engine pool.

The batcher process serves it to gateways over their Submit streams
(batcher.service); a gateway that batches inline (``python -m gateway
--engines ...``) feeds it its own requests (gateway.inline), through this
class alone.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping

import grpc

from batcher import metrics
from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.scheduler import ModelScheduler
from batcher.sequences import Deliver, answer_all
from services.proto.berth.v1 import internal_pb2
from services.repository import ModelEntry


class LocalBatcher:
    """Per-model schedulers sharing one pool of engine streams."""

    def __init__(self, pool: EnginePool, schedulers: dict[str, ModelScheduler]) -> None:
        """``schedulers`` by model name, each over ``pool``; :meth:`connect`
        makes both."""
        self._pool = pool
        self.schedulers = schedulers

    @classmethod
    def connect(
        cls,
        entries: Mapping[str, ModelEntry],
        engines: list[str],
        config: SchedulerConfig,
    ) -> LocalBatcher:
        """A scheduler per model entry over a pool of the ``engines``
        (addresses, or ``dns:///NAME:PORT`` names to follow); nothing runs
        before :meth:`start`."""
        pool = EnginePool(engines, dns_interval_s=config.dns_interval_s)
        schedulers = {
            name: ModelScheduler(entry, pool, config) for name, entry in entries.items()
        }
        return cls(pool, schedulers)

    @property
    def models(self) -> list[str]:
        return list(self.schedulers)

    @property
    def engines(self) -> list[str]:
        """The engines' addresses."""
        return [engine.address for engine in self._pool.engines]

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever an engine comes, goes or frees a slot."""
        self._pool.subscribe(listener)

    # ---- life ---------------------------------------------------------------

    def start(self) -> None:
        """Connect to the engines and start every model's scheduler."""
        self._pool.start()
        for name, scheduler in self.schedulers.items():
            scheduler.start()
            # Counted when scraped (on the metrics thread): engines come,
            # go and are ejected without the scheduler hearing of it.
            metrics.ENGINES_HEALTHY.labels(name).set_function(
                functools.partial(self.engines_available, name)
            )

    async def drain(self) -> None:
        """Send everything queued, wait for its answers, then take no more."""
        await asyncio.gather(*(s.drain() for s in self.schedulers.values()))

    async def close(self) -> None:
        """Close the engine streams: what is still running fails (after
        :meth:`drain`, nothing is)."""
        await self._pool.close()

    # ---- state --------------------------------------------------------------

    def serves_all(self) -> bool:
        """Whether every model has an engine connected."""
        return all(self._pool.serving(name) for name in self.schedulers)

    def serves_any(self) -> bool:
        """Whether some model has an engine connected."""
        return any(self._pool.serving(name) for name in self.schedulers)

    def engines_available(self, model: str) -> int:
        """How many engines take ``model``'s batches now."""
        return len(self._pool.available(model))

    def describe(self) -> internal_pb2.BatcherModels:
        """Each model's circuit state and how many engines can take its batches."""
        return internal_pb2.BatcherModels(
            models=[
                internal_pb2.BatcherModel(
                    name=name,
                    state=s.breaker.label,
                    healthy_engines=len(self._pool.available(name)),
                )
                for name, s in self.schedulers.items()
            ]
        )

    def accepts(self, model: str) -> bool:
        """Whether ``model`` has a scheduler here taking work (an engine
        connected, its circuit not open), a slot free or not."""
        scheduler = self.schedulers.get(model)
        return scheduler is not None and scheduler.accepting()

    def can_take(self, model: str) -> bool:
        """Whether a request for ``model`` would be batched at once: it has
        a scheduler taking work, with an engine slot free."""
        return self.accepts(model) and self._pool.pick(model) is not None

    # ---- work ---------------------------------------------------------------

    def submit(
        self, group: internal_pb2.Sequences, deliver: Deliver
    ) -> list[tuple[int, int]]:
        """Queue one request's sequences with its model's scheduler, all or
        none; each is answered through ``deliver``.

        Returns (sequence id, key) pairs, the keys for :meth:`cancel`. What
        is not queued is answered at once: a model not served here
        NOT_FOUND, a malformed entry or refused work as the scheduler says
        (:meth:`batcher.scheduler.ModelScheduler.submit`)."""
        scheduler = self.schedulers.get(group.model)
        if scheduler is None:
            message = f"batcher does not serve model {group.model!r}"
            answer_all(group.ids, grpc.StatusCode.NOT_FOUND, message, deliver)
            return []
        return scheduler.submit(group, deliver)

    def cancel(self, model: str, key: int) -> None:
        """The caller gave up on a queued sequence: drop it if still queued
        (else its answer is dropped on delivery); nobody is answered."""
        self.schedulers[model].cancel(key)
