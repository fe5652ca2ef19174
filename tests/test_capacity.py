"""The capacity search (agentspec_sim/capacity.py) against a closed form, its rules, and the load protocols it
rests on (engine/load.py): vLLM bench serve's send times, max concurrency, identical copies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq
from simhelpers import ConstantCost, agent_query, call, config, workload

from agentspec_sim.capacity import CapacitySearch, find_capacity
from agentspec_sim.capacity import search as capacity
from agentspec_sim.cost.step_clock import StepClockCost
from agentspec_sim.engine.load import request_rate_arrivals
from agentspec_sim.metrics import summarize
from agentspec_sim.run.simulation import simulate
from agentspec_sim.slo import LatencySLO, attainment


def single_calls(n: int, out_len: int) -> object:
    rng = np.random.default_rng(1)
    return workload(*[[call(f"c{i}", rng.integers(0, 50, 8), rng.integers(0, 50, out_len), query=f"q{i}")]
                      for i in range(n)])


def _md1_rate(out_len: int, eps: float, target: float) -> float:
    """A constant-step engine (every step 1 s) serving one query at a time is an M/D/1 queue with service
    D = output tokens steps. With a query-latency SLO of D(1 + ε), a query meets it iff it waits ≤ εD, whose
    probability is (1 − ρ)·e^{λεD} for εD < D (Erlang), ρ = λD: the rate where that equals the target."""
    rho = brentq(lambda r: (1 - r) * math.exp(r * eps) - target, 1e-6, 1 - 1e-9)
    return rho / out_len


def test_the_md1_capacity_lies_in_the_stated_interval_for_nine_seeds_in_ten():
    """At N = 400 queries (where one finite-trace search scatters 0.78–1.20× of the analytic value) the
    steady-state capacity's interval over its seeds covers the closed form for at least 9 of 10 base seeds."""
    out_len, eps, target = 4, 0.25, 0.5
    analytic = _md1_rate(out_len, eps, target)
    search = CapacitySearch(LatencySLO(query_latency_s=out_len * (1 + eps)), target=target, tolerance=0.03)
    wl = single_calls(400, out_len)
    covered = 0
    for base in range(10):
        cap = find_capacity(wl, "normal", config(max_num_seqs=1, check_invariants=False, seed=100 * base), search,
                            StepClockCost())
        assert cap.conclusive and len(cap.seeds) == search.seeds and cap.low < cap.rate < cap.high
        assert abs(cap.rate / analytic - 1) < 0.1, (cap.rate, analytic)
        covered += cap.low <= analytic <= cap.high
    assert covered >= 9, covered


def test_search_brackets_every_seed_to_its_tolerance():
    """No all-at-once probe: each seed doubles until a rate fails, then bisects; (r, 2r] is always tested."""
    out_len, eps, target, tolerance = 4, 0.25, 0.5, 0.03
    search = CapacitySearch(LatencySLO(query_latency_s=out_len * (1 + eps)), target=target, tolerance=tolerance,
                            seeds=2)
    cap = find_capacity(single_calls(400, out_len), "normal", config(max_num_seqs=1, check_invariants=False), search,
                        StepClockCost())
    assert cap.probes[0].rate is None and cap.probes[0].met == 1.0  # the isolated probe: nobody waits
    assert all(p.rate is None or math.isfinite(p.rate) for p in cap.probes)
    for seed in cap.seeds:
        lo, hi = seed.bracket
        assert 1 < hi / lo <= 1 + tolerance and seed.rate == pytest.approx(math.sqrt(lo * hi))
        mine = [p for p in cap.probes if p.seed == seed.seed and p.rate is not None]
        assert any(p.rate == hi and not p.passes(target) for p in mine)
        assert any(p.rate == lo and p.passes(target) for p in mine)


def test_search_stops_at_once_when_no_rate_can_meet_the_slo():
    """A TPOT SLO below one step's time fails even with each query alone: one probe, capacity 0."""
    search = CapacitySearch(LatencySLO(tpot_s=0.5))
    cap = find_capacity(single_calls(20, 4), "normal", config(max_num_seqs=4, check_invariants=False), search,
                        StepClockCost())
    assert cap.rate == 0.0 and len(cap.probes) == 1 and "alone" in cap.stopped


@given(seed=st.integers(0, 2**16), queries=st.integers(4, 24), seqs=st.integers(1, 4),
       ttft=st.sampled_from([0.02, 0.05, 0.2]), latency=st.sampled_from([None, 0.5, 2.0]),
       factor=st.floats(1.01, 4.0), drafter=st.sampled_from(["normal", "ngram", "suffix"]))
@settings(deadline=None)
def test_looser_slos_never_lower_capacity_property(seed, queries, seqs, ttft, latency, factor, drafter):
    """At every rate a looser SLO passes whatever a stricter one passes (the same runs), and the search's path only
    diverges upward: its capacity is never lower, whatever the trace's attainment curve looks like."""
    rng = np.random.default_rng(seed)
    wl = workload(*[agent_query(rng, f"q{i}", int(rng.integers(1, 3)), out_len=int(rng.integers(4, 16)), vocab=6,
                                think_s=0.05) for i in range(queries)])
    cfg = config(max_num_seqs=seqs, check_invariants=False)
    strict = LatencySLO(ttft_s=ttft, query_latency_s=latency)
    cost = ConstantCost(per_token_s=1e-4)
    a = find_capacity(wl, drafter, cfg, CapacitySearch(strict, tolerance=0.1, seeds=1), cost)
    b = find_capacity(wl, drafter, cfg, CapacitySearch(strict.looser(factor), tolerance=0.1, seeds=1), cost)
    assert b.rate >= a.rate, (a.rate, b.rate, a.probes, b.probes)


def test_a_looser_slo_never_lowers_capacity():
    rng = np.random.default_rng(3)
    wl = workload(*[agent_query(rng, f"q{i}", 2, out_len=12, think_s=0.2) for i in range(40)])
    cfg = config(max_num_seqs=4, check_invariants=False)
    base = LatencySLO(ttft_s=0.05, query_latency_s=1.0)
    rates = [find_capacity(wl, "ngram", cfg, CapacitySearch(base.looser(f), tolerance=0.1, seeds=1),
                           ConstantCost()).rate for f in (1.0, 1.5, 3.0)]
    assert rates == sorted(rates) and rates[0] > 0, rates
    again = find_capacity(wl, "ngram", cfg, CapacitySearch(base, tolerance=0.1, seeds=2), ConstantCost())
    assert again.probes == find_capacity(wl, "ngram", cfg, CapacitySearch(base, tolerance=0.1, seeds=2),
                                         ConstantCost()).probes  # reruns are identical


def test_request_rate_send_times_follow_vllm_bench_serve():
    """vllm/benchmarks/serve.py get_request: gamma gaps of shape b, scale 1/(R·b), cumulated, rescaled so the last
    is sent at N/R; inf rate → all at 0; inf burstiness → evenly 1/R apart. One seed at two rates: one pattern."""
    t = request_rate_arrivals(50, 2.0, 1.0, 7)
    assert t[-1] == pytest.approx(25.0) and t[0] > 0 and np.all(np.diff(t) >= 0)
    a = request_rate_arrivals(50, 2.0, 0.5, 1)
    b = request_rate_arrivals(50, 8.0, 0.5, 1)
    np.testing.assert_allclose(a, 4 * b)
    assert not request_rate_arrivals(5, math.inf, 1.0, 7).any()
    np.testing.assert_allclose(request_rate_arrivals(4, 2.0, math.inf, 7), [0.5, 1.0, 1.5, 2.0])


def test_request_rate_send_times_are_vllm_bench_serves_own_for_the_seed():
    """The same --seed sends at the same times: vLLM seeds NumPy's legacy global generator and draws the gaps from
    it one by one (`np.random.seed(seed)`, then `np.random.gamma(shape, scale)` per request)."""
    np.random.seed(0)  # what `vllm bench serve --seed 0` does, then its get_request loop
    gaps = [np.random.gamma(shape=1.0, scale=1.0 / 4.0) for _ in range(8)]
    expected = np.cumsum(gaps) * ((8 / 4.0) / np.sum(gaps))
    np.testing.assert_allclose(request_rate_arrivals(8, 4.0, 1.0, 0), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(expected, [0.1953, 0.5035, 0.7300, 0.9232, 1.0584, 1.3132, 1.4544, 2.0], atol=1e-4)


def test_max_concurrency_holds_at_most_n_queries_in_flight():
    rng = np.random.default_rng(0)
    wl = workload(*[agent_query(rng, f"q{i}", 3, think_s=0.5) for i in range(7)])
    q = simulate(wl, "ngram", config(arrival="request-rate", rate=math.inf, max_concurrency=2), ConstantCost()).queries
    starts, ends = q["arrival_s"].to_numpy(), q["finish_s"].to_numpy()
    for t in np.concatenate([starts, ends]):
        assert ((starts <= t) & (ends > t)).sum() <= 2
    assert sorted(starts)[2] == pytest.approx(sorted(ends)[0])  # the third starts when the first ends


@pytest.mark.parametrize("drafter", ["normal", "ngram", "suffix", "eagle3", "agentspec"])
def test_copies_of_one_query_give_identical_per_copy_results(drafter):
    """--copies B: each copy drafts with its own state and draws the same acceptance; with room in the token
    budget every copy emits, drafts and accepts the same at the same times."""
    rng = np.random.default_rng(5)
    wl = workload(agent_query(rng, "q0", 3, out_len=30, vocab=6))
    copies = 6
    result = simulate(wl, drafter, config(copies=copies, max_num_batched_tokens=4096), ConstantCost())
    calls = result.calls.select("drafted", "accepted", "draft_steps", "first_token_s", "finish_s").to_numpy()
    per_copy = calls.reshape(copies, -1, calls.shape[1])
    for k in range(1, copies):
        np.testing.assert_array_equal(per_copy[k], per_copy[0])
    if drafter != "normal":
        assert per_copy[0][:, 0].sum() > 0


def test_copies_speedup_mean_per_query_and_pooled():
    rng = np.random.default_rng(2)
    wl = workload(*[agent_query(rng, f"q{i}", 2, out_len=25, vocab=5) for i in range(4)])
    cfg = config(copies=4, max_num_batched_tokens=4096)
    base = simulate(wl, "normal", cfg, ConstantCost())
    run = simulate(wl, "ngram", cfg, ConstantCost())
    s = summarize(run, base)
    assert s.speedup_mean_per_query is not None and s.speedup is not None
    from agentspec_sim.metrics import per_query_batch_s

    mine, theirs = per_query_batch_s(run), per_query_batch_s(base)
    assert s.speedup_mean_per_query == pytest.approx(float(np.mean(theirs / mine)))
    assert s.speedup == pytest.approx(theirs.sum() / mine.sum(), rel=1e-9)  # pooled: back-to-back batches
    assert "copies 4" in s.protocol


def test_attainment_counts_calls_and_queries():
    wl = single_calls(3, 4)
    result = simulate(wl, "normal", config(max_num_seqs=1), StepClockCost())
    # All at t = 0, one at a time: latencies 4, 8, 12 steps; TTFT 1, 5, 9; TPOT 1.
    a = attainment(result, LatencySLO(ttft_s=5.0, tpot_s=1.0, query_latency_s=4.0))
    assert a["calls_ttft"] == pytest.approx(2 / 3) and a["calls_tpot"] == 1.0 and a["calls"] == pytest.approx(2 / 3)
    assert a["queries"] == pytest.approx(1 / 3) and a["met"] == pytest.approx(1 / 3)
    assert attainment(result, LatencySLO())["met"] is None


def test_copies_ignore_recorded_arrivals_between_batches():
    """Under --copies each query's batch is sent the instant the previous one ends, whatever arrival_s says."""
    rng = np.random.default_rng(4)
    queries = [[call(f"c{i}", rng.integers(0, 50, 8), rng.integers(0, 50, 6), query=f"q{i}",
                     arrival_s=100.0 * i)] for i in range(3)]
    q = simulate(workload(*queries), "normal", config(copies=2), ConstantCost()).queries
    starts, ends = q["arrival_s"].to_numpy().reshape(2, 3), q["finish_s"].to_numpy().reshape(2, 3)
    assert starts[:, 0].tolist() == [0.0, 0.0]
    for i in (1, 2):
        assert starts[0, i] == starts[1, i] == pytest.approx(ends[:, i - 1].max())


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "agentspec"])  # the drafters with workload tables
def test_a_search_reads_its_tables_once_and_no_probe_changes_them(drafter, monkeypatch, tmp_path):
    """What no probe's load changes is made once per search: the drafter's workload tables are read (or built)
    once and held for every probe (drafters/common/table_cache.py `held_in_memory`), and no probe writes them."""
    import hashlib

    from agentspec_sim.drafters.common import table_cache

    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path))
    rng = np.random.default_rng(5)
    wl = workload(*[agent_query(rng, f"q{i}", 2, out_len=12, vocab=6, think_s=0.05) for i in range(10)])
    reads, held = [], {}
    real = table_cache._read_or_build

    def counting(kind, key, build, valid):
        reads.append(kind)
        return real(kind, key, build, valid)

    def digest(arrays):
        return {name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for name, a in arrays.items()}

    monkeypatch.setattr(table_cache, "_read_or_build", counting)
    real_search = capacity.search_capacity

    def spying(*args, **kwargs):
        out = real_search(*args, **kwargs)
        held.update({key: digest(arrays) for key, arrays in table_cache.held_tables().items()})
        return out

    monkeypatch.setattr(capacity, "search_capacity", spying)
    cap = find_capacity(wl, drafter, config(max_num_seqs=4, check_invariants=False),
                        CapacitySearch(LatencySLO(ttft_s=0.05), tolerance=0.2), ConstantCost(per_token_s=1e-4))
    assert len(cap.probes) >= 3 and reads and len(reads) == len(set(reads))  # each kind of table read once
    assert table_cache.held_tables() == {}  # released with the search
    for (kind, key), before in held.items():  # the held arrays, as the probes left them, equal the stored ones
        assert digest(table_cache._read_or_build(kind, key, lambda: {}, lambda a: True)) == before
