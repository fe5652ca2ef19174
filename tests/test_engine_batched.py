"""drafters/ngram/index.py: the incremental n-gram index gives exactly `ngram_match`'s drafts.

The index is stateful (per arena offset, extended as histories grow), so these tests drive it the
way the engine does — the same drafter across many steps, histories growing at shared offsets,
agent calls extending earlier ones in place, replicate copies at one offset with different lengths,
overlapping regions — and compare every row of every step with the stateless reference scan and
with a brute-force search. A tiny table forces growth and the empty-and-rebuild path.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentspec_sim.drafters.ngram.index import NgramIndex, propose_ngram_rows, propose_ngram_rows_scan
from agentspec_sim.drafters.ngram.rule import NgramDrafter
from agentspec_sim.drafters.ngram.v2 import ngram_v2_match
from agentspec_sim.drafters.registry import parse_drafter


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest m in [lo, hi] whose suffix occurs at a start p < len − m, smallest such p, then up to k tokens."""
    n = len(tokens)
    for m in range(min(hi, n), lo - 1, -1):
        suffix = tokens[n - m:]
        for p in range(0, n - m):
            if tokens[p:p + m] == suffix:
                return tokens[p + m:p + m + min(k, n - p - m)]
    return []


def drafter_for(lo: int, hi: int) -> NgramDrafter:
    return NgramDrafter(parse_drafter({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": lo,
                                       "prompt_lookup_max": hi}))


def check_step(drafter, arena, starts, lengths, max_lens, brute: bool = False) -> None:
    got_s, got_n = propose_ngram_rows(drafter, arena, starts, lengths, max_lens)
    ref_s, ref_n = propose_ngram_rows_scan(drafter, arena, starts, lengths, max_lens)
    got = [arena[s:s + n].tolist() for s, n in zip(got_s, got_n, strict=True)]
    ref = [arena[s:s + n].tolist() for s, n in zip(ref_s, ref_n, strict=True)]
    assert got == ref
    assert (got_n == ref_n).all()  # also where the draft is empty
    if brute:
        for s, n, k, g in zip(starts.tolist(), lengths.tolist(), max_lens.tolist(), got, strict=True):
            want = brute_force(arena[s:s + n].tolist(), drafter.min_n, drafter.max_n, k) if k > 0 else []
            assert g == want


@pytest.mark.parametrize(("lo", "hi"), [(4, 4), (1, 1), (2, 5), (3, 3), (1, 6)])
def test_growing_histories_at_shared_offsets_match_the_scan(lo, hi):
    rng = np.random.default_rng(lo * 10 + hi)
    drafter = drafter_for(lo, hi)
    # Regions of a low-entropy arena (many repeats); rows are calls whose histories grow step by step.
    # Several rows share an offset (an agent's successive calls, or replicate copies at different lengths).
    arena = rng.integers(0, 4, 6000).astype(np.int32)
    arena[3000:3400] = arena[100:500]  # long exact repeats, as agent prompts have
    region_starts = np.array([0, 1500, 3000, 4500], dtype=np.int64)
    rows_off = np.array([0, 0, 1500, 3000, 3000, 4500, 1500], dtype=np.int64)
    lengths = rng.integers(1, 30, rows_off.shape[0]).astype(np.int64)
    for step in range(150):
        max_lens = rng.integers(-1, 8, rows_off.shape[0])
        check_step(drafter, arena, rows_off, lengths, max_lens, brute=step % 25 == 0)
        # Each row emits 1–6 tokens; now and then a row restarts shorter (a new call at that offset
        # whose history is a prefix of what was indexed, or a replicate lagging behind).
        lengths = np.minimum(lengths + rng.integers(1, 7, lengths.shape[0]), 1490)
        if step % 17 == 0:
            lengths[rng.integers(0, lengths.shape[0])] = int(rng.integers(1, 50))
    assert set(region_starts.tolist()) >= set(rows_off.tolist())


def test_overlapping_regions_are_indexed_separately():
    # Offsets inside another region's span: each offset's history starts there, so its "earliest
    # occurrence" differs from the enclosing region's.
    rng = np.random.default_rng(7)
    drafter = drafter_for(2, 4)
    arena = rng.integers(0, 3, 800).astype(np.int32)
    offs = np.array([0, 5, 37, 38, 200], dtype=np.int64)
    for length in range(1, 500, 3):
        lengths = np.full(offs.shape[0], length, dtype=np.int64)
        check_step(drafter, arena, offs, lengths, np.full(offs.shape[0], 5))


def test_table_growth_and_rebuild_keep_the_drafts(monkeypatch):
    monkeypatch.setattr(NgramIndex, "initial_capacity", 16)
    monkeypatch.setattr(NgramIndex, "max_capacity", 256)
    rng = np.random.default_rng(11)
    drafter = drafter_for(1, 3)
    arena = rng.integers(0, 9, 20000).astype(np.int32)
    offs = np.arange(0, 20000, 1000, dtype=np.int64)
    lengths = np.ones(offs.shape[0], dtype=np.int64)
    for _ in range(60):
        check_step(drafter, arena, offs, lengths, rng.integers(0, 6, offs.shape[0]))
        lengths += rng.integers(1, 20, offs.shape[0])
    index = drafter._prompt_index
    assert index.rebuilds > 0  # the table was emptied at its cap and rebuilt on demand
    assert index.entries.shape[0] >= 256


def test_one_history_longer_than_the_table_grows_past_the_cap(monkeypatch):
    monkeypatch.setattr(NgramIndex, "initial_capacity", 16)
    monkeypatch.setattr(NgramIndex, "max_capacity", 64)
    drafter = drafter_for(2, 2)
    arena = np.random.default_rng(5).integers(0, 5, 3000).astype(np.int32)
    check_step(drafter, arena, np.array([0], dtype=np.int64), np.array([2500], dtype=np.int64), np.array([5]),
               brute=True)


def test_a_new_arena_starts_a_new_index():
    drafter = drafter_for(2, 2)
    first = np.array([1, 2, 7, 1, 2], dtype=np.int32)
    s, n = propose_ngram_rows(drafter, first, np.array([0]), np.array([5]), np.array([3]))
    assert first[s[0]:s[0] + n[0]].tolist() == [7, 1, 2]
    # Same offsets and lengths, different tokens: the old index must not answer for them.
    second = np.array([1, 2, 9, 3, 4], dtype=np.int32)
    s, n = propose_ngram_rows(drafter, second, np.array([0]), np.array([5]), np.array([3]))
    assert n[0] == 0


@pytest.mark.parametrize(("lo", "hi"), [(5, 5), (1, 1), (2, 5), (1, 6)])
def test_rightmost_index_matches_the_ngram_v2_scan(lo, hi):
    """`ngram_v2_rows_indexed` (entries moved to each n-gram's latest end) = `ngram_v2_match` on every row
    of every step: growing histories at shared offsets, and rows restarting shorter at an offset indexed
    further (a replicate copy behind), where the index hands the row to the scan."""
    rng = np.random.default_rng(lo * 7 + hi)
    arena = rng.integers(0, 4, 6000).astype(np.int32)
    arena[3000:3400] = arena[100:500]
    rows_off = np.array([0, 0, 1500, 3000, 3000, 4500, 1500], dtype=np.int64)
    lengths = rng.integers(1, 30, rows_off.shape[0]).astype(np.int64)
    index = NgramIndex(arena, lo, hi, rightmost=True)
    index.entries = np.zeros((1 << 6, 3), dtype=np.int64)  # tiny: grows, then empties itself on the way
    index.max_capacity = 1 << 9
    for step in range(150):
        match = np.empty(rows_off.shape[0], dtype=np.int64)
        index.match_rightmost(arena, rows_off, lengths, match)
        for off, n, got in zip(rows_off.tolist(), lengths.tolist(), match.tolist(), strict=True):
            start, _ = ngram_v2_match(arena[off:off + n], lo, hi)
            assert got == (off + start if start >= 0 else -1), (step, off, n)
        lengths = np.minimum(lengths + rng.integers(1, 7, lengths.shape[0]), 1490)
        if step % 17 == 0:
            lengths[rng.integers(0, lengths.shape[0])] = int(rng.integers(1, 50))
    if (hi - lo + 1) * 4 ** hi > index.max_capacity:  # more distinct n-grams than the table may hold
        assert index.rebuilds > 0
