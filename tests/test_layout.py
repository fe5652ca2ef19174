"""engine/layout.py: a workload's call layout is made once per (workload, settings), read by every run
and never written to."""

from __future__ import annotations

import numpy as np
from simhelpers import agent_query, config, workload

from agentspec_sim.engine import layout
from agentspec_sim.run.simulation import simulate


def _workload(seed=1):
    rng = np.random.default_rng(seed)
    return workload(*[agent_query(rng, f"q{i}", 3, think_s=0.01 * (i % 2)) for i in range(4)])


def test_a_layout_is_made_once_per_workload_and_settings():
    wl = _workload()
    first = layout.call_layout(wl, 1, 4096, 4, None)
    assert layout.call_layout(wl, 1, 4096, 4, None) is first
    assert layout.call_layout(wl, 1, 100, 4, None) is not first  # targets cut at max_model_len
    assert layout.call_layout(wl, 2, 4096, 4, None).ids[-1].endswith("#1")
    other = _workload(2)
    assert layout.call_layout(other, 1, 4096, 4, None) is not first
    assert layout.call_layout(wl, 1, 4096, 4, None) is not first  # only the last workload's are kept


def test_runs_leave_the_layout_as_they_found_it_and_repeat_exactly():
    wl = _workload()
    cfg = config(max_num_seqs=2, num_kv_blocks=60, check_invariants=False)
    first = simulate(wl, "ngram", cfg)
    kept = layout.call_layout(wl, 1, cfg.max_model_len, cfg.block_size, None)
    before = {k: v.copy() for k, v in kept.columns.items()}, kept.tokens.copy()
    for seqs in (1, 3):
        simulate(wl, "suffix", config(max_num_seqs=seqs, check_invariants=False))
    again = simulate(wl, "ngram", cfg)
    assert layout.call_layout(wl, 1, cfg.max_model_len, cfg.block_size, None) is kept
    for name, values in before[0].items():
        assert np.array_equal(kept.columns[name], values), name
    assert np.array_equal(kept.tokens, before[1])
    for name in ("engine_steps", "calls", "queries"):
        assert getattr(first, name).equals(getattr(again, name)), name


def test_the_first_call_no_run_can_replay_is_named():
    """An empty output or more KV blocks than the cache holds: the error names the first such call, in
    engine order, whichever it is (the layout is shared, the KV check is the run's)."""
    import pytest
    from simhelpers import call

    from agentspec_sim.engine.simulator import SimulationError

    big, empty = call("big", list(range(60)), [1, 2], query="q0"), call("empty", [1, 2], [], query="q1")
    cfg = config(num_kv_blocks=8, check_invariants=False)
    with pytest.raises(SimulationError, match="'big' needs 16 KV blocks"):
        simulate(workload([big], [empty]), "normal", cfg)
    with pytest.raises(SimulationError, match="'empty' has an empty output"):
        simulate(workload([empty], [big]), "normal", cfg)
    with pytest.raises(SimulationError, match="'empty' has an empty output"):
        simulate(workload([big], [empty]), "normal", config(check_invariants=False))
