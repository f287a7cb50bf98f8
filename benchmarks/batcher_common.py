"""The batcher benchmark's workload, policy and cores (benchmarks/batcher.py).

Shared by its two parts: core throughput (``batcher_throughput``) and the
simulated engine (``batcher_sim``). Import it after ``benchmarks/batcher.py``
has put the repository root first on ``sys.path`` (run as a file, that file
would otherwise shadow the batcher package).
"""

from __future__ import annotations

import math

import numpy as np

from batcher import _core_py

try:
    from batcher import _core_c
except ImportError:  # reported in the table; the simulation uses the twin
    _core_c = None  # type: ignore[assignment]

# The two cores, for part 1 (both) and part 2 (the Cython one, else the twin).
__all__ = ["_core_c", "_core_py"]

# Workload and policy: the batcher's defaults (SchedulerConfig) with buckets
# every 8 tokens to 64, then coarser (20 buckets; multiples of 8 suit tensor cores).
BUCKETS = [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
BUCKETS += [160, 192, 224, 256, 320, 384, 448, 512]
POW2_BUCKETS = [32, 64, 128, 256, 512]  # the design's default templates
TOKEN_BUDGET, MAX_BATCH, MAX_DELAY_S = 16384, 256, 0.005
POLICY = (BUCKETS, TOKEN_BUDGET, MAX_DELAY_S)
MEDIAN, SIGMA, MIN_LEN, MAX_LEN = 20, 0.9, 3, 512
CHUNK = 64  # sequences per gateway message
# Engine cost model: a BERT-base-class encoder on one GPU (fp16, CUDA graphs),
# about 2 M padded tokens/s: latency = FIXED_S + PER_TOKEN_S * padded tokens.
FIXED_S, PER_TOKEN_S = 0.3e-3, 0.5e-6
ENGINES, IN_FLIGHT = 1, 2  # one running batch plus one prefetched per engine
RATE = 10_000.0  # arrivals per second for the headline numbers
RATES = (5_000.0, RATE, 20_000.0)  # the sweep printed in the table
SIMULATED_ENGINE = (
    f"simulated, not run: a batch takes {FIXED_S * 1e3:.1f} ms + "
    f"{PER_TOKEN_S * 1e6:.2f} us x padded tokens (a cost model of a "
    f"BERT-base-class encoder on one GPU, fp16), {ENGINES} engine, "
    f"{IN_FLIGHT} batches in flight, virtual time"
)
SIMULATED_MEANING = (
    "padding efficiency and queue wait are properties of the batcher (its "
    "policy on this length mix, given when the simulated engine frees up); "
    "done latencies and load come from the cost model, not a real engine"
)


def sample_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Mostly short texts, long tail to 512: lognormal, median 20, clipped."""
    raw = rng.lognormal(math.log(MEDIAN), SIGMA, n)
    return np.clip(np.round(raw), MIN_LEN, MAX_LEN).astype(np.int64)
