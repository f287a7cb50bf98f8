"""AdaptiveSizer against a simulated engine with a known cost model."""

from __future__ import annotations

import logging
import math
from collections import Counter, deque

import pytest

from batcher._core_py import BucketCore
from batcher.adaptive import AdaptiveSizer

BUCKET, LENGTH = 2, 128  # buckets 32/64/128/256; bucket 2 is 128 tokens long
TARGET = 0.050


class SimEngine:
    """Latency = a + b * batch * length; utilization rises with batch size."""

    def __init__(self, a: float = 0.002, b: float = 5e-6, half: float = 24.0) -> None:
        self.a, self.b, self.half = a, b, half

    def latency(self, n: int) -> float:
        return self.a + self.b * n * LENGTH

    def utilization(self, n: int) -> float:
        return 100.0 * n / (n + self.half)

    def best(self) -> int:
        """Largest batch that meets the latency target."""
        return math.floor((TARGET - self.a) / (self.b * LENGTH))


def make() -> tuple[BucketCore, AdaptiveSizer]:
    core = BucketCore([32, 64, 128, 256], token_budget=65536, max_delay_s=0.005)
    return core, AdaptiveSizer(core, latency_target_s=TARGET, model="m")


def drive(
    core: BucketCore,
    sizer: AdaptiveSizer,
    engine: SimEngine,
    reports: int,
    gpu: bool = True,
) -> list[int]:
    """Full batches at the current target (a loaded server); sizes seen."""
    sizes = []
    for _ in range(reports):
        n = core.batch_size(BUCKET)
        util = engine.utilization(n) if gpu else None
        sizer.report(BUCKET, n, engine.latency(n), util)
        sizes.append(n)
    return sizes


def drive_pipelined(
    core: BucketCore, sizer: AdaptiveSizer, engine: SimEngine, reports: int, lag: int
) -> list[int]:
    """As ``drive``, but each batch reports ``lag`` batches after it was
    formed, as on a loaded server: each engine holds a second batch, formed
    at the target of its time, while it computes one (one engine: lag 1;
    two: 3)."""
    sizes = []
    in_flight: deque[int] = deque()
    for _ in range(reports):
        n = core.batch_size(BUCKET)
        in_flight.append(n)
        sizes.append(n)
        if len(in_flight) > lag:
            m = in_flight.popleft()
            sizer.report(BUCKET, m, engine.latency(m), engine.utilization(m))
    return sizes


def settled(sizes: list[int], best: int) -> float:
    """Share of reports within one x1.25 step below the best size."""
    return sum(best / 1.25 <= n <= best for n in sizes) / len(sizes)


def test_converges_to_largest_size_meeting_latency_target() -> None:
    core, sizer = make()
    engine = SimEngine()
    best = engine.best()  # 75 rows
    assert core.batch_size(BUCKET) == 256  # starts at the budget's max
    drive(core, sizer, engine, 300)
    tail = drive(core, sizer, engine, 400)
    assert settled(tail, best) >= 0.95
    assert Counter(tail).most_common(1)[0][0] == best
    misses = sum(engine.latency(n) > TARGET for n in tail)
    assert misses <= 0.03 * len(tail)  # only the occasional probe of the ceiling


def test_shrinks_when_the_engine_gets_slower() -> None:
    core, sizer = make()
    engine = SimEngine()
    drive(core, sizer, engine, 400)
    slow = SimEngine(b=10e-6)
    drive(core, sizer, slow, 200)
    tail = drive(core, sizer, slow, 400)
    assert slow.best() == 37
    assert settled(tail, slow.best()) >= 0.95


def test_grows_back_when_the_engine_gets_faster() -> None:
    core, sizer = make()
    drive(core, sizer, SimEngine(b=10e-6), 400)
    engine = SimEngine()
    drive(core, sizer, engine, 1500)  # probes of the old ceiling back off
    tail = drive(core, sizer, engine, 400)
    assert settled(tail, engine.best()) >= 0.9


@pytest.mark.parametrize(
    ("lag", "b"),
    [(1, 5e-6), (3, 10e-6), (5, 5e-6)],
    ids=["one-engine", "two-engines", "three-engines"],
)
def test_batches_formed_before_a_size_change_do_not_unsettle_it(
    lag: int, b: float
) -> None:
    """Batches still in flight when the size changes report the old size.
    Counted for the new one, a batch of a missing size would make the size
    just shrunk look slow: the known-good size would be forgotten and the
    size would swing around the best (59 <-> 93 around 75, one engine);
    smaller ones from before a growth would make a size that misses look
    good."""
    core, sizer = make()
    engine = SimEngine(b=b)
    best = engine.best()
    drive_pipelined(core, sizer, engine, 600, lag)
    tail = drive_pipelined(core, sizer, engine, 1000, lag)
    assert settled(tail, best) >= 0.95
    assert max(tail) <= best + 1  # only probes of the ceiling miss
    assert Counter(tail).most_common(1)[0][0] == best


def test_stops_growing_when_the_gpu_is_busy() -> None:
    core, sizer = make()
    core.set_batch_size(BUCKET, 1)
    engine = SimEngine(half=8.0)  # 85 % busy from 46 rows: before latency binds
    sizes = drive(core, sizer, engine, 400)
    final = sizes[-1]
    assert engine.utilization(final) >= 85 > engine.utilization(math.ceil(final / 1.25))
    assert engine.latency(final) <= TARGET
    assert len(set(sizes[-200:])) == 1  # settled, no oscillation


def test_cpu_grows_only_under_80_percent_of_target() -> None:
    core, sizer = make()
    core.set_batch_size(BUCKET, 1)
    engine = SimEngine()
    sizes = drive(core, sizer, engine, 400, gpu=False)
    final = sizes[-1]
    assert engine.latency(final) >= 0.8 * TARGET > engine.latency(sizes[-200 - 1] - 1)
    assert engine.latency(final) <= TARGET
    assert len(set(sizes[-200:])) == 1


def test_partial_batches_do_not_grow_the_target() -> None:
    core, sizer = make()
    core.set_batch_size(BUCKET, 10)
    for _ in range(100):  # light load: batches of 3 rows, fast, GPU idle
        sizer.report(BUCKET, 3, 0.003, 5.0)
    assert core.batch_size(BUCKET) == 10


def test_decides_at_most_once_per_window_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, sizer = make()
    engine = SimEngine()
    with caplog.at_level(logging.INFO, logger="berth.batcher"):
        sizes = drive(core, sizer, engine, 200)
    changes = sum(a != b for a, b in zip(sizes, sizes[1:], strict=False))
    assert 0 < changes <= len(sizes) // sizer.window
    assert len(caplog.records) == changes
    assert "m bucket 2: batch size 256 -> 204" in caplog.records[0].getMessage()


def test_per_bucket_targets_and_validation() -> None:
    core = BucketCore([32, 64], token_budget=4096, max_delay_s=0.005)
    sizer = AdaptiveSizer(core, latency_target_s=[0.01, 0.02])
    assert sizer.targets == [0.01, 0.02]
    with pytest.raises(ValueError):
        AdaptiveSizer(core, latency_target_s=[0.01])
    with pytest.raises(ValueError):
        AdaptiveSizer(core, latency_target_s=0.0)
    with pytest.raises(ValueError):
        AdaptiveSizer(core, grow=1.0)


def test_a_new_ceiling_starts_its_stuck_count_afresh() -> None:
    """Windows stuck under one ceiling say nothing of the next: a ceiling set
    lower (the engine got slower) is probed after ``probe_after`` windows
    settled under it, not after the windows the old one had left. (Carried
    over, the count would have the new ceiling probed at once: one more
    batch over the target.)

    An engine meets the target below 40 rows and misses it from 40: the
    size settles at 39 under a ceiling of 40, three windows of four stuck.
    Then it slows, meeting it only below 30: a miss at 39 sets a new ceiling,
    and the size settles at 29 under a ceiling of 30."""
    core = BucketCore([32, 64, 128, 256], token_budget=65536, max_delay_s=0.005)
    sizer = AdaptiveSizer(core, latency_target_s=TARGET, window=1, probe_after=4)
    core.set_batch_size(BUCKET, 10)
    limit = 40

    def window() -> int:
        """One window (one report): a full batch at the size, GPU idle."""
        n = core.batch_size(BUCKET)
        latency = TARGET * (10 if n >= limit else 0.5)
        sizer.report(BUCKET, n, latency, 10.0)
        return n

    sizes = [window() for _ in range(15)]
    assert sizes[-4:] == [40, 39, 39, 39], sizes  # the 4th at 39 would probe 40
    assert sizer._buckets[BUCKET].stuck == 3
    limit = 30
    sizes = [window() for _ in range(12)]
    # 39 misses (a new ceiling), 31 misses, then it grows back under 31 and
    # probes 30, which misses: settled at 29 under the ceiling of 30.
    assert sizes[:6] == [39, 31, 24, 27, 29, 30], sizes
    assert sizes[6:] == [29, 29, 29, 29, 30, 29], "30 probed too soon"
