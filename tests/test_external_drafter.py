"""A drafter defined outside the package (here, in this test module) registers itself and drafts on the engine's
compiled path through the engine's drafter API alone (engine/drafting.py), with exactly the results of its
Python `propose` (docs/adding-a-drafter.md walks through the same drafter)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim.drafters.registry import parse_drafter, register_drafter
from agentspec_sim.engine.drafting import (
    BaseDrafter,
    DraftSlots,
    EngineDrafting,
    RunView,
    caches_loop,
    compiled_step,
    drafts_from_out,
    fast_path_for,
    sampled_calls,
)
from agentspec_sim.run import simulate


@register_drafter("test-repeat-last")
class RepeatLastDrafter(BaseDrafter):
    """Drafts k copies of the call's last token (a run-length guess: right on runs of one token)."""

    config_keys = frozenset()
    bytes_per_token = (0.0, 0.0)
    compiled = True  # the test turns the fast path off to compare

    @classmethod
    def configure(cls, spec):
        return spec

    def propose(self, rows, max_lens):
        return [np.full(int(m), row.tokens[row.num_tokens - 1], dtype=np.int32)
                for row, m in zip(rows, max_lens, strict=True)]


class RepeatSteps(NamedTuple):
    ds: DraftSlots  # the run's draft limits and work space (the engine's)
    out: np.ndarray  # int32 [max_num_seqs, k]: the step's drafts
    steps: np.ndarray  # int64 [1]: compiled steps run (what the test checks)


@compiled_step(RepeatSteps)
def repeat_last_step(c, sb, pb, state, max_model_len):
    ds = state.ds
    m = sampled_calls(c, sb, ds, max_model_len)  # the calls that sampled and may draft, with their limits
    if m < 0:  # vLLM's proposer skip: the engine set its token-0 drafts
        return 0.0
    for j in range(m):
        last = c.tokens[ds.starts[j] + ds.lengths[j] - 1]
        for t in range(ds.max_lens[j]):
            state.out[j, t] = last
    drafts_from_out(c, ds.rows, state.out, ds.max_lens, m)  # set and verified, as any draft
    state.steps[0] += 1
    return ds.draft_s[m]


class RepeatDrafting(EngineDrafting):
    made: ClassVar[list[RepeatDrafting]] = []

    def __init__(self, run: RunView) -> None:
        k = run.spec.num_speculative_tokens
        self.state = RepeatSteps(DraftSlots.model_free(run), np.zeros((max(run.max_num_seqs, 1), k), dtype=np.int32),
                                 np.zeros(1, dtype=np.int64))
        run.table.reserve_draft_width(k)
        RepeatDrafting.made.append(self)

    def run_state(self) -> RepeatSteps:
        return self.state  # the event loop's own proposals go to `propose` above (the default: None here)


@fast_path_for(RepeatLastDrafter)
def repeat_last_fast_path(drafter: RepeatLastDrafter, run: RunView) -> RepeatDrafting | None:
    if not type(drafter).compiled or run.k_of_batch is None or len(run.drafters) > 1:
        return None
    return RepeatDrafting(run)


def _trace():
    rng = np.random.default_rng(3)
    queries = []
    for q in range(6):
        calls = agent_query(rng, f"q{q}", 3, prompt_len=30, out_len=40, vocab=4)  # short runs of one token
        queries.append(calls)
    return workload(*queries)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_a_drafter_from_outside_the_package_drafts_on_the_compiled_path(monkeypatch, max_num_seqs):
    spec = parse_drafter({"method": "test-repeat-last", "num_speculative_tokens": 3})
    assert spec.drafter_class is RepeatLastDrafter
    trace, cfg = _trace(), config(max_num_seqs=max_num_seqs, check_invariants=False)
    RepeatDrafting.made.clear()
    fast = simulate(trace, spec, cfg, ConstantCost())
    (made,) = RepeatDrafting.made
    assert made.state.steps[0] > 0  # the engine's compiled loop called the kernel between steps
    # ... a loop compiled without the on-disk cache: the shared cache index never names this module
    assert not caches_loop(made.state)
    monkeypatch.setattr(RepeatLastDrafter, "compiled", False)
    slow = simulate(trace, spec, cfg, ConstantCost())
    assert len(RepeatDrafting.made) == 1  # no fast path this time: the event loop and `propose` did it all
    assert int(fast.calls["accepted"].sum()) > 0
    assert fast.calls.equals(slow.calls)
    assert fast.engine_steps.drop("wall_s", strict=False).equals(slow.engine_steps.drop("wall_s", strict=False))
