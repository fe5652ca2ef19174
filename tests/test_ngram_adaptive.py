"""`ngram-adaptive` (drafters/ngram/adaptive.py): the schedule, the hooks against the compiled fast path, and
that adapting the draft length does what it is for (fewer rejected tokens than a fixed k)."""

from __future__ import annotations

import numpy as np
import pytest
from simhelpers import agent_query, config, workload

from agentspec_sim.cost import RooflineCostModel
from agentspec_sim.drafters.ngram.adaptive import AdaptiveDrafting, NgramAdaptiveDrafter, next_length
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import resolve
from agentspec_sim.engine.simulator import Simulator

SPEC = {"method": "ngram-adaptive", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
COST = RooflineCostModel("a100-80g", "qwen3-8b")


def _workload(seed: int = 3):
    rng = np.random.default_rng(seed)
    return workload(*[agent_query(rng, f"q{i}", 3, prompt_len=40, out_len=40, vocab=4) for i in range(6)])


def _sim(wl, spec, cfg, fast: bool = True, max_run_steps: int | None = None) -> Simulator:
    sim = Simulator(wl, parse_drafter(spec), cfg, resolve(cfg), COST, fast_path=fast)
    if max_run_steps is not None:
        sim.max_run_steps = max_run_steps
    return sim


def _same(a, b):
    for name in ("steps", "engine_steps", "calls", "queries"):
        assert getattr(a, name).equals(getattr(b, name)), name


def test_the_draft_length_follows_the_heuristic_schedule():
    assert next_length(6, 6, 6, 8) == 8  # all accepted: +2, capped at k
    assert next_length(7, 3, 3, 8) == 8  # a short proposal fully accepted grows it too
    assert next_length(4, 4, 2, 8) == 3  # a rejection: −1
    assert next_length(1, 1, 0, 8) == 1  # never below 1


def test_observe_compares_the_last_proposal_with_what_the_call_emitted():
    from simhelpers import call

    from agentspec_sim.engine.request import CallState

    drafter = NgramAdaptiveDrafter(parse_drafter(SPEC))
    tokens = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32)
    state = CallState(0, call("c0", tokens, [3, 1, 9, 9]), "c0", 0, 0, 4)
    (draft,) = drafter.propose([state], np.array([6]))
    assert draft.tolist() == [3, 1, 2] and drafter.state.length[0] == 6  # the match runs to the history end
    drafter.observe(state, np.array([3, 1, 9], dtype=np.int32))  # two accepted, then the target's own token
    assert drafter.state.length[0] == 5 and drafter.state.last_n[0] == 0
    drafter.observe(state, np.array([9], dtype=np.int32))  # no proposal since: nothing moves
    assert drafter.state.length[0] == 5


@pytest.mark.parametrize("overrides", [{}, {"max_model_len": 110}, {"max_num_batched_tokens": 16},
                                       {"num_kv_blocks": 60, "max_num_seqs": 6}, {"max_num_seqs": 1},
                                       {"num_speculative_tokens_per_batch_size": [[1, 2, 6], [3, 64, 3]]}])
def test_the_compiled_fast_path_equals_the_hooks(overrides):
    """Steps drafted inside compiled runs and by the event loop's compiled proposal equal the drafter's own
    `observe` and `propose` after every step: preemptions, cut calls, chunked prefills, a k per batch size."""
    spec = {**SPEC, **{k: v for k, v in overrides.items() if k.startswith("num_speculative")}}
    engine = {k: v for k, v in overrides.items() if not k.startswith("num_speculative")}
    cfg = config(**{"check_invariants": False, "arrival": "zero", "max_num_seqs": 4, **engine})
    wl = _workload()
    sim = _sim(wl, spec, cfg)
    assert isinstance(sim.fast, AdaptiveDrafting)
    proposed = []
    own = type(sim.drafters[0]).propose
    compiled = sim.run()
    hooks = _sim(wl, spec, cfg, fast=False)
    hooks.drafters[0].propose = lambda *args: proposed.append(1) or own(hooks.drafters[0], *args)
    _same(compiled, hooks.run())
    assert proposed  # the reference really drafted through the drafter's own propose
    _same(compiled, _sim(wl, spec, cfg, max_run_steps=1).run())
    assert int((compiled.engine_steps["D"] > 0).sum()) > 20
    if "num_kv_blocks" in overrides:
        assert compiled.num_preemptions > 0


def test_adapting_drafts_fewer_rejected_tokens_than_a_fixed_k():
    wl = _workload(seed=5)
    cfg = config(check_invariants=False, arrival="zero", max_num_seqs=4)
    fixed = _sim(wl, {**SPEC, "method": "ngram"}, cfg).run().steps
    adaptive = _sim(wl, SPEC, cfg).run().steps
    rejected = {name: int((s["drafted"] - s["accepted"]).sum()) for name, s in (("fixed", fixed),
                                                                               ("adaptive", adaptive))}
    assert rejected["adaptive"] < 0.8 * rejected["fixed"]
    rate = {name: s["accepted"].sum() / s["drafted"].sum() for name, s in (("fixed", fixed), ("adaptive", adaptive))}
    assert rate["adaptive"] > rate["fixed"]
