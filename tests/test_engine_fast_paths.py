"""The engine's fast paths against their plain forms: runs of steps vs one step per event, batched step
pricing vs `step_time`, the batched n-gram proposer vs `NgramDrafter.propose`, the block pool's node
table, and the kernel-cache guard. (tests/test_engine_golden.py pins whole runs to the reference engine.)"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, call, config, workload

from agentspec_sim.cost import BatchShape, Calibration, RooflineCostModel
from agentspec_sim.drafters.agentspec.fastpath import HistoryDrafting
from agentspec_sim.drafters.agentspec.rule import AgentSpecDrafter
from agentspec_sim.drafters.model.rule import ModelBasedDrafter
from agentspec_sim.drafters.ngram.index import propose_ngram_rows
from agentspec_sim.drafters.ngram.rule import NgramDrafter
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.drafters.suffix.rule import SuffixDrafter
from agentspec_sim.engine.config import resolve
from agentspec_sim.engine.kv import BlockPool
from agentspec_sim.engine.request import CallState
from agentspec_sim.engine.simulator import Simulator
from agentspec_sim.host.kernel_cache import cache_dir, clear_if_changed


def _without_fast_path(monkeypatch, kind):
    """Drafters of `kind` drive no fast path: the engine calls their hooks and `propose`."""
    monkeypatch.setattr(kind, "engine_drafting", lambda self, run: None)


def _run(wl, drafter, cfg, cost, max_run_steps=None):
    sim = Simulator(wl, parse_drafter(drafter), cfg, resolve(cfg), cost)
    if max_run_steps is not None:
        sim.max_run_steps = max_run_steps
    return sim.run()


def _same(a, b):
    for name in ("steps", "engine_steps", "calls", "queries"):
        assert getattr(a, name).equals(getattr(b, name)), name


CASES = [
    ("normal", {}),
    ("ngram", {}),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, {}),
    ({"method": "test-oracle", "num_speculative_tokens": 4, "overshoot": 2}, {}),
    ("normal", {"num_kv_blocks": 60, "max_num_seqs": 6}),
    ("ngram", {"num_kv_blocks": 60, "max_num_seqs": 6}),
    ("normal", {"arrival": "poisson", "rate": 30.0, "replicate": 2, "think_time": 0.02}),
    ("ngram", {"enable_prefix_caching": False, "max_num_batched_tokens": 16}),
]


@pytest.mark.parametrize(("drafter", "overrides"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_runs_of_steps_equal_one_step_per_event(drafter, overrides, seed):
    rng = np.random.default_rng(seed)
    wl = workload(*[agent_query(rng, f"q{i}", 3, prompt_len=30, out_len=25, vocab=5) for i in range(5)])
    cfg = config(**{"check_invariants": False, "arrival": "zero", **overrides})
    for cost in (ConstantCost(per_token_s=1e-4, draft_s=1e-3), RooflineCostModel("a100-80g", "qwen3-8b")):
        _same(_run(wl, drafter, cfg, cost), _run(wl, drafter, cfg, cost, max_run_steps=1))


def test_the_invariant_checks_run_on_the_multi_step_path_users_run():
    """`check_invariants` no longer forces one step per event: the checks (and every property test, which turns
    them on) see the runs of steps production takes, and the run still passes them."""
    rng = np.random.default_rng(5)
    wl = workload(*[agent_query(rng, f"q{i}", 3, prompt_len=30, out_len=25, vocab=5) for i in range(5)])
    cfg = config(arrival="zero")
    assert cfg.check_invariants
    sim = Simulator(wl, parse_drafter("ngram"), cfg, resolve(cfg), ConstantCost(per_token_s=1e-4, draft_s=1e-3))
    assert sim.max_run_steps > 1
    events = []
    step = sim._on_step
    sim._on_step = lambda payload: events.append(1) or step(payload)
    result = sim.run()
    assert len(events) < result.engine_steps.height  # runs of several steps, checked


def test_the_kept_step_bound_cuts_runs_no_shorter_than_a_fresh_one(monkeypatch):
    """`_step_bound` is kept until a call joins the engine or ends its prefill: the same steps, and about as many
    runs as a bound made afresh for every run (kept past a prefill's end, a prefill chunk's bound once cut the
    decodes after it into 2.6 times the runs)."""
    rng = np.random.default_rng(3)
    wl = workload(*[agent_query(rng, f"q{i}", 3, prompt_len=3000, out_len=200, vocab=5, think_s=0.03)
                    for i in range(12)])
    cfg = config(check_invariants=False, arrival="request-rate", rate=1.0, max_num_batched_tokens=8192, max_num_seqs=16,
                 num_kv_blocks=20000, max_model_len=40960)
    cost = RooflineCostModel("a100-80g", "llama-3.1-8b")

    def runs(fresh: bool) -> tuple[int, object]:
        sim = Simulator(wl, parse_drafter("ngram"), cfg, resolve(cfg), cost)
        if fresh:
            monkeypatch.setattr(sim, "_step_bound", sim._new_step_bound)
        events = []
        step = sim._on_step
        sim._on_step = lambda payload: events.append(1) or step(payload)
        result = sim.run()
        return len(events), result

    kept, a = runs(False)
    fresh, b = runs(True)
    _same(a, b)
    assert kept <= fresh * 1.02 and fresh < a.engine_steps.height


LOADED = [
    {"arrival": "request-rate", "rate": 4.0},
    {"arrival": "request-rate", "rate": 20.0, "burstiness": 0.3, "think_time": 0.05},
    {"arrival": "request-rate", "rate": 8.0, "num_kv_blocks": 60, "max_num_seqs": 6},  # preemptions under load
    {"arrival": "request-rate", "rate": 50.0, "max_concurrency": 3, "think_time": 0.01},
    {"copies": 3, "think_time": 0.02},
]


@pytest.mark.parametrize("drafter", ["normal", "ngram", "suffix", "eagle3", "agentspec",
                                     {"method": "ngram", "num_speculative_tokens": 3,
                                      "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 1]]}])
@pytest.mark.parametrize("overrides", LOADED)
def test_runs_with_arrivals_pending_equal_one_step_per_event(drafter, overrides):
    """With arrivals pending in the heap a run takes as many steps as surely all start before the next one
    (`Simulator._step_bound`), stopping at any finish: the same steps, times and admissions as the plain loop."""
    rng = np.random.default_rng(3)
    wl = workload(*[agent_query(rng, f"q{i}", 3, prompt_len=30, out_len=25, vocab=5, think_s=0.03)
                    for i in range(8)])
    cfg = config(**{"check_invariants": False, "max_num_batched_tokens": 64, **overrides})
    cost = RooflineCostModel("a100-80g", "llama-3.1-8b")
    fast = Simulator(wl, parse_drafter(drafter), cfg, resolve(cfg), cost)
    events = []
    step = fast._on_step
    fast._on_step = lambda payload: events.append(1) or step(payload)
    got = fast.run()
    _same(got, _run(wl, drafter, cfg, cost, max_run_steps=1))
    if overrides.get("arrival") == "request-rate" and "max_concurrency" not in overrides:
        assert len(events) < got.engine_steps.height  # some runs took several steps with arrivals pending


@pytest.mark.parametrize(("hardware", "model", "tp"), [("a100-80g", "qwen3-8b", 1), ("h100-80g", "gpt-oss-20b", 2),
                                                      ("h200", "llama-3.1-8b", 1), ("h200", "deepseek-v3", 8)])
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_step_times_equal_step_time_bit_for_bit(hardware, model, tp, p):
    rng = np.random.default_rng(7)
    cm = RooflineCostModel(hardware, model, tp, Calibration(combine_p=p))
    sizes = rng.integers(1, 40, 400)
    sizes[::37] = 30
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    rows = int(offsets[-1])
    q = np.where(rng.random(rows) < 0.8, 1, rng.integers(1, 3000, rows))
    small = rng.random(rows) < 0.1
    q[small] = rng.integers(2, 7, int(small.sum()))
    q[offsets[5]:offsets[6]] = rng.integers(500, 2000, int(sizes[5]))  # > 16 compute-bound calls in a step
    c = rng.integers(0, 60000, rows)
    pf = (q > 1) & (rng.random(rows) < 0.7)
    got = cm.step_times(q, c, pf, offsets)
    ref = [cm.step_time(BatchShape(q[a:b], c[a:b], pf[a:b])).total_s for a, b in itertools.pairwise(offsets)]
    assert got.tolist() == ref
    # in runs of a few steps too (the linear time read from the memo, not from np.unique)
    cuts = [0, 1, 2, 5, 40, 90, 150, 400]
    pieces = [cm.step_times(q[offsets[a]:offsets[b]], c[offsets[a]:offsets[b]], pf[offsets[a]:offsets[b]],
                            offsets[a:b + 1] - offsets[a]) for a, b in itertools.pairwise(cuts)]
    assert np.concatenate(pieces).tolist() == ref


def _six_agents(seed: int, overrides: dict, calls: int = 3):
    """Six agent queries of `calls` short calls (40-token prompts, 30-token outputs over 4 token ids: drafts find
    matches), sent at once to max_num_seqs 4 (plus `overrides`), priced on A100 + Qwen3-8B: the workload, config
    and cost model the fast-path comparisons replay."""
    rng = np.random.default_rng(seed)
    wl = workload(*[agent_query(rng, f"q{i}", calls, prompt_len=40, out_len=30, vocab=4) for i in range(6)])
    cfg = config(**{"check_invariants": False, "arrival": "zero", "max_num_seqs": 4, **overrides})
    return wl, cfg, RooflineCostModel("a100-80g", "qwen3-8b")


@pytest.mark.parametrize("spec", ["ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                            "prompt_lookup_max": 2,
                                            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 1]]},
                                  "ngram-v2", {"method": "ngram-v2", "num_speculative_tokens": 4,
                                               "prompt_lookup_min": 2, "prompt_lookup_max": 4}])
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 120}, {"max_num_batched_tokens": 16},
                                       {"replicate": 3}])
def test_inline_ngram_drafting_equals_the_event_loops(spec, overrides, monkeypatch):
    """`run_steps` drafting with the n-gram index itself (long runs) = the event loop drafting after each
    step, including when the index fills up mid-run (a tiny table: the kernel hands the step back).
    (The index, not the workload's table: tests/test_draft_tables.py compares the two.)"""
    import agentspec_sim.drafters.ngram.index as batched

    monkeypatch.setattr(Simulator, "draft_tables", False)
    wl, cfg, cost = _six_agents(11, overrides, calls=4)
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert sim.fast is not None and sim.fast.run_state() is not None
    by_event_loop = []
    propose = sim._propose
    monkeypatch.setattr(sim, "_propose", lambda *args: by_event_loop.append(1) or propose(*args))
    inline = sim.run()
    drafting_steps = int((inline.engine_steps["D"] > 0).sum())
    assert len(by_event_loop) < drafting_steps / 2  # most steps were drafted inside runs
    _same(inline, _run(wl, spec, cfg, cost, max_run_steps=1))
    monkeypatch.setattr(batched.NgramIndex, "initial_capacity", 1 << 4)
    monkeypatch.setattr(batched.NgramIndex, "max_capacity", 1 << 7)  # a table that keeps emptying itself
    small = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    handed_back = []
    propose_small = small._propose
    monkeypatch.setattr(small, "_propose", lambda *args: handed_back.append(1) or propose_small(*args))
    _same(inline, small.run())
    assert len(handed_back) > len(by_event_loop)  # the kernel handed steps back for room


@pytest.mark.parametrize("spec", ["ngram", "ngram-v2"])
def test_inline_ngram_drafting_goes_on_once_the_index_has_room(spec, monkeypatch):
    # 40 calls at 40 arena offsets: the index's region table (32 regions before it grows) fills mid-run.
    monkeypatch.setattr(Simulator, "draft_tables", False)  # the index, not the workload's table
    rng = np.random.default_rng(5)
    wl = workload(*[agent_query(rng, f"q{i}", 1, prompt_len=40, out_len=40, vocab=4) for i in range(40)])
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4)
    cost = RooflineCostModel("a100-80g", "qwen3-8b")
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    handed_back = []
    propose = sim._propose
    monkeypatch.setattr(sim, "_propose", lambda *args: handed_back.append(1) or propose(*args))
    result = sim.run()
    assert 1 <= len(handed_back) < result.engine_steps.height / 10
    assert sim.drafters[0]._prompt_index.regions.shape[0] > 64
    _same(result, _run(wl, spec, cfg, cost, max_run_steps=1))


EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 4, "seed": 3}


@pytest.mark.parametrize("spec", [EAGLE3, {**EAGLE3, "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 64, 2]],
                                           "num_speculative_tokens": 5}])
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 120}, {"max_num_batched_tokens": 16},
                                       {"replicate": 3}, {"max_num_seqs": 1}])
def test_model_based_drafting_from_tables_equals_the_drafters_own(spec, overrides, monkeypatch):
    """eagle3 drafting from `AcceptanceTables` — inside `run_steps` and in the event loop — equals the
    drafter's own `propose` fed by its start_call/observe hooks, step for step."""
    wl, cfg, cost = _six_agents(2, overrides)
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert sim.fast is not None and sim.fast.run_state() is not None and not any(sim.hooks)
    by_event_loop = []
    propose = sim._propose
    monkeypatch.setattr(sim, "_propose", lambda *args: by_event_loop.append(1) or propose(*args))
    tables = sim.run()
    drafting_steps = int((tables.engine_steps["D"] > 0).sum())
    assert drafting_steps > 20 and len(by_event_loop) < drafting_steps / 2  # most drafted inside runs
    _same(tables, _run(wl, spec, cfg, cost, max_run_steps=1))  # the event loop's compiled proposal
    _without_fast_path(monkeypatch, ModelBasedDrafter)
    reference = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert reference.fast is None and all(reference.hooks)
    _same(tables, reference.run())


def test_model_based_tables_on_a_real_trace_equal_the_drafters_own(monkeypatch):
    """The bundled coding trace: prompts that extend the last call's history share one copy-feature
    stream, and its calls' structures drive the code feature (the qwen3 tokenizer's bytes)."""
    from dataclasses import replace

    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    w = load_trace(default_trace_path())
    wl = replace(w, queries=w.queries[:4])
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=3, max_model_len=40960, num_kv_blocks=20000,
                 max_num_batched_tokens=8192)
    cost = RooflineCostModel("a100-80g", "qwen3-8b")
    sim = Simulator(wl, parse_drafter("eagle3"), cfg, resolve(cfg), cost)
    assert sim.fast is not None and int(sim.fast.state.code.sum()) > 100  # code blocks do occur
    tables = sim.run()
    _without_fast_path(monkeypatch, ModelBasedDrafter)
    _same(tables, _run(wl, "eagle3", cfg, cost))


AGENTSPEC = {"method": "agentspec", "num_speculative_tokens": 6, "min_match_len": 2, "alpha": 24}


@pytest.mark.parametrize("spec", [AGENTSPEC, {**AGENTSPEC, "budget": "token_budget"}])
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 120}, {"max_num_batched_tokens": 16},
                                       {"max_num_seqs": 1}])
@pytest.mark.parametrize("tiny_arena", [False, True])
def test_agentspec_drafting_from_its_history_in_runs_equals_the_drafters_own(spec, overrides, tiny_arena,
                                                                            monkeypatch):
    """agentspec observing and proposing in compiled code — inside `run_steps`, and for the last step of a
    run (`HistoryDrafting.after_step`: hooks for the calls that started or finished, the rest compiled) — equals the
    drafter's own hooks and propose, step for step; with a tiny arena (pool and n-gram table) steps find no
    room in the table and go to the event loop, which grows it."""
    from agentspec_sim.drafters.agentspec.block_index import BlockArena

    monkeypatch.setattr(Simulator, "draft_tables", False)  # the live history (tests/test_history_tables.py: tables)
    if tiny_arena:
        monkeypatch.setattr(BlockArena.__init__, "__defaults__", (8, 16))
    wl, cfg, cost = _six_agents(4, overrides)
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert isinstance(sim.fast, HistoryDrafting)
    by_python = []
    propose = type(sim.drafters[0]).propose
    monkeypatch.setattr(type(sim.drafters[0]), "propose", lambda *args: by_python.append(1) or propose(*args))
    compiled = sim.run()
    drafting_steps = int((compiled.engine_steps["D"] > 0).sum())
    assert drafting_steps > 20
    if not tiny_arena:
        assert len(by_python) < drafting_steps / 4  # most proposals were compiled
    _same(compiled, _run(wl, spec, cfg, cost, max_run_steps=1))  # every step through `after_step`
    _without_fast_path(monkeypatch, AgentSpecDrafter)
    reference = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert reference.fast is None
    _same(compiled, reference.run())


def test_agentspec_calls_start_with_room_for_their_whole_output(monkeypatch):
    """A call's output has room in its blocks from its start (`History.attach_row`), so with a pool that
    starts tiny (and a table that never fills) no step goes back to the event loop for want of room;
    without the reservation most steps with drafts would."""
    from agentspec_sim.drafters.agentspec.block_index import BlockArena

    monkeypatch.setattr(Simulator, "draft_tables", False)
    monkeypatch.setattr(BlockArena.__init__, "__defaults__", (8, 1 << 16))
    rng = np.random.default_rng(4)
    wl = workload(*[agent_query(rng, f"q{i}", 3, prompt_len=40, out_len=120, vocab=4) for i in range(8)])
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=8)
    sim = Simulator(wl, parse_drafter(AGENTSPEC), cfg, resolve(cfg), RooflineCostModel("a100-80g", "qwen3-8b"))
    answers = []
    step = sim.fast._step
    monkeypatch.setattr(sim.fast, "_step", lambda *args: answers.append(step(*args)) or answers[-1])
    sim.run()
    assert len(answers) > 20 and min(answers) >= 0.0


def test_agentspec_history_on_a_real_trace_equals_the_drafters_own(monkeypatch):
    """The bundled coding trace: structures (several blocks per call, lead-ins), prompts that extend the
    last call's history, arena growth."""
    from dataclasses import replace

    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    monkeypatch.setattr(Simulator, "draft_tables", False)
    w = load_trace(default_trace_path())
    wl = replace(w, queries=w.queries[:4])
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=3, max_model_len=40960, num_kv_blocks=20000,
                 max_num_batched_tokens=8192)
    cost = RooflineCostModel("a100-80g", "qwen3-8b")
    sim = Simulator(wl, parse_drafter("agentspec"), cfg, resolve(cfg), cost)
    compiled = sim.run()
    assert int(np.unique(sim.drafters[0].history.tok_block[:sim.drafters[0].history.tok_top]).shape[0]) > 8
    _without_fast_path(monkeypatch, AgentSpecDrafter)
    _same(compiled, _run(wl, "agentspec", cfg, cost))


SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 8}


@pytest.mark.parametrize("spec", [SUFFIX, {**SUFFIX, "suffix_decoding_max_cached_requests": 3},
                                  {**SUFFIX, "suffix_decoding_max_cached_requests": 0}])
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 120}, {"max_num_batched_tokens": 16},
                                       {"num_kv_blocks": 40, "max_num_seqs": 6}, {"max_num_seqs": 1}])
@pytest.mark.parametrize("tiny_forest", [False, True])
@pytest.mark.parametrize("tables", [True, False])
def test_suffix_driven_in_runs_equals_the_event_loops(spec, overrides, tiny_forest, tables, monkeypatch):
    """The suffix proposer driven inside `run_steps` (`suffix_step`: steps where every active
    call and only those emitted) and, at the end of each run, by the event loop through the same kernel
    (calls starting fresh or finishing: `SuffixDrafting.per_step_drafts`) equals the event loop driving the drafter
    after every step — with calls stopped by preemption or the token budget, finishing, evicted from the
    response cache, near max_model_len, and a forest too small for most steps (they go back to the event
    loop, which grows it); with the prompt trees' drafts from the workload's table and built."""
    from agentspec_sim.drafters.suffix.tree import SuffixForest

    if tiny_forest:
        monkeypatch.setattr(SuffixForest.__init__, "__defaults__", (4, 16))
    monkeypatch.setattr(Simulator, "draft_tables", tables)  # prompt trees from the table, or built
    wl, cfg, cost = _six_agents(8, overrides)
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert sim.fast is not None
    by_python, proposed = [], []
    step, propose = sim._per_step_drafts, sim.drafters[0].propose
    monkeypatch.setattr(sim, "_per_step_drafts", lambda *args: by_python.append(1) or step(*args))
    monkeypatch.setattr(sim.drafters[0], "propose", lambda *args: proposed.append(1) or propose(*args))
    compiled = sim.run()
    steps = compiled.engine_steps.height
    if not tiny_forest and set(overrides) <= {"max_num_seqs"}:
        assert len(by_python) < steps / 3  # most steps were driven inside runs
        if spec.get("suffix_decoding_max_cached_requests") == 3:
            assert proposed  # a start that evicts a cached response: the drafter's own propose
        else:
            assert not proposed  # and the others by the kernel too: calls only start fresh or finish
    if "num_kv_blocks" in overrides:
        assert proposed  # preempted calls stop and restart: the drafter's own propose
    reference = _run(wl, spec, cfg, cost, max_run_steps=1)
    _same(compiled, reference)
    _without_fast_path(monkeypatch, SuffixDrafter)
    _same(compiled, _run(wl, spec, cfg, cost))


@pytest.mark.parametrize("spec", [SUFFIX, {**SUFFIX, "suffix_decoding_max_cached_requests": 3},
                                  {**SUFFIX, "suffix_decoding_max_cached_requests": 0}])
@pytest.mark.parametrize("overrides", [{"replicate": 3}, {"replicate": 2, "max_num_seqs": 6},
                                       {"replicate": 2, "arrival": "request-rate", "rate": 30.0},
                                       {"replicate": 2, "num_kv_blocks": 60, "max_num_seqs": 6},
                                       {"copies": 2, "max_model_len": 120}])
@pytest.mark.parametrize("tiny_forest", [False, True])
def test_suffix_tenants_in_one_arena_equal_their_own_drafters(spec, overrides, tiny_forest, monkeypatch):
    """Tenants that are copies draft through one compiled forest (each tenant's global tree in one arena,
    `SuffixDrafter.share_arena`) exactly as each tenant's drafter alone, driven by the event loop after every
    step: FIFO evictions per tenant, preemptions, a forest too small for most steps."""
    from agentspec_sim.drafters.suffix.tree import SuffixForest

    if tiny_forest:
        monkeypatch.setattr(SuffixForest.__init__, "__defaults__", (4, 16))
    wl, cfg, cost = _six_agents(8, overrides)
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), cost)
    assert sim.fast is not None and len(sim.drafters) > 1
    assert all(d.forest is sim.drafters[0].forest for d in sim.drafters)
    by_python = []
    step = sim._per_step_drafts
    monkeypatch.setattr(sim, "_per_step_drafts", lambda *args: by_python.append(1) or step(*args))
    compiled = sim.run()
    if not tiny_forest and "num_kv_blocks" not in overrides:
        assert len(by_python) < compiled.engine_steps.height / 3  # most steps driven inside runs
    assert int(compiled.calls["accepted"].sum()) > 0
    _without_fast_path(monkeypatch, SuffixDrafter)
    _same(compiled, _run(wl, spec, cfg, cost))


def test_batched_ngram_equals_propose():
    rng = np.random.default_rng(3)
    for spec in ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 5}):
        drafter = NgramDrafter(parse_drafter(spec))
        states, histories = [], []
        for i in range(60):
            tokens = rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 300))).astype(np.int32)
            cut = int(rng.integers(1, tokens.shape[0] + 1))
            state = CallState(i, call(f"c{i}", tokens[:cut], np.concatenate([tokens[cut:], [1]])), f"c{i}", 0, i,
                              tokens.shape[0] - cut + 1)
            state.history[cut:tokens.shape[0]] = tokens[cut:]
            state.num_emitted = tokens.shape[0] - cut
            states.append(state)
            histories.append(state.tokens)
        max_lens = rng.integers(-1, 8, len(states))
        arena = np.concatenate(histories)
        starts = np.concatenate([[0], np.cumsum([h.shape[0] for h in histories])[:-1]]).astype(np.int64)
        lengths = np.array([h.shape[0] for h in histories], dtype=np.int64)
        draft_start, draft_len = propose_ngram_rows(drafter, arena, starts, lengths, max_lens)
        expected = drafter.propose(states, max_lens)
        got = [arena[s:s + n] for s, n in zip(draft_start, draft_len, strict=True)]
        assert [e.tolist() for e in expected] == [g.tolist() for g in got]


def test_block_pool_grows_its_node_table():
    pool = BlockPool(400)
    blocks = pool.allocate(300)
    for i, block in enumerate(blocks):  # far past the initial node capacity: the table is rebuilt as it grows
        pool.cache(block, 1000 + i)
    assert [pool.get_cached(1000 + i) for i in range(300)] == blocks
    assert pool.get_cached(5) is None
    pool.free(blocks)
    pool.allocate(150)  # pops the never-cached blocks first, then evicts the LRU tail-first cached ones
    assert sum(pool.get_cached(1000 + i) is not None for i in range(300)) == 300 - (150 - 99)


def test_kernel_cache_is_cleared_when_a_dependency_changes(tmp_path):
    module, dep = tmp_path / "mod.py", tmp_path / "dep.py"
    module.write_text("x = 1\n")
    dep.write_text("y = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    entry = cache / "mod.f-3.py311.nbi"
    clear_if_changed(str(module), [str(dep)])  # first stamp
    entry.write_text("compiled")
    clear_if_changed(str(module), [str(dep)])
    assert entry.exists()  # unchanged dependency: entry kept
    dep.write_text("y = 2\n")
    clear_if_changed(str(module), [str(dep)])
    assert not entry.exists()


def test_engine_modules_stamp_their_dependencies():
    import agentspec_sim.drafters.ngram.fastpath as ngram_fastpath
    import agentspec_sim.drafters.ngram.index as ngram_index
    import agentspec_sim.engine.scheduler as scheduler

    for mod in (scheduler, ngram_index, ngram_fastpath):
        cache = str(cache_dir(mod.__file__))
        stem = os.path.splitext(os.path.basename(mod.__file__))[0]
        if os.access(cache, os.W_OK):
            assert os.path.exists(os.path.join(cache, f"{stem}.kernel-deps"))


def test_fastcall_resolves_once_per_set_of_containers():
    from numba import njit

    from agentspec_sim.engine.fastcall import FastCall

    @njit(cache=False)
    def add_into(out, values, scale):
        for i in range(values.shape[0]):
            out[i] += values[i] * scale
        return out.sum()

    out, values = np.zeros(3), np.arange(3.0)
    call_fast = FastCall(add_into, containers=(0, 1))
    assert call_fast(out, values, 2) == 6.0
    assert call_fast._entry is not None  # resolved: later calls skip the dispatcher
    assert call_fast(out, values, 1) == 9.0
    ints = np.arange(3)  # another container (and type): through the dispatcher again, then resolved anew
    assert call_fast(out, ints, 1) == 12.0 and call_fast._held[1] is ints
    assert call_fast(out, ints, 1.5) == 16.5  # a scalar of another type: a new overload
    assert out.tolist() == [0.0, 5.5, 11.0]
