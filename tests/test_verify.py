"""Greedy verification against the recording: accepted prefix, bonus token, lossless replay."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from simhelpers import ConstantCost, arr, call, config, workload

from agentspec_sim import simulate
from agentspec_sim.engine import SimulationError
from agentspec_sim.engine.drafts import verify


def test_accept_longest_matching_prefix_then_bonus():
    out = arr([10, 11, 12, 13, 14, 15])
    assert verify(arr([11, 12, 99]), out, 1, 6) == (2, 3)  # 2 accepted + the target's token
    assert verify(arr([11, 12, 13]), out, 1, 6) == (3, 4)  # all accepted + bonus
    assert verify(arr([99, 12]), out, 1, 6) == (0, 1)
    assert verify(arr([]), out, 1, 6) == (0, 1)


def test_drafts_past_the_end_of_the_output_are_rejected():
    out = arr([10, 11, 12])
    # 2 tokens remain (11, 12); the draft's third token lies past the end and cannot be accepted
    assert verify(arr([11, 12, 7]), out, 1, 3) == (2, 2)
    assert verify(arr([11, 5]), out, 1, 3) == (1, 2)
    # a truncated call (target_len 2) treats its recorded tail as past the end too
    assert verify(arr([11, 12]), out, 1, 2) == (1, 1)


def test_oracle_drafts_are_all_accepted_and_the_run_is_lossless():
    c = call("c", range(8), range(100, 120))
    result = simulate(workload([c]), {"method": "test-oracle", "num_speculative_tokens": 4}, config(), ConstantCost())
    dec = result.steps.filter(pl.col("phase") == "decode")
    assert (dec["accepted"] == dec["drafted"]).all()
    # 1 token from the prefill step, then 5 tokens per step (4 drafts + bonus), the last step shorter
    assert dec["emitted"].to_list() == [5, 5, 5, 4]
    assert result.calls["output_len"].to_list() == [20]


def test_overshooting_drafts_count_as_rejected():
    c = call("c", range(8), range(100, 107))  # 7 tokens: prefill emits 1, then 4+1, then 1 remains
    spec = {"method": "test-oracle", "num_speculative_tokens": 4, "overshoot": 4}
    result = simulate(workload([c]), spec, config(), ConstantCost())
    dec = result.steps.filter(pl.col("phase") == "decode")
    assert dec["drafted"].to_list() == [4, 4]  # the last draft: 1 real token + 3 past the end
    assert dec["accepted"].to_list() == [4, 1]
    assert dec["emitted"].to_list() == [5, 1]
    calls = result.calls
    assert calls["drafted"].item() == 8 and calls["accepted"].item() == 5


def test_wrong_drafts_emit_exactly_one_token_per_step():
    c = call("c", range(8), range(100, 110))
    result = simulate(workload([c]), {"method": "test-wrong", "num_speculative_tokens": 3}, config(), ConstantCost())
    dec = result.steps.filter(pl.col("phase") == "decode")
    assert (dec["accepted"] == 0).all() and (dec["emitted"] == 1).all() and (dec["drafted"] == 3).all()


def test_a_broken_verifier_is_caught_by_the_lossless_check(monkeypatch):
    import agentspec_sim.engine.scheduler as sched

    def accept_everything(c, buf, source, m):
        # Sets the drafts as `drafts_from_rows` does but claims every one was accepted.
        calls = c.calls
        for r, start, n in zip(buf[0, :m].tolist(), buf[1, :m].tolist(), buf[2, :m].tolist(), strict=True):
            c.slot_drafts[calls["slot"][r], :n] = source[start:start + n]
            calls["draft_len"][r] = n
            calls["draft_acc"][r] = min(n, calls["target_len"][r] - calls["num_emitted"][r])

    monkeypatch.setattr(sched, "drafts_from_rows", accept_everything)
    c = call("c", range(8), range(100, 110))
    with pytest.raises(SimulationError, match="lossless"):
        simulate(workload([c]), {"method": "test-wrong", "num_speculative_tokens": 3}, config(), ConstantCost())


def test_first_output_token_comes_from_the_prefill_step_with_no_draft():
    c = call("c", range(8), range(100, 104))
    result = simulate(workload([c]), {"method": "test-oracle", "num_speculative_tokens": 2}, config(), ConstantCost())
    first = result.steps.row(0, named=True)
    assert first["phase"] == "prefill" and first["drafted"] == 0 and first["emitted"] == 1
    assert np.isclose(result.calls["first_token_s"].item(), 0.01)
