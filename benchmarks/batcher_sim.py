"""Part 2 of the batcher benchmark (benchmarks/batcher.py): a SIMULATED engine.

Poisson arrivals and engines simulated in virtual time, not run: no model,
no GPU, no gRPC. A batch takes FIXED_S + PER_TOKEN_S x its padded tokens.
Policies: berth's (its fine buckets or the design's power-of-two templates)
and a FIFO batcher that pads each batch to its longest sequence.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.batcher_common import (
    ENGINES,
    FIXED_S,
    IN_FLIGHT,
    MAX_BATCH,
    MAX_DELAY_S,
    MAX_LEN,
    PER_TOKEN_S,
    POW2_BUCKETS,
    TOKEN_BUDGET,
    _core_c,
    _core_py,
)


class BerthPolicy:
    """berth: per-bucket queues, token budget, max delay, oldest deadline first."""

    def __init__(self, buckets: list[int], lengths: np.ndarray) -> None:
        pow2 = buckets == POW2_BUCKETS
        self.name = f"berth, {len(buckets)} {'templates' if pow2 else 'buckets'}"
        mod = _core_c if _core_c is not None else _core_py
        self.core = mod.BucketCore(
            buckets, TOKEN_BUDGET, MAX_DELAY_S, capacity=1 << 20, max_batch=MAX_BATCH
        )
        self.tokens = {n: array("i", range(n)) for n in range(1, MAX_LEN + 1)}
        self.lengths = lengths

    def push(self, i: int, now: float) -> None:
        self.core.push(i, self.tokens[int(self.lengths[i])], now)

    def form(self, now: float, eager: bool) -> tuple[list[int], int, int] | None:
        batch = self.core.next_batch(now, eager)
        if batch is None:
            return None
        return batch.ids.tolist(), batch.size * batch.length, batch.real_tokens

    def wake_at(self) -> float:
        return self.core.next_deadline()


class FifoPolicy:
    """One FIFO queue; a batch pads to its longest row under the token budget."""

    name = "FIFO, pad to longest"

    def __init__(self, lengths: np.ndarray) -> None:
        self.queue: deque[int] = deque()
        self.lengths = lengths

    def push(self, i: int, now: float) -> None:
        self.queue.append(i)

    def form(self, now: float, eager: bool) -> tuple[list[int], int, int] | None:
        ids: list[int] = []
        longest = real = 0
        while self.queue and len(ids) < MAX_BATCH:
            n = int(self.lengths[self.queue[0]])
            if max(longest, n) * (len(ids) + 1) > TOKEN_BUDGET:
                break
            longest = max(longest, n)
            real += n
            ids.append(self.queue.popleft())
        return (ids, longest * len(ids), real) if ids else None  # greedy, no delay

    def wake_at(self) -> float:
        return math.inf


@dataclass
class SimResult:
    efficiency: float
    wait_p50_ms: float
    wait_p99_ms: float
    done_p99_ms: float
    busy: float
    mean_batch: float


def simulate(policy: Any, arrivals: list[float]) -> SimResult:
    """Event loop in virtual time: arrivals, batch completions, bucket deadlines."""
    n = len(arrivals)
    ends: list[list[float]] = [[] for _ in range(ENGINES)]  # in-flight batch ends
    completions: list[float] = []
    waits, done = np.empty(n), np.empty(n)
    real = padded = batches = 0
    busy = 0.0
    i, t = 0, 0.0
    while True:
        # 1. Arrivals up to now; batches finished by now leave their engine.
        while i < n and arrivals[i] <= t:
            policy.push(i, arrivals[i])
            i += 1
        while completions and completions[0] <= t:
            heapq.heappop(completions)
        for e in range(ENGINES):
            ends[e] = [x for x in ends[e] if x > t]
        # 2. Fill free engine slots: eager for an idle engine, else ready only.
        while True:
            e = min(range(ENGINES), key=lambda k: len(ends[k]))
            if len(ends[e]) >= IN_FLIGHT:
                break
            formed = policy.form(t, eager=not ends[e])
            if formed is None:
                break
            ids, tokens, real_tokens = formed
            start = ends[e][-1] if ends[e] else t
            latency = FIXED_S + PER_TOKEN_S * tokens
            ends[e].append(start + latency)
            heapq.heappush(completions, start + latency)
            for j in ids:
                waits[j] = t - arrivals[j]
                done[j] = start + latency - arrivals[j]
            real, padded, batches = real + real_tokens, padded + tokens, batches + 1
            busy += latency
        # 3. Sleep until the next arrival, completion or bucket deadline.
        wake = [arrivals[i]] if i < n else []
        if completions:
            wake.append(completions[0])
        if any(len(x) < IN_FLIGHT for x in ends):
            wake.append(policy.wake_at())
        t_next = min(wake, default=math.inf)
        if t_next == math.inf:
            break
        t = max(t_next, math.nextafter(t, math.inf))
    return SimResult(
        efficiency=real / padded,
        wait_p50_ms=float(np.percentile(waits, 50)) * 1e3,
        wait_p99_ms=float(np.percentile(waits, 99)) * 1e3,
        done_p99_ms=float(np.percentile(done, 99)) * 1e3,
        busy=busy / (ENGINES * arrivals[-1]),
        mean_batch=n / batches,
    )


def poisson(rate: float, seconds: float, rng: np.random.Generator) -> list[float]:
    gaps = rng.exponential(1 / rate, int(rate * seconds))
    return [float(x) for x in np.cumsum(gaps)]
