"""The capacity search's shortcuts change its cost, never its answer: a probe stopped once its failure is certain
(capacity/steady.py `FailureWatch`) is a probe its whole run would fail, and a search with the shortcuts finds the
capacities, intervals and picks of the search without them."""

from __future__ import annotations

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim.capacity import CapacitySearch, find_capacity, steady_state
from agentspec_sim.capacity.steady import FailureWatch
from agentspec_sim.run.simulation import simulate
from agentspec_sim.slo import LatencySLO


def agents(n: int, seed: int = 5, calls: int = 3, out_len: int = 12, think_s: float = 0.3) -> object:
    rng = np.random.default_rng(seed)
    return workload(*[agent_query(rng, f"q{i}", calls, out_len=out_len, think_s=think_s) for i in range(n)])


SLOS = [LatencySLO(ttft_s=0.3), LatencySLO(tpot_s=0.045), LatencySLO(ttft_s=0.5, tpot_s=0.05),
        LatencySLO(query_latency_s=3.0), LatencySLO(ttft_s=0.4, query_latency_s=4.0)]


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_a_stopped_probe_is_one_its_whole_run_fails(data_parallel):
    """Over rates from calm to overloaded, SLOs of every kind and both criteria, with the engine's multi-step
    runs and its invariant checks on: wherever the watch stops a probe, `steady_state` of the same probe run to its
    end fails it; wherever it does not, the run is the run without a watch. Some probes must stop (else nothing
    was tested)."""
    wl = agents(120)
    reasons: dict[str | None, int] = {}
    for rate in (2.0, 10.0, 14.0, 40.0):
        for i, slo in enumerate(SLOS):
            criterion = "queries" if i % 2 else "calls"
            cfg = config(max_num_seqs=4, arrival="request-rate", rate=rate * data_parallel, seed=i,
                         data_parallel_size=data_parallel)
            whole = simulate(wl, "normal", cfg, ConstantCost())
            verdict = steady_state(whole, slo, 0.2, 0.1, criterion)
            watch = FailureWatch(slo, 0.9, 0.2, 0.1, criterion, looks=16)
            watched = simulate(wl, "normal", cfg, ConstantCost(), watch=watch)
            reasons[watch.stopped_by] = reasons.get(watch.stopped_by, 0) + 1
            if watched.stopped_s is None:
                assert watched.calls.equals(whole.calls)
                continue
            assert not (verdict.stable and verdict.met is not None and verdict.met >= 0.9), (rate, slo, criterion)
            assert watched.stopped_s < float(whole.calls["finish_s"].max())
            if watch.stopped_by == "stability":
                assert not verdict.stable
    assert reasons.get("attainment", 0) >= 3 and reasons.get("stability", 0) >= 3 and reasons.get(None, 0) >= 5


def test_searches_with_and_without_the_shortcuts_agree():
    """The same capacities, intervals, seeds' brackets and probe verdicts; the shortcut search stopped probes."""
    wl = agents(40)
    cfg = config(max_num_seqs=4, check_invariants=False)
    for slo, criterion in ((LatencySLO(ttft_s=0.5, tpot_s=0.05), "calls"), (LatencySLO(ttft_s=0.4, query_latency_s=4.0),
                                                                             "queries")):
        search = CapacitySearch(slo, seeds=3, criterion=criterion, min_queries=60)
        fast = find_capacity(wl, "normal", cfg, search, ConstantCost())
        full = find_capacity(wl, "normal", cfg, search, ConstantCost(), shortcuts=False)
        assert (fast.rate, fast.low, fast.high, fast.bracket) == (full.rate, full.low, full.high, full.bracket)
        assert [s.bracket for s in fast.seeds] == [s.bracket for s in full.seeds]
        assert [p.passes(0.9) for p in fast.probes] == [p.passes(0.9) for p in full.probes]
        assert [p.rate for p in fast.probes] == [p.rate for p in full.probes]
        assert any(p.partial for p in fast.probes) and not any(p.partial for p in full.probes)
        same = {k: v for k, v in fast.at_capacity.to_row().items() if k != "wall_s"}
        assert same == {k: v for k, v in full.at_capacity.to_row().items() if k != "wall_s"}


def test_a_stopped_probe_says_when_and_why_and_claims_no_statistics():
    wl = agents(40)
    cfg = config(max_num_seqs=2, check_invariants=False)
    cap = find_capacity(wl, "normal", cfg, CapacitySearch(LatencySLO(ttft_s=0.5), seeds=1, min_queries=60),
                        ConstantCost())
    partial = [p for p in cap.probes if p.partial]
    assert partial
    for p in partial:
        assert not p.passes(0.9) and p.met is None and p.ttft_p99 is None and p.stopped_by in ("attainment",
                                                                                               "stability")
        assert p.stopped_s > 0


def test_a_workers_searches_on_one_config_share_normals_isolated_run(monkeypatch):
    """The lengthening reference (`normal`'s isolated p90) runs once per engine config in a worker, whatever the
    drafters searched there, and the answers are the searches' own."""
    import agentspec_sim.capacity.search as capacity_search
    from agentspec_sim.drafters.registry import parse_drafter
    from agentspec_sim.sweep.cells import Cell
    from agentspec_sim.sweep.run import run_capacity_cell

    wl = agents(30)
    cfg = config(max_num_seqs=4, check_invariants=False)
    search = CapacitySearch(LatencySLO(ttft_s=2.0, tpot_s=0.1), seeds=2, min_queries=40)
    calls = []
    real = capacity_search.isolated_p90
    monkeypatch.setattr(capacity_search, "isolated_p90", lambda *a: calls.append(1) or real(*a))
    rows = [run_capacity_cell(wl, Cell("t", parse_drafter(name), cfg), search, band=False)
            for name in ("ngram", "ngram-v2", "agentspec-s")]
    assert len(calls) == 1
    for name, row in zip(("ngram", "ngram-v2", "agentspec-s"), rows, strict=True):
        alone = find_capacity(wl, name, cfg, search, shortcuts=False)
        assert row["capacity_rate"] > 0
        assert (row["capacity_rate"], row["capacity_low"], row["capacity_high"]) == (alone.rate, alone.low,
                                                                                     alone.high)
        assert len(calls) == 1 + ["ngram", "ngram-v2", "agentspec-s"].index(name) + 1  # find_capacity runs its own


def test_a_plan_with_the_shortcuts_picks_what_it_picks_without(monkeypatch):
    """A whole capacity sweep (three drafters × two max_num_seqs, tenants sharing tables, normal's isolated run
    shared) with and without the shortcuts: the same capacities, intervals, plan and pick."""
    import agentspec_sim.capacity.search as capacity_search
    from agentspec_sim.sweep.capacity_plan import plan_capacity
    from agentspec_sim.sweep.run import run_sweep

    wl = agents(40)
    search = CapacitySearch(LatencySLO(ttft_s=1.5, tpot_s=0.08), seeds=2, min_queries=60)
    engine = config(check_invariants=False)

    def sweep():
        return run_sweep(workload=wl, drafters=("ngram", "agentspec-s"), max_num_seqs=(2, 6), engine=engine,
                         capacity=search, executor="inline", band=False)

    fast = sweep()
    monkeypatch.setattr(capacity_search, "SHORTCUTS", False)
    full = sweep()
    keys = ["drafter", "max_num_seqs", "capacity_rate", "capacity_low", "capacity_high", "capacity_seed_rates",
            "capacity_bracket_low", "capacity_bracket_high", "capacity_probes", "capacity_tenants"]
    assert fast.select(keys).equals(full.select(keys))
    assert fast["capacity_rate"].min() > 0 and fast["capacity_tenants"].max() > 1
    assert any(x is not None for xs in fast["probe_stopped_s"].to_list() for x in xs)
    assert all(x is None for xs in full["probe_stopped_s"].to_list() for x in xs)
    a, b = plan_capacity(fast)[0], plan_capacity(full)[0]
    assert a.best is not None and a.best == b.best
    assert a.to_dict() == b.to_dict()
