"""Drafts from tables made once per workload against the live state they replace: AgentSpec's lookups
(drafters/agentspec/tables.py, drafters/agentspec/fastpath.py `TableSteps`), suffix decoding's prompt-tree drafts
(drafters/suffix/tables.py, OP_TABLE_STEP) and the n-gram proposers' matches (drafters/ngram/tables.py,
`NgramDrafting.from_table`) — whole runs equal, what turns a table off, the disk cache, the path pool.
(tests/test_suffix.py also runs the engine with the suffix table against the real ArcticInference
library.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from simhelpers import agent_query, config, workload

from agentspec_sim.cost import RooflineCostModel
from agentspec_sim.drafters.agentspec import tables as history_tables
from agentspec_sim.drafters.agentspec.fastpath import TableDrafting
from agentspec_sim.drafters.common.table_cache import pack_paths
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import resolve
from agentspec_sim.engine.simulator import Simulator

AGENTSPEC = {"method": "agentspec", "num_speculative_tokens": 6, "min_match_len": 2, "alpha": 24}
COST = RooflineCostModel("a100-80g", "qwen3-8b")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))


def _sim(wl, spec, cfg, tables=True):
    Simulator.draft_tables = tables
    try:
        return Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), COST)
    finally:
        Simulator.draft_tables = True


def _same(a, b):
    for name in ("steps", "engine_steps", "calls", "queries"):
        assert getattr(a, name).equals(getattr(b, name)), name


def _queries(seed=4, n=6, calls=3):
    rng = np.random.default_rng(seed)
    return workload(*[agent_query(rng, f"q{i}", calls, prompt_len=40, out_len=30, vocab=4) for i in range(n)])


@pytest.mark.parametrize("spec", [AGENTSPEC, {**AGENTSPEC, "budget": "alpha", "depth": "allocation"},
                                  {**AGENTSPEC, "single_candidate": "ct_only", "prompt_history": False},
                                  {"method": "agentspec-paper", "num_speculative_tokens": 6, "alpha": 24},
                                  {"method": "agentspec-s", "num_speculative_tokens": 4, "min_match_len": 2},
                                  {"method": "agentspec-n", "num_speculative_tokens": 5, "alpha": 12}])
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 100}, {"max_num_batched_tokens": 16},
                                       {"num_kv_blocks": 40, "max_num_seqs": 6}, {"max_num_seqs": 1},
                                       {"check_invariants": True}])
def test_drafting_from_the_table_equals_the_live_history(spec, overrides):
    """Every step's drafts (tokens included), acceptances and times equal the live history's — with
    preemptions, calls refused or cut at max_model_len, chunked prefills, one call at a time, and the
    engine's one-step-per-event loop."""
    wl = _queries()
    cfg = config(**{"check_invariants": False, "arrival": "zero", "max_num_seqs": 4, **overrides})
    sim = _sim(wl, spec, cfg)
    assert isinstance(sim.fast, TableDrafting) and not any(sim.hooks)
    from_table = sim.run()
    live = _sim(wl, spec, cfg, tables=False)
    assert not isinstance(live.fast, TableDrafting)
    from_history = live.run()
    _same(from_table, from_history)
    assert int((from_table.engine_steps["D"] > 0).sum()) > 20
    assert int(from_table.steps["accepted"].sum()) > 0
    if "num_kv_blocks" in overrides:
        assert from_table.num_preemptions > 0
    if "max_model_len" in overrides:
        assert (from_table.calls["status"] == "refused").any()  # and the second calls cut at 100 tokens


@pytest.mark.parametrize("spec", [{**AGENTSPEC, "budget": "alpha", "alpha": 8}, {**AGENTSPEC, "depth": "break_even"},
                                  {"method": "agentspec-s", "num_speculative_tokens": 4, "min_match_len": 2}])
@pytest.mark.parametrize("overrides", [{"replicate": 3}, {"replicate": 2, "arrival": "request-rate", "rate": 40.0},
                                       {"copies": 2}, {"replicate": 2, "max_model_len": 100}])
def test_tenants_draft_from_one_table_as_their_own_histories(spec, overrides):
    """Tenants (replicate copies, each with its own drafter) read one tenant's table at their rows; each
    tenant's drafter drafts its own rows with its share of the step's budget: the same run as every tenant's
    live history."""
    wl = _queries()
    cfg = config(**{"check_invariants": False, "arrival": "zero", "max_num_seqs": 8, **overrides})
    sim = _sim(wl, spec, cfg)
    assert isinstance(sim.fast, TableDrafting) and len(sim.drafters) > 1
    assert sim.fast.state.at.shape[0] == len(sim.states)
    from_table = sim.run()
    _same(from_table, _sim(wl, spec, cfg, tables=False).run())
    assert int(from_table.steps["accepted"].sum()) > 0


def test_a_real_trace_with_structure_equals_the_live_history():
    """The bundled coding trace: structures (several blocks per call, lead-ins), prompts that extend the
    last call's history; a max_model_len that refuses some calls and cuts others."""
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    w = load_trace(default_trace_path())
    wl = replace(w, queries=w.queries[:6])
    for max_len in (40960, 14000):
        cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4, max_model_len=max_len,
                     num_kv_blocks=20000, max_num_batched_tokens=8192)
        sim = _sim(wl, "agentspec", cfg)
        assert isinstance(sim.fast, TableDrafting)
        result = sim.run()
        _same(result, _sim(wl, "agentspec", cfg, tables=False).run())
        if max_len == 14000:
            assert (result.calls["status"] != "finished").any()  # refused / skipped calls


def test_the_table_needs_no_memory_bound_and_the_live_history_says_when_it_passes_its_own(monkeypatch):
    """AgentSpec keeps every running query's history; only the simulator's live history bounds its memory
    (MAX_LIVE_TOKENS), dropping idle queries' histories past it and reporting them. The table holds no
    histories: a bound the live history passes changes nothing there, and where the live history evicts
    nothing the two agree."""
    import agentspec_sim.drafters.agentspec.history as agentspec

    wl = _queries()
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=2)
    live = _sim(wl, AGENTSPEC, cfg, tables=False).run()
    assert "history_evictions" not in live.extra
    from_table = _sim(wl, AGENTSPEC, cfg).run()
    _same(from_table, live)
    monkeypatch.setattr(agentspec, "MAX_LIVE_TOKENS", 60)
    sim = _sim(wl, AGENTSPEC, cfg)
    assert isinstance(sim.fast, TableDrafting)
    _same(sim.run(), from_table)
    bounded = _sim(wl, AGENTSPEC, cfg, tables=False).run()
    assert bounded.extra["history_evictions"] > 0


def test_the_table_is_made_once_and_read_from_the_cache(monkeypatch, tmp_path):
    wl = _queries()
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4)
    first = _sim(wl, AGENTSPEC, cfg).run()
    stored = list((tmp_path / "cache" / "history-tables").glob("*.npz"))
    assert len(stored) == 1

    def fail(*args):
        raise AssertionError("built again")

    monkeypatch.setattr("agentspec_sim.drafters.agentspec.tables.build_tables", fail)
    for seqs in (1, 4):  # other engine settings, the same calls: the same table
        _sim(wl, AGENTSPEC, config(check_invariants=False, arrival="zero", max_num_seqs=seqs)).run()
    _same(first, _sim(wl, AGENTSPEC, cfg).run())
    with pytest.raises(AssertionError, match="built again"):  # other options: another table
        _sim(wl, {**AGENTSPEC, "max_candidates": 3}, cfg)
    with pytest.raises(AssertionError, match="built again"):  # other calls: another table
        _sim(_queries(seed=5), AGENTSPEC, cfg)
    monkeypatch.undo()
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))
    whole = stored[0].read_bytes()
    for damaged in (b"not a table", whole[:len(whole) // 2]):  # a damaged entry (or one cut short) is made again
        stored[0].write_bytes(damaged)
        _same(first, _sim(wl, AGENTSPEC, cfg).run())
        assert history_tables.HistoryTables.valid(dict(np.load(stored[0])))


def test_an_unwritable_cache_still_gives_the_table(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(blocker / "cache"))  # a path under a file
    wl = _queries()
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4)
    sim = _sim(wl, AGENTSPEC, cfg)
    assert isinstance(sim.fast, TableDrafting)
    _same(sim.run(), _sim(wl, AGENTSPEC, cfg, tables=False).run())


def test_path_windows_hold_every_positions_path():
    rng = np.random.default_rng(2)
    for _ in range(200):
        T, width = int(rng.integers(1, 40)), int(rng.integers(1, 8))
        base = rng.integers(0, 3, T + width + 5).astype(np.int32)
        out = np.zeros((T, width), dtype=np.int32)
        lengths = rng.integers(0, width + 1, T)
        for t in range(T):  # mostly the next stretch of one text (a match going on), sometimes another
            src = base[t:t + width] if rng.random() < 0.7 else rng.integers(0, 3, width).astype(np.int32)
            out[t] = src
        pool = np.zeros(T * width + 1, dtype=np.int32)
        path = np.zeros(T, dtype=np.int64)
        top = pack_paths(out, lengths, pool, 0, path)
        assert top <= int(lengths.sum())
        for t in range(T):
            n = int(lengths[t])
            assert pool[path[t]:path[t] + n].tolist() == out[t, :n].tolist()


# --------------------------------------------------------------------------------------------
# suffix: the prompt trees' drafts

SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 8}


@pytest.mark.parametrize("spec", [SUFFIX, {**SUFFIX, "suffix_decoding_max_cached_requests": 2},
                                  {**SUFFIX, "suffix_decoding_max_cached_requests": 0,
                                   "suffix_decoding_max_spec_factor": 2.0}])
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 100}, {"max_num_batched_tokens": 16},
                                       {"num_kv_blocks": 40, "max_num_seqs": 6}, {"max_num_seqs": 1},
                                       {"check_invariants": True}])
def test_suffix_prompt_trees_from_the_table_equal_the_built_ones(spec, overrides):
    """With calls stopped and restarted (preemption, the token budget: their trees are built), steps that
    skip the proposer near max_model_len (the calls in them leave the table), refused and cut calls."""
    from agentspec_sim.drafters.suffix.rule import SuffixDrafter

    wl = _queries(seed=8)
    cfg = config(**{"check_invariants": False, "arrival": "zero", "max_num_seqs": 4, **overrides})
    sim = _sim(wl, spec, cfg)
    drafter = sim.drafters[0]
    assert drafter.table_at is not None
    built = []  # calls that drafted from the table until a step skipped the proposer
    skip = SuffixDrafter.skip_tokens

    def skipping(state, n):
        built.append(state.drafter_state is not None and state.drafter_state.table_at >= 0)
        skip(drafter, state, n)

    drafter.skip_tokens = skipping
    synced = []  # the starts and finishes the compiled steps made themselves
    sync = SuffixDrafter.sync
    drafter.sync = lambda: synced.append(int(drafter.n_events[0])) or sync(drafter)
    from_table = sim.run()
    live = _sim(wl, spec, cfg, tables=False)
    assert live.drafters[0].table_at is None
    _same(from_table, live.run())
    assert int((from_table.engine_steps["D"] > 0).sum()) > 20
    if "max_model_len" in overrides:
        assert any(built)  # steps that skipped the proposer, with calls drafting from the table in them
    if "check_invariants" not in overrides:
        assert sum(synced) > 0
    if "num_kv_blocks" in overrides:
        assert from_table.num_preemptions > 0


def test_suffix_table_entries_are_the_prompt_trees_drafts():
    """Position by position, the table holds what the drafter's own prompt tree drafts for the call."""
    from agentspec_sim.drafters.suffix.tables import build_local_table
    from agentspec_sim.drafters.suffix.tree import SuffixForest

    rng = np.random.default_rng(5)
    calls = agent_query(rng, "q", 3, prompt_len=30, out_len=40, vocab=5)
    prompts = [np.asarray(c.prompt_tokens, dtype=np.int32) for c in calls]
    outputs = [np.asarray(c.output_tokens, dtype=np.int32) for c in calls]
    outputs[1] = outputs[1][:25]  # cut (max_model_len): the next prompt still extends it
    depth, k, max_len = 6, 5, 150
    table, at = build_local_table(depth, k, 1.0, 0.1, max_len, prompts, outputs)
    checked = 0
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for t in range(1, output.shape[0]):
            forest = SuffixForest(depth)
            root, seq = forest.new_tree(), forest.new_seq()
            seen = np.concatenate([prompt, output[:t]])
            forest.append(root, seq, seen)
            spec = min(k, max_len - seen.shape[0] - 1)
            j = int(at[i]) + t
            if spec <= 0:
                assert table.length[j] == 0
                continue
            draft, score = forest.speculate(root, seen[-depth:], spec, 1.0, 0.0, 0.1, seq)
            n = int(table.length[j])
            assert table.pool[table.path[j]:table.path[j] + n].tolist() == draft.tolist()
            assert np.float32(score) == table.score[j]
            checked += int(n > 0)
    assert checked > 20


NGRAM_SPECS = ["ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                          "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 1]]},
               "ngram-v2", {"method": "ngram-v2", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4}]


@pytest.mark.parametrize("spec", NGRAM_SPECS)
@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 100}, {"max_num_batched_tokens": 16},
                                       {"num_kv_blocks": 40, "max_num_seqs": 6}, {"max_num_seqs": 1},
                                       {"check_invariants": True}, {"replicate": 3},
                                       {"replicate": 2, "arrival": "request-rate", "rate": 40.0}])
def test_ngram_drafts_from_the_table_equal_the_index(spec, overrides):
    """The n-gram proposers drafting from the workload's table — inside runs and in the event loop — make
    every step the index makes: preemptions, refused and cut calls, chunked prefills, per-batch-size k."""
    wl = _queries(seed=9)
    cfg = config(**{"check_invariants": False, "arrival": "zero", "max_num_seqs": 4, **overrides})
    sim = _sim(wl, spec, cfg)
    assert sim.fast.from_table
    from_table = sim.run()
    live = _sim(wl, spec, cfg, tables=False)
    assert not live.fast.from_table
    _same(from_table, live.run())
    assert int((from_table.engine_steps["D"] > 0).sum()) > 20
    assert int(from_table.steps["accepted"].sum()) > 0
    if "num_kv_blocks" in overrides:
        assert from_table.num_preemptions > 0


@pytest.mark.parametrize("rightmost", [False, True])
def test_ngram_table_entries_are_the_scans_matches(rightmost):
    """Position by position (calls that share their query's arena region, the first call's positions
    shorter than any n-gram), the table holds where the reference scan's draft starts — asked all at
    once or in small batches."""
    from agentspec_sim.drafters.ngram.rule import ngram_match
    from agentspec_sim.drafters.ngram.tables import build_ngram_table
    from agentspec_sim.drafters.ngram.v2 import ngram_v2_match

    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 4, size=12).astype(np.int32)
    first, second = rng.integers(0, 4, size=20).astype(np.int32), rng.integers(0, 4, size=25).astype(np.int32)
    other = rng.integers(0, 4, size=30).astype(np.int32)
    tokens = np.concatenate([prompt, first, second, other])
    starts = np.array([0, 0, 57], dtype=np.int64)  # the second call's prompt is prompt + first output
    prompt_lens = np.array([12, 32, 10], dtype=np.int64)
    target_lens = np.array([20, 25, 20], dtype=np.int64)
    table = build_ngram_table(tokens, starts, prompt_lens, target_lens, 2, 3, rightmost)
    small = build_ngram_table(tokens, starts, prompt_lens, target_lens, 2, 3, rightmost, chunk=7)
    assert np.array_equal(small.at, table.at) and np.array_equal(small.match, table.match)  # asked in batches
    match = ngram_v2_match if rightmost else ngram_match
    found = 0
    for i in range(3):
        for t in range(int(target_lens[i]) + 1):
            history = tokens[starts[i]:starts[i] + prompt_lens[i] + t]
            start, _ = match(history, 2, 3)
            want = int(starts[i]) + start if start >= 0 else -1
            assert table.match[table.at[i] + t] == want
            found += int(want >= 0)
    assert found > 30


def test_the_ngram_table_is_made_once_and_read_from_the_cache(monkeypatch):
    from agentspec_sim.drafters.ngram import tables as ngram_tables

    built = []
    build = ngram_tables.build_ngram_table
    monkeypatch.setattr(ngram_tables, "build_ngram_table", lambda *a: built.append(1) or build(*a))
    wl = _queries(seed=9)
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4)
    first = _sim(wl, "ngram", cfg).run()
    _same(first, _sim(wl, "ngram", config(check_invariants=False, arrival="zero", max_num_seqs=4)).run())
    assert len(built) == 1
    _sim(wl, "ngram-v2", cfg).run()  # the other rule: its own table
    _sim(wl, {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
         cfg).run()  # another n-gram range: its own table
    assert len(built) == 3


def test_the_cache_keeps_the_most_recently_used_tables_within_its_limit(monkeypatch, tmp_path):
    import os
    import time

    from agentspec_sim.drafters.common import table_cache

    def arrays(n):
        return lambda: {"x": np.arange(n, dtype=np.int64)}

    def ok(a):
        return a["x"].dtype == np.int64

    directory = tmp_path / "cache" / "t"
    for i, key in enumerate(("a", "b", "c")):
        table_cache.cached_arrays("t", key, arrays(20_000), ok)
        os.utime(directory / f"{key}.npz", ns=(i * 10**9, i * 10**9))  # a, b, c: oldest first
    size = (directory / "a.npz").stat().st_size
    assert table_cache.cached_arrays("t", "a", arrays(1), ok)["x"].shape == (20_000,)  # read: a is now the newest
    assert (directory / "a.npz").stat().st_mtime_ns > time.time_ns() - 60 * 10**9
    monkeypatch.setenv(table_cache.LIMIT_ENV, str(2.5 * size / (1 << 20)))
    table_cache.cached_arrays("t", "d", arrays(20_000), ok)  # over the limit: b and c, the least recently used, go
    assert sorted(p.stem for p in directory.glob("*.npz")) == ["a", "d"]
    assert table_cache.cached_arrays("t", "a", arrays(3), ok)["x"].shape == (20_000,)


def test_two_builders_of_one_table_build_it_once(tmp_path):
    """A sweep's workers asking for the same table at once: one builds it, the other waits and reads it."""
    import threading
    import time

    from agentspec_sim.drafters.common import table_cache

    builds = []

    def build():
        builds.append(1)
        time.sleep(0.3)
        return {"x": np.arange(5, dtype=np.int64)}

    got = []
    workers = [threading.Thread(target=lambda: got.append(table_cache.cached_arrays(
        "t", "k", build, lambda a: a["x"].shape == (5,)))) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(builds) == 1 and len(got) == 2
    assert all(a["x"].tolist() == [0, 1, 2, 3, 4] for a in got)


def test_a_run_reports_its_start_before_building_its_tables():
    """`simulate(progress=…)` hears (0, calls) before the tables are built (a progress bar shows the run at
    once), then every finished call, up to (calls, calls)."""

    wl = _queries()
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4)
    heard = []
    build = history_tables.build_tables

    def building(*args):
        heard.append("build")
        return build(*args)

    history_tables.build_tables = building
    try:
        Simulator(wl, parse_drafter(AGENTSPEC), cfg, resolve(cfg), COST,
                  progress=lambda done, total: heard.append((done, total))).run()
    finally:
        history_tables.build_tables = build
    assert heard[0] == (0, 18) and heard[1] == "build" and heard[-1] == (18, 18)


@given(seed=st.integers(0, 2**32 - 1))
def test_random_workloads_and_engines_draft_the_same_with_tables(seed):
    """Random agent workloads (think times, Poisson arrivals), drafter options and engine limits (a small
    KV cache, a short max_model_len, a token budget that leaves calls out): the tables, the live state and
    one step per event give the same run."""
    rng = np.random.default_rng(seed)
    calls = int(rng.integers(1, 5))
    wl = workload(*[agent_query(rng, f"q{i}", calls, prompt_len=int(rng.integers(10, 60)),
                                out_len=int(rng.integers(5, 50)), vocab=int(rng.integers(3, 8)),
                                think_s=float(rng.choice([0.0, 0.01]))) for i in range(int(rng.integers(2, 9)))])
    depth = int(rng.integers(2, 10))
    method = str(rng.choice(["suffix", "agentspec", "agentspec-s", "agentspec-n", "ngram", "ngram-v2"]))
    if method.startswith("ngram"):
        low = int(rng.integers(1, 4))
        spec = {"method": method, "num_speculative_tokens": int(rng.integers(1, 8)), "prompt_lookup_min": low,
                "prompt_lookup_max": low + int(rng.integers(0, 3))}
    elif method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": int(rng.integers(1, depth + 1)),
                "suffix_decoding_max_tree_depth": depth,
                "suffix_decoding_max_cached_requests": int(rng.choice([0, 1, 2, 5, 10000])),
                "suffix_decoding_max_spec_factor": float(rng.choice([0.5, 1.0, 2.0]))}
    else:
        spec = {"method": method, "num_speculative_tokens": int(rng.integers(1, 8)),
                "min_match_len": int(rng.integers(1, 3))}
    cfg = config(check_invariants=False, max_num_seqs=int(rng.integers(1, 7)),
                 max_num_batched_tokens=int(rng.choice([16, 32, 64])), num_kv_blocks=int(rng.choice([80, 512])),
                 max_model_len=int(rng.choice([90, 150, 4096])), arrival=str(rng.choice(["zero", "poisson"])),
                 rate=50.0)
    with_tables = _sim(wl, spec, cfg).run()
    _same(with_tables, _sim(wl, spec, cfg, tables=False).run())
    one_step = _sim(wl, spec, cfg)
    one_step.max_run_steps = 1
    _same(with_tables, one_step.run())


def test_a_suffix_run_sizes_its_forest_from_the_last_runs_note(monkeypatch):
    """The response forest ends each run of a workload about as large: a run notes its size, the next run of
    the same workload allocates that much at once (no doubling on the way), and drafts the same."""
    from agentspec_sim.drafters.suffix import tree

    grown: list[int] = []
    real = tree.SuffixForest._grow_nodes
    monkeypatch.setattr(tree.SuffixForest, "_grow_nodes", lambda self, cap: grown.append(cap) or real(self, cap))
    rng = np.random.default_rng(9)  # outputs long and varied enough to outgrow the forest's first arena
    wl = workload(*[agent_query(rng, f"q{i}", 3, prompt_len=40, out_len=200, vocab=200) for i in range(12)])
    cfg = config(max_num_seqs=4, check_invariants=False)
    spec = {"method": "suffix", "num_speculative_tokens": 5}
    first = _sim(wl, spec, cfg).run()
    during_first = [c for c in grown if c > 4096]  # past the initial arena: doublings during the run
    grown.clear()
    sim = _sim(wl, spec, cfg)
    sized = list(grown)
    grown.clear()
    second = sim.run()
    assert during_first and sized and not grown  # the second run grew only when it was made, to the noted size
    _same(first, second)
