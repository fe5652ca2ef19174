"""`eagle3` and `mtp`'s fast path (engine/drafting.py): each proposal a compiled draw from the calls'
acceptance tables, made once for the workload, priced by the cost model's draft-network terms.

`ModelBasedDrafter.acceptance_tables` computes every call's acceptance inputs up front (the copy signal
and code blocks per position, the random key per call), so a proposal reads no drafter state and the
drafter's hooks are not needed; `draft_from_tables` is `propose`'s draw (tests/test_model_based.py).
Where the draft length follows the batch size alone and the cost model gives the draft network's terms
(a roofline), the compiled loop drafts between steps too; else the event loop draws (and, unpriced, the
drafter's `draft_time` prices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from agentspec_sim.cost import roofline
from agentspec_sim.cost.roofline import draft_seconds
from agentspec_sim.drafters.model import rule as model_based
from agentspec_sim.drafters.model.rule import ModelBasedDrafter, draft_from_tables
from agentspec_sim.engine.drafting import (
    ENGINE_KERNEL_SOURCES,
    DraftSlots,
    EngineDrafting,
    FastCall,
    RunView,
    compiled_step,
    fast_path_for,
    kernel,
    sampled_calls,
    set_verified,
)
from agentspec_sim.host.kernel_cache import clear_if_changed

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

clear_if_changed(__file__, [model_based.__file__, roofline.__file__, *ENGINE_KERNEL_SOURCES])


class ModelSteps(NamedTuple):
    """The compiled state of a model-based run: draft limits, every call's `AcceptanceTables`, the pricing."""

    ds: DraftSlots
    on: np.ndarray  # int64 [1]: the compiled loop drafts (a draft length by batch size, a priced draft network)
    copy_at: np.ndarray  # `AcceptanceTables` (drafters/model/rule.py), per table row
    copy: np.ndarray
    code_at: np.ndarray
    code: np.ndarray
    keys: np.ndarray
    a: np.ndarray
    coef: np.ndarray
    pass_s: np.ndarray  # float64 [max_num_seqs + 1]: one draft-network pass over that many rows
    draft_terms: np.ndarray  # float64: the rest of `draft_seconds`' terms (cost/roofline.py)


@kernel
def propose_model_rows(c, rows, lengths, st):
    """A model-based drafter's drafts of calls rows[i], lengths[i] tokens each, from `st`'s
    `AcceptanceTables` (`draft_from_tables`), verified as the engine verifies any draft; returns the draft
    network's seconds for them (`draft_seconds`: max(lengths) passes over the rows and their contexts)."""
    k_max = 0
    ctx = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        k = lengths[i]
        slot = c.calls.slot[r]
        n = c.calls.num_emitted[r]
        target = c.calls.target_len[r]
        out = c.calls.hist_off[r] + c.calls.prompt_len[r]
        at = st.copy_at[r] + n
        code = st.code[st.code_at[r] + n] if n < target else 0
        draft_from_tables(c.tokens, out, n, target, k, st.copy[at:at + max(0, min(k, target - n))], code,
                          st.keys[r], st.a, st.coef, c.slot_drafts[slot])
        set_verified(c, r, slot, k)
        k_max = max(k_max, k)
        ctx += c.calls.prompt_len[r] + n
    m = rows.shape[0]
    if m == 0:
        return 0.0
    t = st.draft_terms
    return draft_seconds(st.pass_s[m], t[0], t[1], t[2], t[3], m, k_max, float(ctx))


@kernel
def propose_model_buffered(c, st, m):
    """`propose_model_rows` of the first m entries of the work space (rows, max_lens)."""
    return propose_model_rows(c, st.ds.rows[:m], st.ds.max_lens[:m], st)


@compiled_step(ModelSteps)
def model_step(c, sb, pb, state, max_model_len):
    """The draws of the calls that sampled in the step in `sb`; the draft network's seconds, or −1.0 where
    the compiled loop does not draft (`ModelSteps.on`)."""
    ds = state.ds
    if state.on[0] == 0:
        return -1.0
    m = sampled_calls(c, sb, ds, max_model_len)
    if m <= 0:
        return 0.0
    return propose_model_rows(c, ds.rows[:m], ds.max_lens[:m], state)


class ModelDrafting(EngineDrafting):
    """One run's model-based fast path (module docstring)."""

    replaces_hooks = True

    def __init__(self, drafter: ModelBasedDrafter, run: RunView) -> None:
        self.drafter, self.run = drafter, run
        n, seqs, cols = len(run.states), run.max_num_seqs, run.table.cols
        tables = drafter.acceptance_tables(run.table.tokens, cols["hist_off"][:n], cols["prompt_len"][:n],
                                           cols["target_len"][:n], [s.call for s in run.states],
                                           [s.draw_id for s in run.states], tokens_digest=run.tokens_digest)
        try:
            pass_s, terms = run.cost.draft_model_terms(seqs, kind=drafter.network)
            self.priced = True
        except (AttributeError, TypeError, ValueError):  # not a roofline, or no such draft network: Python prices
            pass_s, terms, self.priced = np.zeros(seqs + 1), np.ones(4), False
        inline = self.priced and run.k_of_batch is not None
        k_max = run.spec.num_speculative_tokens
        ds = DraftSlots.make(k_max, run.skips_unfit_batches,
                             run.k_of_batch if inline else np.zeros(1, dtype=np.int64), np.zeros(1), seqs)
        self.state = ModelSteps(ds, np.array([int(inline)], dtype=np.int64), tables.copy_at, tables.copy,
                                tables.code_at, tables.code, tables.keys, tables.a, tables.coef, pass_s, terms)
        self._buffered = FastCall(propose_model_buffered, containers=(0, 1))
        run.table.reserve_draft_width(k_max)

    def run_state(self) -> ModelSteps | None:
        return self.state if self.state.on[0] else None

    def propose(self, rows: Sequence[CallState], calls: np.ndarray, max_lens: np.ndarray) -> float:
        m = calls.shape[0]
        ds = self.state.ds
        ds.rows[:m] = calls
        ds.max_lens[:m] = max_lens
        self.run.table.reserve_draft_width(int(max_lens.max()))
        seconds = float(self._buffered(self.run.table.nt, self.state, m))
        return seconds if self.priced else float(self.drafter.draft_time(self.run.cost, rows, max_lens))


@fast_path_for(ModelBasedDrafter)
def engine_drafting(drafter: ModelBasedDrafter, run: RunView) -> ModelDrafting | None:
    if run.spec.num_speculative_tokens <= 0:
        return None
    return ModelDrafting(drafter, run)
