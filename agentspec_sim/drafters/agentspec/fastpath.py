"""AgentSpec's fast path (engine/drafting.py): its lookups from the workload's table, or its live
history driven by compiled steps.

Two forms, both the drafter's own proposals (tests/test_draft_tables.py, tests/test_engine_fast_paths.py):

- Table (`TableSteps`): where one drafter drafts with a fixed k, every lookup of every call is the same
  in every run (drafters/agentspec/tables.py), so they are made once per workload; a step reads each
  drafting call's lookup at its position and applies the budget and caps over the step's rows
  (`capped_lengths`). No drafter state: the hooks are not needed.
- Live history (`HistorySteps`, `agentspec` and `agentspec-paper` with tables off): the compiled step
  observes — each emitted run of one block appended to the block arena, continuing its last segment or
  as a new one with its lead-in — and proposes, in a step in which no call started or finished; any
  other step goes to the event loop and the drafter's hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from agentspec_sim.cost import break_even
from agentspec_sim.cost.break_even import break_even_at
from agentspec_sim.drafters.agentspec import rule as agentspec
from agentspec_sim.drafters.agentspec import tables as history_tables
from agentspec_sim.drafters.agentspec.allocation import capped_lengths
from agentspec_sim.drafters.agentspec.block_index import BCAP, BLEN, OP_APPEND, OP_LOOKUP, run_ops_into
from agentspec_sim.drafters.agentspec.history import MAX_SCAN, MIN_SUPPORT
from agentspec_sim.drafters.agentspec.rule import (
    AgentSpecDrafter,
    AgentSpecNDrafter,
    AgentSpecPaperDrafter,
    AgentSpecSDrafter,
)
from agentspec_sim.drafters.suffix import tree as suffix_tree
from agentspec_sim.engine.drafting import (
    DS_K_MAX,
    ENGINE_KERNEL_SOURCES,
    S_FINISHED,
    SC_ROWS,
    DraftSlots,
    EngineDrafting,
    FastCall,
    RunView,
    compiled_step,
    draft_now,
    drafting_calls,
    drafts_from_out,
    fast_path_for,
    kernel,
    proposer_skipped,
    refreshed,
    sampled_calls,
    set_verified,
)
from agentspec_sim.host.kernel_cache import clear_if_changed, package_sources

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

# Its kernels call the family's own compiled functions (allocation, history, block index, the suffix tree it
# builds on) and the cost model's break-even grid.
clear_if_changed(__file__, [*package_sources(__package__), suffix_tree.__file__, break_even.__file__,
                            *ENGINE_KERNEL_SOURCES])

# Drafters whose every lookup a workload table can give; drafters whose live history the compiled steps drive.
TABLE_DRAFTERS = (AgentSpecDrafter, AgentSpecSDrafter, AgentSpecNDrafter, AgentSpecPaperDrafter)
HISTORY_DRAFTERS = (AgentSpecDrafter, AgentSpecPaperDrafter)
# TableSteps.par and HistorySteps.par fields.
TB_K, TB_BUDGETED, TB_CT_MIN, TB_SINGLE_CT, TB_TENANTS = range(5)
AH_MAX_N, AH_MAX_CAND, AH_MAX_SCAN, AH_MIN_SUPPORT, AH_K, AH_BUDGETED, AH_CT_MIN, AH_SINGLE_CT = range(8)


class TableSteps(NamedTuple):
    """AgentSpec's lookups of every call, made once for the workload (drafters/agentspec/tables.py
    `HistoryTables`), and the work space `propose_table_rows` drafts from them with."""

    ds: DraftSlots
    at: np.ndarray  # int64 [table rows]: the row's first position (its lookup before output token 0)
    meta: np.ndarray  # int32 [positions, 5]: n, c, |CT*|, |P|, match length
    path: np.ndarray  # int64 [positions]: where P starts in `pool`
    pool: np.ndarray  # int32
    par: np.ndarray  # int64: [k, budgeted, ct_min_match, single_ct_only, tenants]
    g_min: np.ndarray  # float64 [1]
    budget_of: np.ndarray  # int64 [max_num_seqs + 1]: B_t for that many drafting calls
    lookups: np.ndarray  # int64 [max_num_seqs, 5] work space: the drafting calls' meta rows
    lens: np.ndarray  # int64 [max_num_seqs]: their draft lengths
    fwork: np.ndarray  # float64 [2, max_num_seqs]: the budget's work space (`capped_lengths`)
    iwork: np.ndarray  # int64 [4, max_num_seqs]
    break_even: np.ndarray  # float64: the drafter's τ grid (cost/break_even.py); [1, 1] when drafting ignores τ
    group: np.ndarray  # int64 [2, max_num_seqs] work space: one tenant's drafting calls and their draft limits


class History(NamedTuple):
    """AgentSpec's history (drafters/agentspec/rule.py `History`: the block arena, each block's last segment,
    each engine call's output tokens' blocks) as the compiled steps read and extend it."""

    par: np.ndarray  # int64: [max_n, max_candidates, max_scan, min_support, k, budgeted, ct_min_match,
    #                    single_ct_only]
    g_min: np.ndarray  # float64 [1]
    budget_of: np.ndarray  # int64 [max_num_seqs + 1]: B_t for that many drafting calls
    pool: np.ndarray  # the `BlockArena` arrays
    pv: np.ndarray
    bk: np.ndarray
    hk: np.ndarray
    hv: np.ndarray
    used: np.ndarray
    levels: np.ndarray
    live: np.ndarray
    tail_lin: np.ndarray  # History.tail_lin / tail_pos
    tail_pos: np.ndarray
    tok_block: np.ndarray  # History.tok_block: the block of each engine call's output token, from row_at[row]
    row_at: np.ndarray
    row_lineage: np.ndarray
    need: np.ndarray  # int64 [blocks] work space (zero between calls)
    ops: np.ndarray  # int64 [., 8] work space: the step's `block_index.run_ops` batch
    out: np.ndarray  # int32 [max_num_seqs, width]
    meta: np.ndarray  # int64 [max_num_seqs, 5]
    lens: np.ndarray  # int64 [max_num_seqs]
    fwork: np.ndarray  # float64 [2, max_num_seqs]: the budget's work space (`capped_lengths`)
    iwork: np.ndarray  # int64 [4, max_num_seqs]
    cands: np.ndarray  # int64 [3, max_candidates]: the lookups' work space (`run_ops_into`)
    keys: np.ndarray  # uint64 [levels]
    hooked: np.ndarray  # int8 [max_num_seqs]: batch rows the event loop ran the drafter's hooks for (0 in runs)
    break_even: np.ndarray  # float64: the drafter's τ grid (cost/break_even.py); [1, 1] when drafting ignores τ


class HistorySteps(NamedTuple):
    """The compiled state of a run drafting from AgentSpec's live history."""

    ds: DraftSlots
    ah: History


@kernel
def _step_break_even(c, rows, grid, bz):
    """τ for a step of `bz` drafting calls, from the mean context of `rows` (the calls one drafter drafts), or −1
    when `grid` is off."""
    m = rows.shape[0]
    if grid.shape[0] < 2 or m == 0:
        return -1.0
    ctx = 0
    for i in range(m):
        ctx += c.calls.prompt_len[rows[i]] + c.calls.num_emitted[rows[i]]
    return break_even_at(grid, float(bz), ctx / m)


@kernel
def propose_table_rows(c, rows, max_lens, tb):
    """AgentSpec's drafts of calls rows[i] (draft limits max_lens[i]) from the workload's lookup table, as
    the drafters' propose makes them from their live histories: each call's lookup at its position, the
    budget over these rows and the caps (`capped_lengths`), the draft P[:L], verified; returns the
    drafting seconds. With tenants (replicate copies, a drafter each) each tenant's drafter drafts its own
    rows, in their order, with its share of the step's budget (`_AgentSpecBase.batch_share`)."""
    m = rows.shape[0]
    if m == 0:
        return 0.0
    tenants = tb.par[TB_TENANTS]
    if tenants <= 1:
        _draft_rows(c, rows, max_lens, tb, tb.budget_of[m], _step_break_even(c, rows, tb.break_even, m))
        return tb.ds.draft_s[m]
    for t in range(tenants):
        g = 0
        for i in range(m):
            if c.calls.tenant[rows[i]] == t:
                tb.group[0, g] = rows[i]
                tb.group[1, g] = max_lens[i]
                g += 1
        if g == 0:
            continue
        budget = tb.budget_of[m] if g == m else tb.budget_of[m] * g // m
        mine = tb.group[0, :g]
        _draft_rows(c, mine, tb.group[1, :g], tb, budget, _step_break_even(c, mine, tb.break_even, m))
    return tb.ds.draft_s[m]


@kernel
def _draft_rows(c, rows, max_lens, tb, budget, tau):
    """One drafter's drafts of `rows` from the table, its budget `budget` and τ given."""
    m = rows.shape[0]
    for i in range(m):
        j = tb.at[rows[i]] + c.calls.num_emitted[rows[i]]
        for f in range(5):
            tb.lookups[i, f] = tb.meta[j, f]
    capped_lengths(tb.lookups[:m], max_lens, budget, tb.g_min[0], tb.par[TB_K], tb.par[TB_BUDGETED] != 0,
                   tb.par[TB_CT_MIN], tb.par[TB_SINGLE_CT] != 0, tau, tb.lens[:m], tb.fwork, tb.iwork)
    for i in range(m):
        r = rows[i]
        start = tb.path[tb.at[r] + c.calls.num_emitted[r]]
        slot = c.calls.slot[r]
        length = tb.lens[i]
        for t in range(length):
            c.slot_drafts[slot, t] = tb.pool[start + t]
        set_verified(c, r, slot, length)


@kernel
def propose_table_buffered(c, tb, m):
    """`propose_table_rows` of the first m entries of the work space (rows, max_lens)."""
    return propose_table_rows(c, tb.ds.rows[:m], tb.ds.max_lens[:m], tb)


@compiled_step(TableSteps)
def table_step(c, sb, pb, state, max_model_len):
    """The drafts of the calls that sampled in the step in `sb`, from the table; the drafting seconds."""
    m = sampled_calls(c, sb, state.ds, max_model_len)
    if m <= 0:
        return 0.0
    return propose_table_rows(c, state.ds.rows[:m], state.ds.max_lens[:m], state)


@kernel
def _run_end(tok_block, at, j, end):
    """The end of the run of equal blocks from output token j (< end) of the call whose blocks start at `at`."""
    b = tok_block[at + j]
    t = j + 1
    while t < end and tok_block[at + t] == b:
        t += 1
    return t


@compiled_step(HistorySteps)
def history_step(c, sb, pb, state, max_model_len):
    """The drafter's observe then propose for the step in `sb`, from its live history, the rows marked in
    `ah.hooked` already observed by the event loop; returns the drafting seconds, or −1.0 with nothing
    changed when the event loop must do it: a call that started or finished and was not hooked (its
    Python hooks), the V1 proposer skip, or no room in the arena."""
    dr, ah = state.ds, state.ah
    n = sb.sc[SC_ROWS]
    if proposer_skipped(sb, dr, max_model_len):
        return -1.0
    for i in range(n):
        if sb.rows.emitted[i] and not ah.hooked[i]:
            r = sb.rows.call[i]
            if sb.rows.started[i] or c.calls.status[r] == S_FINISHED or ah.row_at[r] < 0:
                return -1.0
    max_n = ah.par[AH_MAX_N]
    # Room for what each emitted run appends (its tokens; a new segment also its SEP and lead-in), as
    # `BlockArena.run` reserves it, checked before anything changes. Only a block's first run in the step
    # can continue its last segment (the rows of a step are calls of different queries: no block is
    # shared, and a later run of a block in the same call follows another block's run).
    total = 0
    room = True
    for sweep in range(2):
        for i in range(n):
            e = sb.rows.emitted[i]
            if e == 0 or ah.hooked[i]:
                continue
            r = sb.rows.call[i]
            at = ah.row_at[r]
            prompt = c.calls.prompt_len[r]
            end = c.calls.num_emitted[r]
            j = end - e
            while j < end:
                t = _run_end(ah.tok_block, at, j, end)
                b = ah.tok_block[at + j]
                if sweep == 0:
                    pos = prompt + j
                    grow = t - j
                    if ah.need[b] or ah.tail_lin[b] != ah.row_lineage[r] or ah.tail_pos[b] != pos:
                        grow += min(max_n, pos) + 1
                    ah.need[b] += grow
                    total += grow
                    if ah.bk[b, BLEN] + ah.need[b] > ah.bk[b, BCAP]:
                        room = False
                else:
                    ah.need[b] = 0
                j = t
    if not room or 2 * (ah.used[0] + total * ah.levels.shape[0]) > ah.hk.shape[0]:
        return -1.0
    # observe: each emitted run of one block, in row order
    ops = ah.ops
    nops = 0
    added = 0
    for i in range(n):
        e = sb.rows.emitted[i]
        if e == 0 or ah.hooked[i]:
            continue
        r = sb.rows.call[i]
        at = ah.row_at[r]
        lineage = ah.row_lineage[r]
        base = c.calls.hist_off[r]
        prompt = c.calls.prompt_len[r]
        end = c.calls.num_emitted[r]
        j = end - e
        while j < end:
            t = _run_end(ah.tok_block, at, j, end)
            b = ah.tok_block[at + j]
            pos = prompt + j
            ops[nops, 0] = OP_APPEND
            ops[nops, 1] = b
            ops[nops, 2] = base + pos
            ops[nops, 3] = t - j
            if ah.tail_lin[b] == lineage and ah.tail_pos[b] == pos:
                ops[nops, 4] = 0
                ops[nops, 5] = -1
                added += t - j
            else:
                lead = min(max_n, pos)
                ops[nops, 4] = base + pos - lead
                ops[nops, 5] = lead
                added += t - j + lead + 1
            ah.tail_lin[b] = lineage
            ah.tail_pos[b] = prompt + t
            nops += 1
            j = t
    # propose: a lookup per drafting call, then the budget and the caps
    m = drafting_calls(c, sb, dr, max_model_len)
    for i in range(m):
        r = dr.rows[i]
        cn = min(max_n, dr.lengths[i])
        ops[nops, 0] = OP_LOOKUP
        ops[nops, 1] = ah.tok_block[ah.row_at[r] + c.calls.num_emitted[r]]
        ops[nops, 2] = c.calls.hist_off[r] + dr.lengths[i] - cn
        ops[nops, 3] = cn
        ops[nops, 4] = i
        nops += 1
    run_ops_into(ah.pool, ah.pv, ah.bk, ah.hk, ah.hv, ah.used, ah.levels, ops[:nops], c.tokens, ah.par[AH_MAX_CAND],
                 ah.par[AH_MAX_SCAN], ah.par[AH_MIN_SUPPORT], ah.out[:m], ah.meta[:m], ah.cands, ah.keys)
    ah.live[1] += added
    if m == 0:
        return 0.0
    capped_lengths(ah.meta[:m], dr.max_lens[:m], ah.budget_of[m], ah.g_min[0], ah.par[AH_K], ah.par[AH_BUDGETED] != 0,
                   ah.par[AH_CT_MIN], ah.par[AH_SINGLE_CT] != 0, _step_break_even(c, dr.rows[:m], ah.break_even, m),
                   ah.lens[:m], ah.fwork, ah.iwork)
    drafts_from_out(c, dr.rows, ah.out, ah.lens, m)
    return dr.draft_s[m]


def _budget_of(drafter: agentspec._AgentSpecBase, max_num_seqs: int) -> np.ndarray:
    """B_t for 0…max_num_seqs drafting calls (zeros when drafting is not budgeted)."""
    budgeted = bool(drafter.budgeted)
    return np.array([drafter.step_budget(b) if budgeted and b else 0 for b in range(max_num_seqs + 1)], dtype=np.int64)


def _grid(drafter: agentspec._AgentSpecBase, max_num_seqs: int) -> np.ndarray:
    return drafter.break_even_grid(max_num_seqs) if drafter.budgeted else np.zeros((1, 1))


class TableDrafting(EngineDrafting):
    """One run's AgentSpec drafts read from the workload's lookup table."""

    replaces_hooks = True

    def __init__(self, drafter: agentspec._AgentSpecBase, run: RunView) -> None:
        self.run = run
        tenants = len(run.drafters)
        per_tenant = len(run.states) // tenants
        tables = self._tables(drafter, per_tenant)
        seqs, k = run.max_num_seqs, drafter.k
        budgeted = bool(drafter.budgeted)
        run.table.reserve_draft_width(max(k, 1))
        # Tenants are copies of the trace, tenant-major (engine/layout.py): row i of tenant t is row i of
        # tenant 0, and its drafter's history holds its own tenant's calls exactly as tenant 0's holds
        # tenant 0's — one table, read at every tenant's rows.
        at = np.tile(tables.at[:per_tenant], tenants)
        self.state = TableSteps(
            DraftSlots.model_free(run), at=at, meta=tables.meta, path=tables.path, pool=tables.pool,
            par=np.array([k, int(budgeted), drafter.ct_min_match, int(drafter.single_ct_only), tenants],
                         dtype=np.int64),
            g_min=np.array([drafter.g_min if budgeted else 0.0]), budget_of=_budget_of(drafter, seqs),
            lookups=np.zeros((seqs, 5), dtype=np.int64), lens=np.zeros(seqs, dtype=np.int64),
            fwork=np.zeros((2, seqs)), iwork=np.zeros((4, seqs), dtype=np.int64), break_even=_grid(drafter, seqs),
            group=np.zeros((2, seqs), dtype=np.int64))
        self._buffered = FastCall(propose_table_buffered, containers=(0, 1))

    def _tables(self, drafter: agentspec._AgentSpecBase, rows: int) -> history_tables.HistoryTables:
        """The lookup table of this run's first `rows` calls (one tenant's; each query's calls up to the first
        one refused), from the disk cache when a run with the same calls and options made it."""
        run = self.run
        states = run.states[:rows]
        calls = [state.call for state in states]
        prompts, outputs, lengths = run.runnable()
        prompts, outputs, lengths = prompts[:rows], outputs[:rows], lengths[:rows]
        cols = run.table.cols
        key = history_tables.table_key(drafter.history, run.tokens_digest, cols["hist_off"][:rows],
                                       cols["prompt_len"][:rows], lengths, calls)
        fresh = drafter.history.empty_copy()
        return history_tables.cached_tables(key, lambda: history_tables.build_tables(
            fresh, calls, prompts, outputs, [s.last_in_query for s in states]))

    def run_state(self) -> TableSteps:
        return self.state

    def propose(self, rows: Sequence[CallState], calls: np.ndarray, max_lens: np.ndarray) -> float:
        m = calls.shape[0]
        ds = self.state.ds
        ds.rows[:m] = calls
        ds.max_lens[:m] = max_lens
        self.run.table.reserve_draft_width(int(ds.par[DS_K_MAX]))
        return float(self._buffered(self.run.table.nt, self.state, m))


class HistoryDrafting(EngineDrafting):
    """One run's AgentSpec drafts from its live history, the compiled steps observing and proposing."""

    observes_steps = True

    def __init__(self, drafter: AgentSpecDrafter, run: RunView) -> None:
        self.drafter, self.run = drafter, run
        run.table.reserve_draft_width(max(drafter.k, 1))
        self.ds = DraftSlots.model_free(run)
        self.state: HistorySteps | None = None
        self._step = FastCall(draft_now, containers=(0, 1, 2, 3))

    def run_state(self) -> HistorySteps:
        """The history's current arrays (a new tuple only when one was replaced: the scheduler's FastCall
        keys on it). Appends the event loop queued (a started call's prompt, a finished call's last tokens)
        are applied first, as the next lookup would."""
        drafter = self.drafter
        history = drafter.history
        if history.queue or history.room:
            history.lookup(())
        arena = history.arena
        current = {"pool": arena.pool, "pv": arena.pv, "bk": arena.bk, "hk": arena.hk, "hv": arena.hv,
                   "tail_lin": history.tail_lin, "tail_pos": history.tail_pos, "tok_block": history.tok_block,
                   "row_at": history.row_at, "row_lineage": history.row_lineage}
        if self.state is None:
            seqs, k = self.run.max_num_seqs, drafter.k
            budgeted = bool(drafter.budgeted)
            ah = History(
                par=np.array([history.max_n, history.max_candidates, MAX_SCAN, MIN_SUPPORT, k, int(budgeted),
                              drafter.ct_min_match, int(drafter.single_ct_only)], dtype=np.int64),
                g_min=np.array([drafter.g_min if budgeted else 0.0]), budget_of=_budget_of(drafter, seqs),
                used=arena.used, levels=arena.levels, live=arena.live,
                need=np.zeros(arena.bk.shape[0], dtype=np.int64),
                ops=np.zeros((seqs * (k + 3) + 8, 8), dtype=np.int64),
                out=np.zeros((seqs, history.width), dtype=np.int32), meta=np.zeros((seqs, 5), dtype=np.int64),
                lens=np.zeros(seqs, dtype=np.int64), fwork=np.zeros((2, seqs)),
                iwork=np.zeros((4, seqs), dtype=np.int64),
                cands=np.zeros((3, max(history.max_candidates, 1)), dtype=np.int64),
                keys=np.zeros(arena.levels.shape[0], dtype=np.uint64), hooked=np.zeros(seqs, dtype=np.int8),
                break_even=_grid(drafter, seqs), **current)
            self.state = HistorySteps(self.ds, ah)
        else:
            ah = refreshed(self.state.ah, current)
            if ah is not self.state.ah:
                if ah.need.shape[0] < arena.bk.shape[0]:  # the arena grew its blocks: their work space too
                    ah = ah._replace(need=np.zeros(arena.bk.shape[0], dtype=np.int64))
                self.state = HistorySteps(self.ds, ah)
        return self.state

    def after_step(self, n_rows: int) -> float | None:
        """The drafter's hooks for the calls that started or finished (in row order), then the compiled
        observe and propose for the rest. Rows of one step are calls of different queries, whose histories
        share no block, so the order between them does not matter; the hooks' appends are applied first, as
        the next lookup would. None when the kernel declined: the other rows are observed by the hooks
        then, and the engine proposes."""
        run = self.run
        sb = run.scheduler.sb
        rows = sb.rows[:n_rows]
        emitted, started, calls = rows["emitted"], rows["started"], rows["call"]
        hooked = (emitted > 0) & ((started != 0) | (run.table.cols["status"][calls] == S_FINISHED))
        states = [run.states[r] for r in calls.tolist()]
        if hooked.any():
            run.drafter_hooks(states, emitted * hooked, started)
        st = self.run_state()
        st.ah.hooked[:n_rows] = hooked
        run.table.reserve_draft_width(int(st.ds.par[DS_K_MAX]))
        seconds = float(self._step(run.table.nt, sb, run.scheduler.pb, st, run.max_model_len))
        st.ah.hooked[:n_rows] = 0
        if seconds < 0.0:
            run.drafter_hooks(states, emitted * ~hooked, started)
            return None
        return seconds


@fast_path_for(agentspec._AgentSpecBase)
def engine_drafting(drafter: agentspec._AgentSpecBase, run: RunView) -> EngineDrafting | None:
    """The table where it is exact for this run (one drafter, a fixed draft length), else the live history's
    compiled steps (`agentspec`, `agentspec-paper`), else None (the drafter's hooks and propose)."""
    if run.spec.num_speculative_tokens <= 0 or not run.fixed_k:
        return None
    # The table replays the history of every call in order: a data-parallel rank's history holds its own calls.
    if run.use_tables and run.sees_every_call and type(drafter) in TABLE_DRAFTERS:
        return TableDrafting(drafter, run)
    if len(run.drafters) == 1 and type(drafter) in HISTORY_DRAFTERS:
        return HistoryDrafting(drafter, run)
    return None
