# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, binding=False
"""Cython batcher core: the rules of ``_core_py`` over C arrays.

State lives in C arrays allocated in ``__cinit__``: a slot table (id, length,
bucket, enqueue time, expiry, state), a token arena of fixed-size slots (one
row of the largest bucket each), a free list of slots, one ring of slot
indices per bucket, and an open-addressing id -> slot hash map. Drop, select,
pop and pack run without the GIL; Python objects appear only at the API
boundary. Batch buffers are ``array`` objects in a ring of four, handed out as
read-only memoryviews. ``push_many`` checks a whole message under the GIL,
copying ids, offsets and lengths into scratch arrays of the core, then queues
it without the GIL from those copies (so a caller mutating its buffers from
another thread meanwhile cannot make it read out of bounds).

Like the twin, a core has one owner (the scheduler task). ``next_batch``
releases the GIL while it packs, so a second thread calling in meanwhile
would race: it gets a RuntimeError instead.
"""

from cpython.buffer cimport (
    PyBUF_RECORDS_RO,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset, strchr

import operator
import sys
from array import array

from batcher._core_py import (
    N_OUTPUT_BUFFERS,
    REASON_CANCELLED,
    REASON_EXPIRED,
    Batch,
    QueueFull,
    check_config,
    message_full,
)

cdef enum:
    FREE = 0  # slot states
    LIVE = 1
    CANCELLED = 2
    DROP_CANCELLED = 1  # drop reasons, as REASON_* of the twin
    DROP_EXPIRED = 2
    N_OUT = 4  # batch buffers in the output ring
    EMPTY = -1  # hash map: no slot
    RESERVED = -2  # hash map: an id of the message push_many is checking

assert (N_OUT, DROP_CANCELLED, DROP_EXPIRED) == (
    N_OUTPUT_BUFFERS, REASON_CANCELLED, REASON_EXPIRED
)
cdef bint LITTLE_ENDIAN = sys.byteorder == "little"


cdef inline uint64_t _hash(uint64_t x) noexcept nogil:
    """splitmix64 finaliser: spreads sequential ids over the table."""
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= 0x94D049BB133111EBULL
    x ^= x >> 31
    return x


cdef Py_ssize_t _pow2_at_least(Py_ssize_t n):
    cdef Py_ssize_t p = 1
    while p < n:
        p <<= 1
    return p


cdef class BucketCore:
    """Length-bucketed queues packed into padded token batches (C arrays)."""

    # configuration
    cdef int nb, max_len, pad_id
    cdef Py_ssize_t capacity
    cdef int32_t *blen
    cdef int32_t *target
    cdef int32_t *max_size
    cdef double *delay
    cdef int32_t *len_to_bucket  # length (0..max_len) -> bucket index
    # per-bucket rings of slot indices
    cdef Py_ssize_t ring_mask
    cdef int32_t *ring
    cdef Py_ssize_t *rhead
    cdef Py_ssize_t *rcount  # entries in the ring, cancelled ones included
    cdef Py_ssize_t *rcancelled
    # slot table, token arena, free list
    cdef uint64_t *sid
    cdef int32_t *slen
    cdef int32_t *sbucket
    cdef double *senq
    cdef double *sexp
    cdef uint8_t *sstate
    cdef int32_t *arena
    cdef int32_t *free_slots
    cdef Py_ssize_t n_free
    cdef Py_ssize_t n_cancelled
    cdef double min_expiry  # lower bound on any queued expires_at
    # id -> slot map (linear probing, backward-shift deletion)
    cdef Py_ssize_t hmask
    cdef uint64_t *hkey
    cdef int32_t *hslot
    # dropped entries not yet taken
    cdef uint64_t *drop_id
    cdef uint8_t *drop_reason
    cdef Py_ssize_t n_dropped, drop_cap
    # statistics
    cdef int64_t *st_batches
    cdef int64_t *st_seqs
    cdef int64_t *st_real
    cdef int64_t *st_padded
    cdef double *st_wait
    # output ring: array objects, their read-only views, raw pointers
    cdef list out_arrays, out_tokens, out_lengths, out_ids, out_enq
    cdef int32_t *out_tok_p[N_OUT]
    cdef int32_t *out_len_p[N_OUT]
    cdef uint64_t *out_id_p[N_OUT]
    cdef double *out_enq_p[N_OUT]
    cdef int out_next
    cdef bint busy  # inside a nogil section
    # push_many scratch: a checked message, and the set of its ids
    cdef uint64_t *msg_id
    cdef Py_ssize_t *msg_start
    cdef int32_t *msg_len
    cdef Py_ssize_t *msg_cell  # the map cell reserved for each
    cdef Py_ssize_t *msg_set  # 1 + index into msg_id, 0 = empty
    cdef Py_ssize_t msg_cap, msg_set_cap

    def __cinit__(
        self,
        buckets,
        Py_ssize_t token_budget,
        max_delay_s,
        Py_ssize_t capacity=4096,
        Py_ssize_t max_batch=256,
        long long pad_id=0,
    ):
        lengths, delays, max_sizes = check_config(
            buckets, token_budget, max_delay_s, capacity, max_batch, pad_id
        )
        cdef Py_ssize_t b, i, ring_size, nb = len(lengths)
        self.nb = <int>nb
        self.capacity = capacity
        self.pad_id = <int>pad_id
        self.max_len = lengths[nb - 1]
        ring_size = _pow2_at_least(capacity)
        self.ring_mask = ring_size - 1
        self.hmask = _pow2_at_least(2 * capacity) - 1
        self.blen = <int32_t *>malloc(nb * sizeof(int32_t))
        self.target = <int32_t *>malloc(nb * sizeof(int32_t))
        self.max_size = <int32_t *>malloc(nb * sizeof(int32_t))
        self.delay = <double *>malloc(nb * sizeof(double))
        self.len_to_bucket = <int32_t *>malloc((self.max_len + 1) * sizeof(int32_t))
        self.ring = <int32_t *>malloc(nb * ring_size * sizeof(int32_t))
        self.rhead = <Py_ssize_t *>calloc(nb, sizeof(Py_ssize_t))
        self.rcount = <Py_ssize_t *>calloc(nb, sizeof(Py_ssize_t))
        self.rcancelled = <Py_ssize_t *>calloc(nb, sizeof(Py_ssize_t))
        self.sid = <uint64_t *>malloc(capacity * sizeof(uint64_t))
        self.slen = <int32_t *>malloc(capacity * sizeof(int32_t))
        self.sbucket = <int32_t *>malloc(capacity * sizeof(int32_t))
        self.senq = <double *>malloc(capacity * sizeof(double))
        self.sexp = <double *>malloc(capacity * sizeof(double))
        self.sstate = <uint8_t *>calloc(capacity, sizeof(uint8_t))
        self.arena = <int32_t *>malloc(capacity * self.max_len * sizeof(int32_t))
        self.free_slots = <int32_t *>malloc(capacity * sizeof(int32_t))
        self.hkey = <uint64_t *>malloc((self.hmask + 1) * sizeof(uint64_t))
        self.hslot = <int32_t *>malloc((self.hmask + 1) * sizeof(int32_t))
        self.drop_cap = 64
        self.drop_id = <uint64_t *>malloc(self.drop_cap * sizeof(uint64_t))
        self.drop_reason = <uint8_t *>malloc(self.drop_cap * sizeof(uint8_t))
        self.st_batches = <int64_t *>calloc(nb, sizeof(int64_t))
        self.st_seqs = <int64_t *>calloc(nb, sizeof(int64_t))
        self.st_real = <int64_t *>calloc(nb, sizeof(int64_t))
        self.st_padded = <int64_t *>calloc(nb, sizeof(int64_t))
        self.st_wait = <double *>calloc(nb, sizeof(double))
        self._reserve_message(64)
        if (
            not self.blen or not self.target or not self.max_size or not self.delay
            or not self.len_to_bucket or not self.ring or not self.rhead
            or not self.rcount or not self.rcancelled or not self.sid or not self.slen
            or not self.sbucket or not self.senq or not self.sexp or not self.sstate
            or not self.arena or not self.free_slots or not self.hkey
            or not self.hslot or not self.drop_id or not self.drop_reason
            or not self.st_batches or not self.st_seqs or not self.st_real
            or not self.st_padded or not self.st_wait
        ):
            raise MemoryError("BucketCore: cannot allocate its queues")
        for b in range(nb):
            self.blen[b] = lengths[b]
            self.delay[b] = delays[b]
            self.max_size[b] = max_sizes[b]
            self.target[b] = max_sizes[b]
        b = 0
        for i in range(self.max_len + 1):
            while self.blen[b] < i:
                b += 1
            self.len_to_bucket[i] = <int32_t>b
        for i in range(capacity):  # pop order: slot 0 first
            self.free_slots[i] = <int32_t>(capacity - 1 - i)
        self.n_free = capacity
        for i in range(self.hmask + 1):
            self.hslot[i] = EMPTY
        self.min_expiry = INFINITY
        self._alloc_outputs(
            max(n * s for n, s in zip(lengths, max_sizes)), max(max_sizes)
        )

    def __dealloc__(self):
        free(self.blen); free(self.target); free(self.max_size); free(self.delay)
        free(self.len_to_bucket); free(self.ring); free(self.rhead)
        free(self.rcount)
        free(self.rcancelled); free(self.sid); free(self.slen); free(self.sbucket)
        free(self.senq); free(self.sexp); free(self.sstate); free(self.arena)
        free(self.free_slots); free(self.hkey); free(self.hslot)
        free(self.drop_id); free(self.drop_reason)
        free(self.st_batches); free(self.st_seqs); free(self.st_real)
        free(self.st_padded); free(self.st_wait)
        free(self.msg_id); free(self.msg_start); free(self.msg_len)
        free(self.msg_cell); free(self.msg_set)

    cdef _alloc_outputs(self, Py_ssize_t max_tokens, Py_ssize_t max_rows):
        cdef int32_t[::1] tok, lens
        cdef unsigned long long[::1] ids
        cdef double[::1] enq
        self.out_arrays, self.out_tokens, self.out_lengths = [], [], []
        self.out_ids, self.out_enq = [], []
        for k in range(N_OUT):
            tok_a = array("i", [self.pad_id]) * max_tokens
            len_a, id_a = array("i", [0]) * max_rows, array("Q", [0]) * max_rows
            enq_a = array("d", [0.0]) * max_rows
            tok, lens, ids, enq = tok_a, len_a, id_a, enq_a
            self.out_tok_p[k] = &tok[0]
            self.out_len_p[k] = &lens[0]
            self.out_id_p[k] = <uint64_t *>&ids[0]
            self.out_enq_p[k] = &enq[0]
            self.out_arrays.append((tok_a, len_a, id_a, enq_a))  # keep alive
            self.out_tokens.append(memoryview(tok_a).toreadonly())
            self.out_lengths.append(memoryview(len_a).toreadonly())
            self.out_ids.append(memoryview(id_a).toreadonly())
            self.out_enq.append(memoryview(enq_a).toreadonly())

    # ---- queries -------------------------------------------------------------

    def bucket_for(self, Py_ssize_t length):
        if length > self.max_len:
            return -1
        return self.len_to_bucket[length] if length > 0 else 0

    def batch_size(self, Py_ssize_t bucket):
        return self.target[self._check_bucket(bucket)]

    def max_batch_size(self, Py_ssize_t bucket):
        return self.max_size[self._check_bucket(bucket)]

    def set_batch_size(self, Py_ssize_t bucket, Py_ssize_t size):
        self._check_owner()
        cdef int b = self._check_bucket(bucket)
        self.target[b] = <int32_t>max(1, min(<Py_ssize_t>self.max_size[b], size))
        return self.target[b]

    def __len__(self):
        return self.capacity - self.n_free - self.n_cancelled

    def queued(self, Py_ssize_t bucket):
        cdef int b = self._check_bucket(bucket)
        return self.rcount[b] - self.rcancelled[b]

    def next_deadline(self):
        """Earliest head deadline; a cancelled head may make it early, never late."""
        cdef double deadline = INFINITY, d
        cdef int b
        for b in range(self.nb):
            if self.rcount[b]:
                d = self.senq[self._at(b, 0)] + self.delay[b]
                if d < deadline:
                    deadline = d
        return deadline

    def next_expiry(self):
        """Earliest ``expires_at`` queued; early, never late (packing leaves it
        early until a drop pass, which makes it exact again)."""
        return self.min_expiry

    def stats(self):
        cdef int b
        rows = []
        for b in range(self.nb):
            rows.append({
                "length": self.blen[b],
                "batches": self.st_batches[b],
                "sequences": self.st_seqs[b],
                "real_tokens": self.st_real[b],
                "padded_tokens": self.st_padded[b],
                "queue_wait_s_total": self.st_wait[b],
                "batch_size": self.target[b],
            })
        return rows

    def take_dropped(self):
        self._check_owner()
        cdef Py_ssize_t i
        dropped = [
            (self.drop_id[i], self.drop_reason[i]) for i in range(self.n_dropped)
        ]
        self.n_dropped = 0
        return dropped

    # ---- commands ------------------------------------------------------------

    def push(
        self,
        unsigned long long seq_id,
        tokens,
        double now,
        double expires_at=INFINITY,
    ):
        self._check_owner()
        cdef Py_buffer view
        _get_int32_buffer(tokens, &view)
        cdef Py_ssize_t cell, n = view.len // 4
        try:
            if n == 0 or n > self.max_len:
                raise ValueError(
                    f"sequence length {n} is outside [1, {self.max_len}]"
                )
            cell = self._probe(seq_id)
            if self.hslot[cell] != EMPTY:
                raise ValueError(f"sequence id {seq_id} is already queued")
            if self.n_free == 0:
                self._reserve_drops()
                self.busy = True
                with nogil:
                    self._drop(now)
                self.busy = False
                if self.n_free == 0:
                    raise QueueFull(f"{self.capacity} sequences already queued")
                cell = self._probe(seq_id)  # the drop may have moved entries
            # A few dozen instructions: not worth releasing the GIL for.
            self._push(seq_id, <const int32_t *>view.buf, n, now, expires_at, cell)
        finally:
            PyBuffer_Release(&view)
        return self.len_to_bucket[n]

    def push_many(
        self,
        seq_ids,
        tokens,
        offsets,
        double now,
        double expires_at=INFINITY,
    ):
        self._check_owner()
        cdef Py_buffer idv, tokv, offv
        # obj = NULL until acquired: PyBuffer_Release skips those.
        memset(&idv, 0, sizeof(Py_buffer))
        memset(&tokv, 0, sizeof(Py_buffer))
        memset(&offv, 0, sizeof(Py_buffer))
        try:
            _get_int_buffer(seq_ids, &idv, "seq_ids", "uint64", b"QL", 8, 8)
            _get_int32_buffer(tokens, &tokv)
            _get_int_buffer(
                offsets, &offv, "offsets", "int32 or int64", b"ilq", 4, 8
            )
            return self._push_many(&idv, &tokv, &offv, now, expires_at)
        finally:
            PyBuffer_Release(&offv)
            PyBuffer_Release(&tokv)
            PyBuffer_Release(&idv)

    cdef Py_ssize_t _push_many(
        self, Py_buffer *idv, Py_buffer *tokv, Py_buffer *offv,
        double now, double expires_at,
    ) except -1:
        cdef Py_ssize_t n = idv.len // 8, n_tok = tokv.len // 4
        cdef Py_ssize_t n_off = offv.len // offv.itemsize
        if n_off != n + 1:
            raise ValueError(
                f"offsets must hold n + 1 = {n + 1} entries, got {n_off}"
            )
        self._reserve_message(n)
        # 1. Check every sequence in order (as the twin), copying what is used.
        # With room for all (the usual case) each id is put in the map at once,
        # marked RESERVED: a second probe finds it, as does a repeat within the
        # message, and queuing writes the slot into the cell found here. Else
        # the map may lack room: repeats are found with a set of the ids.
        cdef const uint64_t *ids = <const uint64_t *>idv.buf
        cdef const char *offs = <const char *>offv.buf
        cdef bint wide = offv.itemsize == 8
        cdef bint reserve = n <= self.n_free
        cdef Py_ssize_t smask = _pow2_at_least(2 * n) - 1
        cdef Py_ssize_t i, j, cell
        cdef int64_t start = 0, end = _offset(offs, wide, 0)
        cdef uint64_t key = 0
        cdef int err = 0
        if not reserve:
            memset(self.msg_set, 0, (smask + 1) * sizeof(Py_ssize_t))
        for i in range(n):
            start = end
            end = _offset(offs, wide, i + 1)
            if not (0 <= start <= n_tok and 0 <= end <= n_tok):
                err = 1
                break
            if not 0 < end - start <= self.max_len:
                err = 2
                break
            key = ids[i]
            cell = self._probe(key)
            if self.hslot[cell] != EMPTY:
                err = 4 if self.hslot[cell] == RESERVED else 3
                break
            if reserve:
                self.hkey[cell] = key
                self.hslot[cell] = RESERVED
                self.msg_cell[i] = cell
            else:
                j = _hash(key) & smask
                while self.msg_set[j] and self.msg_id[self.msg_set[j] - 1] != key:
                    j = (j + 1) & smask
                if self.msg_set[j]:
                    err = 4
                    break
                self.msg_set[j] = i + 1
            self.msg_id[i] = key
            self.msg_start[i] = <Py_ssize_t>start
            self.msg_len[i] = <int32_t>(end - start)
        if err:
            if reserve:
                for j in range(i):  # sequences 0..i-1 were reserved
                    self._erase(self.msg_id[j])
            if err == 1:
                raise ValueError(
                    f"sequence {i}: offsets [{start}, {end}) are outside the "
                    f"{n_tok} tokens"
                )
            if err == 2:
                raise ValueError(
                    f"sequence length {end - start} is outside [1, {self.max_len}] "
                    f"(sequence {i})"
                )
            if err == 3:
                raise ValueError(f"sequence id {key} is already queued")
            raise ValueError(f"sequence id {key} appears twice in the message")
        # 2. Room for all n, after dropping cancelled and expired entries.
        if not reserve:
            self._reserve_drops()
            self.busy = True
            with nogil:
                self._drop(now)
            self.busy = False
            if n > self.n_free:
                raise QueueFull(
                    message_full(self.capacity, self.capacity - self.n_free, n)
                )
        # 3. Queue them in order, from the checked copies.
        cdef const int32_t *flat = <const int32_t *>tokv.buf
        self.busy = True
        with nogil:
            for i in range(n):
                key = self.msg_id[i]
                cell = self.msg_cell[i] if reserve else self._probe(key)
                self._push(
                    key, flat + self.msg_start[i], self.msg_len[i], now, expires_at,
                    cell,
                )
        self.busy = False
        return n

    cdef int _reserve_message(self, Py_ssize_t n) except -1:
        """Scratch for a message of n sequences and the set of its ids."""
        cdef Py_ssize_t cap, cells
        if n > self.msg_cap:
            cap = max(n, 2 * self.msg_cap)
            self.msg_id = <uint64_t *>_grow(self.msg_id, cap * sizeof(uint64_t))
            self.msg_start = <Py_ssize_t *>_grow(
                self.msg_start, cap * sizeof(Py_ssize_t)
            )
            self.msg_len = <int32_t *>_grow(self.msg_len, cap * sizeof(int32_t))
            self.msg_cell = <Py_ssize_t *>_grow(
                self.msg_cell, cap * sizeof(Py_ssize_t)
            )
            self.msg_cap = cap
        cells = _pow2_at_least(2 * n)
        if cells > self.msg_set_cap:
            self.msg_set = <Py_ssize_t *>_grow(
                self.msg_set, cells * sizeof(Py_ssize_t)
            )
            self.msg_set_cap = cells
        return 0

    def cancel(self, seq_id):
        self._check_owner()
        cdef uint64_t key
        seq_id = operator.index(seq_id)
        if not 0 <= seq_id <= 0xFFFFFFFFFFFFFFFF:
            return False
        key = seq_id
        cdef int32_t slot = self._find(key)
        if slot == EMPTY:
            return False
        self._erase(key)
        self.sstate[slot] = CANCELLED
        self.rcancelled[self.sbucket[slot]] += 1
        self.n_cancelled += 1
        return True

    def expire(self, double now):
        """Drop cancelled and expired entries now, as ``next_batch`` does first,
        without forming a batch (for when no engine can take one)."""
        self._check_owner()
        self._reserve_drops()
        self._drop(now)

    def next_batch(self, double now, bint eager=False):
        cdef int b
        cdef Py_ssize_t size
        cdef int64_t real
        cdef int k = self.out_next
        self._check_owner()
        self._reserve_drops()
        self.busy = True
        with nogil:
            # 1. Drop cancelled and expired entries.
            self._drop(now)
            # 2-3. Among ready buckets, the one with the earliest head deadline.
            b = self._select(now, eager)
            # 4. Pop up to the target size FIFO and pack the padded rows.
            if b >= 0:
                size = self._pack(b, now, k, &real)
        self.busy = False
        if b < 0:
            return None
        self.out_next = (k + 1) % N_OUT
        cdef Py_ssize_t length = self.blen[b]
        return Batch(
            b,
            length,
            self.out_ids[k][:size],
            self.out_lengths[k][:size],
            self.out_tokens[k][: size * length],
            self.out_enq[k][:size],
            real,
        )

    # ---- the phases (nogil) --------------------------------------------------

    cdef inline int32_t _at(self, int b, Py_ssize_t i) noexcept nogil:
        """Slot index of the i-th entry of bucket b's ring."""
        cdef Py_ssize_t pos = (self.rhead[b] + i) & self.ring_mask
        return self.ring[b * (self.ring_mask + 1) + pos]

    cdef void _push(
        self, uint64_t seq_id, const int32_t *tokens, Py_ssize_t n,
        double now, double expires_at, Py_ssize_t cell,
    ) noexcept nogil:
        """Queue a sequence whose id is absent; ``cell``: its free map cell."""
        cdef int32_t b = self.len_to_bucket[n]
        self.n_free -= 1
        cdef int32_t slot = self.free_slots[self.n_free]
        memcpy(self.arena + <Py_ssize_t>slot * self.max_len, tokens, n * 4)
        self.sid[slot] = seq_id
        self.slen[slot] = <int32_t>n
        self.sbucket[slot] = b
        self.senq[slot] = now
        self.sexp[slot] = expires_at
        self.sstate[slot] = LIVE
        cdef Py_ssize_t pos = (self.rhead[b] + self.rcount[b]) & self.ring_mask
        self.ring[b * (self.ring_mask + 1) + pos] = slot
        self.rcount[b] += 1
        self.hkey[cell] = seq_id
        self.hslot[cell] = slot
        if expires_at < self.min_expiry:
            self.min_expiry = expires_at

    cdef void _drop(self, double now) noexcept nogil:
        if self.n_cancelled == 0 and self.min_expiry > now:
            return  # nothing can be dropped: skip the scan
        cdef double min_expiry = INFINITY
        cdef Py_ssize_t i, kept, base, ring_size = self.ring_mask + 1
        cdef int b
        cdef int32_t slot
        for b in range(self.nb):
            base = b * ring_size
            kept = 0
            for i in range(self.rcount[b]):
                slot = self._at(b, i)
                if self.sstate[slot] == CANCELLED:
                    self._record_drop(self.sid[slot], DROP_CANCELLED)
                elif self.sexp[slot] <= now:
                    self._record_drop(self.sid[slot], DROP_EXPIRED)
                    self._erase(self.sid[slot])
                else:
                    self.ring[base + ((self.rhead[b] + kept) & self.ring_mask)] = slot
                    kept += 1
                    if self.sexp[slot] < min_expiry:
                        min_expiry = self.sexp[slot]
                    continue
                self._free(slot)
            self.rcount[b] = kept
            self.rcancelled[b] = 0
        self.n_cancelled = 0
        self.min_expiry = min_expiry

    cdef int _select(self, double now, bint eager) noexcept nogil:
        cdef int b, best = -1
        cdef double deadline, best_deadline = INFINITY
        for b in range(self.nb):
            if self.rcount[b] == 0:
                continue
            deadline = self.senq[self._at(b, 0)] + self.delay[b]
            if (
                (eager or self.rcount[b] >= self.target[b] or deadline <= now)
                and (best < 0 or deadline < best_deadline)
            ):
                best = b
                best_deadline = deadline
        return best

    cdef Py_ssize_t _pack(
        self, int b, double now, int k, int64_t *real
    ) noexcept nogil:
        cdef Py_ssize_t size = min(self.rcount[b], <Py_ssize_t>self.target[b])
        cdef Py_ssize_t row, j, length = self.blen[b]
        cdef int32_t slot, n
        cdef int32_t *dst
        cdef int32_t pad = self.pad_id
        cdef int64_t total = 0
        # Pad the whole batch, then copy each row over it: one long loop, where
        # a pad loop per row of varying length mispredicts a branch or two
        # (a fifth of next_batch's time).
        dst = self.out_tok_p[k]
        for j in range(size * length):
            dst[j] = pad
        for row in range(size):
            slot = self._at(b, row)
            n = self.slen[slot]
            dst = self.out_tok_p[k] + row * length
            memcpy(dst, self.arena + <Py_ssize_t>slot * self.max_len, n * 4)
            self.out_len_p[k][row] = n
            self.out_id_p[k][row] = self.sid[slot]
            self.out_enq_p[k][row] = self.senq[slot]
            self.st_wait[b] += now - self.senq[slot]
            total += n
            self._erase(self.sid[slot])
            self._free(slot)
        self.rhead[b] = (self.rhead[b] + size) & self.ring_mask
        self.rcount[b] -= size
        self.st_batches[b] += 1
        self.st_seqs[b] += size
        self.st_real[b] += total
        self.st_padded[b] += size * length
        real[0] = total
        return size

    cdef inline void _free(self, int32_t slot) noexcept nogil:
        self.sstate[slot] = FREE
        self.free_slots[self.n_free] = slot
        self.n_free += 1

    cdef inline void _record_drop(self, uint64_t seq_id, uint8_t reason) noexcept nogil:
        self.drop_id[self.n_dropped] = seq_id
        self.drop_reason[self.n_dropped] = reason
        self.n_dropped += 1

    cdef int _reserve_drops(self) except -1:
        """Make room to record every held entry as dropped (before nogil)."""
        cdef Py_ssize_t need = self.n_dropped + self.capacity - self.n_free
        if need <= self.drop_cap:
            return 0
        cdef Py_ssize_t cap = max(need, 2 * self.drop_cap)
        cdef uint64_t *ids = <uint64_t *>realloc(self.drop_id, cap * sizeof(uint64_t))
        if not ids:
            raise MemoryError()
        self.drop_id = ids
        cdef uint8_t *reasons = <uint8_t *>realloc(self.drop_reason, cap)
        if not reasons:
            raise MemoryError()
        self.drop_reason = reasons
        self.drop_cap = cap
        return 0

    # ---- id -> slot hash map -----------------------------------------------

    cdef inline Py_ssize_t _probe(self, uint64_t key) noexcept nogil:
        """The cell holding ``key``, else the empty cell where it would go."""
        cdef Py_ssize_t i = _hash(key) & self.hmask
        while self.hslot[i] != EMPTY and self.hkey[i] != key:
            i = (i + 1) & self.hmask
        return i

    cdef inline int32_t _find(self, uint64_t key) noexcept nogil:
        return self.hslot[self._probe(key)]

    cdef void _erase(self, uint64_t key) noexcept nogil:
        cdef Py_ssize_t i = self._probe(key), j, home
        cdef bint move
        if self.hslot[i] == EMPTY:
            return
        # Backward-shift deletion: pull later entries of the run into the gap.
        j = i
        while True:
            j = (j + 1) & self.hmask
            if self.hslot[j] == EMPTY:
                break
            home = _hash(self.hkey[j]) & self.hmask
            # Move j into the gap at i unless its home lies cyclically in (i, j].
            if i <= j:
                move = home <= i or home > j
            else:
                move = home <= i and home > j
            if move:
                self.hkey[i] = self.hkey[j]
                self.hslot[i] = self.hslot[j]
                i = j
        self.hslot[i] = EMPTY

    cdef inline int _check_owner(self) except -1:
        if self.busy:
            raise RuntimeError("BucketCore called from a second thread while packing")
        return 0

    cdef int _check_bucket(self, Py_ssize_t bucket) except -1:
        if not 0 <= bucket < self.nb:
            raise IndexError(f"bucket index {bucket} out of range")
        return <int>bucket


cdef inline int64_t _offset(const char *offs, bint wide, Py_ssize_t i) noexcept nogil:
    if wide:
        return (<const int64_t *>offs)[i]
    return (<const int32_t *>offs)[i]


cdef void *_grow(void *p, size_t size) except NULL:
    """realloc, or MemoryError (``p`` stays valid and owned by the caller)."""
    cdef void *q = realloc(p, size)
    if not q:
        raise MemoryError()
    return q


cdef int _get_int_buffer(
    object obj, Py_buffer *view, str name, str what, const char *codes,
    Py_ssize_t size_a, Py_ssize_t size_b,
) except -1:
    """Acquire ``obj`` as a 1-D C-contiguous integer buffer, else ValueError.

    Accepted: a struct code of ``codes`` (native byte order) with an item size
    of ``size_a`` or ``size_b`` bytes; the twin's ``_int_array`` rules.
    """
    PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO)
    cdef const char *fmt = view.format
    if fmt == NULL:
        fmt = b"B"
    if fmt[0] in b"@=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
        fmt += 1
    if (
        view.ndim != 1
        or fmt[0] == 0
        or fmt[1] != 0
        or strchr(codes, fmt[0]) == NULL
        or (view.itemsize != size_a and view.itemsize != size_b)
    ):
        format = (<bytes>view.format).decode() if view.format else "B"
        ndim = view.ndim
        PyBuffer_Release(view)
        raise ValueError(
            f"{name} must be a 1-D {what} buffer, got format {format!r} "
            f"with {ndim} dimension(s)"
        )
    if not PyBuffer_IsContiguous(view, b"C"):
        PyBuffer_Release(view)
        raise ValueError(f"{name} must be C-contiguous")
    return 0


cdef int _get_int32_buffer(object tokens, Py_buffer *view) except -1:
    """Acquire ``tokens`` as a 1-D C-contiguous int32 buffer, else ValueError.

    The raw buffer protocol instead of a typed memoryview: acquiring one costs
    about 90 ns, half of a push.
    """
    PyObject_GetBuffer(tokens, view, PyBUF_RECORDS_RO)
    cdef const char *fmt = view.format
    if fmt == NULL:
        fmt = b"B"
    if fmt[0] in b"@=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
        fmt += 1
    if view.ndim != 1 or view.itemsize != 4 or fmt[0] != b"i" or fmt[1] != 0:
        format = (<bytes>view.format).decode() if view.format else "B"
        ndim = view.ndim
        PyBuffer_Release(view)
        raise ValueError(
            f"tokens must be a 1-D int32 buffer, got format {format!r} "
            f"with {ndim} dimension(s)"
        )
    if not PyBuffer_IsContiguous(view, b"C"):
        PyBuffer_Release(view)
        raise ValueError("tokens must be C-contiguous")
    return 0
