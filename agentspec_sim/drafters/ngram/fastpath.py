"""`ngram` and `ngram-v2`'s fast path (engine/drafting.py): every drafting call's lookup in one compiled
call per step, between the engine's steps or from its event loop.

The drafts are the drafters' own (`NgramDrafter.propose`, `NgramV2Drafter.propose`), found either in the
workload's table of every position's match (drafters/ngram/tables.py: one drafter, tables on) or by
the incremental index (drafters/ngram/index.py: tables off, or a drafter per replicate copy). `ngram`'s
draft is the arena stretch after its match; `ngram-v2`'s is k slots padded with the last token
(Model Runner V2). Drafting inside the compiled loop needs a draft length known from the batch size
alone (FixedK, BatchSizeSchedule) and n ≤ 255 (the index packs n in a byte); otherwise the event loop
drafts with the same lookups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from agentspec_sim.drafters.ngram import index as ngram_index
from agentspec_sim.drafters.ngram import rule as ngram
from agentspec_sim.drafters.ngram import tables as ngram_tables
from agentspec_sim.drafters.ngram import v2 as ngram_v2
from agentspec_sim.drafters.ngram.index import (
    MAX_INDEXED_N,
    _ngram_rows_indexed,
    ngram_v2_rows_indexed,
    prompt_index,
    propose_ngram_rows,
)
from agentspec_sim.engine.drafting import (
    DS_K_MAX,
    ENGINE_KERNEL_SOURCES,
    DraftSlots,
    EngineDrafting,
    RunView,
    compiled_step,
    drafts_from,
    fast_path_for,
    kernel,
    refreshed,
    sampled_calls,
    set_verified,
)
from agentspec_sim.host.kernel_cache import clear_if_changed

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

clear_if_changed(__file__, [ngram_index.__file__, ngram.__file__, ngram_v2.__file__, *ENGINE_KERNEL_SOURCES])

# NgramIndexSteps.par fields.
NG_MIN_N, NG_MAX_N = range(2)


class NgramTableSteps(NamedTuple):
    """An `ngram` run drafting from the workload's table of matches (drafters/ngram/tables.py)."""

    ds: DraftSlots
    at: np.ndarray  # int64 per call row: its first position in `match`
    match: np.ndarray  # int64 per position: where the n-gram draft starts in the arena, −1: none


class NgramV2TableSteps(NgramTableSteps):
    """`ngram-v2`'s: the same table (of rightmost matches), drafts padded with the last token."""


class NgramIndexSteps(NamedTuple):
    """An `ngram` run drafting with the incremental index (drafters/ngram/index.py)."""

    ds: DraftSlots
    par: np.ndarray  # int64: [min_n, max_n]
    entries: np.ndarray  # the `NgramIndex` tables
    regions: np.ndarray
    counts: np.ndarray


class NgramV2IndexSteps(NgramIndexSteps):
    """`ngram-v2`'s: the index of rightmost ends."""


@kernel
def drafts_padded(c, rows, match, lengths):
    """ngram-v2's drafts of calls rows[i]: lengths[i] slots, the arena from match[i] while within the
    call's history and its last token after (all of them when match[i] < 0), verified as `drafts_from`."""
    for i in range(rows.shape[0]):
        r = rows[i]
        n = lengths[i]
        slot = c.calls.slot[r]
        end = c.calls.hist_off[r] + c.calls.prompt_len[r] + c.calls.num_emitted[r]
        last = c.tokens[end - 1]
        for k in range(n):
            p = match[i] + k
            c.slot_drafts[slot, k] = c.tokens[p] if match[i] >= 0 and p < end else last
        set_verified(c, r, slot, n)


@kernel
def table_drafts(c, rows, starts, lengths, max_lens, at, match, work):
    """`ngram`'s drafts of calls rows[i] (histories tokens[starts[i]:starts[i] + lengths[i]], draft limits
    max_lens[i]) from the workload's table: the arena stretch after the match, set and verified."""
    m = rows.shape[0]
    for i in range(m):
        r = rows[i]
        j = match[at[r] + c.calls.num_emitted[r]]
        work[0, i] = j if j >= 0 else starts[i]
        work[1, i] = min(max_lens[i], starts[i] + lengths[i] - j) if j >= 0 else 0
    drafts_from(c, rows, c.tokens, work[0, :m], work[1, :m])


@kernel
def table_drafts_v2(c, rows, max_lens, at, match, work):
    """`ngram-v2`'s drafts of calls rows[i] from the workload's table (`drafts_padded`)."""
    m = rows.shape[0]
    for i in range(m):
        work[0, i] = match[at[rows[i]] + c.calls.num_emitted[rows[i]]]
    drafts_padded(c, rows, work[0, :m], max_lens)


@compiled_step(NgramTableSteps)
def ngram_table_step(c, sb, pb, state, max_model_len):
    """`ngram`'s drafts of the calls that sampled in the step in `sb`, from the table; the drafting seconds."""
    ds = state.ds
    m = sampled_calls(c, sb, ds, max_model_len)
    if m <= 0:
        return 0.0
    table_drafts(c, ds.rows[:m], ds.starts[:m], ds.lengths[:m], ds.max_lens[:m], state.at, state.match,
                 ds.drafts[:, :m])
    return ds.draft_s[m]


@compiled_step(NgramV2TableSteps)
def ngram_v2_table_step(c, sb, pb, state, max_model_len):
    """`ngram-v2`'s, from the table."""
    ds = state.ds
    m = sampled_calls(c, sb, ds, max_model_len)
    if m <= 0:
        return 0.0
    table_drafts_v2(c, ds.rows[:m], ds.max_lens[:m], state.at, state.match, ds.drafts[:, :m])
    return ds.draft_s[m]


@compiled_step(NgramIndexSteps)
def ngram_index_step(c, sb, pb, state, max_model_len):
    """`ngram`'s, from the index; −1.0 when the index needs room (nothing is set: the event loop proposes,
    growing it)."""
    ds = state.ds
    m = sampled_calls(c, sb, ds, max_model_len)
    if m <= 0:
        return 0.0
    if _ngram_rows_indexed(c.tokens, ds.starts[:m], ds.lengths[:m], ds.max_lens[:m], state.par[NG_MIN_N],
                           state.par[NG_MAX_N], ds.drafts[:, :m], state.entries, state.regions, state.counts, 0) < m:
        return -1.0
    drafts_from(c, ds.rows[:m], c.tokens, ds.drafts[0, :m], ds.drafts[1, :m])
    return ds.draft_s[m]


@compiled_step(NgramV2IndexSteps)
def ngram_v2_index_step(c, sb, pb, state, max_model_len):
    """`ngram-v2`'s, from the index of rightmost ends (−1.0 as `ngram_index_step`)."""
    ds = state.ds
    m = sampled_calls(c, sb, ds, max_model_len)
    if m <= 0:
        return 0.0
    if ngram_v2_rows_indexed(c.tokens, ds.starts[:m], ds.lengths[:m], state.par[NG_MIN_N], state.par[NG_MAX_N],
                             ds.drafts[0, :m], state.entries, state.regions, state.counts, 0) < m:
        return -1.0
    drafts_padded(c, ds.rows[:m], ds.drafts[0, :m], ds.max_lens[:m])
    return ds.draft_s[m]


def workload_table(run: RunView, min_n: int, max_n: int, rightmost: bool, n: int | None = None
                   ) -> ngram_tables.NgramTable:
    """Where each of the first `n` calls of `run` (default: all) has its n-gram draft at every position
    (drafters/ngram/tables.py), from the disk cache when a run over the same calls with the same n-gram range
    made it."""
    cols = run.table.cols
    n = len(run.states) if n is None else n
    args = (run.table.tokens, cols["hist_off"][:n], cols["prompt_len"][:n], cols["target_len"][:n])
    key = ngram_tables.table_key(min_n, max_n, rightmost, run.tokens_digest, *args[1:])
    return ngram_tables.cached_ngram_table(key, lambda: ngram_tables.build_ngram_table(*args, min_n, max_n,
                                                                                         rightmost))


class NgramDrafting(EngineDrafting):
    """One run's n-gram fast path: the compiled steps' state and the event loop's batched proposal."""

    def __init__(self, drafter: ngram.NgramDrafter, run: RunView) -> None:
        self.drafter, self.run = drafter, run
        self.rightmost = isinstance(drafter, ngram_v2.NgramV2Drafter)
        self.state: NgramTableSteps | NgramIndexSteps | None = None
        if drafter.max_n <= MAX_INDEXED_N and run.spec.num_speculative_tokens > 0 and run.k_of_batch is not None:
            ds = DraftSlots.model_free(run)
            if run.use_tables:
                # Tenants are copies of the trace, tenant-major (engine/layout.py), and an n-gram draft reads only
                # its own call's tokens: one tenant's table, read at every tenant's rows.
                tenants = len(run.drafters)
                per_tenant = len(run.states) // tenants
                table = workload_table(run, drafter.min_n, drafter.max_n, self.rightmost, per_tenant)
                kind = NgramV2TableSteps if self.rightmost else NgramTableSteps
                self.state = kind(ds, np.tile(table.at[:per_tenant], tenants), table.match)
            else:
                kind = NgramV2IndexSteps if self.rightmost else NgramIndexSteps
                self.state = kind(ds, np.array([drafter.min_n, drafter.max_n], dtype=np.int64),
                                  np.zeros((1, 3), dtype=np.int64), np.zeros((1, 2), dtype=np.int64),
                                  np.zeros(3, dtype=np.int64))

    @property
    def from_table(self) -> bool:
        return isinstance(self.state, NgramTableSteps)

    def run_state(self) -> NgramTableSteps | NgramIndexSteps | None:
        state = self.state
        if state is None:
            return None
        self.run.table.reserve_draft_width(int(state.ds.par[DS_K_MAX]))
        if self.from_table:
            return state
        index = prompt_index(self.drafter, self.run.table.tokens)
        index.make_room_if_asked()  # the run before stopped because the index was full
        self.state = refreshed(state, {"entries": index.entries, "regions": index.regions, "counts": index.counts})
        return self.state

    def propose(self, rows: Sequence[CallState], calls: np.ndarray, max_lens: np.ndarray) -> float | None:
        run = self.run
        cols, nt = run.table.cols, run.table.nt
        if self.from_table:
            state, m = self.state, calls.shape[0]
            run.table.reserve_draft_width(int(max_lens.max()))
            calls, lens = calls.astype(np.int64), max_lens.astype(np.int64)
            if self.rightmost:
                table_drafts_v2(nt, calls, lens, state.at, state.match, state.ds.drafts[:, :m])
            else:
                table_drafts(nt, calls, cols["hist_off"][calls].astype(np.int64),
                             (cols["prompt_len"][calls] + cols["num_emitted"][calls]).astype(np.int64), lens,
                             state.at, state.match, state.ds.drafts[:, :m])
        elif not self.rightmost:
            # The same drafts as the drafter's propose, for all rows in one compiled call (the index).
            starts, lengths = propose_ngram_rows(self.drafter, run.table.tokens, cols["hist_off"][calls],
                                                 cols["prompt_len"][calls] + cols["num_emitted"][calls], max_lens)
            run.scheduler.set_drafts_from_tokens(calls, starts, lengths)
        else:
            return None  # ngram-v2 without its table: the drafter's own scan
        return float(self.drafter.draft_time(run.cost, rows, max_lens))


@fast_path_for(ngram.NgramDrafter)
def engine_drafting(drafter: ngram.NgramDrafter, run: RunView) -> NgramDrafting | None:
    """The fast path of exactly `ngram` and `ngram-v2` (a subclass may change the rule: it drafts itself)."""
    if type(drafter) not in (ngram.NgramDrafter, ngram_v2.NgramV2Drafter):
        return None
    fast = NgramDrafting(drafter, run)
    return fast if fast.state is not None or not fast.rightmost else None
