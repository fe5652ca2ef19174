"""`ngram-adaptive`: vLLM's n-gram proposer with each call's draft length following its own acceptance.

A fixed k drafts as many tokens for a call whose drafts keep failing as for one whose drafts keep
landing; at large batch every rejected token is verification work the step pays for. This drafter
keeps a draft length per call and moves it with Hugging Face's "heuristic" schedule for assisted
generation (transformers `AssistedCandidateGenerator.update_candidate_strategy`): after a step in which
all of the call's proposed tokens were accepted, +2; after one with a rejection, −1; never below 1 nor
above `num_speculative_tokens`, where every call starts. The draft itself is `ngram`'s (the earliest
occurrence of the longest suffix n-gram, `prompt_lookup_min` … `prompt_lookup_max`), cut to the call's
length; the engine's own limits (budget policy, max_model_len) apply on top as for any drafter.

What the drafter sees of acceptance is what a drafter can see: its last proposal against the tokens the
call emitted next (the longest common prefix), so a proposal the token budget cut short counts as
rejected past the cut, exactly as a real proposer comparing its drafts with the sampled tokens would.

The per-call state is three arrays indexed by the call's engine row (`CallState.index`): the draft
length, the last proposal and its length. The Python hooks (`observe`, `propose`) and the fast path's
compiled step (`adaptive_step`: observe every emitting row, then propose from the workload's n-gram
table, drafters/ngram/tables.py) read and write the same arrays, so a run may switch between them step
by step (tests/test_ngram_adaptive.py compares whole runs). docs/adding-a-drafter.md walks through this
module as the example of a drafter with a compiled fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import numpy as np

from agentspec_sim.drafters.ngram import rule as ngram
from agentspec_sim.drafters.ngram.fastpath import workload_table
from agentspec_sim.drafters.ngram.index import MAX_INDEXED_N
from agentspec_sim.drafters.ngram.rule import NgramDrafter, propose_ngram
from agentspec_sim.drafters.registry import register_drafter
from agentspec_sim.engine.drafting import (
    DS_K_MAX,
    ENGINE_KERNEL_SOURCES,
    SC_ROWS,
    DraftSlots,
    EngineDrafting,
    RunView,
    SpeculativeConfig,
    compiled_step,
    grown,
    kernel,
    sampled_calls,
    set_verified,
)
from agentspec_sim.host.kernel_cache import clear_if_changed

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

clear_if_changed(__file__, [ngram.__file__, *ENGINE_KERNEL_SOURCES])

STEP_UP, STEP_DOWN = 2, 1  # Hugging Face's heuristic schedule


@kernel
def next_length(length, proposed, accepted, k_max):
    """A call's draft length after a step whose `proposed` drafts had their first `accepted` accepted."""
    if accepted >= proposed:
        return min(length + STEP_UP, k_max)
    return max(length - STEP_DOWN, 1)


@kernel
def common_prefix(proposal, emitted):
    """How many of `proposal`'s tokens the emitted tokens confirm (their longest common prefix)."""
    m = min(proposal.shape[0], emitted.shape[0])
    a = 0
    while a < m and proposal[a] == emitted[a]:
        a += 1
    return a


class AdaptiveState(NamedTuple):
    """Per engine call row: its draft length, its last proposal (the first `last_n` of `last`)."""

    length: np.ndarray  # int64 [rows]
    last: np.ndarray  # int32 [rows, k]
    last_n: np.ndarray  # int64 [rows]: 0 once the proposal was compared with what the call emitted


class AdaptiveSteps(NamedTuple):
    """The compiled state of a run: draft limits, the per-call state, the workload's n-gram table."""

    ds: DraftSlots
    calls: AdaptiveState
    at: np.ndarray  # int64 per call row: its first position in `match` (drafters/ngram/tables.py)
    match: np.ndarray  # int64 per position: where the n-gram draft starts in the arena, −1: none


@kernel
def _observe_step(c, sb, st, k_max):
    """`NgramAdaptiveDrafter.observe` for every row of the step in `sb` that emitted tokens."""
    for i in range(sb.sc[SC_ROWS]):
        e = sb.rows.emitted[i]
        r = sb.rows.call[i]
        n = st.last_n[r]
        if e == 0 or n == 0:
            continue
        end = c.calls.hist_off[r] + c.calls.prompt_len[r] + c.calls.num_emitted[r]
        accepted = common_prefix(st.last[r, :n], c.tokens[end - e:end])
        st.length[r] = next_length(st.length[r], n, accepted, k_max)
        st.last_n[r] = 0


@kernel
def propose_rows(c, rows, starts, lengths, max_lens, state):
    """The drafts of calls rows[i] (histories tokens[starts[i]:starts[i] + lengths[i]], limits max_lens[i]):
    the table's n-gram match cut to the call's draft length, recorded as its last proposal, set and
    verified."""
    st = state.calls
    for i in range(rows.shape[0]):
        r = rows[i]
        j = state.match[state.at[r] + c.calls.num_emitted[r]]
        n = min(max_lens[i], st.length[r], starts[i] + lengths[i] - j) if j >= 0 else 0
        slot = c.calls.slot[r]
        for t in range(n):
            c.slot_drafts[slot, t] = c.tokens[j + t]
            st.last[r, t] = c.tokens[j + t]
        st.last_n[r] = n
        set_verified(c, r, slot, n)


@kernel
def propose_buffered(c, state, m):
    """`propose_rows` of the first m entries of the work space."""
    ds = state.ds
    propose_rows(c, ds.rows[:m], ds.starts[:m], ds.lengths[:m], ds.max_lens[:m], state)


@compiled_step(AdaptiveSteps)
def adaptive_step(c, sb, pb, state, max_model_len):
    """Observe the step in `sb` (every emitting row's acceptance moves its draft length), then draft for the
    calls that sampled; the drafting seconds."""
    ds = state.ds
    _observe_step(c, sb, state.calls, ds.par[DS_K_MAX])
    m = sampled_calls(c, sb, ds, max_model_len)
    if m <= 0:
        return 0.0
    propose_rows(c, ds.rows[:m], ds.starts[:m], ds.lengths[:m], ds.max_lens[:m], state)
    return ds.draft_s[m]


@register_drafter("ngram-adaptive")
class NgramAdaptiveDrafter(NgramDrafter):
    """`ngram`'s drafts, each call's draft length adapted to its acceptance (module docstring)."""

    # Memory: not measured; the default (BaseDrafter's), not the n-gram table's.
    bytes_per_token = (170.0, 170.0)
    # `--drafter ngram-adaptive`: the paper's n-gram settings; k is the longest draft a call's length may grow to.
    shorthand: ClassVar[dict] = {"method": "ngram-adaptive", "num_speculative_tokens": 5,
                                  "prompt_lookup_max": 4}

    config_keys: ClassVar[frozenset[str]] = NgramDrafter.config_keys

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        self.k = max(spec.num_speculative_tokens, 0)
        self.state = self._state_for(0)

    def _state_for(self, rows: int) -> AdaptiveState:
        """The per-call arrays with room for call rows 0 … rows − 1 (new rows start at length k)."""
        old = getattr(self, "state", None)
        if old is None:
            n = max(rows, 1)
            return AdaptiveState(np.full(n, self.k, dtype=np.int64), np.zeros((n, max(self.k, 1)), dtype=np.int32),
                                 np.zeros(n, dtype=np.int64))
        if rows <= old.length.shape[0]:
            return old
        return AdaptiveState(grown(old.length, rows, self.k), grown(old.last, rows, 0), grown(old.last_n, rows, 0))

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        st = self.state = self._state_for(state.index + 1)
        r, n = state.index, int(st.last_n[state.index])
        if n:
            accepted = common_prefix(st.last[r, :n], np.ascontiguousarray(emitted, dtype=np.int32))
            st.length[r] = next_length(int(st.length[r]), n, accepted, self.k)
            st.last_n[r] = 0

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        st = self.state = self._state_for(max((row.index for row in rows), default=-1) + 1)
        out = []
        for row, limit in zip(rows, max_lens, strict=True):
            draft = propose_ngram(row.tokens, self.min_n, self.max_n, min(int(limit), int(st.length[row.index])))
            st.last[row.index, :draft.shape[0]] = draft
            st.last_n[row.index] = draft.shape[0]
            out.append(draft)
        return out

    def engine_drafting(self, run: RunView) -> EngineDrafting | None:
        if (len(run.drafters) > 1 or not run.use_tables or self.k <= 0 or run.k_of_batch is None
                or self.max_n > MAX_INDEXED_N):
            return None  # the hooks and `propose` above, with the n-gram scan
        return AdaptiveDrafting(self, run)


class AdaptiveDrafting(EngineDrafting):
    """One run's fast path: the compiled steps observe and propose; the event loop proposes compiled too."""

    def __init__(self, drafter: NgramAdaptiveDrafter, run: RunView) -> None:
        self.drafter, self.run = drafter, run
        n = len(run.states)
        table = workload_table(run, drafter.min_n, drafter.max_n, False)
        drafter.state = drafter._state_for(n)
        ds = DraftSlots.model_free(run)
        self.state = AdaptiveSteps(ds, drafter.state, table.at[:n].copy(), table.match)
        run.table.reserve_draft_width(drafter.k)

    def run_state(self) -> AdaptiveSteps:
        return self.state

    def propose(self, rows: Sequence[CallState], calls: np.ndarray, max_lens: np.ndarray) -> float:
        run, ds, m = self.run, self.state.ds, calls.shape[0]
        cols = run.table.cols
        ds.rows[:m] = calls
        ds.starts[:m] = cols["hist_off"][calls]
        ds.lengths[:m] = cols["prompt_len"][calls] + cols["num_emitted"][calls]
        ds.max_lens[:m] = max_lens
        propose_buffered(run.table.nt, self.state, m)
        return float(self.drafter.draft_time(run.cost, rows, max_lens))


__all__ = ["AdaptiveDrafting", "NgramAdaptiveDrafter", "common_prefix", "next_length"]
