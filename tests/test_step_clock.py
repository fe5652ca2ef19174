"""The step clock (cost/step_clock.py), the simulator's preemption log and the step-for-step comparison with
vLLM's schedule (validation/vllm_schedule.py), on hand-made inputs: no vLLM needed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from simhelpers import call, config, workload

from agentspec_sim import EngineConfig, load_trace, simulate
from agentspec_sim.cost.base import StepCostModel
from agentspec_sim.cost.step_clock import StepClockCost
from agentspec_sim.trace.bundled import default_trace_path
from agentspec_sim.validation.vllm_schedule import (
    EngineStep,
    ScheduledCall,
    ScheduleRecorder,
    call_steps,
    compare_schedules,
    sim_engine_steps,
)


def test_every_step_is_one_unit_and_think_time_counts_steps():
    assert isinstance(StepClockCost(), StepCostModel)
    # Query q0: a 4-token prompt, 3 output tokens (prefill step + 2 decode steps), then 2.5 steps of thought.
    first = call("c0", [1, 2, 3, 4], [5, 6, 7], seq=0)
    second = call("c1", [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], seq=1, think_s=2.5)
    result = simulate(workload([first, second]), "normal", config(max_num_seqs=1), StepClockCost())
    steps = result.engine_steps
    assert steps["forward_s"].to_list() == [1.0] * steps.height
    # c0 runs steps 0-2 (t = 0..3); c1 arrives at 3 + 2.5 = 5.5 and runs from there, on whole units.
    assert steps["time_s"].to_list() == [0.0, 1.0, 2.0, 5.5, 6.5]
    calls = result.calls.sort("call_id")
    assert calls["finish_s"].to_list() == [3.0, 7.5]


def test_preemptions_are_logged_in_order_with_their_step():
    wl = load_trace(default_trace_path())
    picked = [replace(q, calls=q.calls[:4]) for i, q in enumerate(wl.queries) if i in (18, 19, 25, 33, 39, 45)]
    wl = replace(wl, queries=tuple(picked))
    result = simulate(wl, "normal", EngineConfig(max_num_seqs=16, num_kv_blocks=1100, arrival="zero"))
    log = result.preemptions
    assert result.num_preemptions > 0 and log.height == result.num_preemptions
    assert log["step"].is_sorted()
    # A preempted call is not in the step that preempted it, and recomputes from scratch (or a prefix hit) later.
    steps = result.steps
    for step, call_id in zip(log["step"].to_list(), log["call_id"].to_list(), strict=True):
        here = steps.filter((steps["step"] == step) & (steps["call_id"] == call_id))
        assert here.height == 0
        later = steps.filter((steps["step"] > step) & (steps["call_id"] == call_id)).sort("step")
        assert later.height and later["phase"][0] == "prefill"


def _vllm_step(index, calls, preempted=()):
    return EngineStep(index, [ScheduledCall(cid, comp, n, tuple(d), "decode") for cid, comp, n, d in calls],
                      list(preempted), len(calls), 0)


def test_schedules_line_up_and_the_first_difference_is_named():
    result = simulate(workload([call("a", [1, 2, 3, 1, 2, 3], [1, 2, 3, 1], seq=0)]), "ngram",
                      config(max_num_seqs=1), StepClockCost())
    sim = sim_engine_steps(result.steps, result.preemptions)
    frame = result.steps.sort("step")
    same = [_vllm_step(int(r["step"]), [(r["call_id"], r["context_len"], r["scheduled_tokens"], r["draft"] or [])])
            for r in frame.iter_rows(named=True)]
    ok = compare_schedules(same, sim)
    assert ok.engine_steps_identical == ok.engine_steps_vllm == ok.engine_steps_sim == frame.height
    assert ok.first_difference is None and ok.verify_steps == ok.draft_ids_identical_steps > 0
    # vLLM drafted another token at the first verify step: that step and the draft count differ, named.
    k = next(i for i, s in enumerate(same) if s.calls[0].draft)
    c = same[k].calls[0]
    other = list(same)
    other[k] = _vllm_step(k, [(c.call_id, c.computed, c.scheduled + 1, (*c.draft, 7))])
    bad = compare_schedules(other, sim)
    assert bad.engine_steps_identical == k and bad.draft_ids_identical_steps == bad.verify_steps - 1
    assert f"step {k}, call a" in bad.first_difference
    # A preemption on one side only.
    other = list(same)
    other[1] = _vllm_step(1, [(s.call_id, s.computed, s.scheduled, s.draft) for s in same[1].calls], ["a"])
    assert "preempted ['a']" in compare_schedules(other, sim).first_difference


def test_call_steps_are_the_calibrate_cost_columns():
    rec = ScheduleRecorder([_vllm_step(0, [("a", 0, 8, [])]), _vllm_step(1, [("a", 8, 3, [4, 5])])])
    rec.steps[0].calls[0] = replace(rec.steps[0].calls[0], phase="prefill")
    rec.steps[0].seconds, rec.steps[1].seconds = 0.5, 0.25
    rows = call_steps(rec.steps)
    assert [(r["step"], r["phase"], r["context_len"], r["scheduled_tokens"], r["drafted"], r["step_time_s"])
            for r in rows] == [(0, "prefill", 0, 8, 0, 0.5), (1, "decode", 8, 3, 2, 0.25)]
    rec.rename(lambda rid: rid.upper())
    assert rec.steps[1].calls[0].call_id == "A"
    assert np.isnan(EngineStep(0, [], [], 0, 0).seconds)
