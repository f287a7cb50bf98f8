"""A bounded loopback load generator that accounts for every request."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc

TEXTS = [
    "set an alarm for 7 am",
    "what's the weather like today",
    "berth serves encoders over grpc",
    "how do i transfer money to savings",
    "play some jazz",
    "remind me to call mom",
]


@dataclass
class LoadResult:
    """Every request's outcome and the OK latencies."""

    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    degraded: int = 0
    sent: int = 0
    # (perf_counter at send, outcome) of every call
    calls: list[tuple[float, str]] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(self.outcomes.values())

    @property
    def ok_ratio(self) -> float:
        return self.outcomes["OK"] / max(1, self.sent)

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else 0.0

    def summary(self, name: str) -> str:
        return (
            f"{name}: sent {self.sent}, answered {self.answered}, "
            f"lost {self.sent - self.answered}, outcomes {dict(self.outcomes)}, "
            f"degraded {self.degraded}, ok {self.ok_ratio:.5f}, "
            f"p50 {self.p(50) * 1e3:.1f} ms, p99 {self.p(99) * 1e3:.1f} ms"
        )


async def run_load(
    address: str,
    requests: int,
    concurrency: int = 16,
    model: str = "minilm",
    timeout_s: float = 20.0,
    max_duration_s: float = 240.0,
) -> LoadResult:
    """Send ``requests`` single-text Embed calls, ``concurrency`` at a time.

    Every call carries a deadline, so every call ends: OK, an error code, or
    DEADLINE_EXCEEDED; 'lost' = sent minus answered, which must be zero.
    """
    result = LoadResult()
    run = uuid.uuid4().hex[:8]
    counter = iter(range(requests))
    stop_at = time.monotonic() + max_duration_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)

        async def worker() -> None:
            for i in counter:
                if time.monotonic() > stop_at:
                    return
                # Unique texts: the gateway's response cache must not answer.
                text = f"{TEXTS[i % len(TEXTS)]} (request {run}-{i})"
                request = berth_pb2.EmbedRequest(model=model, texts=[text])
                result.sent += 1
                start = time.perf_counter()
                try:
                    reply = await stub.Embed(request, timeout=timeout_s)
                except grpc.aio.AioRpcError as exc:
                    result.outcomes[exc.code().name] += 1
                    result.calls.append((start, exc.code().name))
                    continue
                result.latencies.append(time.perf_counter() - start)
                result.outcomes["OK"] += 1
                result.calls.append((start, "OK"))
                result.degraded += reply.degraded

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


def run_load_while(
    address: str,
    requests: int,
    concurrency: int,
    *events: tuple[float, Callable[[], None]],
    **options: Any,
) -> LoadResult:
    """:func:`run_load`, with each ``(delay, action)`` of ``events`` done
    ``delay`` seconds after the one before it (the first after the load
    starts): a signal to a process, say. ``options`` go to run_load."""

    async def scenario() -> LoadResult:
        load = asyncio.create_task(run_load(address, requests, concurrency, **options))
        for delay, action in events:
            await asyncio.sleep(delay)
            action()
        return await load

    return asyncio.run(scenario())
