"""Suffix decoding's fast path (engine/drafting.py): the proposer's step, compiled, after every engine step.

vLLM's V1 runner runs its suffix proposer after every step with a forward pass, emitting or not
(`Simulator._per_step_drafts` is the runner's part). For a step in which every active call, and only
those, emitted — none starts, stops or finishes — the compiled step appends each call's tokens to its
prompt tree and its response to the global tree and the drafting calls speculate, in vLLM's
persistent-batch order, as `SuffixDrafter.propose` applies them (tests/test_engine_fast_paths.py).
With the workload's table of prompt-tree drafts (drafters/suffix/tables.py), calls drafting from it
also start fresh and finish inside the compiled steps (`SuffixDrafter.use_local_table`, `sync`).
Any other step goes to the drafter's `propose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from agentspec_sim.drafters.common import table_cache
from agentspec_sim.drafters.suffix import rule as suffix
from agentspec_sim.drafters.suffix import tables as suffix_tables
from agentspec_sim.drafters.suffix import tree as suffix_tree
from agentspec_sim.drafters.suffix.rule import KERNEL_FINISH, KERNEL_START, SuffixDrafter
from agentspec_sim.drafters.suffix.tree import M_NHWM, OP_STEP, OP_TABLE_STEP, SCAP, LocalTable, room, run_ops_into
from agentspec_sim.engine.drafting import (
    DS_K_MAX,
    ENGINE_KERNEL_SOURCES,
    PB_ON,
    S_FINISHED,
    SC_ROWS,
    DraftSlots,
    EngineDrafting,
    FastCall,
    RunView,
    batch_k,
    compiled_step,
    draft_now,
    drafts_from_out,
    fast_path_for,
    kernel,
    proposer_skipped,
    refreshed,
)
from agentspec_sim.host.kernel_cache import clear_if_changed

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

clear_if_changed(__file__, [suffix.__file__, suffix_tree.__file__, *ENGINE_KERNEL_SOURCES])

# Forest.par fields.
SX_DEPTH, SX_K, SX_GLOBAL_ROOT, SX_EVENT_LOOP, SX_MAX_CACHED, SX_ON = range(6)


class Forest(NamedTuple):
    """Suffix decoding's state (drafters/suffix/rule.py `SuffixDrafter`: its `SuffixForest` and each engine
    call's trees and activity) as the compiled steps drive it."""

    par: np.ndarray  # int64: [depth, k, global root, 1 while the event loop calls, max cached, compiled runs drive it]
    fpar: np.ndarray  # float32: [max_spec_factor, offset, min_token_prob]
    nd: np.ndarray  # the `SuffixForest` arrays
    gp: np.ndarray
    sq: np.ndarray
    act: np.ndarray
    pool: np.ndarray
    ht: np.ndarray
    meta: np.ndarray
    seq_len: np.ndarray
    row_state: np.ndarray  # SuffixDrafter.row_state / n_active
    n_active: np.ndarray  # int64 [tenants]: each tenant's drafter's active calls
    ops: np.ndarray  # int64 [max_num_seqs, 10] work space: the step's `suffix_tree.run_ops` batch
    out: np.ndarray  # int32 [max_num_seqs, k]
    out_n: np.ndarray  # int32 [max_num_seqs]
    work: np.ndarray  # int32 [3, k]
    local: LocalTable  # the prompt-tree drafts of calls that read them from the workload's table
    score: np.ndarray  # float32 [max_num_seqs] work space
    # With the table, calls start and finish here too (`SuffixDrafter.use_local_table` / `sync`):
    table_at: np.ndarray  # int64 [rows]: each row's first table position
    response_seq: np.ndarray  # int64 [rows]: each row's response sequence (-1: responses not cached)
    kernel_fresh: np.ndarray  # int8 [rows]: the row may be started here (never started before)
    events: np.ndarray  # int64 [., 2]: (KERNEL_START | KERNEL_FINISH, row) made here, for `sync`
    n_events: np.ndarray  # int64 [1]
    n_cached: np.ndarray  # int64 [tenants]: each tenant's cached responses
    marks: np.ndarray  # int64 [max_num_seqs, 2] work space: each op's row and whether it starts / finishes
    # Tenants that are copies (`SuffixDrafter.share_arena`): each tenant's global tree in the one arena, and work
    # space for its ops (a tenant's rows only touch its own trees: its ops run together, in batch order).
    roots: np.ndarray  # int64 [tenants]
    tally: np.ndarray  # int64 [tenants, 2] work space: each tenant's ops and fresh starts in the step
    group: np.ndarray  # int64 [max_num_seqs, 10] work space: one tenant's ops


class SuffixSteps(NamedTuple):
    """The compiled state of a suffix run."""

    ds: DraftSlots
    sx: Forest


@kernel
def _suffix_event(sx, kind, r):
    sx.events[sx.n_events[0], 0] = kind
    sx.events[sx.n_events[0], 1] = r
    sx.n_events[0] += 1


@compiled_step(SuffixSteps, every_step=True)
def suffix_step(c, sb, pb, state, max_model_len):
    """`SuffixDrafter.propose` for the step in `sb`, its rows in vLLM's persistent-batch order (`pb.order`,
    when on); returns the drafting seconds, or −1.0 with nothing changed when the event loop must do it:
    a compiled run while the drafter holds queued work (par[SX_ON] = 0), the V1 runner's proposer skip, a
    call that starts, stops (active, not in the batch), finishes or reached max_model_len, or no room in
    the forest. Called by the event loop (par[SX_EVENT_LOOP]), the drafter has started the calls that
    start, and a call that finishes has its tokens appended and drafts nothing (`SuffixDrafter.finish_rows`
    follows). Inside a run, a call drafting from the workload's table (`Forest.table_at`) that starts
    fresh — its first tokens, never started before, no cached response to evict — or finishes is started
    or finished here: a start only opens its response (made up front), so doing it before the rows ahead
    of it changes nothing they see (as `SuffixDrafter.start_fresh`); a finish follows its row's tokens;
    both are logged for `SuffixDrafter.sync`."""
    dr, sx = state.ds, state.sx
    n = sb.sc[SC_ROWS]
    event_loop = sx.par[SX_EVENT_LOOP] != 0
    if not event_loop and sx.par[SX_ON] == 0:
        return -1.0
    if proposer_skipped(sb, dr, max_model_len):
        return -1.0
    depth = sx.par[SX_DEPTH]
    k = batch_k(sb, dr)
    # The step's OP_STEP batch, in batch-row order, built in work space only (ops, dr.rows): a row the
    # kernel cannot do returns before anything changes.
    ops = sx.ops
    need = 0
    m = 0
    nops = 0
    tenants = sx.roots.shape[0]
    sx.tally[:, :] = 0
    max_cached = sx.par[SX_MAX_CACHED]
    for row in range(n):
        i = pb.order[row] if pb.par[PB_ON] else row
        e = sb.rows.emitted[i]
        if e == 0:
            continue
        r = sb.rows.call[i]
        t = c.calls.tenant[r] if tenants > 1 else 0
        flags = 0
        if r < sx.row_state.shape[0] and sx.row_state[r, 3] == 1 and (event_loop or not sb.rows.started[i]):
            local, glob, tabled = sx.row_state[r, 1], sx.row_state[r, 2], sx.row_state[r, 4]
        elif (not event_loop and sb.rows.started[i] and r < sx.kernel_fresh.shape[0] and sx.kernel_fresh[r]
              and (max_cached == 0 or sx.n_cached[t] + sx.tally[t, 1] < max_cached)):
            local, glob, tabled = -1, sx.response_seq[r], sx.table_at[r]
            flags = 1
            sx.tally[t, 1] += 1
        else:
            return -1.0
        sx.tally[t, 0] += 1
        if c.calls.status[r] == S_FINISHED and not event_loop:
            if tabled < 0:  # its own prompt tree: the drafter keeps or frees it
                return -1.0
            flags |= 2
        end = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        if end >= max_model_len:
            return -1.0
        sx.marks[nops, 0] = r
        sx.marks[nops, 1] = flags
        if ((tabled < 0 and sx.seq_len[local] + e > sx.sq[local, SCAP])
                or (glob >= 0 and sx.seq_len[glob] + e > sx.sq[glob, SCAP])):
            return -1.0
        need += (depth if tabled >= 0 else 2 * depth) * e + 1
        base = c.calls.hist_off[r]
        ctx = min(depth, end)
        if tabled >= 0:  # the prompt tree's draft after num_emitted tokens, from the table
            ops[nops, 0] = OP_TABLE_STEP
            ops[nops, 1] = tabled + c.calls.num_emitted[r]
        else:
            ops[nops, 0] = OP_STEP
            ops[nops, 1] = sx.row_state[r, 0]
        ops[nops, 2] = local
        ops[nops, 3] = glob
        ops[nops, 4] = base + end - e
        ops[nops, 5] = e
        ops[nops, 6] = base + end - ctx
        ops[nops, 7] = ctx
        ops[nops, 8] = 0
        ops[nops, 9] = -1
        limit = min(k, max_model_len - end - 1)  # the V1 runner's suffix budget
        if limit > 0 and c.calls.status[r] != S_FINISHED:
            ops[nops, 8] = min(limit, sx.par[SX_K])
            ops[nops, 9] = m
            dr.rows[m] = r
            m += 1
        nops += 1
    for t in range(tenants):  # every tenant's active calls emitted (none stops) — each drafter's own rule
        if sx.tally[t, 0] != sx.n_active[t] + sx.tally[t, 1]:
            return -1.0
    if not room(sx.nd, sx.ht, sx.meta, need):
        return -1.0
    if nops == 0:
        return 0.0
    for j in range(nops):  # fresh starts: an active call with its (empty) response
        if sx.marks[j, 1] & 1:
            r = sx.marks[j, 0]
            t = c.calls.tenant[r] if tenants > 1 else 0
            sx.row_state[r, 0] = -1
            sx.row_state[r, 1] = -1
            sx.row_state[r, 2] = ops[j, 3]
            sx.row_state[r, 3] = 1
            sx.row_state[r, 4] = sx.table_at[r]
            sx.kernel_fresh[r] = 0
            sx.n_active[t] += 1
            if ops[j, 3] >= 0:
                sx.n_cached[t] += 1
            _suffix_event(sx, KERNEL_START, r)
    for j in range(nops):  # the sequences' lengths as `SuffixForest.reserve` keeps them
        if ops[j, 0] == OP_STEP:
            sx.seq_len[ops[j, 2]] += ops[j, 5]
        if ops[j, 3] >= 0:
            sx.seq_len[ops[j, 3]] += ops[j, 5]
    if tenants == 1:
        run_ops_into(sx.nd, sx.gp, sx.sq, sx.act, sx.pool, sx.ht, sx.meta, sx.roots[0], ops[:nops], c.tokens,
                     sx.fpar[0], sx.fpar[1], sx.fpar[2], sx.out, sx.out_n, 0, 0, sx.work, sx.local, sx.score)
    else:
        for t in range(tenants):  # each tenant's ops in batch order, against its own global tree
            g = 0
            for j in range(nops):
                if c.calls.tenant[sx.marks[j, 0]] == t:
                    for f in range(10):
                        sx.group[g, f] = ops[j, f]
                    g += 1
            if g:
                run_ops_into(sx.nd, sx.gp, sx.sq, sx.act, sx.pool, sx.ht, sx.meta, sx.roots[t], sx.group[:g],
                             c.tokens, sx.fpar[0], sx.fpar[1], sx.fpar[2], sx.out, sx.out_n, 0, 0, sx.work, sx.local,
                             sx.score)
    for j in range(nops):  # finishes (inside a run): no longer active
        if sx.marks[j, 1] & 2:
            r = sx.marks[j, 0]
            sx.row_state[r, 3] = 0
            sx.n_active[c.calls.tenant[r] if tenants > 1 else 0] -= 1
            _suffix_event(sx, KERNEL_FINISH, r)
    drafts_from_out(c, dr.rows, sx.out, sx.out_n, m)
    return dr.draft_s[m]


FOREST_SIZES = "suffix-forest-sizes"  # table_cache notes: the response forest's nodes at a run's end


class SuffixDrafting(EngineDrafting):
    """One run's suffix fast path: the compiled steps' state, and the event loop's compiled step."""

    def __init__(self, drafter: SuffixDrafter, run: RunView) -> None:
        self.drafter, self.run = drafter, run
        # Tenants that are copies: every tenant's drafter in the first's arena (`SuffixDrafter.share_arena`).
        self.drafters: list[SuffixDrafter] = list(run.drafters)  # type: ignore[arg-type]
        tenants = len(self.drafters)
        # Each tenant's active calls and cached responses, which the kernel reads: the drafters' counts are views.
        self.counts = np.zeros((2, tenants), dtype=np.int64)
        self.counts[:, 0] = drafter.n_active[0], drafter.n_cached[0]
        drafter.n_active, drafter.n_cached = self.counts[0, 0:1], self.counts[1, 0:1]
        run.table.reserve_draft_width(max(drafter.k, 1))
        self._size_key: str | None = None
        self._noted_nodes: int | None = None
        if run.use_tables:
            table, at, key = self._table(len(run.states) // tenants, tenants)
            drafter.use_local_table(table, at, run.states, run.table.cols["target_len"][:len(run.states)])
            if tenants > 1:
                drafter.row_tenant = run.table.cols["tenant"][:len(run.states)].copy()
                drafter.peers = self.drafters
                for tenant, other in enumerate(self.drafters[1:], start=1):
                    other.share_arena(drafter, tenant, self.counts)
                key = f"{key}|{tenants} tenants"
            # The response tree ends each run of this workload about as large: a noted size from an earlier
            # run sizes the forest now, instead of doubling it a dozen times on the way (`finish_run`).
            # (Noted for a whole workload's run: a data-parallel rank grows its own share of the forest.)
            self._size_key = key if run.sees_every_call else None
            note = table_cache.read_note(FOREST_SIZES, key) if run.sees_every_call else None
            if note is not None:  # a quarter more: the room each step reserves ahead, and runs' differences
                self._noted_nodes = int(note["nodes"][0])
                drafter.forest.make_room(self._noted_nodes * 5 // 4)
        self.ds = DraftSlots.model_free(run)
        self.state: SuffixSteps | None = None
        self._step = FastCall(draft_now, containers=(0, 1, 2, 3))

    def finish_run(self) -> None:
        """Note the forest's size for the next run of this workload (a sweep's next cell, a capacity search's next
        probe), where it differs from the note by more than a tenth."""
        if self._size_key is None:
            return
        nodes = int(self.drafter.forest.meta[M_NHWM])
        if self._noted_nodes is None or abs(self._noted_nodes - nodes) > nodes // 10:
            table_cache.write_note(FOREST_SIZES, self._size_key, {"nodes": np.array([nodes], dtype=np.int64)})

    def _table(self, n: int, tenants: int) -> tuple[LocalTable, np.ndarray, str]:
        """The prompt-tree drafts of this run's first `n` calls (one tenant's; drafters/suffix/tables.py), each
        table row's first position — one tenant's, read at every tenant's rows (copies, tenant-major:
        engine/layout.py) —, and the table's key; from the disk cache when a run with the same calls, options
        and max_model_len made them."""
        run, drafter = self.run, self.drafter
        prompts, outputs, lengths = run.runnable()
        prompts, outputs, lengths = prompts[:n], outputs[:n], lengths[:n]
        cols = run.table.cols
        options = {"depth": drafter.depth, "k": drafter.k, "factor": drafter.factor, "min_prob": drafter.min_prob,
                   "offset": drafter.offset, "max_model_len": run.max_model_len}
        key = suffix_tables.table_key(options, run.tokens_digest, cols["hist_off"][:n], cols["prompt_len"][:n],
                                      lengths)
        table, at = suffix_tables.cached_local_table(key, lambda: suffix_tables.build_local_table(
            drafter.depth, drafter.k, drafter.factor, drafter.min_prob, run.max_model_len, prompts, outputs))
        return table, np.tile(at[:n], tenants), key

    def run_state(self) -> SuffixSteps:
        """The forest's current arrays (a new tuple only when an array was replaced: the scheduler's FastCall
        keys on it). While the drafter holds queued work (a call's finish seen in a step where the proposer
        was skipped) a compiled run drives nothing (par[SX_ON] = 0): its next `propose` applies it."""
        drafter = self.drafter
        forest = drafter.forest
        current = {"nd": forest.nd, "gp": forest.gp, "sq": forest.sq, "act": forest.act, "pool": forest.pool,
                   "ht": forest.ht, "meta": forest.meta, "seq_len": forest.seq_len, "row_state": drafter.row_state}
        if self.state is None:
            seqs, k = self.run.max_num_seqs, max(drafter.k, 1)
            tenants = len(self.drafters)
            sx = Forest(
                par=np.array([drafter.depth, drafter.k, drafter.global_root, 0, drafter.max_cached, 0], dtype=np.int64),
                fpar=np.array([drafter.factor, drafter.offset, drafter.min_prob], dtype=np.float32),
                n_active=self.counts[0], ops=np.zeros((seqs, 10), dtype=np.int64),
                out=np.zeros((seqs, k), dtype=np.int32), out_n=np.zeros(seqs, dtype=np.int32),
                work=np.zeros((3, k), dtype=np.int32), local=forest.local_table,
                score=np.zeros(seqs, dtype=np.float32),
                table_at=drafter.table_at if drafter.table_at is not None else np.zeros(1, dtype=np.int64),
                response_seq=drafter.response_seq, kernel_fresh=drafter.kernel_fresh, events=drafter.events,
                n_events=drafter.n_events, n_cached=self.counts[1], marks=np.zeros((seqs, 2), dtype=np.int64),
                roots=np.array([d.global_root for d in self.drafters], dtype=np.int64),
                tally=np.zeros((tenants, 2), dtype=np.int64), group=np.zeros((seqs, 10), dtype=np.int64), **current)
            self.state = SuffixSteps(self.ds, sx)
        elif (sx := refreshed(self.state.sx, current)) is not self.state.sx:
            self.state = SuffixSteps(self.ds, sx)
        self.state.sx.par[SX_ON] = 0 if any(d.queue or d.touched for d in self.drafters) else 1
        return self.state

    def sync(self) -> None:
        self.drafter.sync()  # the starts and finishes the compiled steps made

    def per_step_drafts(self, rows: Sequence[CallState], calls: np.ndarray, emitted: np.ndarray,
                        num_tokens: np.ndarray) -> float | None:
        """The compiled kernel doing the rows' appends and drafts (`SuffixDrafter.start_fresh`, `suffix_step`,
        `SuffixDrafter.finish_rows`): the drafting seconds, or None when the step needs the drafter's own
        `propose` (a stop, a restart, an eviction, a call at max_model_len), before anything changed or,
        should the kernel decline, after the fresh starts."""
        drafter, run, drafters = self.drafter, self.run, self.drafters
        emitting = emitted.nonzero()[0]
        if (num_tokens[emitting] >= run.max_model_len).any():
            return None
        fresh = [state for state in (rows[i] for i in emitting.tolist())
                 if state.drafter_state is None or not state.drafter_state.active]
        # An active call did not emit: it stops.
        if sum(len(d.active) for d in drafters) + len(fresh) != emitting.shape[0]:
            return None
        if fresh:
            by_tenant = _by_tenant(fresh, len(drafters))
            if not all(drafters[t].can_start_fresh(states) for t, states in by_tenant.items()):
                return None
            for t, states in by_tenant.items():
                drafters[t].start_fresh(states)
        drafter.make_step_room(calls[emitting], emitted[emitting])
        st = self.run_state()
        run.table.reserve_draft_width(int(st.ds.par[DS_K_MAX]))
        st.sx.par[SX_EVENT_LOOP] = 1
        try:
            seconds = float(self._step(run.table.nt, run.scheduler.sb, run.scheduler.pb, st, run.max_model_len))
        finally:
            st.sx.par[SX_EVENT_LOOP] = 0
        if seconds < 0.0:
            return None
        finished = emitting[run.table.cols["status"][calls[emitting]] == S_FINISHED]
        if finished.shape[0]:
            for t, states in _by_tenant([rows[i] for i in finished.tolist()], len(drafters)).items():
                drafters[t].finish_rows(states)
        return seconds


def _by_tenant(states: Sequence[CallState], tenants: int) -> dict[int, list[CallState]]:
    """`states` by tenant, each tenant's in their order."""
    if tenants == 1:
        return {0: list(states)}
    out: dict[int, list[CallState]] = {}
    for state in states:
        out.setdefault(state.tenant, []).append(state)
    return out


@fast_path_for(SuffixDrafter)
def engine_drafting(drafter: SuffixDrafter, run: RunView) -> SuffixDrafting | None:
    """The fast path of exactly `suffix` with a fixed k, with one drafter or (with the workload's table) one per
    tenant in one arena (else its own `propose` every step)."""
    if (type(drafter) is not SuffixDrafter or run.spec.num_speculative_tokens <= 0 or not run.fixed_k
            or (len(run.drafters) > 1 and not run.use_tables)):
        return None
    return SuffixDrafting(drafter, run)
