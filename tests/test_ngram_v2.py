"""`ngram-v2` = vLLM 0.33's Model Runner V2 GPU n-gram speculator (rightmost occurrence, always k slots)."""

from __future__ import annotations

import numpy as np
import pytest

from agentspec_sim.drafters.ngram.v2 import propose_ngram_v2
from agentspec_sim.drafters.registry import make_drafter, speculative_config
from agentspec_sim.engine.budget import BatchSizeSchedule, make_budget_policy
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace


def draft(history, lo, hi, k):
    return propose_ngram_v2(np.asarray(history, dtype=np.int32), lo, hi, k).tolist()


def kernel_reference(tokens: list[int], lo: int, hi: int, k: int, max_model_len: int = 1 << 20) -> list[int]:
    """A literal transcription of `_ngram_scan_kernel` + `_ngram_finalize_kernel` (vLLM 0.33,
    v1/worker/gpu/spec_decode/ngram/speculator.py) for one row that sampled a token."""
    seq_len = len(tokens)
    lp1 = max_model_len + 1
    score = 0
    if seq_len >= lo:  # eligible row
        for n in range(lo, hi + 1):
            suffix = tokens[seq_len - n:] if n <= seq_len else None
            for pos in range(0, seq_len - n):  # 0 ≤ pos ≤ seq_len − n − 1
                if tokens[pos:pos + n] == suffix:
                    score = max(score, n * lp1 + pos + 1)
    last = tokens[-1]
    if score == 0:
        return [last] * k
    best_n, best_pos = divmod(score - 1, lp1)
    start = best_pos + best_n
    avail = seq_len - start
    return [tokens[start + i] if i < avail else last for i in range(k)]


def test_pinned_examples():
    assert draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 4) == [7, 5, 1, 2]
    assert draft([1, 2, 3, 4], 1, 2, 4) == [4, 4, 4, 4]


def test_always_k_slots_padded_with_the_last_token():
    assert draft([5, 6, 5, 6], 2, 2, 4) == [5, 6, 6, 6]  # 2 tokens available after the match, 2 filler
    assert draft([7], 2, 3, 3) == [7, 7, 7]  # shorter than min_n: no match, all filler
    assert draft([3, 3], 1, 1, 2) == [3, 3]
    assert draft([1, 2, 1, 2], 2, 2, 0) == []  # k = 0 (max_model_len reached, or k(b) = 0)


def test_longest_n_beats_a_later_shorter_match_and_rightmost_wins_ties():
    # suffix [4, 5]: the 2-gram occurs at 1 only; the 1-gram [5] occurs further right, at 5.
    assert draft([0, 4, 5, 8, 9, 5, 6, 4, 5], 1, 2, 2) == [8, 9]
    # suffix [7, 5] never occurred: the 1-gram [5] at 1, 4 and 7, the rightmost wins.
    assert draft([0, 5, 8, 4, 5, 9, 4, 5, 7, 5], 1, 2, 2) == [7, 5]
    assert draft([0, 4, 5, 8, 4, 5, 9, 4, 5], 1, 2, 2) == [9, 4]  # [4, 5] at 1 and 4: rightmost (4) wins


def test_kernel_reference_agrees_on_the_pinned_examples():
    assert kernel_reference([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 4) == [7, 5, 1, 2]
    assert kernel_reference([1, 2, 3, 4], 1, 2, 4) == [4, 4, 4, 4]


def test_differential_against_the_kernel_on_5000_random_histories():
    rng = np.random.default_rng(20250)
    for _ in range(5000):
        n = int(rng.integers(1, 70))
        vocab = int(rng.integers(2, 7))
        tokens = rng.integers(0, vocab, n).tolist()
        lo = int(rng.integers(1, 5))
        hi = int(rng.integers(lo, 8))
        k = int(rng.integers(0, 9))
        assert draft(tokens, lo, hi, k) == kernel_reference(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_differential_on_real_histories_from_the_default_trace():
    workload = load_trace(bundled_trace("default.jsonl.zst"))
    rng = np.random.default_rng(7)
    calls = [c for c in workload.calls if c.output_len >= 50]
    for idx in rng.choice(len(calls), size=6, replace=False):
        c = calls[int(idx)]
        full = np.concatenate([c.prompt_tokens[-3000:], c.output_tokens]).astype(np.int32)
        for cut in rng.integers(3001, full.shape[0], size=4):
            history = full[:int(cut)]
            for lo, hi in ((1, 3), (2, 4), (4, 4), (5, 5)):
                got = propose_ngram_v2(history, lo, hi, 5).tolist()
                assert got == kernel_reference(history.tolist(), lo, hi, 5), (c.id, int(cut), lo, hi)


def test_drafter_uses_ngram_config_rules_and_the_batch_size_schedule():
    spec = speculative_config({"method": "ngram-v2", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    with pytest.raises(SpecConfigError, match="num_speculative_tokens"):
        speculative_config({"method": "ngram-v2"})
    sched = speculative_config({"method": "ngram-v2", "num_speculative_tokens": 4,
                                         "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 64, 1]]})
    policy = make_budget_policy(sched)
    assert isinstance(policy, BatchSizeSchedule) and policy.k_for(10) == 1


class _Row:
    def __init__(self, tokens):
        self.tokens = np.asarray(tokens, dtype=np.int32)


def test_propose_returns_exactly_max_len_slots_per_row():
    spec = speculative_config({"method": "ngram-v2", "num_speculative_tokens": 4,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    drafter = make_drafter(spec)
    rows = [_Row([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]), _Row([1, 2, 3, 4])]
    out = drafter.propose(rows, np.array([4, 2]))
    assert [d.tolist() for d in out] == [[7, 5, 1, 2], [4, 4]]
    assert all(d.dtype == np.int32 for d in out)
