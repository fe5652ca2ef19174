"""The `ngram` drafter = vLLM V1 CPU prompt lookup; speculative-config parsing with vLLM's rules."""

from __future__ import annotations

import numpy as np
import pytest

from agentspec_sim.drafters.ngram.rule import propose_ngram
from agentspec_sim.drafters.registry import parse_drafter, parse_drafter_list, speculative_config
from agentspec_sim.engine.budget import BatchSizeSchedule, FixedK, make_budget_policy
from agentspec_sim.engine.drafting import SpecConfigError


def draft(history, lo, hi, k):
    return propose_ngram(np.asarray(history, dtype=np.int32), lo, hi, k).tolist()


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """VLLM-NOTES' characterisation: largest m in [lo, hi] whose suffix occurs at a start p < len − m,
    smallest such p, then up to k following tokens."""
    n = len(tokens)
    for m in range(min(hi, n), lo - 1, -1):
        suffix = tokens[n - m:]
        for p in range(0, n - m):
            if tokens[p:p + m] == suffix:
                start = p + m
                return tokens[start:start + min(k, n - start)]
    return []


def test_pinned_examples():
    assert draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 4) == [9, 1, 2, 3]
    assert draft([5, 6, 5, 6], 2, 2, 4) == [5, 6]


def test_no_match_and_short_history_give_no_draft():
    assert draft([1, 2, 3, 4], 1, 2, 4) == []
    assert draft([7], 2, 3, 4) == []
    assert draft([1, 2, 1, 2], 2, 2, 0) == []  # k clipped to 0 (max_model_len reached)


def test_longest_n_wins_over_earlier_shorter_match():
    # suffix [4, 5]: the 1-gram [5] occurs first at 1, the 2-gram [4, 5] only at 3.
    assert draft([0, 5, 8, 4, 5, 9, 4, 5], 1, 2, 2) == [9, 4]


def test_draft_is_capped_by_k_and_by_the_history():
    h = [1, 2, 3, 4, 5, 6, 1, 2]
    assert draft(h, 2, 2, 3) == [3, 4, 5]
    assert draft(h, 2, 2, 10) == [3, 4, 5, 6, 1, 2]


def test_brute_force_differential_2000_histories():
    rng = np.random.default_rng(1234)
    for _ in range(2000):
        n = int(rng.integers(1, 60))
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, n).tolist()
        lo = int(rng.integers(1, 5))
        hi = int(rng.integers(lo, 7))
        k = int(rng.integers(0, 8))
        assert draft(tokens, lo, hi, k) == brute_force(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_prompt_lookup_defaults_follow_vllm():
    spec = speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "≤"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "≥ 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "> 0"),  # vLLM: Field(gt=0)
    ({"method": "nope", "num_speculative_tokens": 3}, "unknown drafter"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]},
     "start at 1"),
    ({"method": "ngram", "num_speculative_tokens": 3,
      "num_speculative_tokens_per_batch_size": [[1, 4, 2], [3, 8, 1]]}, "overlap"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4]]},
     "[start, end, k]"),
])
def test_bad_configs_are_rejected_with_the_reason(config, message):
    with pytest.raises(SpecConfigError, match=message):
        speculative_config(config)


def test_no_effect_keys_are_accepted_and_json_text_parses():
    spec = parse_drafter('{"method": "ngram", "num_speculative_tokens": 2, "model": "ngram"}')
    assert spec.num_speculative_tokens == 2


def test_drafter_shorthand_uses_the_paper_settings():
    normal, ngram = parse_drafter_list("normal, ngram")
    assert normal.method == "normal" and normal.num_speculative_tokens == 0
    assert (ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 4, 4)


def test_batch_size_schedule_lookup_carries_forward_and_clips():
    spec = speculative_config({"method": "ngram", "num_speculative_tokens": 4,
                                        "num_speculative_tokens_per_batch_size": [[1, 2, 6], [5, 8, 1], [9, 9, 0]]})
    policy = make_budget_policy(spec)
    assert isinstance(policy, BatchSizeSchedule)
    ks = [policy.k_for(b) for b in range(1, 12)]
    # 1-2: 6 clipped to 4; 3-4: gap carries 4; 5-8: 1; 9: 0; past the end: 0
    assert ks == [4, 4, 4, 4, 1, 1, 1, 1, 0, 0, 0]
    assert isinstance(make_budget_policy(parse_drafter("ngram")), FixedK)
