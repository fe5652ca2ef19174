"""Property-based tests: random small traces and engine configs, every registered drafter.

For each example the run must be lossless (each call emits exactly its recording, capped at
max_model_len, and every accepted draft token is the recorded one), accept no more than it drafted,
draft within k and the context left, keep each step within the token budget, move time forward, stay
under the goodput the cost model allows, repeat itself exactly under the same seed, and (`normal`)
never draft. The engine's own invariant checks are on (simhelpers.config).

Examples per drafter: the hypothesis profile (tests/conftest.py): `ci` by default, thousands with
HYPOTHESIS_PROFILE=thorough.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st
from simhelpers import ConstantCost, call, config, workload

from agentspec_sim import simulate
from agentspec_sim.drafters.registry import drafter_class, families, shorthand_config
from agentspec_sim.engine.kv import cdiv

drafter_class("normal")  # loads the built-in drafters
BUILTIN_DRAFTERS = sorted(families())
# Drafters that need a target model with their draft network (MiMo-7B has the MTP layer).
MODEL_FOR = {"mtp": "mimo-7b"}


@st.composite
def traces(draw):
    """1–3 agent queries of 1–3 calls over a tiny vocabulary (so drafters find matches); a later call's
    prompt usually extends the previous prompt + output, as an agent's does."""
    vocab = draw(st.integers(2, 12))
    tokens = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40)
    queries = []
    for q in range(draw(st.integers(1, 3))):
        calls, prompt = [], draw(tokens)
        for k in range(draw(st.integers(1, 3))):
            output = draw(outputs(prompt, vocab))
            think = draw(st.sampled_from([0.0, 0.0, 0.003, 0.05]))
            calls.append(call(f"q{q}-{k}", prompt, output, query=f"q{q}", seq=k, think_s=think if k else 0.0))
            prompt = prompt + output + draw(st.lists(st.integers(0, vocab - 1), max_size=8)) if draw(st.booleans()) \
                else draw(tokens)
        queries.append(calls)
    return workload(*queries)


@st.composite
def outputs(draw, prompt: list[int], vocab: int) -> list[int]:
    """Random tokens, a repeated pattern, or a copy of part of the prompt: what drafters find or miss."""
    kind = draw(st.sampled_from(["random", "repeat", "copy"]))
    tail = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    if kind == "repeat":
        pattern = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        body = pattern * draw(st.integers(1, 8))
    elif kind == "copy":
        start = draw(st.integers(0, len(prompt) - 1))
        body = prompt[start:start + draw(st.integers(1, 40))]
    else:
        body = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=48))
    return (body + tail)[:48]


@st.composite
def engines(draw, trace, k: int):
    """An engine config the trace fits (every call's KV blocks, one call at a time), often exactly, so calls
    preempt each other and a call alone may preempt itself for its drafts' blocks
    (test_a_call_alone_that_preempts_itself_is_rescheduled); sometimes with room for k drafts besides."""
    seqs = draw(st.integers(1, 6))
    block = draw(st.sampled_from([2, 4, 16]))
    max_len = draw(st.sampled_from([24, 64, 4096]))
    lookahead = draw(st.sampled_from([0, k]))
    need = max((cdiv(min(c.prompt_len + min(c.output_len, max_len - c.prompt_len) + lookahead, max_len), block)
                for c in trace.calls if c.prompt_len < max_len), default=1)
    # The load protocols (engine/load.py): the trace's arrivals, a burst, Poisson, vLLM bench serve's request
    # rate (gamma, any burstiness), max concurrency (closed loop or gated rate), identical copies.
    arrival = draw(st.sampled_from(["recorded", "zero", "poisson", "request-rate", "max-concurrency", "copies"]))
    load: dict = {"replicate": draw(st.integers(1, 2))}
    if arrival == "poisson":
        load.update(arrival="poisson", rate=draw(st.floats(1.0, 200.0)))
    elif arrival in ("request-rate", "max-concurrency"):
        load.update(arrival="request-rate", rate=draw(st.sampled_from([float("inf"), 5.0, 80.0])),
                    burstiness=draw(st.sampled_from([0.25, 1.0, float("inf")])))
        if arrival == "max-concurrency":
            load["max_concurrency"] = draw(st.integers(1, 3))
    elif arrival == "copies":
        load = {"copies": draw(st.integers(2, 3))}
    else:
        load["arrival"] = arrival
    return config(
        max_num_seqs=seqs, max_num_batched_tokens=max(seqs, draw(st.sampled_from([8, 16, 48, 256]))),
        block_size=block, max_model_len=max_len, num_kv_blocks=need + 1 + draw(st.sampled_from([0, 1, 3, 8, 40])),
        enable_prefix_caching=draw(st.booleans()), seed=draw(st.integers(0, 2**16)), **load,
    )


@st.composite
def cases(draw):
    trace = draw(traces())
    k = draw(st.integers(1, 8))
    engine = draw(engines(trace, k))
    step_s = draw(st.sampled_from([1e-3, 0.01]))
    per_token_s = draw(st.sampled_from([0.0, 1e-5, 1e-4]))
    draft_s = draw(st.sampled_from([0.0, 2e-4]))
    return trace, engine, k, (step_s, per_token_s, draft_s)


def spec_for(name: str, k: int) -> dict:
    return {**shorthand_config(name), "num_speculative_tokens": 0 if name == "normal" else k}


def run(trace, engine, name, k, cost):
    from dataclasses import replace

    if name in MODEL_FOR:
        engine = replace(engine, model=MODEL_FOR[name])
    return simulate(trace, spec_for(name, k), engine, ConstantCost(*cost))


def check_lossless(result, trace, max_len: int) -> None:
    recorded = {c.id: c for c in trace.calls}
    calls = result.calls
    for row in calls.iter_rows(named=True):
        c = recorded[row["call_id"].split("#")[0]]
        if row["status"] == "finished":
            assert row["output_len"] == min(c.output_len, max_len - c.prompt_len), row
        else:
            assert row["status"] in ("refused", "skipped") and row["output_len"] == 0, row
            assert row["status"] == "skipped" or c.prompt_len >= max_len, row
    steps = result.steps
    emitted = steps.group_by("call_id").agg(pl.col("emitted").sum())
    by_call = dict(zip(calls["call_id"], calls["output_len"], strict=True))
    for cid, total in emitted.iter_rows():
        assert total == by_call[cid], cid
    # Greedy verification: the accepted prefix of each draft is the recording, the next token is not.
    for row in steps.filter(pl.col("drafted") > 0).select("call_id", "position", "draft", "accepted").iter_rows():
        cid, pos, draft, acc = row
        out = recorded[cid.split("#")[0]].output_tokens
        assert list(draft[:acc]) == out[pos:pos + acc].tolist(), row
        if acc < len(draft) and pos + acc < len(out):
            assert draft[acc] != out[pos + acc], row


def check_drafting(result, trace, engine, name: str, k: int) -> None:
    steps = result.steps
    assert (steps["accepted"] <= steps["drafted"]).all()
    assert (steps["emitted"] <= steps["accepted"] + 1).all()
    assert int(steps["drafted"].max() or 0) <= k
    prompt = {c.id: c.prompt_len for c in trace.calls}
    room = steps.select(pl.col("call_id").str.split("#").list.first().replace_strict(prompt).alias("p"),
                        "position", "drafted")
    assert (room["drafted"] <= engine.max_model_len - room["p"] - room["position"]).all()
    engine_steps = result.engine_steps
    assert (engine_steps["scheduled_tokens"] <= engine.max_num_batched_tokens).all()
    assert (engine_steps["batch_size"] <= engine.max_num_seqs).all()
    if name == "normal":
        assert int(steps["drafted"].sum()) == 0 and int(result.calls["drafted"].sum()) == 0


def check_time_and_goodput(result, engine, k: int, cost) -> None:
    step_s, per_token_s, _ = cost
    es = result.engine_steps
    t = es["time_s"].to_numpy()
    assert np.all(np.diff(t) > 0), "step start times must strictly increase"
    assert (es["step_time_s"] > 0).all()
    # The cost model prices a step at step_s + per_token_s × its tokens (plus drafting): no cheaper.
    floor = step_s + per_token_s * es["scheduled_tokens"].to_numpy()
    assert np.all(es["forward_s"].to_numpy() >= floor * (1 - 1e-12))
    calls = result.calls
    output = int(calls["output_len"].sum())
    if output == 0:
        return
    makespan = float(calls["finish_s"].max()) - float(calls["arrival_s"].min())
    # A step emits at most min(token budget, max_num_seqs × (k + 1)) tokens and costs at least
    # step_s + per_token_s × that many: the best goodput any schedule could reach.
    most = min(engine.max_num_batched_tokens, engine.max_num_seqs * (k + 1))
    bound = most / (step_s + per_token_s * most)
    assert output / makespan <= bound * (1 + 1e-9), (output / makespan, bound)


@pytest.mark.parametrize("name", BUILTIN_DRAFTERS)
@given(case=cases())
def test_every_drafter_keeps_the_invariants(name, case):
    trace, engine, k, cost = case
    result = run(trace, engine, name, k, cost)
    check_lossless(result, trace, engine.max_model_len)
    check_drafting(result, trace, engine, name, k)
    check_time_and_goodput(result, engine, k, cost)
    again = run(trace, engine, name, k, cost)
    assert again.steps.equals(result.steps) and again.calls.equals(result.calls)
    assert again.engine_steps.equals(result.engine_steps) and again.queries.equals(result.queries)


def test_the_drafter_list_covers_the_paper_and_vllm_methods():
    assert {"normal", "ngram", "ngram-v2", "suffix", "eagle3", "mtp", "agentspec", "agentspec-s", "agentspec-r",
            "agentspec-n", "agspec"} <= set(BUILTIN_DRAFTERS)


def test_a_call_alone_that_preempts_itself_is_rescheduled():
    # One call: prompt 1 + output 7 = 4 blocks of 2, the cache's 4 usable blocks; ngram's 2 drafts near the
    # end need a 5th. vLLM preempts the call (recompute), re-admits it next step and it finishes.
    trace = workload([call("c", [0], [0] * 7)])
    engine = config(max_num_seqs=1, max_num_batched_tokens=8, block_size=2, max_model_len=24, num_kv_blocks=5)
    result = simulate(trace, spec_for("ngram", 2), engine, ConstantCost(1e-3))
    assert result.calls["output_len"].to_list() == [7] and result.num_preemptions >= 1


# -- the whole-run checks themselves (engine/invariants.py): each catches the violation it names ----
def test_clock_check_catches_overlap_zero_steps_and_nan():
    from agentspec_sim.engine.invariants import check_clock
    from agentspec_sim.engine.scheduler import SimulationError

    check_clock(np.array([0.0, 1.0, 2.5]), np.array([1.0, 1.5, 0.1]))
    for start, dur in (([0.0, 0.5], [1.0, 1.0]), ([0.0, 1.0], [1.0, 0.0]), ([0.0, np.nan], [1.0, 1.0])):
        with pytest.raises(SimulationError, match="CLOCK"):
            check_clock(np.array(start), np.array(dur))


def test_work_conservation_check_catches_an_idle_engine_with_waiting_calls():
    from agentspec_sim.engine.invariants import check_work_conservation
    from agentspec_sim.engine.scheduler import SimulationError

    start, dur = np.array([0.0, 1.0, 5.0]), np.array([1.0, 1.0, 1.0])
    check_work_conservation(start, dur, np.array([3, 0, 0]))  # idle 2 → 5 with nobody waiting: fine
    with pytest.raises(SimulationError, match=r"idled from 2\.0 s to 5\.0 s after step 1 while 2 call"):
        check_work_conservation(start, dur, np.array([0, 2, 0]))
    with pytest.raises(SimulationError, match="still wait after the last step"):
        check_work_conservation(start, dur, np.array([0, 0, 1]))


def test_causality_check_catches_early_starts_and_early_successors():
    from agentspec_sim.engine.invariants import check_causality, first_scheduled
    from agentspec_sim.engine.request import S_FINISHED
    from agentspec_sim.engine.scheduler import SimulationError

    ids = ["a", "b"]
    status = np.array([S_FINISHED, S_FINISHED])
    pred = np.array([-1, 0])
    scheduled = first_scheduled(np.array([0, 0, 1]), np.array([0, 1, 2]), np.array([0.0, 1.0, 3.0]), 2)
    assert scheduled.tolist() == [0.0, 3.0]
    good = dict(arrival_s=np.array([0.0, 2.0]), scheduled_s=scheduled, first_token_s=np.array([1.0, 4.0]),
                finish_s=np.array([2.0, 5.0]))
    check_causality(ids, **good, status=status, predecessor=pred)
    broken = [("arrival_s", [0.0, 3.5], "before it arrives"), ("first_token_s", [1.0, 2.0], "before its first step"),
              ("finish_s", [2.0, 3.5], "before its first token"), ("arrival_s", [0.0, 1.5], "before the call before")]
    for name, values, what in broken:
        with pytest.raises(SimulationError, match=what):
            check_causality(ids, **{**good, name: np.array(values)}, status=status, predecessor=pred)


def test_completion_check_catches_open_short_and_ghost_calls():
    from agentspec_sim.engine.invariants import check_completion
    from agentspec_sim.engine.request import S_FINISHED, S_RUNNING, S_SKIPPED
    from agentspec_sim.engine.scheduler import SimulationError

    t = np.array([0.0, np.nan])
    ok = dict(status=np.array([S_FINISHED, S_SKIPPED]), emitted=np.array([5, 0]), target=np.array([5, 3]),
              arrival_s=t, first_token_s=np.array([1.0, np.nan]), finish_s=np.array([2.0, np.nan]))
    check_completion(["a", "b"], **ok)
    for change, what in ((dict(status=np.array([S_RUNNING, S_SKIPPED])), "still running"),
                         (dict(emitted=np.array([4, 0])), "finished with 4 tokens"),
                         (dict(finish_s=np.array([np.nan, np.nan])), "lacks an arrival"),
                         (dict(arrival_s=np.array([0.0, 1.0])), "skipped call 'b' arrived")):
        with pytest.raises(SimulationError, match=what):
            check_completion(["a", "b"], **{**ok, **change})


def test_check_run_runs_exactly_when_the_flag_is_on(monkeypatch):
    from agentspec_sim.engine import simulator

    seen = []
    monkeypatch.setattr(simulator, "check_run", lambda *run: seen.append(True))
    trace = workload([call("c", [1, 2, 3], [4, 5])])
    simulate(trace, "ngram", config(), ConstantCost())
    simulate(trace, "ngram", config(check_invariants=False), ConstantCost())
    assert seen == [True]
