"""Pure-Python batcher core: the executable specification of ``_core_c.pyx``.

Sequences wait in one FIFO queue per length bucket. ``next_batch`` drops
cancelled and expired entries, picks the ready bucket whose oldest entry has
the earliest deadline (enqueued_at + max_delay), and packs up to that bucket's
target batch size into one padded int32 buffer.

Counting rules (the Cython core follows them exactly):

* ``len(core)`` and ``queued(b)`` count entries that are not cancelled. An
  entry whose ``expires_at`` has passed still counts until ``next_batch`` (or
  a push that finds the core full) drops it: these methods have no clock.
* ``capacity`` bounds the entries holding a slot, cancelled ones included
  until dropped. A push that finds the core full first drops cancelled and
  expired entries, then raises ``QueueFull`` only if it is still full.
* ``expire(now)`` drops as ``next_batch`` does and forms no batch.
* A cancelled id is forgotten at once, so it may be pushed again.
* ``push_many`` queues a whole message or nothing: it checks every sequence
  (offsets, length, id) in order, then capacity, and only then queues them in
  order, as that many pushes would. If the message does not fit, it first
  drops cancelled and expired entries (as a full push does), so a message
  whose own ``expires_at`` has passed is queued whole and dropped later.
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

REASON_CANCELLED = 1
REASON_EXPIRED = 2
N_OUTPUT_BUFFERS = 4  # batch buffers stay valid until 4 more batches are formed

_INT32_FORMATS = {"i", "@i", "=i"} | ({"<i"} if sys.byteorder == "little" else set())
_NATIVE_PREFIXES = ("@", "=", "<") if sys.byteorder == "little" else ("@", "=")
_UINT64_MAX = (1 << 64) - 1


class QueueFull(Exception):
    """Raised by ``push`` when ``capacity`` entries are already queued."""


class Batch:
    """One packed batch: padded int32 tokens plus per-row ids, lengths, times."""

    __slots__ = (
        "bucket",
        "length",
        "size",
        "ids",
        "lengths",
        "tokens",
        "enqueued_at",
        "real_tokens",
    )

    def __init__(
        self,
        bucket: int,
        length: int,
        ids: memoryview,
        lengths: memoryview,
        tokens: memoryview,
        enqueued_at: memoryview,
        real_tokens: int,
    ) -> None:
        self.bucket = bucket  # bucket index
        self.length = length  # padded row length (the bucket's length)
        self.size = len(ids)  # rows
        self.ids = ids  # uint64 ("Q"), row order = FIFO order
        self.lengths = lengths  # int32 ("i"), real length of each row
        self.tokens = tokens  # int32 ("i"), size * length, C-contiguous
        self.enqueued_at = enqueued_at  # float64 ("d"), push time of each row
        self.real_tokens = real_tokens  # sum(lengths)

    def __repr__(self) -> str:
        return (
            f"Batch(bucket={self.bucket}, length={self.length}, size={self.size}, "
            f"real_tokens={self.real_tokens})"
        )


def check_config(
    buckets: Sequence[int],
    token_budget: int,
    max_delay_s: float | Sequence[float],
    capacity: int,
    max_batch: int,
    pad_id: int,
) -> tuple[list[int], list[float], list[int]]:
    """Validate the constructor arguments; return lengths, delays, max sizes."""
    lengths = [int(n) for n in buckets]
    if not lengths or lengths[0] < 1:
        raise ValueError("buckets must be a non-empty list of positive lengths")
    if any(a >= b for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ValueError(f"buckets must be strictly ascending, got {lengths}")
    if lengths[-1] > 1 << 20:
        raise ValueError("bucket lengths are limited to 1048576 tokens")
    if token_budget < lengths[-1]:
        raise ValueError(
            f"token_budget={token_budget} cannot hold one row of the largest "
            f"bucket ({lengths[-1]} tokens)"
        )
    if isinstance(max_delay_s, int | float):
        delays = [float(max_delay_s)] * len(lengths)
    else:
        delays = [float(d) for d in max_delay_s]
    if len(delays) != len(lengths):
        raise ValueError("max_delay_s needs one value per bucket (or one for all)")
    if any(not d >= 0.0 for d in delays):  # also rejects NaN
        raise ValueError(f"max_delay_s must be >= 0, got {delays}")
    if not 1 <= capacity <= 1 << 24:
        raise ValueError("capacity must be in [1, 16777216]")
    if not 1 <= max_batch <= 1 << 16:
        raise ValueError("max_batch must be in [1, 65536]")
    if not -(1 << 31) <= pad_id < 1 << 31:
        raise ValueError("pad_id must fit in int32")
    max_sizes = [max(1, min(max_batch, token_budget // n)) for n in lengths]
    return lengths, delays, max_sizes


def int32_view(tokens: Buffer) -> memoryview:
    """A 1-D C-contiguous int32 view of ``tokens`` (ValueError otherwise)."""
    view = memoryview(tokens)
    if view.ndim != 1 or view.itemsize != 4 or view.format not in _INT32_FORMATS:
        raise ValueError(
            f"tokens must be a 1-D int32 buffer, got format {view.format!r} "
            f"with {view.ndim} dimension(s)"
        )
    if not view.c_contiguous:
        raise ValueError("tokens must be C-contiguous")
    return view


def _int_array(
    obj: Buffer, name: str, what: str, codes: str, itemsizes: tuple[int, ...]
) -> array[int]:
    """A copy of a 1-D C-contiguous integer buffer (ValueError otherwise).

    ``codes``: the accepted struct codes (native byte order); ``itemsizes``:
    the accepted item sizes. The Cython core applies the same rules.
    """
    view = memoryview(obj)
    code = view.format
    if code[:1] in _NATIVE_PREFIXES:
        code = code[1:]
    if (
        view.ndim != 1
        or len(code) != 1
        or code not in codes
        or view.itemsize not in itemsizes
    ):
        raise ValueError(
            f"{name} must be a 1-D {what} buffer, got format {view.format!r} "
            f"with {view.ndim} dimension(s)"
        )
    if not view.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    signed = code.islower()
    values = array(("q" if signed else "Q") if view.itemsize == 8 else "i")
    values.frombytes(view.tobytes())
    return values


def _check_message(
    ids: array[int],
    offsets: array[int],
    n_tokens: int,
    max_len: int,
    queued: Container[int],
) -> None:
    """ValueError for the first bad sequence of a ``push_many`` message.

    For each sequence in order: its offsets, its length, its id (queued, or
    seen earlier in the message). The Cython core checks the same things in
    the same order with the same messages.
    """
    n = len(ids)
    if len(offsets) != n + 1:
        raise ValueError(
            f"offsets must hold n + 1 = {n + 1} entries, got {len(offsets)}"
        )
    seen: set[int] = set()
    for i in range(n):
        start, end = offsets[i], offsets[i + 1]
        if not (0 <= start <= n_tokens and 0 <= end <= n_tokens):
            raise ValueError(
                f"sequence {i}: offsets [{start}, {end}) are outside the "
                f"{n_tokens} tokens"
            )
        if not 0 < end - start <= max_len:
            raise ValueError(
                f"sequence length {end - start} is outside [1, {max_len}] "
                f"(sequence {i})"
            )
        seq_id = ids[i]
        if seq_id in queued:
            raise ValueError(f"sequence id {seq_id} is already queued")
        if seq_id in seen:
            raise ValueError(f"sequence id {seq_id} appears twice in the message")
        seen.add(seq_id)


def message_full(capacity: int, held: int, n: int) -> str:
    """The QueueFull message of a ``push_many`` that does not fit."""
    return f"no room for {n} sequences: {held} of {capacity} slots held"


class _Entry:
    """One queued sequence."""

    __slots__ = ("seq_id", "tokens", "enqueued_at", "expires_at", "cancelled")

    def __init__(
        self, seq_id: int, tokens: array[int], enqueued_at: float, expires_at: float
    ) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.enqueued_at = enqueued_at
        self.expires_at = expires_at
        self.cancelled = False


class _Stats:
    """Running counters of one bucket."""

    __slots__ = ("batches", "sequences", "real_tokens", "padded_tokens", "wait")

    def __init__(self) -> None:
        self.batches = 0
        self.sequences = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.wait = 0.0


class BucketCore:
    """Length-bucketed queues packed into padded token batches (pure Python)."""

    def __init__(
        self,
        buckets: Sequence[int],
        token_budget: int,
        max_delay_s: float | Sequence[float],
        capacity: int = 4096,
        max_batch: int = 256,
        pad_id: int = 0,
    ) -> None:
        self._lengths, self._delays, self._max_sizes = check_config(
            buckets, token_budget, max_delay_s, capacity, max_batch, pad_id
        )
        self._targets = list(self._max_sizes)
        self._capacity = capacity
        self._pad_id = pad_id
        self._queues: list[deque[_Entry]] = [deque() for _ in self._lengths]
        self._by_id: dict[int, _Entry] = {}  # queued and not cancelled
        self._held = 0  # entries in the queues, cancelled ones included
        self._cancelled = 0  # cancelled entries not yet dropped
        self._min_expiry = math.inf  # lower bound on any queued expires_at
        self._dropped: list[tuple[int, int]] = []
        self._stats = [_Stats() for _ in self._lengths]

    # ---- queries -------------------------------------------------------------

    def bucket_for(self, length: int) -> int:
        b = bisect_left(self._lengths, length)  # smallest bucket >= length
        return b if b < len(self._lengths) else -1

    def batch_size(self, bucket: int) -> int:
        return self._targets[self._check_bucket(bucket)]

    def max_batch_size(self, bucket: int) -> int:
        return self._max_sizes[self._check_bucket(bucket)]

    def set_batch_size(self, bucket: int, size: int) -> int:
        b = self._check_bucket(bucket)
        self._targets[b] = max(1, min(self._max_sizes[b], operator.index(size)))
        return self._targets[b]

    def __len__(self) -> int:
        return self._held - self._cancelled

    def queued(self, bucket: int) -> int:
        queue = self._queues[self._check_bucket(bucket)]
        return sum(not e.cancelled for e in queue)

    def next_deadline(self) -> float:
        """Earliest head deadline; a cancelled head may make it early, never late."""
        deadline = math.inf
        for b, queue in enumerate(self._queues):
            if queue:
                deadline = min(deadline, queue[0].enqueued_at + self._delays[b])
        return deadline

    def next_expiry(self) -> float:
        """Earliest ``expires_at`` queued; early, never late (packing leaves it
        early until a drop pass, which makes it exact again)."""
        return self._min_expiry

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                "length": n,
                "batches": s.batches,
                "sequences": s.sequences,
                "real_tokens": s.real_tokens,
                "padded_tokens": s.padded_tokens,
                "queue_wait_s_total": s.wait,
                "batch_size": self._targets[b],
            }
            for b, (n, s) in enumerate(zip(self._lengths, self._stats, strict=True))
        ]

    def take_dropped(self) -> list[tuple[int, int]]:
        dropped, self._dropped = self._dropped, []
        return dropped

    # ---- commands ------------------------------------------------------------

    def push(
        self, seq_id: int, tokens: Buffer, now: float, expires_at: float = math.inf
    ) -> int:
        seq_id = operator.index(seq_id)
        if not 0 <= seq_id <= _UINT64_MAX:
            raise OverflowError(f"seq_id {seq_id} does not fit in uint64")
        view = int32_view(tokens)
        length = len(view)
        bucket = self.bucket_for(length)
        if length == 0 or bucket < 0:
            raise ValueError(
                f"sequence length {length} is outside [1, {self._lengths[-1]}]"
            )
        if seq_id in self._by_id:
            raise ValueError(f"sequence id {seq_id} is already queued")
        if self._held >= self._capacity:
            self._drop(now)
            if self._held >= self._capacity:
                raise QueueFull(f"{self._capacity} sequences already queued")
        copy = array("i")
        copy.frombytes(view.cast("B"))
        self._insert(seq_id, copy, bucket, now, expires_at)
        return bucket

    def push_many(
        self,
        seq_ids: Buffer,
        tokens: Buffer,
        offsets: Buffer,
        now: float,
        expires_at: float = math.inf,
    ) -> int:
        """Queue a message of sequences, all or none; return how many.

        ``seq_ids``: n uint64 ids; ``tokens``: one int32 buffer holding all n
        sequences; ``offsets``: n + 1 int32 or int64 offsets into ``tokens``
        (sequence i is ``tokens[offsets[i]:offsets[i + 1]]``). On any error
        (ValueError as ``push``, or QueueFull) nothing is queued.
        """
        ids = _int_array(seq_ids, "seq_ids", "uint64", "QL", (8,))
        flat = array("i")
        flat.frombytes(int32_view(tokens).tobytes())
        offs = _int_array(offsets, "offsets", "int32 or int64", "ilq", (4, 8))
        n = len(ids)
        _check_message(ids, offs, len(flat), self._lengths[-1], self._by_id)
        if self._held + n > self._capacity:
            self._drop(now)
            if self._held + n > self._capacity:
                raise QueueFull(message_full(self._capacity, self._held, n))
        for i in range(n):
            start, end = offs[i], offs[i + 1]
            bucket = self.bucket_for(end - start)
            self._insert(ids[i], flat[start:end], bucket, now, expires_at)
        return n

    def _insert(
        self,
        seq_id: int,
        copy: array[int],
        bucket: int,
        now: float,
        expires_at: float,
    ) -> None:
        """Queue a checked sequence (its own copy of the tokens) with room."""
        entry = _Entry(seq_id, copy, now, expires_at)
        self._queues[bucket].append(entry)
        self._by_id[seq_id] = entry
        self._held += 1
        self._min_expiry = min(self._min_expiry, expires_at)

    def cancel(self, seq_id: int) -> bool:
        entry = self._by_id.pop(operator.index(seq_id), None)
        if entry is None:
            return False
        entry.cancelled = True
        self._cancelled += 1
        return True

    def expire(self, now: float) -> None:
        """Drop cancelled and expired entries now, as ``next_batch`` does first,
        without forming a batch (for when no engine can take one)."""
        self._drop(now)

    def next_batch(self, now: float, eager: bool = False) -> Batch | None:
        # 1. Drop cancelled and expired entries.
        self._drop(now)
        # 2-3. Among ready buckets, the one with the earliest head deadline.
        bucket = self._select(now, eager)
        if bucket < 0:
            return None
        # 4. Pop up to the target size FIFO and pack the padded rows.
        return self._pack(bucket, now)

    # ---- the phases of next_batch ----------------------------------------------

    def _drop(self, now: float) -> None:
        if not self._cancelled and self._min_expiry > now:
            return  # nothing can be dropped: skip the scan
        min_expiry = math.inf
        for queue in self._queues:
            kept: deque[_Entry] = deque()
            for e in queue:
                if e.cancelled:
                    self._dropped.append((e.seq_id, REASON_CANCELLED))
                elif e.expires_at <= now:
                    self._dropped.append((e.seq_id, REASON_EXPIRED))
                    del self._by_id[e.seq_id]
                else:
                    kept.append(e)
                    min_expiry = min(min_expiry, e.expires_at)
                    continue
                self._held -= 1
            queue.clear()
            queue.extend(kept)
        self._cancelled = 0
        self._min_expiry = min_expiry

    def _select(self, now: float, eager: bool) -> int:
        best, best_deadline = -1, math.inf
        for b, queue in enumerate(self._queues):
            if not queue:
                continue
            deadline = queue[0].enqueued_at + self._delays[b]
            ready = eager or len(queue) >= self._targets[b] or deadline <= now
            if ready and (best < 0 or deadline < best_deadline):
                best, best_deadline = b, deadline
        return best

    def _pack(self, bucket: int, now: float) -> Batch:
        queue, length = self._queues[bucket], self._lengths[bucket]
        size = min(len(queue), self._targets[bucket])
        ids, lengths, enqueued = array("Q"), array("i"), array("d")
        tokens = array("i", [self._pad_id]) * (size * length)
        stats = self._stats[bucket]
        for row in range(size):
            e = queue.popleft()
            del self._by_id[e.seq_id]
            start = row * length
            tokens[start : start + len(e.tokens)] = e.tokens
            ids.append(e.seq_id)
            lengths.append(len(e.tokens))
            enqueued.append(e.enqueued_at)
            stats.wait += now - e.enqueued_at
        self._held -= size
        real = sum(lengths)
        stats.batches += 1
        stats.sequences += size
        stats.real_tokens += real
        stats.padded_tokens += size * length
        return Batch(
            bucket,
            length,
            memoryview(ids).toreadonly(),
            memoryview(lengths).toreadonly(),
            memoryview(tokens).toreadonly(),
            memoryview(enqueued).toreadonly(),
            real,
        )

    def _check_bucket(self, bucket: int) -> int:
        if not 0 <= bucket < len(self._lengths):
            raise IndexError(f"bucket index {bucket} out of range")
        return bucket
