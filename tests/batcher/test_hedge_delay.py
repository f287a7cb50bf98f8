"""The hedge delay follows the bucket's recent p95, recomputed every few batches."""

from __future__ import annotations

import asyncio

from batcher.dispatch import P95_EVERY
from batcher.engines import EnginePool
from batcher.options import SchedulerConfig
from batcher.scheduler import ModelScheduler
from services.repository import ModelEntry


def test_hedge_delay_tracks_the_p95_without_recomputing_it_per_batch() -> None:
    async def scenario() -> list[float]:
        entry = ModelEntry(name="m", task="embed", checkpoint="", buckets=[16, 32])
        config = SchedulerConfig(hedge_p95=True, hedge_delay_s=0.05)
        dispatcher = ModelScheduler(entry, EnginePool([]), config).dispatcher
        seen = [dispatcher.hedge_delay(0)]  # too few latencies: the floor
        for _ in range(20):
            dispatcher.record_latency(0, 0.2)
        seen.append(dispatcher.hedge_delay(0))  # p95 of 0.2 s batches
        for _ in range(P95_EVERY - 1):
            dispatcher.record_latency(0, 1.0)
        seen.append(dispatcher.hedge_delay(0))  # not recomputed yet
        dispatcher.record_latency(0, 1.0)
        seen.append(dispatcher.hedge_delay(0))  # now it is
        seen.append(dispatcher.hedge_delay(1))  # another bucket: its own
        return seen

    floor, first, cached, fresh, other = asyncio.run(scenario())
    assert floor == 0.05 and first == 0.2 and cached == 0.2
    assert fresh == 1.0  # 16 of 36 recent batches took 1 s
    assert other == 0.05
