"""Part 1 of the batcher benchmark (benchmarks/batcher.py): core throughput.

The Cython core against its Python twin, measured for real in CPU time of
one thread: messages of CHUNK sequences, each queued with one ``push_many``
(or one ``push`` per sequence), then ``next_batch`` until it returns None.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.batcher_common import CHUNK, POLICY, _core_c, _core_py, sample_lengths


def _drained(next_batch: Callable[..., Any], n: int, rows: int, start: float) -> float:
    """Flush what is still queued (every deadline passed), check that all
    ``n`` sequences came out, and return the thread's CPU seconds since
    ``start``."""
    while (batch := next_batch(n * 1e-6 + 1.0, True)) is not None:
        rows += batch.size
    elapsed = time.thread_time() - start
    assert rows == n, (rows, n)
    return elapsed


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
    return _drained(next_batch, n, rows, start)


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
    return _drained(next_batch, n, rows, start)


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
