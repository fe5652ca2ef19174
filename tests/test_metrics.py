"""Every metric of DESIGN.md "Metrics" on tiny traces whose numbers are worked out by hand.

Cost double: each step costs 0.01 s (+ 0.001 s per token where noted), drafting 0.002 s per pass.
"""

from __future__ import annotations

import math

import pytest
from simhelpers import ConstantCost, call, config, workload

from agentspec_sim import simulate
from agentspec_sim.metrics import summarize

ORACLE = {"method": "test-oracle", "num_speculative_tokens": 2}
WRONG = {"method": "test-wrong", "num_speculative_tokens": 2}


def one_call():
    # prompt 8, output 5
    return workload([call("c", range(8), range(100, 105))])


def test_normal_baseline():
    s = summarize(simulate(one_call(), "normal", config(), ConstantCost()))
    # steps: prefill (emits 1) at 0.00–0.01, then 4 decode steps → finish at 0.05
    assert s.steps == 5
    assert s.makespan_s == pytest.approx(0.05)
    assert s.goodput_tok_s == pytest.approx(100.0)
    assert s.speedup is None
    assert s.rejection_rate is None and s.rejection_rate_tokens is None and s.mean_acceptance_length is None
    assert s.ttft.p50 == pytest.approx(0.01)
    assert s.tpot.p50 == pytest.approx(0.01)  # (0.05 − 0.01) / (5 − 1)
    assert s.query_latency.p50 == pytest.approx(0.05)
    assert s.decode_call_steps == 4 and s.drafted_call_steps == 0
    assert s.draft_time_s == 0 and s.forward_time_s == pytest.approx(0.05)
    assert s.batch_size_mean == 1 and s.running_max == 1 and s.bound_by == "none"


def test_oracle_drafter_all_accepted():
    wl = one_call()
    base = simulate(wl, "normal", config(), ConstantCost())
    s = summarize(simulate(wl, ORACLE, config(), ConstantCost()), base)
    # prefill → token 1 at 0.01; decode with 2 drafts → 3 tokens at 0.02; decode with 1 draft
    # (only one token left) → 1 token, done at 0.03.
    assert s.steps == 3
    assert s.makespan_s == pytest.approx(0.03)
    assert s.goodput_tok_s == pytest.approx(5 / 0.03)
    assert s.speedup == pytest.approx(0.05 / 0.03)
    assert (s.drafted_tokens, s.accepted_tokens, s.drafted_call_steps, s.decode_call_steps) == (3, 3, 2, 2)
    assert s.rejection_rate == 0 and s.rejection_rate_tokens == 0
    assert s.mean_acceptance_length == pytest.approx(1 + 3 / 2)
    assert s.accepted_per_decode_step == pytest.approx(3 / 2)
    assert s.tpot.p50 == pytest.approx((0.03 - 0.01) / 4)
    # budget: M(b=1) = 64 − 1 = 63; drafted tokens per decode step 2 and 1
    assert s.draft_tokens_per_step == pytest.approx(1.5)
    assert s.token_budget_mean == pytest.approx(63)
    assert s.budget_utilisation == pytest.approx((2 / 63 + 1 / 63) / 2)


def test_wrong_drafter_with_drafting_cost():
    cost = ConstantCost(draft_s=0.002)
    wl = one_call()
    base = simulate(wl, "normal", config(), cost)
    result = simulate(wl, WRONG, config(), cost)
    s = summarize(result, base)
    # same 5 steps; proposals after steps 0..3 (none after the last) each cost 0.002 s
    assert s.steps == 5
    assert s.draft_time_s == pytest.approx(0.008)
    assert s.makespan_s == pytest.approx(0.058)
    assert s.speedup == pytest.approx(0.05 / 0.058)
    # drafts at positions 1..4: max_len = 2 each step → 8 drafted, 0 accepted
    assert (s.drafted_tokens, s.accepted_tokens, s.drafted_call_steps) == (8, 0, 4)
    assert s.rejection_rate == 1.0 and s.rejection_rate_tokens == 1.0
    assert s.mean_acceptance_length == 1.0
    assert s.accepted_per_decode_step == 0.0


def test_delta_t_decomposition_per_step():
    cost = ConstantCost(step_s=0.01, per_token_s=0.001, draft_s=0.002)
    result = simulate(one_call(), WRONG, config(), cost)
    row = result.engine_steps.row(1, named=True)  # first decode step: 1 + 2 tokens
    assert row["D"] == 2 and row["accepted"] == 0 and row["rho"] == 1.0
    assert row["forward_s"] == pytest.approx(0.013)
    assert row["t_A"] == pytest.approx(0.011)  # the batch without drafts, per call (b = 1)
    assert row["t_V"] == pytest.approx(0.001)  # (0.013 − 0.011) / 2
    assert row["t_D"] == pytest.approx(0.001)  # 0.002 / 2
    first = result.engine_steps.row(0, named=True)
    assert first["rho"] is None and first["t_V"] is None


def test_rejection_rate_is_a_mean_over_calls_and_token_weighted():
    # call a: oracle-like acceptance impossible to arrange per call with one drafter, so mix two queries
    # under the overshooting oracle: a 2-token output drafts past its end more than a long one.
    spec = {"method": "test-oracle", "num_speculative_tokens": 4, "overshoot": 4}
    wl = workload([call("a", range(8), [50, 51])], [call("b", range(20, 28), range(60, 70), query="q1")])
    result = simulate(wl, spec, config(), ConstantCost())
    calls = {r["call_id"]: r for r in result.calls.iter_rows(named=True)}
    s = summarize(result)
    per_call = [(c["drafted"] - c["accepted"]) / c["drafted"] for c in calls.values() if c["draft_steps"]]
    assert s.rejection_rate == pytest.approx(sum(per_call) / len(per_call))
    drafted = sum(c["drafted"] for c in calls.values())
    accepted = sum(c["accepted"] for c in calls.values())
    assert s.rejection_rate_tokens == pytest.approx((drafted - accepted) / drafted)
    # a: 1 token left after prefill, draft [51, 7, 7, 7] → 1 accepted of 4
    assert (calls["a"]["drafted"], calls["a"]["accepted"]) == (4, 1)


def test_query_latency_and_ttft_with_think_time():
    c0 = call("c0", range(8), range(100, 102), query="q", seq=0)
    c1 = call("c1", [*range(8), 100, 101, 5], range(200, 202), query="q", seq=1, think_s=0.5)
    s_result = simulate(workload([c0, c1]), "normal", config(), ConstantCost())
    calls = s_result.calls
    # c0: prefill (token 1) 0.01, decode 0.02 → done; c1 arrives 0.52, prefill → 0.53, decode → 0.54
    assert calls["finish_s"].to_list() == pytest.approx([0.02, 0.54])
    assert calls["arrival_s"].to_list() == pytest.approx([0.0, 0.52])
    s = summarize(s_result)
    assert s.query_latency.p50 == pytest.approx(0.54)
    assert s.ttft.p50 == pytest.approx(0.01)
    assert s.makespan_s == pytest.approx(0.54)
    assert s.goodput_tok_s == pytest.approx(4 / 0.54)


def test_to_dict_is_json_ready():
    import json

    s = summarize(simulate(one_call(), WRONG, config(), ConstantCost()))
    doc = json.loads(json.dumps(s.to_dict()))
    assert doc["drafter"] == "test-wrong" and doc["ttft"]["p50"] == pytest.approx(0.01)
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in doc.values())


def test_to_row_is_flat_with_stable_keys():
    import json

    normal = summarize(simulate(one_call(), "normal", config(), ConstantCost()))
    wrong = summarize(simulate(one_call(), WRONG, config(), ConstantCost()))
    row = wrong.to_row()
    assert list(row) == list(normal.to_row())  # same columns whatever the drafter
    assert row["ttft_p50"] == pytest.approx(0.01) and row["limits_max_num_seqs"] == wrong.limits["max_num_seqs"]
    assert json.loads(row["speculative_config"]) == wrong.speculative_config
    assert not any(isinstance(v, dict | list) for v in row.values())
