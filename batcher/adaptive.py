"""Adaptive batch size: tunes each bucket's target from what engines report.

Policy, per bucket, decided at most once every ``window`` reports on an EWMA
of the reported latency and GPU utilization:

* miss: latency above the bucket's target -> shrink, back to the largest size
  known to meet the target, else by ``shrink`` (x0.8, min 1). The size that
  missed becomes a ceiling.
* grow: latency within target, the GPU idles more than 15 % (utilization
  below ``idle_utilization``) and most batches of the window were full (the
  target is what limits them) -> grow by ``grow`` (x1.25, at least +1), but
  only half way to a known ceiling, so the size settles just under it instead
  of oscillating across it.
* CPU engines report no utilization: they grow only while latency stays
  under ``target x cpu_headroom`` (0.8), as latency is the only load signal.
* a ceiling is probed again after ``probe_after`` windows stuck under it
  (doubling after each failed probe), so a faster engine is noticed.
* batches formed before the last size change (in flight when it was made)
  measured the old size and are not counted: one larger than the size, and
  after a growth any smaller one until the first of the new size reports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger("berth.batcher")


class SizedCore(Protocol):
    """The part of ``BucketCore`` the sizer drives."""

    def batch_size(self, bucket: int) -> int: ...
    def set_batch_size(self, bucket: int, size: int) -> int: ...
    def max_batch_size(self, bucket: int) -> int: ...
    def stats(self) -> list[dict[str, Any]]: ...


class _Bucket:
    """Smoothed reports and search bounds of one bucket."""

    __slots__ = (
        "latency",
        "utilization",
        "fresh",
        "grown",
        "reports",
        "full",
        "known_good",
        "ceiling",
        "stuck",
        "probe_after",
    )

    def __init__(self, probe_after: int) -> None:
        self.latency = 0.0  # EWMA of latency_s
        self.utilization: float | None = None  # EWMA; None while no reading
        self.fresh = True  # restart the EWMAs at the next report
        self.grown = False  # grew: no batch of the new size reported yet
        self.reports = 0  # since the last decision
        self.full = 0  # reports of full batches since the last decision
        self.known_good = 0  # largest size that met the target (0: none)
        self.ceiling = math.inf  # smallest size that missed the target
        self.stuck = 0  # windows spent just under this ceiling (0 when it is set)
        self.probe_after = probe_after


class AdaptiveSizer:
    """Adapts one model's per-bucket batch sizes to engine latency and load."""

    def __init__(
        self,
        core: SizedCore,
        latency_target_s: float | Sequence[float] = 0.050,
        *,
        idle_utilization: float = 85.0,
        cpu_headroom: float = 0.8,
        grow: float = 1.25,
        shrink: float = 0.8,
        alpha: float = 0.3,
        window: int = 4,
        probe_after: int = 8,
        model: str = "",
    ) -> None:
        n = len(core.stats())
        if isinstance(latency_target_s, int | float):
            targets = [float(latency_target_s)] * n
        else:
            targets = [float(t) for t in latency_target_s]
        if len(targets) != n or any(not t > 0 for t in targets):
            raise ValueError("latency_target_s: one positive value, or one per bucket")
        if not (grow > 1 and 0 < shrink < 1 and 0 < alpha <= 1 and window >= 1):
            raise ValueError(
                "need grow > 1, 0 < shrink < 1, 0 < alpha <= 1, window >= 1"
            )
        self.core = core
        self.targets = targets
        self.idle_utilization = idle_utilization
        self.cpu_headroom = cpu_headroom
        self.grow = grow
        self.shrink = shrink
        self.alpha = alpha
        self.window = window
        self.model = model
        self._probe_after = probe_after
        self._buckets = [_Bucket(probe_after) for _ in range(n)]

    def report(
        self,
        bucket: int,
        batch_size: int,
        latency_s: float,
        gpu_utilization: float | None = None,
    ) -> int:
        """Record one batch's result; return the bucket's (possibly new) size."""
        state = self._buckets[bucket]
        size = self.core.batch_size(bucket)
        # 0. Skip a batch formed before the last change: larger than the size,
        # it was formed before a shrink (the core forms none larger).
        if batch_size > size or (state.grown and batch_size < size):
            return size
        state.grown = False
        # 1. Smooth; the first report after a size change restarts the EWMA.
        a = 1.0 if state.fresh else self.alpha
        state.latency += a * (latency_s - state.latency)
        if gpu_utilization is None:
            state.utilization = None
        elif state.utilization is None or state.fresh:
            state.utilization = gpu_utilization
        else:
            state.utilization += a * (gpu_utilization - state.utilization)
        state.fresh = False
        state.reports += 1
        state.full += batch_size >= size
        if state.reports < self.window:
            return size
        # 2. Decide once per window.
        new = self._decide(bucket, state, size)
        state.reports = state.full = 0
        if new != size:
            new = self.core.set_batch_size(bucket, new)
            state.fresh = True  # the next window measures the new size only
            state.grown = new > size
            log.info(
                "%sbucket %d: batch size %d -> %d (latency %.1f ms, target %.1f ms, "
                "gpu %s)",
                f"{self.model} " if self.model else "",
                bucket,
                size,
                new,
                state.latency * 1e3,
                self.targets[bucket] * 1e3,
                "n/a" if state.utilization is None else f"{state.utilization:.0f}%",
            )
        return new

    def _decide(self, bucket: int, state: _Bucket, size: int) -> int:
        target = self.targets[bucket]
        if state.latency > target:  # miss: shrink
            if state.known_good >= size:  # the engine got slower: forget it
                state.known_good = 0
            # A new ceiling: windows stuck under the old one say nothing about
            # it (they made a ceiling set lower by a slower engine be probed
            # after a window or two, not ``probe_after``).
            state.ceiling = size
            state.stuck = 0
            if state.known_good:
                return state.known_good
            return max(1, math.floor(size * self.shrink))
        state.known_good = max(state.known_good, size)
        if state.ceiling <= size:  # met at or above an old ceiling: it is stale
            state.ceiling = math.inf
            state.stuck = 0
            state.probe_after = self._probe_after
        if not self._may_grow(state, target) or 2 * state.full < self.window:
            return size
        limit = self.core.max_batch_size(bucket)
        new = min(limit, max(size + 1, math.ceil(size * self.grow)))
        if state.ceiling < math.inf:
            new = min(new, (size + int(state.ceiling)) // 2)
            if new <= size:  # settled just under the ceiling
                state.stuck += 1
                if state.stuck < state.probe_after:
                    return size
                state.stuck = 0  # probe: try the ceiling again
                state.probe_after = min(8 * self._probe_after, 2 * state.probe_after)
                new = int(state.ceiling)
        return new

    def _may_grow(self, state: _Bucket, target: float) -> bool:
        if state.utilization is None:  # CPU: latency is the only load signal
            return state.latency < target * self.cpu_headroom
        return state.utilization < self.idle_utilization
