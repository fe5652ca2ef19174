"""Budget policies (agentspec_sim/engine/budget.py): vLLM's fixed k and per-batch-size schedule (unchanged),
the AdaSpec-style per-call policy, and how a config selects a policy."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim import simulate
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.budget import (
    BUDGET_POLICIES,
    AdaSpecPolicy,
    BatchSizeSchedule,
    FixedK,
    budget_policy_name,
    make_budget_policy,
)
from agentspec_sim.engine.drafting import SpecConfigError


class Row:
    """The CallState fields a policy reads."""

    def __init__(self, num_tokens: int = 100) -> None:
        self.drafted = 0
        self.accepted = 0
        self.num_tokens = num_tokens

    def step(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted


def test_vllm_policies_unchanged():
    assert make_budget_policy(parse_drafter("ngram")).max_draft_lens(3, [Row(), Row()]).tolist() == [5, 5]
    sched = parse_drafter({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                           "num_speculative_tokens_per_batch_size": [[1, 2, 4], [5, 8, 1]]})
    policy = make_budget_policy(sched)
    assert isinstance(policy, BatchSizeSchedule)
    assert [policy.k_for(b) for b in (1, 2, 3, 4, 5, 8, 100)] == [4, 4, 4, 4, 1, 1, 1]
    assert isinstance(make_budget_policy(parse_drafter("suffix")), FixedK)


@pytest.mark.parametrize(("a", "tau", "k"), [
    (0.9, 0.3, 11),  # ⌊ln 0.3 / ln 0.9⌋ = ⌊11.43⌋
    (0.5, 0.3, 1),  # 0.5 ≥ 0.3 > 0.25
    (0.5, 0.5, 1),  # a^1 = τ exactly: still drafted
    (0.2, 0.3, 0),
    (0.99, 0.3, 16),  # capped at k_max
    (1.0, 0.3, 16),
    (0.0, 0.3, 0),
])
def test_adaspec_length_rule(a, tau, k):
    assert AdaSpecPolicy(16).length(a, tau) == k


def test_adaspec_acceptance_estimate_from_the_calls_own_steps():
    policy = AdaSpecPolicy(8, threshold=0.3, prior_weight=4.0)
    r = Row()
    policy.max_draft_lens(1, [r])  # first sight: the pooled prior (nothing seen: 1/2)
    assert policy.acceptance(r) == pytest.approx(0.5)
    r.step(drafted=4, accepted=4)  # fully accepted: 4 successes, no failure
    policy.max_draft_lens(1, [r])
    r.step(drafted=4, accepted=1)  # 1 success, then a rejection
    policy.max_draft_lens(1, [r])
    # A = 5, F = 1; pooled = (5 + 1) / (5 + 1 + 2) = 0.75; a = (5 + 4·0.75) / (5 + 1 + 4) = 0.8
    assert policy.acceptance(r) == pytest.approx(0.8)
    assert policy.max_draft_lens(1, [r]).tolist() == [math.floor(math.log(0.3) / math.log(0.8))]  # 5
    # a new call starts from the pooled estimate
    assert policy.acceptance(Row()) == pytest.approx(0.75)


def test_adaspec_probes_a_call_that_stopped_drafting():
    policy = AdaSpecPolicy(8, threshold=0.9, probe_every=3)
    r = Row()
    ks = [int(policy.max_draft_lens(1, [r])[0]) for _ in range(7)]
    assert ks == [0, 0, 1, 0, 0, 1, 0]  # a = 0.5 < 0.9: one probe token every 3 steps


def test_adaspec_threshold_from_the_cost_model():
    # ConstantCost: T(b calls × q tokens) = 0.01 + 1e-4·b·q → τ = (T(2) − T(1)) / T(1) = 1e-4·b / (0.01 + 1e-4·b)
    cost = ConstantCost(step_s=0.01, per_token_s=1e-4)
    policy = make_budget_policy(replace(parse_drafter("suffix"), raw={"budget_policy": "adaspec"}), cost)
    assert isinstance(policy, AdaSpecPolicy)
    for b in (1, 10, 100):
        assert policy.tau(b, 1000) == pytest.approx(1e-4 * b / (0.01 + 1e-4 * b))
    # a larger batch makes tokens dearer: the same call drafts less
    r = Row()
    k_small = int(policy.max_draft_lens(1, [r])[0])
    k_large = int(policy.max_draft_lens(200, [r])[0])
    assert k_small > k_large


def test_policy_selection():
    spec = parse_drafter("ngram")
    assert budget_policy_name(spec) == "fixed"
    assert budget_policy_name(replace(spec, raw={"budget_policy": "adaspec"})) == "adaspec"
    assert budget_policy_name(replace(spec, options=(("budget_policy", "adaspec"),))) == "adaspec"
    with pytest.raises(SpecConfigError, match="unknown budget_policy"):
        budget_policy_name(replace(spec, raw={"budget_policy": "nope"}))
    assert {"fixed", "batch-size-schedule", "adaspec"} <= set(BUDGET_POLICIES)


def test_adaspec_through_the_engine():
    rng = np.random.default_rng(4)
    wl = workload(*[agent_query(rng, f"q{i}", 3, vocab=6, out_len=40) for i in range(4)])
    spec = replace(parse_drafter({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3}), raw={"budget_policy": "adaspec"})
    fixed = simulate(wl, parse_drafter({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 3}), config(), ConstantCost())
    ada = simulate(wl, spec, config(), ConstantCost())
    assert (ada.calls["status"] == "finished").all()
    assert 0 < int(ada.calls["drafted"].sum()) != int(fixed.calls["drafted"].sum())
