"""The gateway's response cache: per-text model outputs, bounded per model.

An entry is what the engine computed for one text: its float32 output row
(the pooled embedding before any normalization, or the probabilities), its
token count, and the timings of the call that computed it. The key is
(tenant, truncate, prompt, text): normalization and a call's dimensions are
applied by the gateway after the cache, to the full row, so they are not
part of the key; the prompt the text was run with is (the model's default
prompt when the call names none), so a text asked for with another prompt
is never answered from this one's row; and truncate is, so that a text over
the limit is never answered from a truncated entry when the caller did not
ask to truncate. The tenant keeps callers apart: one never gets an answer
another's call put in the cache (gateway.calls ``tenant_of``). A hit
answers with the stored timings, so that its timings do not tell a caller
whether the text was cached. Both public APIs (berth.v1 and KServe) go
through the same cache. Everything here runs on the event loop thread: no
locks.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict

import numpy as np

# Bookkeeping per entry beyond the row and the text: the dict slot, the key
# tuple, the ndarray header. An estimate; it keeps the byte bound honest for
# short texts and narrow rows.
ENTRY_OVERHEAD_BYTES = 256

# tokenize_us, queue_us, inference_us, total_us of a berth_pb2.Timings.
Timings = tuple[int, int, int, int]
NO_TIMINGS: Timings = (0, 0, 0, 0)
Key = tuple[str, bool, str, str]
Entry = tuple[np.ndarray, int, Timings]


def key_of(tenant: str, truncate: bool, prompt: str, text: str) -> Key:
    """The cache key of a tenant's text run after ``prompt``."""
    return (tenant, truncate, prompt, text)


class ModelCache:
    """One model's bounded LRU of output rows, with hit and miss counters."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # key -> (row, tokens, timings, size in bytes)
        self._entries: OrderedDict[Key, tuple[np.ndarray, int, Timings, int]] = (
            OrderedDict()
        )
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.inserts = 0
        # Cumulative time spent looking texts up, for statistics.
        self.lookup_ns = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, tenant: str, truncate: bool, text: str, prompt: str = ""
    ) -> Entry | None:
        """The row, token count and timings cached for a tenant's text run
        after ``prompt``, or None (counted)."""
        key = key_of(tenant, truncate, prompt, text)
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0], found[1], found[2]

    def put(
        self,
        tenant: str,
        truncate: bool,
        text: str,
        row: np.ndarray,
        tokens: int,
        timings: Timings = NO_TIMINGS,
        prompt: str = "",
    ) -> None:
        """Store a copy of one text's row (run after ``prompt``), with the
        timings of the call that computed it; evicts the least recently
        used."""
        # Sized as stored (float32), whatever the dtype it comes in; a
        # prompt is counted as if each entry held its own.
        size = (
            row.size * 4
            + sys.getsizeof(text)
            + sys.getsizeof(tenant)
            + (sys.getsizeof(prompt) if prompt else 0)
        ) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes or self.max_entries <= 0:
            return
        key = key_of(tenant, truncate, prompt, text)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[3]
        # A copy: a view would keep its whole batch alive, and callers may
        # write to their own arrays.
        row = np.array(row, dtype=np.float32)
        row.flags.writeable = False
        self._entries[key] = (row, tokens, timings, size)
        self.bytes += size
        self.inserts += 1
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, _, _, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


class ResponseCache:
    """The gateway's per-model caches (flags --cache-entries, --cache-mb)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.models: dict[str, ModelCache] = {}

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def model(self, name: str) -> ModelCache | None:
        """The cache of one model (made on first use); None when disabled."""
        if not self.enabled:
            return None
        cache = self.models.get(name)
        if cache is None:
            cache = self.models[name] = ModelCache(self.max_entries, self.max_bytes)
        return cache

    def lookup(
        self,
        model: str,
        tenant: str,
        truncate: bool,
        texts: list[str],
        prompt: str = "",
    ) -> list[Entry | None]:
        """Per text, the tenant's cached (row, tokens, timings) of it run
        after ``prompt``, or None."""
        cache = self.model(model)
        if cache is None:
            return [None] * len(texts)
        t0 = time.perf_counter_ns()
        found = [cache.get(tenant, truncate, text, prompt) for text in texts]
        cache.lookup_ns += time.perf_counter_ns() - t0
        return found

    def insert(
        self,
        model: str,
        tenant: str,
        truncate: bool,
        texts: list[str],
        rows: list[np.ndarray],
        tokens: list[int],
        timings: Timings = NO_TIMINGS,
        prompt: str = "",
    ) -> None:
        """Store the rows one call computed for a tenant, its texts run
        after ``prompt``, with its timings."""
        cache = self.model(model)
        if cache is None:
            return
        for text, row, n in zip(texts, rows, tokens, strict=True):
            cache.put(tenant, truncate, text, row, n, timings, prompt)

    @property
    def hits(self) -> int:
        return sum(c.hits for c in self.models.values())

    @property
    def misses(self) -> int:
        return sum(c.misses for c in self.models.values())
