"""Batcher benchmark: core throughput, padding efficiency and simulated queue wait.

Run: ``python -m benchmarks.batcher [--quick]`` (or ``python benchmarks/batcher.py``).
Prints a table, then one JSON line (the last line) with the headline numbers.

1. Throughput: sequences arrive in messages of 64 (one gateway message, one
   arrival time) and go in through one ``push_many`` per message (as the
   service queues a request's texts), then ``next_batch`` is called until it
   returns None; this is bucketing + batching + packing, the core's whole job.
   The same with one ``push`` per sequence is timed too. The Python twin runs
   on fewer sequences; rates are compared per sequence.
2. Padding efficiency and queue wait: Poisson arrivals and engines simulated
   in virtual time, for berth's policy with its fine buckets and with the
   design's default power-of-two templates, and for a FIFO batcher that pads
   each batch to its longest sequence under the same token budget (how
   Triton's dynamic batcher and text-embeddings-inference batch).

The engine in part 2 is simulated, not run: no model, no GPU, no gRPC. A
batch takes the time of a fixed cost model, FIXED_S + PER_TOKEN_S x its
padded tokens (0.3 ms + 0.5 us a padded token: a BERT-base-class encoder on
one GPU in fp16, about 2 M padded tokens/s), in virtual time. So padding
efficiency and queue wait are properties of the batcher (its policy on this
length mix; the engine enters only through when it is free to take the next
batch, here as the cost model says), while the "done" latencies and the load
are the cost model's, not a real engine's latencies. Latencies of the served
stack are ``benchmarks/e2e.py``'s. Part 1 is measured for real, in CPU time.

``--out FILE`` also writes the results as JSON; the committed run is
``benchmarks/results/batcher_simulated_engine_cpu.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # measure on one core
if not __package__:  # run as a file: this file must not shadow the batcher package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402

from batcher import _core_py  # noqa: E402

try:
    from batcher import _core_c
except ImportError:  # reported in the table; the simulation uses the twin
    _core_c = None  # type: ignore[assignment]

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


# ---- 1. throughput ----------------------------------------------------------


def run_core(make: Callable[[], Any], pool: list[array[int]], n: int) -> float:
    """Seconds to push ``n`` sequences and drain every batch."""
    core = make()
    push, next_batch = core.push, core.next_batch
    p = len(pool)
    rows = 0
    start = time.thread_time()
    for first in range(0, n, CHUNK):
        now = first * 1e-6  # 1 M sequences/s of virtual arrival time
        offset = first % p
        ids = range(first, min(first + CHUNK, n))
        for seq_id, tokens in zip(ids, pool[offset : offset + len(ids)], strict=True):
            push(seq_id, tokens, now)
        while (batch := next_batch(now)) is not None:
            rows += batch.size
    while (batch := next_batch(n * 1e-6 + 1.0, True)) is not None:
        rows += batch.size
    elapsed = time.thread_time() - start
    assert rows == n, (rows, n)
    return elapsed


# A push_many message: all tokens back to back, n + 1 offsets.
Message = tuple["array[int]", memoryview]


def pack_messages(pool: list[array[int]]) -> list[Message]:
    """The pool as ``push_many`` messages of CHUNK sequences (tokens, offsets)."""
    messages = []
    for first in range(0, len(pool), CHUNK):
        tokens, offsets = array("i"), array("q", [0])
        for seq in pool[first : first + CHUNK]:
            tokens.extend(seq)
            offsets.append(len(tokens))
        messages.append((tokens, memoryview(offsets)))
    return messages


def run_core_many(make: Callable[[], Any], messages: list[Message], n: int) -> float:
    """Seconds to push ``n`` sequences, one ``push_many`` per message, and drain."""
    core = make()
    push_many, next_batch = core.push_many, core.next_batch
    ids = memoryview(array("Q", range(n)))  # the message's ids, as the service's
    m = len(messages)
    rows = 0
    start = time.thread_time()
    for k, first in enumerate(range(0, n, CHUNK)):
        now = first * 1e-6  # 1 M sequences/s of virtual arrival time
        tokens, offsets = messages[k % m]
        count = min(CHUNK, n - first)
        if count < CHUNK:
            offsets = offsets[: count + 1]
        push_many(ids[first : first + count], tokens, offsets, now)
        while (batch := next_batch(now)) is not None:
            rows += batch.size
    while (batch := next_batch(n * 1e-6 + 1.0, True)) is not None:
        rows += batch.size
    elapsed = time.thread_time() - start
    assert rows == n, (rows, n)
    return elapsed


def run_loop_only(pool: list[array[int]], n: int) -> float:
    """Seconds the benchmark's own loop takes with no core call in it."""
    p = len(pool)
    start = time.thread_time()
    for first in range(0, n, CHUNK):
        offset = first % p
        ids = range(first, min(first + CHUNK, n))
        for _seq_id, _tokens in zip(ids, pool[offset : offset + len(ids)], strict=True):
            pass
    return time.thread_time() - start


def throughput(quick: bool, rng: np.random.Generator) -> dict[str, float]:
    """Best of a few interleaved runs (ns per sequence), so load hits both alike."""
    pool = [array("i", range(int(n))) for n in sample_lengths(8192, rng)]
    messages = pack_messages(pool)
    n_c = 200_000 if quick else 1_000_000
    n_py = 20_000 if quick else 100_000
    best: dict[str, float] = {}

    def keep(key: str, seconds: float, n: int) -> None:
        best[key] = min(best.get(key, math.inf), seconds * 1e9 / n)

    def py() -> Any:
        return _core_py.BucketCore(*POLICY)

    def c() -> Any:
        return _core_c.BucketCore(*POLICY)

    for _ in range(2 if quick else 5):
        keep("py_many_ns", run_core_many(py, messages, n_py), n_py)
        keep("py_ns", run_core(py, pool, n_py), n_py)
        keep("loop_ns", run_loop_only(pool, n_c), n_c)
        if _core_c is not None:
            keep("c_many_ns", run_core_many(c, messages, n_c), n_c)
            keep("c_ns", run_core(c, pool, n_c), n_c)
    return best | {"n_c": n_c, "n_py": n_py}


# ---- 2. simulation -----------------------------------------------------------


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


# ---- report -----------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The CPU part 1 ran on (part 2 runs in virtual time)."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "cython_core": _core_c is not None,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument(
        "--out",
        type=Path,
        help="also write the results as JSON here (the committed run: "
        "benchmarks/results/batcher_simulated_engine_cpu.json)",
    )
    args = parser.parse_args()
    info = machine()
    rng = np.random.default_rng(2024)
    seconds = 0.5 if args.quick else 2.0
    probe = sample_lengths(1_000_000, rng)

    print(f"berth batcher benchmark{' (--quick)' if args.quick else ''}")
    print(
        f"lengths: lognormal, median {MEDIAN} tokens, sigma {SIGMA}, clipped to "
        f"[{MIN_LEN}, {MAX_LEN}] (mean {probe.mean():.1f}, p99 "
        f"{np.percentile(probe, 99):.0f})"
    )
    print(
        f"policy: {len(BUCKETS)} buckets {BUCKETS[0]}..{BUCKETS[-1]} (step 8 to 64, "
        f"then coarser); token budget {TOKEN_BUDGET}; max batch {MAX_BATCH}; "
        f"max delay {MAX_DELAY_S * 1e3:.0f} ms"
    )

    tp = throughput(args.quick, rng)
    print(
        f"\n1. core throughput: messages of {CHUNK} sequences, each queued with one "
        "push_many\n   (or one push per sequence), then next_batch until None; "
        "best of interleaved\n   runs, timed in CPU time of this thread (one core)"
    )
    print(f"   {'core':<8}{'API':<11}{'sequences':>11}{'ns/seq':>9}{'seq/s':>14}")
    table = []
    for api, key in (("push_many", "many_ns"), ("push", "ns")):
        if f"c_{key}" in tp:
            table.append(("cython", api, tp["n_c"], tp[f"c_{key}"]))
        table.append(("python", api, tp["n_py"], tp[f"py_{key}"]))
    for core, api, n, ns in table:
        print(f"   {core:<8}{api:<11}{n:>11,}{ns:>9.0f}{1e9 / ns:>14,.0f}")
    ratio = ratio_push = core_rate = None
    if "c_ns" in tp:
        ratio = tp["py_many_ns"] / tp["c_many_ns"]
        ratio_push = tp["py_ns"] / tp["c_ns"]
        core_rate = 1e9 / tp["c_many_ns"]
        net = (tp["py_ns"] - tp["loop_ns"]) / (tp["c_ns"] - tp["loop_ns"])
        print(
            f"   cython / python, per sequence, end to end (the twin ran "
            f"{tp['n_py']:,} sequences):\n     push_many: {ratio:.1f}x (the JSON "
            f"line's cython_vs_python and core_seq_per_s)\n     push:      "
            f"{ratio_push:.1f}x; {net:.1f}x without the benchmark loop's own "
            f"{tp['loop_ns']:.0f} ns/seq (iterating the messages)"
        )
    else:
        print("   cython core not built: build it to measure (cythonize -i ...)")

    print(
        f"\n2. simulated serving, SIMULATED ENGINE (a cost model; no model, GPU "
        f"or gRPC runs),\n   virtual time: Poisson arrivals, {ENGINES} engine, "
        f"latency = {FIXED_S * 1e3:.1f} ms + {PER_TOKEN_S * 1e6:.2f} us x padded "
        f"tokens,\n   {IN_FLIGHT} batches in flight per engine (1 running + 1 "
        f"prefetched); wait = arrival -> batch formed; done = -> batch finished;"
        f"\n   load = engine work / time (an idle engine always takes a batch, so "
        f"about 1; above 1 the queue grows without bound)"
    )
    header = (
        f"   {'arrivals/s':>10}  {'policy':<22}{'efficiency':>11}{'wait p50':>11}"
        f"{'wait p99':>11}{'done p99':>11}{'rows/batch':>11}{'load':>6}"
    )
    print(header)
    headline: dict[str, SimResult] = {}
    rows: list[dict[str, Any]] = []
    for rate in RATES:
        arrivals = poisson(rate, seconds, rng)
        lengths = sample_lengths(len(arrivals), rng)
        policies: dict[str, BerthPolicy | FifoPolicy] = {
            "berth": BerthPolicy(BUCKETS, lengths),
            "pow2": BerthPolicy(POW2_BUCKETS, lengths),
            "fifo": FifoPolicy(lengths),
        }
        for key, policy in policies.items():
            r = simulate(policy, arrivals)
            if rate == RATE:
                headline[key] = r
            named = {"busy": "load", "mean_batch": "rows_per_batch"}  # the table's
            rows.append(
                {"arrivals_per_s": rate, "policy": policy.name}
                | {named.get(k, k): round(v, 3) for k, v in asdict(r).items()}
            )
            print(
                f"   {rate:>10,.0f}  {policy.name:<22}{r.efficiency:>11.3f}"
                f"{r.wait_p50_ms:>9.2f}ms{r.wait_p99_ms:>9.2f}ms"
                f"{r.done_p99_ms:>9.2f}ms{r.mean_batch:>11.1f}{r.busy:>6.2f}"
            )
    berth, pow2, fifo = headline["berth"], headline["pow2"], headline["fifo"]
    print(
        f"   buckets: {len(BUCKETS)} = {BUCKETS[0]}..{BUCKETS[-1]} as above; "
        f"templates: the design's default {POW2_BUCKETS}"
    )
    print(
        f"   headline: {RATE:,.0f} arrivals/s: efficiency {berth.efficiency:.3f} "
        f"with the {len(BUCKETS)} buckets, {pow2.efficiency:.3f} with the "
        f"{len(POW2_BUCKETS)} templates, {fifo.efficiency:.3f} FIFO"
    )
    print(
        "   the engine is simulated: efficiency and wait are properties of the "
        "batcher\n   (its policy on this mix, given when the cost model frees "
        "the engine); done and\n   load are the cost model's, not a real "
        "engine's latencies (served: benchmarks/e2e.py)"
    )
    line = {
        "cython_vs_python": None if ratio is None else round(ratio, 1),
        "core_seq_per_s": None if core_rate is None else round(core_rate),
        "cython_vs_python_push": (None if ratio_push is None else round(ratio_push, 1)),
        "padding_efficiency": round(berth.efficiency, 3),
        "templates_padding_efficiency": round(pow2.efficiency, 3),
        "fifo_padding_efficiency": round(fifo.efficiency, 3),
        "p99_queue_wait_ms": round(berth.wait_p99_ms, 2),
        "max_delay_ms": MAX_DELAY_S * 1e3,
        "engine": "simulated (cost model)",
    }
    if args.out:
        document = {
            "benchmark": "benchmarks/batcher.py",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": info,
            "command": " ".join(["python", *sys.argv]),
            "engine": SIMULATED_ENGINE,
            "engine_simulated": True,
            "what_the_figures_mean": SIMULATED_MEANING,
            "workload": {
                "lengths": f"lognormal, median {MEDIAN}, sigma {SIGMA}, clipped "
                f"to [{MIN_LEN}, {MAX_LEN}]",
                "arrivals": "Poisson",
                "seconds_per_rate": seconds,
                "message_sequences": CHUNK,
            },
            "policy": {
                "buckets": BUCKETS,
                "templates": POW2_BUCKETS,
                "token_budget": TOKEN_BUDGET,
                "max_batch": MAX_BATCH,
                "max_delay_ms": MAX_DELAY_S * 1e3,
            },
            "core_throughput": {
                "measured": "CPU time of one thread, best of interleaved runs",
                "rows": [
                    {
                        "core": core,
                        "api": api,
                        "sequences": n,
                        "ns_per_seq": round(ns, 1),
                        "seq_per_s": round(1e9 / ns),
                    }
                    for core, api, n, ns in table
                ],
                "loop_ns_per_seq": round(tp["loop_ns"], 1),
            },
            "simulation": rows,
            "headline": line,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.out}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
