"""The n-gram proposers' incremental index: every row's draft in one compiled call per step.

A drafter's `propose` takes a list of `CallState`s and returns a list of arrays: per row, a Python
call into the drafter and back. The n-gram rules are compiled functions of the call's token history,
so their fast path (drafters/ngram/fastpath.py) runs the rule over every row in one compiled loop
instead, reading the histories where they lie (the token arena) and writing the drafts where the
engine keeps them. Each batch form must return exactly what the drafter's `propose` returns
(tests/test_engine_batched.py and tests/test_engine_fast_paths.py check it row by row, against
`propose` and against a brute-force search).

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

A run normally drafts from a table of every position's match made once per workload by this index
(drafters/ngram/tables.py); the index drafts itself where tables are off or copies of a trace each
have their own drafter.

`ngram-v2` (Model Runner V2: the *rightmost* occurrence of the longest n-gram, k slots padded with
the last token) uses the same index with each entry moved to the n-gram's latest end as positions
are added (`ngram_v2_rows_indexed`). Its drafts are not arena stretches: the compiled steps draft
with it (drafters/ngram/fastpath.py), and the event loop calls `NgramV2Drafter.propose` (the scan)
for the steps left to it.
"""

from __future__ import annotations

import weakref

import numpy as np
from numba import njit

from agentspec_sim.drafters.ngram import rule as ngram
from agentspec_sim.drafters.ngram import v2 as ngram_v2
from agentspec_sim.host.kernel_cache import clear_if_changed

# `_ngram_rows_scan` compiles in ngram.py's ngram_match, `ngram_v2_rows_indexed` in ngram_v2.py's match.
clear_if_changed(__file__, [ngram.__file__, ngram_v2.__file__])

_MIX = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xFF51AFD7ED558CCD)
MAX_INDEXED_N = 255  # n is packed in the low byte of an entry's value
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
    """64-bit hash of (region offset, n, tokens[end − n + 1 … end]); odd, so never 0 (0 marks an empty slot)."""
    h = (np.uint64(off) * _MIX) ^ np.uint64(n)
    for j in range(end - n + 1, end + 1):
        h = (h ^ np.uint64(tokens[j])) * _MIX2
        h ^= h >> np.uint64(29)
    return np.int64(h | np.uint64(1))


@njit(cache=True, nogil=True, inline="always")
def _same_gram(tokens, a, b, n):
    j = 0
    while j < n and tokens[a - j] == tokens[b - j]:
        j += 1
    return j == n


@njit(cache=True, nogil=True)
def _find(tokens, entries, off, n, end):
    """End of the first occurrence of the n-gram ending at `end` in region `off`, or −1 if not indexed."""
    mask = entries.shape[0] - 1
    h = _gram_hash(tokens, end, n, off)
    s = (h >> 1) & mask
    while entries[s, 0] != 0:
        e = entries[s]
        if e[0] == h and e[1] == off and (e[2] & 255) == n and _same_gram(tokens, e[2] >> 8, end, n):
            return e[2] >> 8
        s = (s + 1) & mask
    return -1


@njit(cache=True, nogil=True)
def _insert(tokens, entries, off, n, end, latest):
    """Add the n-gram ending at `end` of region `off`; if already present, keep its entry (the earliest
    end: ends come in order) or, with `latest`, move it to `end` (the rightmost)."""
    mask = entries.shape[0] - 1
    h = _gram_hash(tokens, end, n, off)
    s = (h >> 1) & mask
    while entries[s, 0] != 0:
        e = entries[s]
        if e[0] == h and e[1] == off and (e[2] & 255) == n and _same_gram(tokens, e[2] >> 8, end, n):
            if latest:
                entries[s, 2] = (end << 8) | n
            return 0
        s = (s + 1) & mask
    entries[s, 0] = h
    entries[s, 1] = off
    entries[s, 2] = (end << 8) | n
    return 1


@njit(cache=True, nogil=True)
def _region(regions, off):
    """Row of region `off` in the region table ([offset, upto], offset −1: empty), inserted with upto = 0
    if new (the caller keeps the table below half full); second value: whether it was new."""
    mask = regions.shape[0] - 1
    s = (off * 0x9E3779B1) & mask
    while regions[s, 0] != -1:
        if regions[s, 0] == off:
            return s, False
        s = (s + 1) & mask
    regions[s, 0] = off
    regions[s, 1] = 0
    return s, True


@njit(cache=True, nogil=True)
def _index_region(tokens, entries, regions, counts, off, length, min_n, max_n, latest):
    """Extend region `off`'s entries to the n-grams ending at positions ≤ length − 2; False (entries not
    extended) when the tables lack room: counts[2] = entries needed, or NEED_REGIONS."""
    if 2 * (counts[1] + 1) > regions.shape[0]:
        counts[2] = NEED_REGIONS
        return False
    slot, new = _region(regions, off)
    if new:
        counts[1] += 1
    upto = regions[slot, 1]
    if upto < length - 1:  # index the n-grams ending at the positions appended since
        need = (length - 1 - upto) * (max_n - min_n + 1)
        if 2 * (counts[0] + need) > entries.shape[0]:
            counts[2] = need
            return False
        added = 0
        for e in range(upto, length - 1):
            for n in range(min_n, min(max_n, e + 1) + 1):
                added += _insert(tokens, entries, off, n, off + e, latest)
        counts[0] += added
        regions[slot, 1] = length - 1
    return True


@njit(cache=True, nogil=True)
def _ngram_rows_indexed(tokens, starts, lengths, max_lens, min_n, max_n, drafts, entries, regions, counts,
                        first_row):
    """`_ngram_rows_scan`'s drafts (drafts[:, i] = start, length) from the incremental index, rows
    first_row …; returns the row it stopped at (all rows: done). It stops before a row whose entries
    would fill the table past half (counts[2] = how many it needs) or when the region table is half
    full (counts[2] = NEED_REGIONS); the caller makes room and calls again from that row.
    counts = [entries, regions, need]."""
    for i in range(first_row, starts.shape[0]):
        off, length = starts[i], lengths[i]
        drafts[0, i] = off
        drafts[1, i] = 0
        if max_lens[i] <= 0:
            continue
        if not _index_region(tokens, entries, regions, counts, off, length, min_n, max_n, False):
            return i
        last = off + length - 1
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            end = _find(tokens, entries, off, n, last)
            if 0 <= end <= last - 1:
                drafts[0, i] = end + 1
                drafts[1, i] = min(max_lens[i], off + length - end - 1)
                break
    return starts.shape[0]


@njit(cache=True, nogil=True)
def ngram_v2_rows_indexed(tokens, starts, lengths, min_n, max_n, match, entries, regions, counts, first_row):
    """`ngram_v2.ngram_v2_match` of rows first_row … from an index of *rightmost* ends: match[i] = where
    row i's draft starts in the arena (after the rightmost occurrence, ending at ≤ len − 2, of the
    longest suffix n-gram), or −1. The first n from max_n down with an entry decides: an entry at or
    before len − 2 is the rightmost occurrence there (none lies between it and the indexed end); one
    past it (the region indexed further by a longer history at this offset, e.g. a replicate copy)
    leaves the row to the scan. Same stop/resume protocol as `_ngram_rows_indexed`."""
    for i in range(first_row, starts.shape[0]):
        off, length = starts[i], lengths[i]
        match[i] = -1
        if not _index_region(tokens, entries, regions, counts, off, length, min_n, max_n, True):
            return i
        last = off + length - 1
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            end = _find(tokens, entries, off, n, last)
            if end < 0:
                continue
            if end <= last - 1:
                match[i] = end + 1
            else:
                start, _ = ngram_v2.ngram_v2_match(tokens[off:off + length], min_n, max_n)
                match[i] = off + start if start >= 0 else -1
            break
    return starts.shape[0]


@njit(cache=True, nogil=True)
def _rehash(entries, grown):
    mask = grown.shape[0] - 1
    for s in range(entries.shape[0]):
        if entries[s, 0] != 0:
            t = (entries[s, 0] >> 1) & mask
            while grown[t, 0] != 0:
                t = (t + 1) & mask
            grown[t] = entries[s]


@njit(cache=True, nogil=True)
def _rehash_regions(regions, grown):
    for s in range(regions.shape[0]):
        if regions[s, 0] != -1:
            slot, _ = _region(grown, regions[s, 0])
            grown[slot, 1] = regions[s, 1]


def _filled(shape: tuple[int, int], value: int) -> np.ndarray:
    # Written once, in order: on some VMs a never-written page read at random costs ~100 ns per
    # element (engine/request.py `zeros`), and the table is read at random.
    out = np.empty(shape, dtype=np.int64)
    out.fill(value)
    return out


class NgramIndex:
    """The incremental prompt-lookup index of one arena (see the module docstring)."""

    initial_capacity = 1 << 16
    max_capacity = 1 << 23  # 8M slots × 24 bytes = 192 MiB before it is emptied and rebuilt on demand

    def __init__(self, tokens: np.ndarray, min_n: int, max_n: int, rightmost: bool = False) -> None:
        self.arena = weakref.ref(tokens)
        self.min_n, self.max_n = min_n, max_n
        self.rightmost = rightmost  # entries hold each n-gram's last end (ngram-v2), not its first (ngram)
        self.counts = np.zeros(3, dtype=np.int64)
        self.rebuilds = 0  # times the table was emptied at max_capacity (for benchmarks)
        # Sized for the arena up front where it fits (an arena's distinct n-grams: about half its tokens).
        capacity = self.initial_capacity
        while capacity < min(self.max_capacity, tokens.shape[0] * (max_n - min_n + 1)):
            capacity *= 2
        self.entries = _filled((capacity, 3), 0)
        self.regions = _filled((64, 2), -1)

    def serves(self, tokens: np.ndarray, min_n: int, max_n: int, rightmost: bool) -> bool:
        return self.arena() is tokens and (self.min_n, self.max_n, self.rightmost) == (min_n, max_n, rightmost)

    def make_room_if_asked(self) -> None:
        """Make the room a compiled caller stopped for (counts[2]), if it did and nobody made it since."""
        if self.counts[2]:
            self._make_room()
            self.counts[2] = 0

    def _make_room(self) -> None:
        need = int(self.counts[2])
        if need == NEED_REGIONS:
            grown = _filled((2 * self.regions.shape[0], 2), -1)
            _rehash_regions(self.regions, grown)
            self.regions = grown
            return
        capacity = self.entries.shape[0]
        entries = int(self.counts[0])
        if capacity < self.max_capacity:
            while 2 * (entries + need) > capacity:
                capacity *= 2
            grown = _filled((capacity, 3), 0)
            _rehash(self.entries, grown)
            self.entries = grown
            return
        # Full: forget everything; each region is re-indexed from its start when it next proposes.
        self.rebuilds += 1
        while 2 * need > capacity:  # one history longer than the whole table: let it grow past the cap
            capacity *= 2
        self.entries = _filled((capacity, 3), 0)
        self.regions = _filled(self.regions.shape, -1)
        self.counts[:2] = 0

    def propose(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, max_lens: np.ndarray,
                drafts: np.ndarray) -> None:
        """`_ngram_rows_indexed` over all rows (the earliest-end index: `ngram`)."""
        row = 0
        while True:
            row = _ngram_rows_indexed(tokens, starts, lengths, max_lens, self.min_n, self.max_n, drafts,
                                      self.entries, self.regions, self.counts, row)
            if row == starts.shape[0]:
                return
            self._make_room()

    def match_rightmost(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                        match: np.ndarray) -> None:
        """`ngram_v2_rows_indexed` over all rows (the rightmost-end index: `ngram-v2`)."""
        row = 0
        while True:
            row = ngram_v2_rows_indexed(tokens, starts, lengths, self.min_n, self.max_n, match, self.entries,
                                        self.regions, self.counts, row)
            if row == starts.shape[0]:
                return
            self._make_room()


def prompt_index(drafter: ngram.NgramDrafter, tokens: np.ndarray) -> NgramIndex | None:
    """The drafter's incremental index of arena `tokens` (made on first use; rightmost ends for
    `ngram-v2`, earliest for `ngram`); None where n > 255."""
    lo, hi = drafter.min_n, drafter.max_n
    if hi > MAX_INDEXED_N:
        return None
    rightmost = isinstance(drafter, ngram_v2.NgramV2Drafter)
    index = getattr(drafter, "_prompt_index", None)
    if index is None or not index.serves(tokens, lo, hi, rightmost):
        index = drafter._prompt_index = NgramIndex(tokens, lo, hi, rightmost)
    return index


def propose_ngram_rows(drafter: ngram.NgramDrafter, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       max_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(draft start, draft length) in `tokens` of each row's `NgramDrafter.propose` draft."""
    index = prompt_index(drafter, tokens)
    if index is None:
        return propose_ngram_rows_scan(drafter, tokens, starts, lengths, max_lens)
    drafts = np.empty((2, starts.shape[0]), dtype=np.int64)
    index.propose(tokens, starts.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False),
                  max_lens.astype(np.int64, copy=False), drafts)
    return drafts[0], drafts[1]


def propose_ngram_rows_scan(drafter: ngram.NgramDrafter, tokens: np.ndarray, starts: np.ndarray,
                            lengths: np.ndarray, max_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`propose_ngram_rows` by scanning every history with `ngram_match` (the reference; for tests and benchmarks)."""
    draft_start = np.empty(starts.shape[0], dtype=np.int64)
    draft_len = np.empty(starts.shape[0], dtype=np.int64)
    _ngram_rows_scan(tokens, starts.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False),
                     max_lens.astype(np.int64, copy=False), drafter.min_n, drafter.max_n, draft_start, draft_len)
    return draft_start, draft_len

