"""Capacity as a steady-state rate (agentspec_sim/capacity): one test per class of the rules — stability, the
steady window, lengthening and inconclusive answers, the client's send order, the attainment criterion, refused
calls, the max-concurrency refusal and the money a plan states."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import polars as pl
import pytest
from simhelpers import ConstantCost, agent_query, call, config, workload

from agentspec_sim.capacity import CapacitySearch, find_capacity, steady_state
from agentspec_sim.cost.step_clock import StepClockCost
from agentspec_sim.engine.load import send_order
from agentspec_sim.run.simulation import simulate
from agentspec_sim.slo import LatencySLO
from agentspec_sim.sweep.capacity_plan import UTILISATION, Prices, plan_capacity


def single_calls(n: int, out_len: int, prompt: int = 8) -> object:
    rng = np.random.default_rng(1)
    return workload(*[[call(f"c{i}", rng.integers(0, 50, prompt), rng.integers(0, 50, out_len), query=f"q{i}")]
                      for i in range(n)])


def test_an_engine_that_falls_behind_fails_whatever_its_attainment():
    """Over its capacity the queue grows: a TPOT-only SLO is still met (queueing delays the first token, not the
    gaps), but the engine emitted far less than was offered over the steady window: the probe is unstable."""
    wl = single_calls(200, 4)
    cfg = config(max_num_seqs=1, arrival="request-rate", rate=0.5, check_invariants=False)  # 2× its 0.25 q/s
    result = simulate(wl, "normal", cfg, StepClockCost())
    steady = steady_state(result, LatencySLO(tpot_s=1.5), warmup=0.2, stability=0.1)
    assert steady.met == 1.0 and not steady.stable and steady.served_share < 0.7
    calm = steady_state(simulate(wl, "normal", config(max_num_seqs=1, arrival="request-rate", rate=0.1,
                                                      check_invariants=False), StepClockCost()),
                        LatencySLO(tpot_s=1.5), warmup=0.2, stability=0.1)
    assert calm.stable and calm.served_share == pytest.approx(1.0, abs=0.1)
    cap = find_capacity(wl, "normal", config(max_num_seqs=1, check_invariants=False),
                        CapacitySearch(LatencySLO(tpot_s=1.5), seeds=2), StepClockCost())
    # Never above what the engine serves (one query per 4 s) by more than the stability rule admits: a probe
    # passes while it serves ≥ 90 % of what is offered, so up to 0.25 / 0.9 (seed 0 finds 0.273).
    assert 0 < cap.rate < 0.25 / 0.9


def test_the_steady_window_leaves_out_the_warm_up_and_the_drain():
    """Only calls sent inside [warmup·T, T] count (T: the last send): neither the first queries, which meet an
    empty engine, nor a query's later calls after T, which meet a draining one."""
    rng = np.random.default_rng(3)
    wl = workload(*[agent_query(rng, f"q{i}", 3, out_len=6, think_s=0.5) for i in range(50)])
    result = simulate(wl, "normal", config(max_num_seqs=4, arrival="request-rate", rate=2.0,
                                           check_invariants=False), ConstantCost())
    steady = steady_state(result, LatencySLO(ttft_s=10.0), warmup=0.25, stability=0.1)
    sends = result.queries["arrival_s"].to_numpy()
    assert steady.end_s == pytest.approx(sends.max()) and steady.start_s == pytest.approx(0.25 * sends.max())
    arrivals = result.calls["arrival_s"].to_numpy()
    inside = (arrivals >= steady.start_s) & (arrivals <= steady.end_s)
    assert steady.calls == int(inside.sum()) < result.calls.height
    assert steady.queries == int(((sends >= steady.start_s) & (sends <= steady.end_s)).sum())
    whole = steady_state(result, LatencySLO(ttft_s=10.0), warmup=0.25, stability=0.1, whole=True)
    assert whole.calls == result.calls.height


def test_a_short_trace_is_lengthened_with_tenants_or_declared_inconclusive():
    """Eight queries cannot load an engine for long: probes send them as independent tenants (said in the
    answer); capped below what a steady probe needs, the capacity is inconclusive — a floor, not a figure."""
    wl = single_calls(8, 4)
    slo = LatencySLO(query_latency_s=5.0)
    cap = find_capacity(wl, "normal", config(max_num_seqs=1, check_invariants=False), CapacitySearch(
        slo, target=0.5, seeds=2), StepClockCost())
    assert cap.conclusive and cap.tenants > 1
    assert all(p.tenants * 8 >= 100 for p in cap.probes if p.rate is not None)  # min_queries
    capped = find_capacity(wl, "normal", config(max_num_seqs=1, check_invariants=False), CapacitySearch(
        slo, target=0.5, seeds=2, max_tenants=2), StepClockCost())
    assert not capped.conclusive and "too short" in capped.inconclusive and math.isinf(capped.high)


def test_queries_go_out_in_vllm_bench_serves_shuffled_order():
    """vllm/benchmarks/datasets: random.seed(seed); random.shuffle(data), unless --disable-shuffle."""
    order = list(range(30))
    random.Random(7).shuffle(order)
    assert send_order(30, 7, True).tolist() == order
    assert send_order(30, 7, False).tolist() == list(range(30))
    wl = single_calls(30, 2)
    for shuffle in (True, False):
        q = simulate(wl, "normal", config(arrival="request-rate", rate=5.0, seed=7, disable_shuffle=not shuffle,
                                          check_invariants=False), ConstantCost()).queries
        sent = q.sort("arrival_s")["query_id"].to_list()
        assert sent == [f"q{i}" for i in (order if shuffle else range(30))]
    gated = simulate(wl, "normal", config(arrival="request-rate", rate=math.inf, max_concurrency=1, seed=7,
                                          check_invariants=False), ConstantCost()).queries
    assert gated.sort("arrival_s")["query_id"].to_list() == [f"q{i}" for i in order]


def test_the_criterion_pools_calls_or_judges_whole_queries():
    """Per query: a query is good only when every one of its calls met the call SLOs; pooled calls count each
    call. A query of three calls with one slow call: 2/3 of its calls, 0 of its queries."""
    rng = np.random.default_rng(0)
    wl = workload(*[agent_query(rng, f"q{i}", 3, out_len=8, think_s=0.1) for i in range(40)])
    result = simulate(wl, "normal", config(max_num_seqs=2, arrival="request-rate", rate=4.0,
                                           check_invariants=False), ConstantCost(per_token_s=2e-3))
    slo = LatencySLO(ttft_s=float(np.median((result.calls["first_token_s"] - result.calls["arrival_s"]).to_numpy())))
    pooled = steady_state(result, slo, 0.0, 0.1, "calls")
    per_query = steady_state(result, slo, 0.0, 0.1, "queries")
    assert 0 < per_query.met < pooled.met < 1
    ttft = (result.calls["first_token_s"] - result.calls["arrival_s"]).to_numpy()
    good = pl.DataFrame({"q": result.calls["query_id"], "ok": ttft <= slo.ttft_s}).group_by("q").agg(pl.col("ok").all())
    assert per_query.met == pytest.approx(good["ok"].mean())


def test_refused_calls_count_as_not_good():
    """A call refused at max_model_len is a failed request, as vLLM's benchmark counts one: not good."""
    wl = workload(*[[call(f"c{i}", list(range(8 + 40 * (i % 2))), [1, 2, 3], query=f"q{i}")] for i in range(20)])
    result = simulate(wl, "normal", config(max_model_len=32, arrival="request-rate", rate=1.0,
                                           check_invariants=False), ConstantCost())
    steady = steady_state(result, LatencySLO(ttft_s=10.0), 0.0, 0.1)
    assert steady.refused_calls == 10 and steady.met == pytest.approx(0.5)
    from agentspec_sim.metrics import summarize

    summary = summarize(result, slo=LatencySLO(ttft_s=10.0))  # replay's attainment counts them the same way
    assert summary.attainment["calls"] == pytest.approx(0.5) and summary.refused_calls == 10


def test_a_capacity_search_refuses_max_concurrency():
    """Under max concurrency latency is clocked from the slot, so every rate would pass: refused."""
    with pytest.raises(ValueError, match="max concurrency"):
        find_capacity(single_calls(10, 2), "normal", config(max_concurrency=2), CapacitySearch(
            LatencySLO(ttft_s=1.0)), ConstantCost())


def _rows(rate: float, low: float, high: float, inconclusive: str | None = None, per_query: float = 500.0,
          drafter: str = "normal", seqs: int = 16) -> dict:
    return {"trace": "t.jsonl", "hardware": "h100-80g", "model": "qwen3-8b", "seed": 0, "drafter": drafter,
            "speculative_config": json.dumps({"method": drafter}), "max_num_seqs": seqs,
            "capacity_rate": None if inconclusive else rate, "capacity_low": None if inconclusive else low,
            "capacity_high": None if inconclusive else high, "capacity_at_least": rate if inconclusive else None,
            "capacity_inconclusive": inconclusive, "capacity_output_tokens_per_query": per_query,
            "capacity_stopped": "bisected", "capacity_search": json.dumps({"target": 0.9, "tolerance": 0.05,
                                                                           "burstiness": 1.0, "slo": {}}),
            "engine_config": json.dumps({"tensor_parallel_size": 2})}


def test_money_and_replicas_come_from_the_sustained_rate_and_the_intervals_floor():
    """$/Mtok = GPUs × $/GPU-h ÷ (rate × output tokens per query × 3600) × 10⁶; replicas = ⌈target ÷ (lower
    bound × utilisation)⌉; an inconclusive capacity gets neither."""
    prices = Prices({"h100-80g": 3.0}, "test")
    frame = pl.DataFrame([_rows(2.0, 1.8, 2.2), _rows(5.0, 0, 0, "inconclusive: too short", drafter="ngram")])
    plan = plan_capacity(frame, target_rate=10.0, prices=prices)[0]
    best = plan.best
    assert best.drafter == "normal" and best.gpus == 2
    assert best.usd_per_million_tokens == pytest.approx(2 * 3.0 / (2.0 * 500.0 * 3600) * 1e6)
    assert best.usd_per_query == pytest.approx(2 * 3.0 / (2.0 * 3600))
    assert best.replicas == math.ceil(10.0 / (1.8 * UTILISATION))
    ngram = next(d for d in plan.drafters if d.drafter == "ngram")
    assert ngram.best is None and "too short" in ngram.why and ngram.at_least == {16: 5.0}
    alone = plan_capacity(frame.filter(pl.col("drafter") == "ngram"), target_rate=10.0, prices=prices)[0]
    assert alone.best is None and "too short" in alone.reason and "replica(s)" not in alone.reason


def test_two_capacities_inside_their_intervals_and_the_models_error_are_not_told_apart():
    prices = Prices({"h100-80g": 3.0}, "test")
    close = pl.DataFrame([_rows(2.0, 1.8, 2.2), _rows(2.1, 1.9, 2.3, drafter="ngram")])
    plan = plan_capacity(close, prices=prices)[0]
    assert plan.best.drafter == "ngram" and plan.within_error and "not told apart" in plan.reason
    apart = pl.DataFrame([_rows(2.0, 1.95, 2.05), _rows(3.0, 2.95, 3.05, drafter="ngram")])
    assert not plan_capacity(apart, prices=prices)[0].within_error


def test_itl_is_the_gap_between_streamed_chunks_and_an_itl_slo_judges_the_longest():
    """vllm bench serve's ITL: one value per chunk after the first, the time since the previous chunk of the same
    request; a speculative step streams its accepted tokens as one chunk, so its gaps are longer than TPOT."""
    from agentspec_sim.metrics import summarize
    from agentspec_sim.slo import attainment, inter_token_latencies

    rng = np.random.default_rng(2)
    wl = workload(*[agent_query(rng, f"q{i}", 2, out_len=40, vocab=4, think_s=0.1) for i in range(12)])
    result = simulate(wl, "ngram", config(max_num_seqs=4, arrival="request-rate", rate=5.0, check_invariants=False),
                      ConstantCost(per_token_s=1e-3))
    gaps, longest = inter_token_latencies(result)
    e = result.emissions
    chunks = e.group_by("call").len()["len"].to_numpy()
    assert gaps.size == int((chunks - 1).sum()) and (gaps > 0).all()
    s = summarize(result)
    assert s.itl.mean == pytest.approx(gaps.mean()) and s.itl.std == pytest.approx(gaps.std())
    assert s.itl.mean > s.tpot.mean  # bursts: more than one token per chunk
    assert s.e2el.p50 is not None and s.ttft.mean is not None
    cut = float(np.nanmedian(longest))
    a = attainment(result, LatencySLO(itl_s=cut))
    finished = (result.calls["status"] == "finished").to_numpy()
    assert a["calls_itl"] == pytest.approx(float((np.nan_to_num(longest[finished]) <= cut).mean()))
    assert a["calls"] == a["calls_itl"] and 0 < a["met"] < 1


def test_an_eagle3_capacity_band_widens_what_the_plan_cannot_tell_apart():
    """A capacity searched at the acceptance model's low and high bound carries the model's uncertainty: the
    same gap that two bare intervals tell apart is not told apart with the band."""
    prices = Prices({"h100-80g": 3.0}, "test")
    rows = [_rows(2.0, 1.95, 2.05), _rows(2.3, 2.25, 2.35, drafter="eagle3")]
    assert not plan_capacity(pl.DataFrame(rows), prices=prices)[0].within_error
    rows[1] = {**rows[1], "capacity_band_low": 1.8, "capacity_band_high": 2.8}
    plan = plan_capacity(pl.DataFrame(rows), prices=prices)[0]
    assert plan.best.drafter == "eagle3" and plan.best.band == (1.8, 2.8) and plan.within_error


@pytest.mark.parametrize("dp", [1, 2])
def test_every_emission_is_a_calls_token_at_its_step_end(dp):
    """`RunResult.emissions` (what ITL is measured on) holds each call's output tokens once, at the engine's step
    ends: the first where first_token_s is and the last where finish_s is, before the front end's time (the client
    has them `frontend_time` later) — with data parallelism too, the ranks' emissions merged."""
    from pathlib import Path

    from agentspec_sim.cost import cost_model_for
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.trace.io import load_trace

    wl = load_trace(Path(__file__).parents[1] / "traces" / "swe-agent.jsonl.zst")
    cfg = EngineConfig(max_num_seqs=8, data_parallel_size=dp, arrival="request-rate", rate=1.0)
    cost = cost_model_for(cfg)
    result = simulate(wl, "ngram", cfg, cost)
    per_call = result.emissions.group_by("call").agg(pl.col("tokens").sum(), pl.col("time_s").min().alias("first"),
                                                     pl.col("time_s").max().alias("last"))
    calls = result.calls.with_row_index("call").with_columns(pl.col("call").cast(pl.Int64)).join(per_call, on="call")
    assert calls.height == result.calls.filter(pl.col("status") == "finished").height
    assert (calls["output_len"] == calls["tokens"]).all()
    front = cost.frontend_time(calls["prompt_len"].to_numpy())
    assert (front > 0).all()
    np.testing.assert_allclose(calls["first"] + front, calls["first_token_s"], atol=1e-9)
    np.testing.assert_allclose(calls["last"] + front, calls["finish_s"], atol=1e-9)


def test_results_of_the_finite_trace_search_are_refused_with_the_reason():
    from agentspec_sim.sweep.cells import SweepError

    old = pl.DataFrame([{k: v for k, v in _rows(2.0, 1.8, 2.2).items()
                         if k not in ("capacity_low", "capacity_high", "capacity_at_least", "capacity_inconclusive")}
                        | {"capacity_unbounded": False}])
    with pytest.raises(SweepError, match="run sweep --capacity again"):
        plan_capacity(old)
