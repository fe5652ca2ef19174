"""Drafters whose proposals the engine computes for all rows in one compiled call per step.

A drafter's `propose` takes a list of `CallState`s and returns a list of arrays: per row, a Python
call into the drafter and back. For a drafter whose rule is a compiled function of the call's token
history, the engine can instead run that rule over every row in one compiled loop, reading the
histories where they lie (the token arena) and writing the drafts where the scheduler keeps them.
`BATCHED` maps such a drafter class to its batch form; each entry must return exactly what the
drafter's `propose` returns (tests/test_engine_batched.py and tests/test_engine_fast_paths.py check
it row by row, against `propose` and against a brute-force search).

`ngram`: `NgramDrafter.propose` is `propose_ngram(row.tokens, min_n, max_n, max_len)` per row: the
earliest occurrence (ending at or before len − 2) of the longest suffix n-gram, n in [min_n, max_n],
then up to max_len tokens after it. `ngram_match` finds it by scanning the whole history, ~8 µs for
the 13–20k-token histories of an agent trace, at every proposal. Here the same answer comes from an
incremental index instead:

- A row's history is tokens[off:off + L] of the arena, and the arena never changes: a call's history
  only grows, and an agent's next call that extends the previous one is laid at the same offset
  (trace/io.py), so one index per arena offset (a *region*) serves every call and step there.
- The index maps (region, n, n-gram) → the end of its first occurrence, for every n-gram of every
  n in [min_n, max_n] ending at positions 0 … upto − 1 of the region. Positions are added in
  order and an n-gram already present is never overwritten, so each entry is the earliest
  occurrence. A proposal for a history of length L first extends its region to upto ≥ L − 1 (the
  tokens appended since the region's last proposal), then looks up the suffix n-gram for n =
  max_n … min_n: the first n whose entry ends at ≤ L − 2 is the longest n that occurs, and the
  entry is its earliest occurrence — exactly `ngram_match`'s answer. (If the region was indexed
  further by a longer history at the same offset — a replicate copy — an entry past L − 2 means no
  occurrence within this history: the earliest one is already too late.)
- One open-addressing table holds all regions' entries (the n-gram's 64-bit hash, its region's
  offset, its end and n); lookups compare the tokens themselves, so a hash collision costs a probe,
  never a wrong answer. It doubles as it fills, up to `NgramIndex.max_capacity` slots; past that it
  is emptied and regions are re-indexed when they next propose (the index is a cache: a rebuild
  gives the same entries).

State lives on the drafter object (`drafter._prompt_index`), tied to the arena it indexes; a new
arena (a new simulation, or a test's array) starts a new index.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
from numba import njit

from agentspec_sim.drafters import ngram
from agentspec_sim.drafters.base import BaseDrafter
from agentspec_sim.engine.kernel_cache import clear_if_changed

clear_if_changed(__file__, [ngram.__file__])  # `_ngram_rows_scan` compiles in ngram.py's ngram_match

_MIX = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xFF51AFD7ED558CCD)
_MAX_INDEXED_N = 255  # n is packed in the low byte of an entry's value
NEED_REGIONS = -1  # kernel status (counts[2]): the region table is half full


@njit(cache=True, nogil=True)
def _ngram_rows_scan(tokens, starts, lengths, max_lens, min_n, max_n, draft_start, draft_len):
    """Reference batch form: `ngram_match` on every row (kept for max_n > 255 and for tests)."""
    for i in range(starts.shape[0]):
        draft_start[i] = starts[i]
        draft_len[i] = 0
        if max_lens[i] <= 0:
            continue
        start, _ = ngram.ngram_match(tokens[starts[i]:starts[i] + lengths[i]], min_n, max_n)
        if start >= 0:
            draft_start[i] = starts[i] + start
            draft_len[i] = min(max_lens[i], lengths[i] - start)


@njit(cache=True, nogil=True, inline="always")
def _gram_hash(tokens, end, n, off):
    """64-bit hash of (region offset, n, tokens[end − n + 1 … end]); never 0 (0 marks an empty slot)."""
    h = (np.uint64(off) * _MIX) ^ np.uint64(n)
    for j in range(end - n + 1, end + 1):
        h = (h ^ np.uint64(tokens[j])) * _MIX2
        h ^= h >> np.uint64(29)
    return h | np.uint64(1)


@njit(cache=True, nogil=True, inline="always")
def _same_gram(tokens, a, b, n):
    j = 0
    while j < n and tokens[a - j] == tokens[b - j]:
        j += 1
    return j == n


@njit(cache=True, nogil=True)
def _find(tokens, e_hash, e_off, e_val, off, n, end):
    """End of the first occurrence of the n-gram ending at `end` in region `off`, or −1 if not indexed."""
    mask = np.uint64(e_hash.shape[0] - 1)
    h = _gram_hash(tokens, end, n, off)
    s = h & mask
    while e_hash[s] != 0:
        if e_hash[s] == h and e_off[s] == off and (e_val[s] & 255) == n and _same_gram(tokens, e_val[s] >> 8, end, n):
            return e_val[s] >> 8
        s = (s + np.uint64(1)) & mask
    return -1


@njit(cache=True, nogil=True)
def _insert(tokens, e_hash, e_off, e_val, off, n, end):
    """Add the n-gram ending at `end` of region `off` unless already present (earlier ends come first)."""
    mask = np.uint64(e_hash.shape[0] - 1)
    h = _gram_hash(tokens, end, n, off)
    s = h & mask
    while e_hash[s] != 0:
        if e_hash[s] == h and e_off[s] == off and (e_val[s] & 255) == n and _same_gram(tokens, e_val[s] >> 8, end, n):
            return 0
        s = (s + np.uint64(1)) & mask
    e_hash[s] = h
    e_off[s] = off
    e_val[s] = (end << 8) | n
    return 1


@njit(cache=True, nogil=True)
def _region(r_off, r_upto, off):
    """Slot of region `off` in the region table (inserted with upto = 0 if new; the caller keeps it below half full)."""
    mask = r_off.shape[0] - 1
    s = (off * 0x9E3779B1) & mask
    while r_off[s] != -1:
        if r_off[s] == off:
            return s, False
        s = (s + 1) & mask
    r_off[s] = off
    r_upto[s] = 0
    return s, True


@njit(cache=True, nogil=True)
def _ngram_rows_indexed(tokens, starts, lengths, max_lens, min_n, max_n, draft_start, draft_len,
                        e_hash, e_off, e_val, r_off, r_upto, counts, first_row):
    """`_ngram_rows_scan`'s drafts from the incremental index, rows first_row …; returns the row it
    stopped at (all rows: done). It stops before a row whose entries would fill the table past
    half (counts[2] = how many it needs) or when the region table is half full (counts[2] =
    NEED_REGIONS); the caller makes room and calls again from that row. counts = [entries, regions, need]."""
    span = max_n - min_n + 1
    for i in range(first_row, starts.shape[0]):
        off, length = starts[i], lengths[i]
        draft_start[i] = off
        draft_len[i] = 0
        if max_lens[i] <= 0:
            continue
        if 2 * (counts[1] + 1) > r_off.shape[0]:
            counts[2] = NEED_REGIONS
            return i
        slot, new = _region(r_off, r_upto, off)
        if new:
            counts[1] += 1
        upto = r_upto[slot]
        if upto < length - 1:  # index the n-grams ending at the positions appended since
            need = (length - 1 - upto) * span
            if 2 * (counts[0] + need) > e_hash.shape[0]:
                counts[2] = need
                return i
            added = 0
            for e in range(upto, length - 1):
                for n in range(min_n, min(max_n, e + 1) + 1):
                    added += _insert(tokens, e_hash, e_off, e_val, off, n, off + e)
            counts[0] += added
            r_upto[slot] = length - 1
        last = off + length - 1
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            end = _find(tokens, e_hash, e_off, e_val, off, n, last)
            if 0 <= end <= last - 1:
                start = end + 1 - off
                draft_start[i] = end + 1
                draft_len[i] = min(max_lens[i], length - start)
                break
    return starts.shape[0]


@njit(cache=True, nogil=True)
def _rehash(tokens, e_hash, e_off, e_val, n_hash, n_off, n_val):
    for s in range(e_hash.shape[0]):
        if e_hash[s] != 0:
            mask = np.uint64(n_hash.shape[0] - 1)
            t = e_hash[s] & mask
            while n_hash[t] != 0:
                t = (t + np.uint64(1)) & mask
            n_hash[t], n_off[t], n_val[t] = e_hash[s], e_off[s], e_val[s]


@njit(cache=True, nogil=True)
def _rehash_regions(r_off, r_upto, n_off, n_upto):
    for s in range(r_off.shape[0]):
        if r_off[s] != -1:
            slot, _ = _region(n_off, n_upto, r_off[s])
            n_upto[slot] = r_upto[s]


class NgramIndex:
    """The incremental prompt-lookup index of one arena (see the module docstring)."""

    initial_capacity = 1 << 16
    max_capacity = 1 << 23  # 8M slots × 24 bytes = 192 MiB before it is emptied and rebuilt on demand

    def __init__(self, tokens: np.ndarray, min_n: int, max_n: int) -> None:
        self.arena = weakref.ref(tokens)
        self.min_n, self.max_n = min_n, max_n
        self.counts = np.zeros(3, dtype=np.int64)
        self.rebuilds = 0  # times the table was emptied at max_capacity (for benchmarks)
        self._allocate(self.initial_capacity)
        self._allocate_regions(64)

    def serves(self, tokens: np.ndarray, min_n: int, max_n: int) -> bool:
        return self.arena() is tokens and (self.min_n, self.max_n) == (min_n, max_n)

    def _allocate(self, capacity: int) -> None:
        self.e_hash = np.zeros(capacity, dtype=np.uint64)
        self.e_off = np.zeros(capacity, dtype=np.int64)
        self.e_val = np.zeros(capacity, dtype=np.int64)
        self.counts[0] = 0

    def _allocate_regions(self, capacity: int) -> None:
        self.r_off = np.full(capacity, -1, dtype=np.int64)
        self.r_upto = np.zeros(capacity, dtype=np.int64)
        self.counts[1] = 0

    def _make_room(self, tokens: np.ndarray) -> None:
        need = int(self.counts[2])
        if need == NEED_REGIONS:
            old_off, old_upto = self.r_off, self.r_upto
            self._allocate_regions(2 * old_off.shape[0])
            _rehash_regions(old_off, old_upto, self.r_off, self.r_upto)
            self.counts[1] = int(np.count_nonzero(self.r_off != -1))
            return
        capacity = self.e_hash.shape[0]
        if capacity < self.max_capacity:
            old = self.e_hash, self.e_off, self.e_val
            entries = int(self.counts[0])
            while 2 * (entries + need) > capacity:
                capacity *= 2
            self._allocate(capacity)
            _rehash(tokens, *old, self.e_hash, self.e_off, self.e_val)
            self.counts[0] = entries
            return
        # Full: forget everything; each region is re-indexed from its start when it next proposes.
        self.rebuilds += 1
        while 2 * need > capacity:  # one history longer than the whole table: let it grow past the cap
            capacity *= 2
        self._allocate(capacity)
        self._allocate_regions(self.r_off.shape[0])

    def propose(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, max_lens: np.ndarray,
                draft_start: np.ndarray, draft_len: np.ndarray) -> None:
        row = 0
        while True:
            row = _ngram_rows_indexed(tokens, starts, lengths, max_lens, self.min_n, self.max_n, draft_start,
                                      draft_len, self.e_hash, self.e_off, self.e_val, self.r_off, self.r_upto,
                                      self.counts, row)
            if row == starts.shape[0]:
                return
            self._make_room(tokens)


def propose_ngram_rows(drafter: ngram.NgramDrafter, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       max_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(draft start, draft length) in `tokens` of each row's `NgramDrafter.propose` draft."""
    draft_start = np.empty(starts.shape[0], dtype=np.int64)
    draft_len = np.empty(starts.shape[0], dtype=np.int64)
    starts = starts.astype(np.int64, copy=False)
    lengths = lengths.astype(np.int64, copy=False)
    max_lens = max_lens.astype(np.int64, copy=False)
    lo, hi = drafter.min_n, drafter.max_n
    if hi > _MAX_INDEXED_N:
        _ngram_rows_scan(tokens, starts, lengths, max_lens, lo, hi, draft_start, draft_len)
        return draft_start, draft_len
    index = getattr(drafter, "_prompt_index", None)
    if index is None or not index.serves(tokens, lo, hi):
        index = drafter._prompt_index = NgramIndex(tokens, lo, hi)
    index.propose(tokens, starts, lengths, max_lens, draft_start, draft_len)
    return draft_start, draft_len


def propose_ngram_rows_scan(drafter: ngram.NgramDrafter, tokens: np.ndarray, starts: np.ndarray,
                            lengths: np.ndarray, max_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`propose_ngram_rows` by scanning every history with `ngram_match` (the reference; for tests and benchmarks)."""
    draft_start = np.empty(starts.shape[0], dtype=np.int64)
    draft_len = np.empty(starts.shape[0], dtype=np.int64)
    _ngram_rows_scan(tokens, starts.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False),
                     max_lens.astype(np.int64, copy=False), drafter.min_n, drafter.max_n, draft_start, draft_len)
    return draft_start, draft_len


# drafter class → (drafter, token arena, history starts, history lengths, max draft lengths) → (starts, lengths)
BATCHED: dict[type[BaseDrafter], Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    ngram.NgramDrafter: propose_ngram_rows,
}
