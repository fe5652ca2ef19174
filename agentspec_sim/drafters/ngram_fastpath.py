"""`ngram` and `ngram-v2`'s fast path (drafters/protocol.py): every drafting call's lookup in one compiled
call per step, between the engine's steps or from its event loop.

The drafts are the drafters' own (`NgramDrafter.propose`, `NgramV2Drafter.propose`), found either in the
workload's table of every position's match (drafters/ngram_tables.py: one drafter, tables on) or by
the incremental index (drafters/ngram_index.py: tables off, or a drafter per replicate copy). `ngram`'s
draft is the arena stretch after its match; `ngram-v2`'s is k slots padded with the last token
(Model Runner V2). Drafting inside the compiled loop needs a draft length known from the batch size
alone (FixedK, BatchSizeSchedule) and n ≤ 255 (the index packs n in a byte); otherwise the event loop
drafts with the same lookups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from agentspec_sim.drafters import ngram, ngram_index, ngram_tables, ngram_v2
from agentspec_sim.drafters.ngram_index import (
    MAX_INDEXED_N,
    _ngram_rows_indexed,
    ngram_v2_rows_indexed,
    prompt_index,
    propose_ngram_rows,
)
from agentspec_sim.drafters.protocol import EngineDrafting, RunView, compiled_step
from agentspec_sim.engine.drafts import (
    DraftSlots,
    drafting_calls,
    drafts_from,
    proposer_skipped,
    set_verified,
    zero_drafts,
)
from agentspec_sim.engine.kv import kernel
from agentspec_sim.kernel_cache import clear_if_changed

if TYPE_CHECKING:
    from agentspec_sim.engine.request import CallState

clear_if_changed(__file__, [ngram_index.__file__, ngram.__file__, ngram_v2.__file__])

# NgramSteps.par fields.
NG_MIN_N, NG_MAX_N, NG_RIGHTMOST, NG_TABLE = range(4)


class NgramSteps(NamedTuple):
    """The compiled state of an n-gram run: its draft limits, then the index's tables or the workload's."""

    ds: DraftSlots
    par: np.ndarray  # int64: [min_n, max_n, rightmost (ngram-v2), drafts from the workload's table]
    entries: np.ndarray  # the `NgramIndex` tables
    regions: np.ndarray
    counts: np.ndarray
    ngram_at: np.ndarray  # int64 per call row: its first position in ngram_match (drafters/ngram_tables.py)
    ngram_match: np.ndarray  # int64 per position: where the n-gram draft starts in the arena, −1: none


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
def table_drafts(c, rows, starts, lengths, max_lens, at, match, rightmost, work):
    """The n-gram proposers' drafts of calls rows[i] (histories tokens[starts[i]:starts[i] + lengths[i]],
    draft limits max_lens[i]) from the workload's table, set and verified as the index's: `ngram-v2`
    padded (`drafts_padded`), `ngram` the arena stretch after the match (`drafts_from`)."""
    m = rows.shape[0]
    for i in range(m):
        r = rows[i]
        j = match[at[r] + c.calls.num_emitted[r]]
        work[0, i] = j
        work[1, i] = min(max_lens[i], starts[i] + lengths[i] - j) if j >= 0 else 0
        if j < 0 and not rightmost:
            work[0, i] = starts[i]
    if rightmost:
        drafts_padded(c, rows, work[0, :m], max_lens)
    else:
        drafts_from(c, rows, c.tokens, work[0, :m], work[1, :m])


@compiled_step(NgramSteps)
@kernel
def ngram_step(c, sb, pb, st, max_model_len):
    """The drafts of the calls that sampled in the step in `sb`, as the event loop makes them; the drafting
    seconds, or −1.0 when the index needs room (nothing is set: the event loop proposes, growing it)."""
    ds = st.ds
    if proposer_skipped(sb, ds, max_model_len):
        zero_drafts(c, sb, ds)
        return 0.0
    m = drafting_calls(c, sb, ds, max_model_len)
    if m == 0:
        return 0.0
    rows, starts, lengths, max_lens = ds.rows[:m], ds.starts[:m], ds.lengths[:m], ds.max_lens[:m]
    rightmost = st.par[NG_RIGHTMOST] != 0
    if st.par[NG_TABLE]:
        table_drafts(c, rows, starts, lengths, max_lens, st.ngram_at, st.ngram_match, rightmost, ds.drafts[:, :m])
    elif rightmost:
        if ngram_v2_rows_indexed(c.tokens, starts, lengths, st.par[NG_MIN_N], st.par[NG_MAX_N], ds.drafts[0, :m],
                                 st.entries, st.regions, st.counts, 0) < m:
            return -1.0
        drafts_padded(c, rows, ds.drafts[0, :m], max_lens)
    else:
        if _ngram_rows_indexed(c.tokens, starts, lengths, max_lens, st.par[NG_MIN_N], st.par[NG_MAX_N],
                               ds.drafts[:, :m], st.entries, st.regions, st.counts, 0) < m:
            return -1.0
        drafts_from(c, rows, c.tokens, ds.drafts[0, :m], ds.drafts[1, :m])
    return ds.draft_s[m]


class NgramDrafting(EngineDrafting):
    """One run's n-gram fast path: the compiled steps' state and the event loop's batched proposal."""

    def __init__(self, drafter: ngram.NgramDrafter, run: RunView) -> None:
        self.drafter, self.run = drafter, run
        self.rightmost = isinstance(drafter, ngram_v2.NgramV2Drafter)
        self.state: NgramSteps | None = None
        if (drafter.max_n <= MAX_INDEXED_N and run.spec.num_speculative_tokens > 0
                and run.k_of_batch is not None):
            one = np.zeros(1, dtype=np.int64)
            ds = DraftSlots.make(run.spec.num_speculative_tokens, run.skips_unfit_batches, run.k_of_batch,
                                 run.model_free_draft_s(), run.max_num_seqs)
            par = np.array([drafter.min_n, drafter.max_n, int(self.rightmost), 0], dtype=np.int64)
            self.state = NgramSteps(ds, par, np.zeros((1, 3), dtype=np.int64), np.zeros((1, 2), dtype=np.int64),
                                    np.zeros(3, dtype=np.int64), one, one)
            if run.use_tables and len(run.drafters) == 1:
                table = self._table()
                par[NG_TABLE] = 1
                self.state = self.state._replace(ngram_at=table.at[:len(run.states)].copy(), ngram_match=table.match)

    @property
    def from_table(self) -> bool:
        return self.state is not None and bool(self.state.par[NG_TABLE])

    def _table(self) -> ngram_tables.NgramTable:
        """Where every call's n-gram draft starts at every position (drafters/ngram_tables.py), from the disk
        cache when a run over the same calls with the same n-gram range made it."""
        run, drafter = self.run, self.drafter
        cols, n = run.table.cols, len(run.states)
        args = (run.table.tokens, cols["hist_off"][:n], cols["prompt_len"][:n], cols["target_len"][:n])
        key = ngram_tables.table_key(drafter.min_n, drafter.max_n, self.rightmost, run.tokens_digest, *args[1:])
        return ngram_tables.cached_ngram_table(key, lambda: ngram_tables.build_ngram_table(
            *args, drafter.min_n, drafter.max_n, self.rightmost))

    def run_state(self) -> NgramSteps | None:
        state = self.state
        if state is None:
            return None
        self.run.table.reserve_draft_width(int(state.ds.par[0]))
        if state.par[NG_TABLE]:
            return state
        index = prompt_index(self.drafter, self.run.table.tokens)
        index.make_room_if_asked()  # the run before stopped because the index was full
        if (state.entries is not index.entries or state.regions is not index.regions
                or state.counts is not index.counts):
            # A new tuple only when the index's tables changed: the scheduler's FastCall keys on it.
            state = self.state = state._replace(entries=index.entries, regions=index.regions, counts=index.counts)
        return state

    def propose(self, rows: Sequence[CallState], calls: np.ndarray, max_lens: np.ndarray) -> float | None:
        run = self.run
        cols = run.table.cols
        if self.from_table:
            m = calls.shape[0]
            run.table.reserve_draft_width(int(max_lens.max()))
            table_drafts(run.table.nt, calls.astype(np.int64), cols["hist_off"][calls].astype(np.int64),
                         (cols["prompt_len"][calls] + cols["num_emitted"][calls]).astype(np.int64),
                         max_lens.astype(np.int64), self.state.ngram_at, self.state.ngram_match, self.rightmost,
                         self.state.ds.drafts[:, :m])
        elif not self.rightmost:
            # The same drafts as the drafter's propose, for all rows in one compiled call (the index).
            starts, lengths = propose_ngram_rows(self.drafter, run.table.tokens, cols["hist_off"][calls],
                                                 cols["prompt_len"][calls] + cols["num_emitted"][calls], max_lens)
            run.scheduler.set_drafts_from_tokens(calls, starts, lengths)
        else:
            return None  # ngram-v2 without its table: the drafter's own scan
        return float(self.drafter.draft_time(run.cost, rows, max_lens))


def engine_drafting(drafter: ngram.NgramDrafter, run: RunView) -> NgramDrafting | None:
    """The fast path of exactly `ngram` and `ngram-v2` (a subclass may change the rule: it drafts itself)."""
    if type(drafter) not in (ngram.NgramDrafter, ngram_v2.NgramV2Drafter):
        return None
    fast = NgramDrafting(drafter, run)
    return fast if fast.state is not None or not fast.rightmost else None
