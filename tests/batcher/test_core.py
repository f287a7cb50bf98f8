"""Batcher core rules, run against the twin and the Cython core alike."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher import _core_py
from batcher._core_py import REASON_CANCELLED, REASON_EXPIRED, Batch, QueueFull


def toks(n: int, base: int = 1) -> array[int]:
    return array("i", range(base, base + n))


def make(mod: ModuleType, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "buckets": [4, 8, 16],
        "token_budget": 64,
        "max_delay_s": 0.01,
        "capacity": 32,
        "max_batch": 8,
        "pad_id": 0,
    }
    args.update(kw)
    return mod.BucketCore(**args)


def rows(batch: Batch) -> list[list[int]]:
    flat = batch.tokens.tolist()
    return [flat[r * batch.length : (r + 1) * batch.length] for r in range(batch.size)]


# ---- selector -------------------------------------------------------------------


def _implementation(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "BERTH_PURE_PYTHON"}
    code = "from batcher import core; print(core.IMPLEMENTATION, core.BucketCore)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=environ | env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_selector_prefers_cython(core_c: ModuleType) -> None:
    assert _implementation() == "cython <class 'batcher._core_c.BucketCore'>"


def test_selector_forced_to_python() -> None:
    got = _implementation(BERTH_PURE_PYTHON="1")
    assert got == "python <class 'batcher._core_py.BucketCore'>"


# ---- configuration ----------------------------------------------------------


def test_bucket_for_picks_smallest_bucket_that_fits(core_mod: ModuleType) -> None:
    core = make(core_mod, buckets=[32, 64, 128], token_budget=1024)
    assert [core.bucket_for(n) for n in (1, 31, 32, 33, 64, 65, 128, 129)] == [
        0,
        0,
        0,
        1,
        1,
        2,
        2,
        -1,
    ]
    assert core.push(1, toks(33), 0.0) == 1
    assert core.queued(1) == 1


def test_push_rejects_empty_and_too_long(core_mod: ModuleType) -> None:
    core = make(core_mod)
    with pytest.raises(ValueError, match="length"):
        core.push(1, toks(0), 0.0)
    with pytest.raises(ValueError, match="length"):
        core.push(2, toks(17), 0.0)
    assert len(core) == 0


def test_budget_clamps_batch_size(core_mod: ModuleType) -> None:
    core = make(core_mod, buckets=[32, 64, 128], token_budget=1024, max_batch=16)
    assert [core.max_batch_size(b) for b in range(3)] == [16, 16, 8]
    assert [core.batch_size(b) for b in range(3)] == [16, 16, 8]  # default = max
    assert core.set_batch_size(0, 100) == 16
    assert core.set_batch_size(1, 0) == 1
    assert core.set_batch_size(2, 5) == 5
    assert [core.batch_size(b) for b in range(3)] == [16, 1, 5]
    with pytest.raises(IndexError):
        core.batch_size(3)
    with pytest.raises(IndexError):
        core.set_batch_size(-1, 2)


@pytest.mark.parametrize(
    "kw",
    [
        {"buckets": []},
        {"buckets": [8, 4]},
        {"buckets": [4, 4]},
        {"buckets": [0, 4]},
        {"token_budget": 15},  # cannot hold one row of 16
        {"max_delay_s": [0.01, 0.02]},  # one per bucket needed
        {"max_delay_s": -1.0},
        {"max_delay_s": math.nan},
        {"capacity": 0},
        {"max_batch": 0},
        {"pad_id": 1 << 31},
    ],
)
def test_constructor_rejects_bad_config(core_mod: ModuleType, kw: Any) -> None:
    with pytest.raises(ValueError):
        make(core_mod, **kw)


def test_accepts_any_int32_buffer(core_mod: ModuleType) -> None:
    core = make(core_mod)
    core.push(1, array("i", [5, 6]), 0.0)
    core.push(2, np.array([7, 8, 9], dtype=np.int32), 0.0)
    core.push(3, memoryview(np.array([1], dtype=np.int32).tobytes()).cast("i"), 0.0)
    core.push(4, np.arange(10, dtype=np.int32)[2:5], 0.0)  # contiguous slice
    batch = core.next_batch(0.0, eager=True)
    assert batch is not None
    assert rows(batch) == [[5, 6, 0, 0], [7, 8, 9, 0], [1, 0, 0, 0], [2, 3, 4, 0]]


@pytest.mark.parametrize(
    "tokens",
    [
        array("q", [1, 2]),
        array("I", [1, 2]),
        np.zeros((2, 2), dtype=np.int32),
        np.arange(8, dtype=np.int32)[::2],
        np.zeros(3, dtype=">i4"),
    ],
)
def test_rejects_non_int32_buffers(core_mod: ModuleType, tokens: Any) -> None:
    core = make(core_mod)
    with pytest.raises(ValueError, match="tokens must be"):
        core.push(1, tokens, 0.0)
    with pytest.raises(TypeError):
        core.push(2, [1, 2], 0.0)
    assert len(core) == 0


# ---- readiness ------------------------------------------------------------------


def test_full_bucket_is_ready_at_once(core_mod: ModuleType) -> None:
    core = make(core_mod)
    core.set_batch_size(0, 3)
    for i in range(4):
        core.push(i, toks(2), 0.0)
    batch = core.next_batch(0.0)
    assert batch is not None
    assert (batch.bucket, batch.length, batch.size) == (0, 4, 3)
    assert batch.ids.tolist() == [0, 1, 2]  # FIFO
    assert core.queued(0) == 1
    assert core.next_batch(0.0) is None  # one left: waits for its delay


def test_partial_bucket_waits_for_max_delay(core_mod: ModuleType) -> None:
    core = make(core_mod, max_delay_s=[0.01, 0.02, 0.03])
    core.push(1, toks(2), 0.0)
    core.push(2, toks(6), 0.0)
    assert core.next_batch(0.0099) is None
    batch = core.next_batch(0.01)
    assert batch is not None and batch.ids.tolist() == [1]
    assert core.next_batch(0.0199) is None
    batch = core.next_batch(0.02)
    assert batch is not None and batch.ids.tolist() == [2]
    assert core.next_batch(1.0) is None


def test_eager_takes_a_partial_batch(core_mod: ModuleType) -> None:
    core = make(core_mod)
    assert core.next_batch(0.0, eager=True) is None  # empty: nothing to take
    core.push(1, toks(3), 0.0)
    core.push(2, toks(3), 0.0)
    assert core.next_batch(0.0) is None
    batch = core.next_batch(0.0, eager=True)
    assert batch is not None and batch.ids.tolist() == [1, 2]


def test_max_batch_caps_rows(core_mod: ModuleType) -> None:
    core = make(core_mod, max_batch=5, token_budget=1000)
    for i in range(12):
        core.push(i, toks(1), 0.0)
    sizes = []
    while (batch := core.next_batch(0.0, eager=True)) is not None:
        sizes.append(batch.size)
    assert sizes == [5, 5, 2]


def test_oldest_deadline_first_prevents_starvation(core_mod: ModuleType) -> None:
    """A busy bucket that fills every tick must not starve a quiet one."""
    core = make(core_mod, max_delay_s=0.01)
    core.set_batch_size(0, 2)
    core.push(1000, toks(6), 0.0)  # bucket 1, alone: ready at t=0.01
    served_at = None
    seq = 0
    for tick in range(20):
        now = tick * 0.001
        for _ in range(2):  # bucket 0 is full at every tick
            core.push(seq, toks(2), now)
            seq += 1
        batch = core.next_batch(now)
        assert batch is not None
        if batch.bucket == 1:
            served_at = now
            break
    assert served_at == pytest.approx(0.01)


def test_odf_uses_per_bucket_delays_and_ties_go_to_smaller_bucket(
    core_mod: ModuleType,
) -> None:
    core = make(core_mod, max_delay_s=[0.05, 0.01, 0.01])
    core.push(1, toks(2), 0.0)  # deadline 0.05
    core.push(2, toks(6), 0.02)  # deadline 0.03
    core.push(3, toks(12), 0.02)  # deadline 0.03, larger bucket
    order = []
    while (batch := core.next_batch(0.021, eager=True)) is not None:
        order.append(batch.bucket)
    assert order == [1, 2, 0]


def test_next_deadline(core_mod: ModuleType) -> None:
    core = make(core_mod, max_delay_s=[0.05, 0.01, 0.01])
    assert core.next_deadline() == math.inf
    core.push(1, toks(2), 0.0)
    assert core.next_deadline() == pytest.approx(0.05)
    core.push(2, toks(6), 0.02)
    assert core.next_deadline() == pytest.approx(0.03)


# ---- cancel, expire, capacity, ids ------------------------------------------------


def test_cancel_drops_before_packing(core_mod: ModuleType) -> None:
    core = make(core_mod)
    for i in range(3):
        core.push(i, toks(2), 0.0)
    assert core.cancel(1) is True
    assert core.cancel(1) is False  # already cancelled
    assert core.cancel(99) is False
    assert core.cancel(-1) is False
    assert len(core) == 2 and core.queued(0) == 2  # cancelled ones not counted
    batch = core.next_batch(0.0, eager=True)
    assert batch is not None and batch.ids.tolist() == [0, 2]
    assert core.take_dropped() == [(1, REASON_CANCELLED)]
    assert core.take_dropped() == []


def test_cancelled_id_may_be_pushed_again(core_mod: ModuleType) -> None:
    core = make(core_mod)
    core.push(7, toks(2), 0.0)
    core.cancel(7)
    core.push(7, toks(3, base=50), 0.001)
    batch = core.next_batch(0.001, eager=True)
    assert batch is not None and batch.ids.tolist() == [7]
    assert rows(batch) == [[50, 51, 52, 0]]
    assert core.take_dropped() == [(7, REASON_CANCELLED)]


def test_expired_entries_are_dropped_and_not_counted_for_readiness(
    core_mod: ModuleType,
) -> None:
    core = make(core_mod)
    core.set_batch_size(0, 2)
    core.push(1, toks(2), 0.0, expires_at=0.005)
    core.push(2, toks(2), 0.001)
    assert len(core) == 2  # no clock: expired entries count until dropped
    assert core.next_batch(0.005) is None  # 1 expired; 2 alone is not full
    assert core.take_dropped() == [(1, REASON_EXPIRED)]
    assert len(core) == 1
    batch = core.next_batch(0.011)
    assert batch is not None and batch.ids.tolist() == [2]


def test_cancel_wins_over_expiry(core_mod: ModuleType) -> None:
    core = make(core_mod)
    core.push(1, toks(2), 0.0, expires_at=0.001)
    assert core.cancel(1) is True
    assert core.next_batch(1.0) is None
    assert core.take_dropped() == [(1, REASON_CANCELLED)]


def test_expire_drops_without_forming_a_batch(core_mod: ModuleType) -> None:
    """The scheduler expires queued work while no engine slot is free (it
    forms no batch then): expire drops what next_batch would, packs nothing."""
    core = make(core_mod)
    core.push(1, toks(2), 0.0, expires_at=0.5)
    core.push(2, toks(6), 0.0, expires_at=0.3)
    core.push(3, toks(2), 0.0)
    core.expire(0.2)
    assert core.take_dropped() == [] and len(core) == 3
    core.expire(0.3)
    assert core.take_dropped() == [(2, REASON_EXPIRED)] and len(core) == 2
    core.cancel(3)
    core.expire(0.3)
    assert core.take_dropped() == [(3, REASON_CANCELLED)] and len(core) == 1
    assert [s["batches"] for s in core.stats()] == [0, 0, 0]
    batch = core.next_batch(0.4, eager=True)
    assert batch is not None and batch.ids.tolist() == [1]


def test_next_expiry_is_early_never_late(core_mod: ModuleType) -> None:
    """The scheduler sleeps until next_expiry: a lower bound on the earliest
    expiry queued (packing leaves it early), exact again after a drop pass."""
    core = make(core_mod)
    assert core.next_expiry() == math.inf
    core.push(1, toks(2), 0.0)
    assert core.next_expiry() == math.inf  # no deadline: never expires
    core.push(2, toks(6), 0.0, expires_at=0.3)
    core.push(3, toks(2), 0.0, expires_at=0.5)
    assert core.next_expiry() == 0.3
    first = core.next_batch(0.1, eager=True)
    second = core.next_batch(0.1, eager=True)
    assert first is not None and first.ids.tolist() == [1, 3]
    assert second is not None and second.ids.tolist() == [2]
    assert core.next_expiry() == 0.3  # id 2 was packed: early, not late
    core.push(4, toks(2), 0.1, expires_at=0.4)
    assert core.next_expiry() == 0.3
    core.expire(0.3)  # nothing due: the scan makes the bound exact
    assert core.take_dropped() == [] and core.next_expiry() == 0.4
    core.expire(0.4)
    assert core.take_dropped() == [(4, REASON_EXPIRED)]
    assert core.next_expiry() == math.inf


def test_capacity_raises_queue_full(core_mod: ModuleType) -> None:
    core = make(core_mod, capacity=3)
    for i in range(3):
        core.push(i, toks(2 + 4 * (i % 2)), 0.0)
    with pytest.raises(QueueFull):
        core.push(3, toks(2), 0.0)
    assert len(core) == 3
    core.cancel(0)
    core.push(3, toks(2), 0.0)  # the full push drops the cancelled entry first
    assert core.take_dropped() == [(0, REASON_CANCELLED)]
    assert len(core) == 3


def test_full_push_drops_expired_entries(core_mod: ModuleType) -> None:
    core = make(core_mod, capacity=2)
    core.push(1, toks(2), 0.0, expires_at=0.5)
    core.push(2, toks(2), 0.0)
    with pytest.raises(QueueFull):
        core.push(3, toks(2), 0.4)
    core.push(3, toks(2), 0.5)
    assert core.take_dropped() == [(1, REASON_EXPIRED)]


def test_duplicate_and_out_of_range_ids(core_mod: ModuleType) -> None:
    core = make(core_mod)
    core.push(2**64 - 1, toks(2), 0.0)
    with pytest.raises(ValueError, match="already queued"):
        core.push(2**64 - 1, toks(3), 0.0)
    with pytest.raises(OverflowError):
        core.push(-1, toks(2), 0.0)
    with pytest.raises(OverflowError):
        core.push(2**64, toks(2), 0.0)
    batch = core.next_batch(0.0, eager=True)
    assert batch is not None and batch.ids.tolist() == [2**64 - 1]
    core.push(2**64 - 1, toks(2), 0.0)  # no longer queued: allowed again
    assert len(core) == 1


def test_many_ids_push_cancel_pop(core_mod: ModuleType) -> None:
    """Stress the id map (the Cython one is open addressing) against a set."""
    rng = random.Random(7)
    core = make(core_mod, capacity=500, buckets=[4], token_budget=64, max_batch=16)
    queued: list[int] = []
    for step in range(5000):
        op = rng.random()
        if op < 0.5 and len(queued) < 500:
            seq_id = rng.getrandbits(64) if rng.random() < 0.5 else rng.randrange(2000)
            if seq_id in queued:
                with pytest.raises(ValueError):
                    core.push(seq_id, toks(1), step)
            else:
                core.push(seq_id, toks(1), step)
                queued.append(seq_id)
        elif op < 0.8:
            seq_id = rng.choice(queued) if queued and rng.random() < 0.8 else 12345
            assert core.cancel(seq_id) is (seq_id in queued)
            if seq_id in queued:
                queued.remove(seq_id)
        else:
            batch = core.next_batch(step, eager=True)
            if batch is not None:
                assert batch.ids.tolist() == queued[: batch.size]
                del queued[: batch.size]
        assert len(core) == len(queued)


# ---- push_many ------------------------------------------------------------------


def tok_base(seq_id: int) -> int:
    return 100 * (seq_id % 10**6)


def message(
    ids: list[int], lengths: list[int], lead: int = 0, wide: bool = True
) -> tuple[array[int], array[int], array[int]]:
    """push_many arguments: sequence i is toks(lengths[i], base=tok_base(ids[i])).

    ``lead`` unused tokens come first (offsets need not start at 0).
    """
    tokens = array("i", [-5] * lead)
    offsets = array("q" if wide else "i", [lead])
    for seq_id, n in zip(ids, lengths, strict=True):
        tokens.extend(toks(n, base=tok_base(seq_id)))
        offsets.append(len(tokens))
    return array("Q", ids), tokens, offsets


def drain(core: Any, now: float) -> list[tuple[Any, ...]]:
    """Every batch, eagerly: bucket, ids, rows, enqueue times, real tokens."""
    out = []
    while (b := core.next_batch(now, eager=True)) is not None:
        out.append(
            (b.bucket, b.ids.tolist(), rows(b), b.enqueued_at.tolist(), b.real_tokens)
        )
    return out


@pytest.mark.parametrize("wide", [False, True])
def test_push_many_equals_pushes(core_mod: ModuleType, wide: bool) -> None:
    ids = [3, 1, 2**64 - 1, 40, 5, 6, 7]
    lengths = [2, 16, 5, 1, 4, 9, 3]
    one, many = make(core_mod), make(core_mod)
    for seq_id, n in zip(ids, lengths, strict=True):
        one.push(seq_id, toks(n, base=tok_base(seq_id)), 0.25, 0.75)
    assert many.push_many(*message(ids, lengths, lead=3, wide=wide), 0.25, 0.75) == 7
    assert len(many) == len(one) == 7
    assert [many.queued(b) for b in range(3)] == [one.queued(b) for b in range(3)]
    assert many.next_deadline() == one.next_deadline()
    assert many.cancel(40) and one.cancel(40)
    assert drain(many, 0.5) == drain(one, 0.5)
    assert many.take_dropped() == one.take_dropped() == [(40, REASON_CANCELLED)]
    assert many.stats() == one.stats()


def test_push_many_large_message(core_mod: ModuleType) -> None:
    """Past the scratch a core starts with; a late error undoes every id."""
    rng = random.Random(3)
    ids = rng.sample(range(10**6), 700)
    lengths = [rng.randint(1, 16) for _ in ids]
    one = make(core_mod, capacity=1000, max_batch=64, token_budget=1024)
    many = make(core_mod, capacity=1000, max_batch=64, token_budget=1024)
    bad = message(ids + [ids[650]], lengths + [1])
    with pytest.raises(ValueError, match="twice"):
        many.push_many(*bad, 0.0)
    for seq_id, n in zip(ids, lengths, strict=True):
        one.push(seq_id, toks(n, base=tok_base(seq_id)), 0.0)
    assert many.push_many(*message(ids, lengths), 0.0) == 700
    assert drain(many, 0.0) == drain(one, 0.0)
    with pytest.raises(QueueFull):
        many.push_many(*message(list(range(1001)), [1] * 1001), 0.0)
    assert len(many) == 0


def test_push_many_expiry_and_empty_message(core_mod: ModuleType) -> None:
    core = make(core_mod)
    assert core.push_many(*message([], []), 0.0) == 0
    assert core.push_many(*message([1, 2], [1, 2]), 0.0, expires_at=0.5) == 2
    assert core.next_batch(0.5) is None
    assert core.take_dropped() == [(1, REASON_EXPIRED), (2, REASON_EXPIRED)]


def test_push_many_accepts_numpy_buffers(core_mod: ModuleType) -> None:
    core = make(core_mod)
    ids = np.array([8, 9], dtype=np.uint64)  # format "L" on LP64
    tokens = np.arange(10, dtype=np.int32)
    assert core.push_many(ids, tokens[2:], np.array([0, 3, 8]), 0.0) == 2
    assert core.push_many(
        memoryview(array("Q", [10]).tobytes()).cast("Q"),
        tokens,
        np.array([9, 10], dtype=np.int32),
        0.0,
    )
    assert drain(core, 0.0) == [
        (0, [8, 10], [[2, 3, 4, 0], [9, 0, 0, 0]], [0.0, 0.0], 4),
        (1, [9], [[5, 6, 7, 8, 9, 0, 0, 0]], [0.0], 5),
    ]


def _bad_messages() -> list[tuple[str, tuple[Any, ...]]]:
    ok_ids = [10, 11, 12]
    return [
        ("length", message(ok_ids, [2, 17, 3])),  # too long
        ("length", message(ok_ids, [2, 0, 3])),  # empty
        ("already queued", message([10, 1, 12], [1, 1, 1])),
        ("twice", message([10, 11, 10], [1, 1, 1])),
        ("outside", (array("Q", [10]), toks(2), array("i", [0, 3]))),
        ("outside", (array("Q", [10]), toks(2), array("q", [-1, 1]))),
        ("n \\+ 1", (array("Q", [10, 11]), toks(2), array("i", [0, 1]))),
        ("seq_ids must be", (array("q", [10]), toks(2), array("i", [0, 1]))),
        ("tokens must be", (array("Q", [10]), array("q", [1]), array("i", [0, 1]))),
        ("offsets must be", (array("Q", [10]), toks(2), array("I", [0, 1]))),
        (
            "offsets must be C-contiguous",
            (array("Q", [10]), toks(2), np.arange(4)[::2]),
        ),
    ]


@pytest.mark.parametrize(("match", "args"), _bad_messages())
def test_push_many_is_all_or_nothing_on_bad_input(
    core_mod: ModuleType, match: str, args: tuple[Any, ...]
) -> None:
    core = make(core_mod)
    core.push(1, toks(2), 0.0)
    with pytest.raises(ValueError, match=match):
        core.push_many(*args, 0.0)
    assert len(core) == 1 and [core.queued(b) for b in range(3)] == [1, 0, 0]
    assert core.push_many(*message([10, 11, 12], [1, 6, 12]), 0.0) == 3
    assert [core.queued(b) for b in range(3)] == [2, 1, 1]


def test_push_many_is_all_or_nothing_on_a_full_queue(core_mod: ModuleType) -> None:
    core = make(core_mod, capacity=6)
    core.push_many(*message([1, 2, 3, 4], [2, 2, 6, 6]), 0.0)
    core.push(5, toks(2), 0.0, expires_at=0.5)
    core.cancel(2)
    with pytest.raises(QueueFull):  # 5 held; dropping the cancelled one leaves 4
        core.push_many(*message([10, 11, 12], [1, 1, 1]), 0.25)
    assert core.take_dropped() == [(2, REASON_CANCELLED)]  # as a full push does
    assert len(core) == 4 and [core.queued(b) for b in range(3)] == [2, 2, 0]
    with pytest.raises(QueueFull):  # dropping the expired one leaves 3: 4 too many
        core.push_many(*message([10, 11, 12, 13], [1, 1, 1, 1]), 0.5)
    assert core.take_dropped() == [(5, REASON_EXPIRED)]
    assert len(core) == 3
    assert core.push_many(*message([10, 11, 12], [1, 1, 1]), 0.5) == 3  # fits
    assert len(core) == 6
    with pytest.raises(TypeError):
        core.push_many([1], toks(1), array("i", [0, 1]), 0.5)


# ---- packing --------------------------------------------------------------------


def test_padding_and_batch_fields(core_mod: ModuleType) -> None:
    core = make(core_mod, pad_id=-7)
    core.push(10, array("i", [1, 2, 3]), 0.5)
    core.push(11, array("i", [4, 5, 6, 7, 8]), 0.75)
    core.push(12, array("i", [9]), 1.0)
    first = core.next_batch(1.0, eager=True)  # bucket 0: oldest deadline
    second = core.next_batch(1.0, eager=True)
    assert first is not None and second is not None
    assert (first.bucket, first.length, first.size) == (0, 4, 2)
    assert (second.bucket, second.length, second.size) == (1, 8, 1)
    assert rows(first) == [[1, 2, 3, -7], [9, -7, -7, -7]]
    assert rows(second) == [[4, 5, 6, 7, 8, -7, -7, -7]]
    assert first.ids.tolist() == [10, 12]
    assert first.lengths.tolist() == [3, 1]
    assert first.enqueued_at.tolist() == [0.5, 1.0]
    assert first.real_tokens == 4
    assert len(bytes(first.tokens)) == 2 * 4 * 4
    assert np.frombuffer(bytes(first.tokens), dtype="<i4").tolist()[:4] == [1, 2, 3, -7]
    for view, fmt in (
        (first.ids, "Q"),
        (first.lengths, "i"),
        (first.tokens, "i"),
        (first.enqueued_at, "d"),
    ):
        assert view.format == fmt and view.readonly and view.c_contiguous


def test_batch_buffers_stay_valid_for_three_more_batches(core_mod: ModuleType) -> None:
    core = make(core_mod, buckets=[8], token_budget=64, max_batch=2)
    for i in range(12):
        core.push(i, toks(1 + i % 8, base=100 * i), 0.0)
    batches = []
    for _ in range(4):
        batch = core.next_batch(0.0, eager=True)
        assert batch is not None
        batches.append((batch, bytes(batch.tokens), batch.ids.tolist()))
    # Four batches formed: the first one's buffers have not been reused yet.
    for batch, wire, ids in batches:
        assert bytes(batch.tokens) == wire and batch.ids.tolist() == ids


def test_stats(core_mod: ModuleType) -> None:
    core = make(core_mod)
    core.push(1, toks(3), 0.0)
    core.push(2, toks(1), 0.25)
    core.next_batch(1.0, eager=True)
    s = core.stats()
    assert len(s) == 3
    assert s[0] == {
        "length": 4,
        "batches": 1,
        "sequences": 2,
        "real_tokens": 4,
        "padded_tokens": 8,
        "queue_wait_s_total": 1.75,
        "batch_size": 8,
    }
    assert s[1]["batches"] == 0 and s[2]["batch_size"] == 4


# ---- both implementations agree -----------------------------------------------------

TICK = 1 / 1024  # times on a dyadic grid: sums are exact, so ties really happen
_SEQ = st.tuples(st.integers(0, 20), st.one_of(st.integers(1, 3), st.integers(0, 10)))
_OP = st.one_of(
    st.tuples(
        st.just("push"),
        st.integers(0, 15),  # first id: small range, so duplicates happen
        st.integers(1, 6),  # a burst of this many ids, first id onwards
        st.one_of(st.integers(1, 3), st.integers(0, 10)),  # 0, 9, 10 invalid
        st.one_of(st.none(), st.integers(0, 12)),  # expires after these ticks
    ),
    st.tuples(
        st.just("next"),
        st.integers(0, 8),  # ticks to advance first
        st.sampled_from([False, False, False, True]),  # eager
    ),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("size"), st.integers(0, 2), st.integers(-1, 6)),
    st.tuples(st.just("expire"), st.integers(0, 8)),  # ticks to advance first
    st.tuples(
        st.just("many"),
        st.one_of(  # (id, length) per sequence; ids may repeat in a message
            st.lists(_SEQ, min_size=1, max_size=7, unique_by=lambda t: t[0]),
            st.lists(_SEQ, max_size=4),
        ),
        st.one_of(st.none(), st.integers(0, 12)),  # expires after these ticks
        st.integers(0, 2),  # unused tokens before the first sequence
        st.booleans(),  # int64 offsets, else int32
    ),
)


def _apply(core: Any, op: tuple[Any, ...], now: float) -> Any:
    try:
        if op[0] == "push":
            _, first, count, length, expires_in = op
            expires = math.inf if expires_in is None else now + expires_in * TICK
            return [
                _apply(core, ("push1", seq_id, length, expires), now)
                for seq_id in range(first, first + count)
            ]
        if op[0] == "push1":
            _, seq_id, length, expires = op
            tokens = array("i", [seq_id * 100 + j for j in range(length)])
            return core.push(seq_id, tokens, now, expires)
        if op[0] == "many":
            _, seqs, expires_in, lead, wide = op
            expires = math.inf if expires_in is None else now + expires_in * TICK
            tokens = array("i", [-3] * lead)
            offsets = array("q" if wide else "i", [lead])
            for seq_id, length in seqs:
                tokens.extend(seq_id * 100 + j for j in range(length))
                offsets.append(len(tokens))
            ids = array("Q", [seq_id for seq_id, _ in seqs])
            return core.push_many(ids, tokens, offsets, now, expires)
        if op[0] == "cancel":
            return core.cancel(op[1])
        if op[0] == "size":
            return core.set_batch_size(op[1], op[2])
        if op[0] == "expire":
            return core.expire(now)
        batch = core.next_batch(now, eager=op[2])
        if batch is None:
            return None
        return (
            batch.bucket,
            batch.length,
            batch.size,
            batch.ids.tolist(),
            batch.lengths.tolist(),
            bytes(batch.tokens),
            batch.enqueued_at.tolist(),
            batch.real_tokens,
        )
    except (ValueError, QueueFull) as exc:
        return type(exc)


def _state(core: Any) -> tuple[Any, ...]:
    return (
        len(core),
        [core.queued(b) for b in range(3)],
        core.next_deadline(),
        core.next_expiry(),
        core.take_dropped(),
        core.stats(),
    )


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(_OP, min_size=10, max_size=60),
    delays=st.lists(st.integers(0, 8), min_size=3, max_size=3),
    capacity=st.integers(1, 12),
)
def test_cython_matches_twin(
    core_c: ModuleType, ops: list[tuple[Any, ...]], delays: list[float], capacity: int
) -> None:
    kw: dict[str, Any] = {
        "buckets": [2, 4, 8],
        "token_budget": 24,  # max sizes 5, 5, 3
        "max_delay_s": [d * TICK for d in delays],
        "capacity": capacity,
        "max_batch": 5,
        "pad_id": -1,
    }
    twin, fast = _core_py.BucketCore(**kw), core_c.BucketCore(**kw)
    now = 0.0
    for op in ops:
        if op[0] in ("next", "expire"):
            now += op[1] * TICK
        assert _apply(fast, op, now) == _apply(twin, op, now), op
        assert _state(fast) == _state(twin), op
