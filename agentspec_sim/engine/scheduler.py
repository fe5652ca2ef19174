"""One vLLM V1 engine step: `schedule()` then `update_from_output()` (vLLM 0.33 `v1/core/sched/scheduler.py`,
synchronous scheduling, FCFS, chunked prefill, as the V1 runner with a CPU n-gram proposer runs it).

schedule():
1. Running requests, in running order (= admission order), while the token budget lasts: each asks
   for num_tokens + len(drafts) − num_computed tokens (a decode: 1 + its drafts; a prefill: the
   rest of its prompt), clipped by the remaining budget and by max_model_len − num_computed − 1; the
   tail of a draft that does not fit is dropped. If the KV cache cannot give the slots, the *last*
   running request is preempted (recompute: its blocks are freed, it goes to the front of the
   waiting queue with num_computed = 0 and its emitted tokens kept) until it can; if the request
   itself was the victim, scheduling of running requests stops.
2. Only if nothing was preempted this step: waiting requests FCFS while budget remains and fewer
   than max_num_seqs run. A request with nothing computed looks up the prefix cache (hit ≤
   num_tokens − 1, whole blocks); it is admitted only if its whole sequence fits in free KV, with a
   chunk of whatever budget is left; the first one that does not fit stops admission (head of line).
update_from_output(): greedy verification against the recording (see `verify`), then each request
rolls num_computed back by its rejected drafts, as vLLM does. Finished requests leave the running
list and free their KV blocks (their full blocks stay cached).

The two halves are compiled functions over the engine's arrays (`schedule_step`, `update_step`),
and so is the KV manager they call (kv.py). Verification is decided when drafts are handed to the
scheduler (`Scheduler.set_drafts` runs `verify` on each draft against the recording; a draft the
token budget truncates accepts the same prefix, cut to its scheduled length), so `update_step`
only applies it and checks that the accepted tokens are the recording's (the lossless check).
`Scheduler.schedule()` / `update_from_output()` run one step for Python callers;
`Scheduler.run()` runs `run_steps`: the same two functions back to back, step after step, until
something needs the event loop (a drafter to see the tokens, a query's next call that does not
arrive at once, a full log buffer). It is the one rule applied repeatedly, not a second scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from agentspec_sim.cost import roofline
from agentspec_sim.cost.break_even import break_even_at
from agentspec_sim.cost.roofline import draft_seconds
from agentspec_sim.drafters import agentspec, block_index, model_based, ngram_v2, suffix, suffix_tree
from agentspec_sim.drafters.agentspec import capped_lengths
from agentspec_sim.drafters.block_index import BCAP as BA_CAP
from agentspec_sim.drafters.block_index import BLEN as BA_LEN
from agentspec_sim.drafters.block_index import OP_APPEND as BA_APPEND
from agentspec_sim.drafters.block_index import OP_LOOKUP as BA_LOOKUP
from agentspec_sim.drafters.block_index import run_ops_into as ba_run_ops
from agentspec_sim.drafters.model_based import draft_from_tables
from agentspec_sim.drafters.suffix import KERNEL_FINISH as SX_FINISH
from agentspec_sim.drafters.suffix import KERNEL_START as SX_START
from agentspec_sim.drafters.suffix_tree import OP_STEP as ST_OP_STEP
from agentspec_sim.drafters.suffix_tree import OP_TABLE_STEP as ST_OP_TABLE_STEP
from agentspec_sim.drafters.suffix_tree import SCAP as ST_SCAP
from agentspec_sim.drafters.suffix_tree import LocalTable
from agentspec_sim.drafters.suffix_tree import room as st_room
from agentspec_sim.drafters.suffix_tree import run_ops_into as st_run_ops
from agentspec_sim.engine import batched, kv
from agentspec_sim.engine.batched import _ngram_rows_indexed, ngram_v2_rows_indexed
from agentspec_sim.engine.fastcall import FastCall
from agentspec_sim.engine.kv import KVCacheManager, allocate_slots, free_call, kernel, lookup
from agentspec_sim.engine.request import NOT_CHAINED, S_FINISHED, S_RUNNING, S_WAITING, CallState, CallTable, zeros
from agentspec_sim.kernel_cache import clear_if_changed

_EMPTY = np.zeros(0, dtype=np.int32)
# This module's kernels compile in kv.py's and batched.py's (and so in ngram_v2.py's).
clear_if_changed(__file__, [kv.__file__, batched.__file__, ngram_v2.__file__, model_based.__file__, roofline.__file__,
                            agentspec.__file__, block_index.__file__, suffix_tree.__file__, suffix.__file__])

# Why requests were left waiting (ScheduledBatch.bound): nobody waiting, max_num_seqs, KV (no room or a
# preemption), token budget spent.
B_NONE, B_SEQS, B_KV, B_TOKENS = 0, 1, 2, 3
BOUNDS = (None, "seqs", "kv", "tokens")
# What `run_steps` stopped on.
RUN_MAX, RUN_IDLE, RUN_EMPTY, RUN_FULL, RUN_STOPPED, RUN_LOSSLESS = range(6)
# Event kinds in the log's event buffer (a run's effects the event loop still has to time).
EV_FIRST, EV_FINISH, EV_ARRIVE, EV_PREEMPT = 0, 1, 2, 3


class SimulationError(RuntimeError):
    """The run cannot go on (a call that can never fit, a broken invariant); says which and why."""


@kernel
def verify(drafts, output, position, target_len):
    """(accepted, emitted) for a greedy verification of `drafts` at `position` of the recorded output.

    accepted = the longest prefix of the drafts equal to the recording from `position`; drafts
    past the end of the call's output (`target_len`) can never be accepted. emitted = accepted + 1
    (the target's own next token: the bonus when every draft matched), except when the accepted
    drafts already end the output.
    """
    remaining = target_len - position
    m = min(drafts.shape[0], remaining)
    accepted = 0
    while accepted < m and drafts[accepted] == output[position + accepted]:
        accepted += 1
    return accepted, min(accepted + 1, remaining)


class Queues(NamedTuple):
    running: np.ndarray  # int64 [max_num_seqs]: call rows in running order
    waiting: np.ndarray  # int64 ring buffer of call rows
    q: np.ndarray  # int64: [running, waiting head, waiting count, preemptions]


# One step's batch row (in batch order) and outcome, written by `schedule_step` / `update_step`.
ROW = np.dtype([
    ("call", np.int64), ("n", np.int64),  # table row; tokens scheduled (query length)
    ("context", np.int64), ("decode", np.bool_),  # num_computed before the step; past its prefill (verifies)
    ("position", np.int64), ("spec", np.int64),  # tokens emitted before the step; drafts scheduled (truncated)
    ("slot", np.int64),  # the call's block-table slot (its drafts are in slot_drafts[slot])
    ("accepted", np.int64), ("emitted", np.int64), ("started", np.bool_),  # started: emitted its first token
], align=True)
# Calls the step preempted, finished, or that sampled a token and go on (candidates for drafting).
LISTS = np.dtype([("preempted", np.int64), ("finished", np.int64), ("sampled", np.int64)], align=True)


class StepBuf(NamedTuple):
    rows: np.ndarray  # [max_num_seqs] ROW
    lists: np.ndarray  # [max_num_seqs] LISTS
    hits: np.ndarray  # prefix-cache lookup work space
    sc: np.ndarray  # int64: [rows, preempted, bound, finished, sampled, bad row, top]
    # top: max over the batch of num_computed + num_scheduled (the V1 runner's proposer-skip test)


# InlineDrafts.par fields; IN_RULE: vLLM V1's n-gram proposer (`ngram`), Model Runner V2's (`ngram-v2`), a
# model-based drafter's acceptance draw (`eagle3`, `mtp`), AgentSpec's block histories (`InlineHistory`),
# suffix decoding's trees (`InlineSuffix`), or AgentSpec's lookups read from the workload's table (`TableDrafts`).
IN_ON, IN_MIN_N, IN_MAX_N, IN_K_MAX, IN_SKIP_UNFIT, IN_RULE, IN_NGRAM_TABLE = range(7)
RULE_V1, RULE_V2, RULE_MODEL, RULE_HISTORY, RULE_SUFFIX, RULE_TABLE = 0, 1, 2, 3, 4, 5
# TableDrafts.par fields.
TB_K, TB_BUDGETED, TB_CT_MIN, TB_SINGLE_CT = range(4)


class TableDrafts(NamedTuple):
    """AgentSpec's lookups of every call, made once for the workload (drafters/history_tables.py
    `HistoryTables`), and the work space `propose_table_rows` drafts from them with."""

    at: np.ndarray  # int64 [table rows]: the row's first position (its lookup before output token 0)
    meta: np.ndarray  # int32 [positions, 5]: n, c, |CT*|, |P|, match length
    path: np.ndarray  # int64 [positions]: where P starts in `pool`
    pool: np.ndarray  # int32
    par: np.ndarray  # int64: [k, budgeted, ct_min_match, single_ct_only]
    g_min: np.ndarray  # float64 [1]
    budget_of: np.ndarray  # int64 [max_num_seqs + 1]: B_t for that many drafting calls
    lookups: np.ndarray  # int64 [max_num_seqs, 5] work space: the drafting calls' meta rows
    lens: np.ndarray  # int64 [max_num_seqs]: their draft lengths
    fwork: np.ndarray  # float64 [2, max_num_seqs]: the budget's work space (`capped_lengths`)
    iwork: np.ndarray  # int64 [4, max_num_seqs]
    break_even: np.ndarray  # float64: the drafter's τ grid (cost/break_even.py); [1, 1] when drafting ignores τ

    @classmethod
    def off(cls) -> TableDrafts:
        one = np.zeros(1, dtype=np.int64)
        return cls(one, np.zeros((1, 5), dtype=np.int32), one, np.zeros(1, dtype=np.int32), np.zeros(4, dtype=np.int64),
                   np.zeros(1), one, np.zeros((1, 5), dtype=np.int64), one, np.zeros((2, 1)),
                   np.zeros((4, 1), dtype=np.int64), np.zeros((1, 1)))


class InlineDrafts(NamedTuple):
    """What `run_steps` needs to draft itself between two steps of a run (`propose_inline`) instead of
    stopping after every step for the event loop to do it.

    It is the engine's proposal (`Simulator._propose`) moved inside the compiled loop: the same rule,
    the same per-call draft limits, the same V1 proposer skip near max_model_len, the same verification;
    tests/test_engine_fast_paths.py checks runs drafted inline against one step per event. For the
    n-gram proposers: the workload's table of matches (par[IN_NGRAM_TABLE], drafters/ngram_tables.py), else
    `engine/batched.py`'s index for `ngram`, `NgramV2Drafter.propose` for `ngram-v2`;
    for `eagle3`/`mtp`: `ModelBasedDrafter.propose` from its `AcceptanceTables`, priced by the cost model's
    `draft_seconds`. Off (par[IN_ON] = 0) for every other drafter.
    """

    par: np.ndarray  # int64: [on, min_n, max_n, k_max (num_speculative_tokens), V1 proposer skip, rule,
    #                 n-gram drafts from `ngram_at`/`ngram_match` instead of the index]
    k_of_batch: np.ndarray  # int64 [max_num_seqs + 1]: draft length allowed at that many scheduled calls
    draft_s: np.ndarray  # float64 [max_num_seqs + 1]: n-gram drafting seconds for that many drafting calls
    entries: np.ndarray  # the `NgramIndex` tables (engine/batched.py)
    regions: np.ndarray
    counts: np.ndarray
    rows: np.ndarray  # int64 [max_num_seqs] work space: drafting calls' table rows,
    starts: np.ndarray  # their history offsets,
    lengths: np.ndarray  # history lengths,
    max_lens: np.ndarray  # draft limits,
    drafts: np.ndarray  # int64 [2, max_num_seqs]: and drafts (start in the arena, length)
    copy_at: np.ndarray  # `AcceptanceTables` (drafters/model_based.py), per table row
    copy: np.ndarray
    code_at: np.ndarray
    code: np.ndarray
    keys: np.ndarray
    a: np.ndarray
    coef: np.ndarray
    pass_s: np.ndarray  # float64 [max_num_seqs + 1]: one draft-network pass over that many rows
    draft_terms: np.ndarray  # float64: the rest of `draft_seconds`' terms (cost/roofline.py)
    tables: TableDrafts  # AgentSpec's lookup table (RULE_TABLE)
    ngram_at: np.ndarray  # int64 per call row: its first position in ngram_match (drafters/ngram_tables.py)
    ngram_match: np.ndarray  # int64 per position: where the n-gram draft starts in the arena, −1: none

    @classmethod
    def off(cls) -> InlineDrafts:
        one = np.zeros(1, dtype=np.int64)
        byte = np.zeros(1, dtype=np.int8)
        return cls(np.zeros(7, dtype=np.int64), one, np.zeros(1), np.zeros((1, 3), dtype=np.int64),
                   np.zeros((1, 2), dtype=np.int64), np.zeros(3, dtype=np.int64), one, one, one, one,
                   np.zeros((2, 1), dtype=np.int64), one, byte, one, byte, np.zeros(1, dtype=np.uint64),
                   np.zeros(1), np.zeros(2), np.zeros(1), np.ones(4), TableDrafts.off(), one, one)


# InlineHistory.par fields.
AH_MAX_N, AH_MAX_CAND, AH_MAX_SCAN, AH_MIN_SUPPORT, AH_K, AH_BUDGETED, AH_CT_MIN, AH_SINGLE_CT = range(8)


class InlineHistory(NamedTuple):
    """AgentSpec's history (drafters/agentspec.py `History`: the block arena, each block's last segment,
    each engine call's output tokens' blocks) as `run_steps` drafts from it between two steps
    (`propose_history_inline`): the drafter's observe (each emitted run of one block appended to it,
    continuing its last segment or as a new one with its lead-in) and propose (lookups, the budget,
    the caps) for a step in which no call started or finished; any other step goes to the event loop.
    """

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

    @classmethod
    def off(cls) -> InlineHistory:
        one = np.zeros(1, dtype=np.int64)
        return cls(np.zeros(8, dtype=np.int64), np.zeros(1), one, np.zeros(1, dtype=np.int32),
                   np.zeros((1, 1), dtype=np.int32), np.zeros((1, 5), dtype=np.int64), np.zeros(1, dtype=np.uint64),
                   np.zeros(1, dtype=np.int32), one, one, np.zeros(2, dtype=np.int64), one, one, one, one, one, one,
                   np.zeros((1, 8), dtype=np.int64), np.zeros((1, 1), dtype=np.int32), np.zeros((1, 5), dtype=np.int64),
                   one, np.zeros((2, 1)), np.zeros((4, 1), dtype=np.int64), np.zeros((3, 1), dtype=np.int64),
                   np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.int8), np.zeros((1, 1)))


# InlineSuffix.par fields.
SX_DEPTH, SX_K, SX_GLOBAL_ROOT, SX_EVENT_LOOP, SX_MAX_CACHED = range(5)


class InlineSuffix(NamedTuple):
    """Suffix decoding's state (drafters/suffix.py `SuffixDrafter`: its `SuffixForest` and each engine
    call's trees and activity) as `run_steps` drives it between two steps (`propose_suffix_inline`): for a
    step in which every active call, and only those, emitted — none starts, stops or finishes — each call's
    tokens go into its prompt tree and its response in the global tree and the drafting calls speculate,
    in batch order, as `SuffixDrafter.propose` applies them; any other step goes to the event loop.
    """

    par: np.ndarray  # int64: [depth, k, global root, 1 while the event loop calls (`Scheduler.suffix_drafts`)]
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
    n_active: np.ndarray
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
    n_cached: np.ndarray  # int64 [1]: cached responses
    marks: np.ndarray  # int64 [max_num_seqs, 2] work space: each op's row and whether it starts / finishes

    @classmethod
    def off(cls) -> InlineSuffix:
        one = np.zeros(1, dtype=np.int64)
        return cls(np.zeros(4, dtype=np.int64), np.zeros(3, dtype=np.float32), np.zeros((1, 16), dtype=np.int32),
                   np.zeros((1, 3), dtype=np.int32), np.zeros((1, 5), dtype=np.int64), np.zeros((1, 1), dtype=np.int32),
                   np.zeros(1, dtype=np.int32), np.zeros((1, 2), dtype=np.int64), np.zeros(8, dtype=np.int64), one,
                   np.zeros((1, 5), dtype=np.int64), one, np.zeros((1, 10), dtype=np.int64),
                   np.zeros((1, 1), dtype=np.int32), np.zeros(1, dtype=np.int32), np.zeros((3, 1), dtype=np.int32),
                   LocalTable.empty(), np.zeros(1, dtype=np.float32), one, one, np.zeros(1, dtype=np.int8),
                   np.zeros((1, 2), dtype=np.int64), one, one, np.zeros((1, 2), dtype=np.int64))


class PersistentBatch(NamedTuple):
    """The rows of vLLM's persistent batch (`InputBatch`, v1/worker/gpu_input_batch.py): which row each
    scheduled call occupies, kept from step to step. The suffix proposer walks the batch row by row and
    each row sees the tokens the rows before it added to the shared global tree, so the suffix drafter
    needs this order (`Scheduler.track_batch_rows`); no other drafter depends on it.

    Before every forward pass — also one whose schedule came out empty — vLLM 0.32's
    `GPUModelRunner._update_states` (v1/worker/gpu_model_runner.py; the CPU runner inherits it):
    1. removes from the batch the requests that finished and those not scheduled in this step (preempted,
       or left out by the token budget): `InputBatch.remove_request` makes their rows holes;
    2. adds the scheduled requests the batch does not hold, in `reqs_to_add` order: the step's new requests
       (`scheduled_new_reqs`, first scheduling), then its cached requests not in the batch (running ones
       that sat out the previous step, then resumed ones: `scheduled_cached_reqs` order), each group in
       scheduling order. `add_request` puts each into the smallest hole (`BatchUpdateBuilder.pop_removed`),
       else appends it;
    3. `condense()`: while a hole lies below the last occupied row, the request in that row moves into the
       smallest hole.
    Then `_may_reorder_batch` reorders only for attention backends with a `reorder_batch_threshold` (MLA,
    FlashInfer, mamba-style and some ROCm ones); CPU attention and FlashAttention set none.

    The step buffer lists the scheduled calls running part first (running order), then admissions
    (waiting order), so group 2's order is the step buffer's; a call is new iff no earlier step scheduled
    it. `persistent_batch_update` does the three parts in O(batch) per step.
    """

    par: np.ndarray  # int64: [on, rows held, steps seen]
    call: np.ndarray  # int64 [max_num_seqs]: the call (table row) in each batch row
    seen: np.ndarray  # int64 [table rows]: the last step (par[2]) that scheduled the call, 0: never
    index: np.ndarray  # int64 [table rows]: the call's index in that step's buffer
    order: np.ndarray  # int64 [max_num_seqs]: the step's batch rows — order[k]: step-buffer index of row k
    work: np.ndarray  # int64 [2, max_num_seqs]: holes; calls to add

    @classmethod
    def make(cls, max_num_seqs: int, calls: int) -> PersistentBatch:
        seqs, calls = max(max_num_seqs, 1), max(calls, 1)
        return cls(np.array([1, 0, 0], dtype=np.int64), zeros(seqs, dtype=np.int64), zeros(calls, dtype=np.int64),
                   zeros(calls, dtype=np.int64), zeros(seqs, dtype=np.int64), zeros((2, seqs), dtype=np.int64))

    @classmethod
    def off(cls) -> PersistentBatch:
        off = cls.make(1, 1)
        off.par[0] = 0
        return off

    def grown(self, calls: int) -> PersistentBatch:
        """The same batch with room for `calls` table rows."""
        if calls <= self.seen.shape[0]:
            return self
        seen, index = zeros(2 * calls, dtype=np.int64), zeros(2 * calls, dtype=np.int64)
        seen[:self.seen.shape[0]] = self.seen
        index[:self.index.shape[0]] = self.index
        return self._replace(seen=seen, index=index)


@kernel
def persistent_batch_update(pb, calls):
    """`PersistentBatch`'s three parts for a step that scheduled `calls` (table rows, step-buffer order):
    afterwards the batch holds exactly these calls in rows 0 … len(calls) − 1 and pb.order[k] is the
    step-buffer index of the call in row k."""
    n_old = pb.par[1]
    tick = pb.par[2] + 1
    pb.par[2] = tick
    holes = pb.work[0]
    adds = pb.work[1]
    n = calls.shape[0]
    # The calls to add: the new ones, then the others the batch does not hold (it holds those of the last step).
    n_add = 0
    for i in range(n):
        if pb.seen[calls[i]] == 0:
            adds[n_add] = calls[i]
            n_add += 1
    for i in range(n):
        r = calls[i]
        if pb.seen[r] != 0 and pb.seen[r] != tick - 1:
            adds[n_add] = r
            n_add += 1
        pb.seen[r] = tick
        pb.index[r] = i
    # 1. Rows whose call is not scheduled now become holes (ascending).
    n_holes = 0
    for j in range(n_old):
        if pb.seen[pb.call[j]] != tick:
            holes[n_holes] = j
            n_holes += 1
    # 2. Each added call takes the smallest hole, else a new row at the end.
    h = 0
    top = n_old
    for a in range(n_add):
        if h < n_holes:
            pb.call[holes[h]] = adds[a]
            h += 1
        else:
            pb.call[top] = adds[a]
            top += 1
    # 3. condense(): the last occupied row moves into the smallest hole while that hole lies below it.
    last = top - 1
    hi = n_holes - 1
    while h < n_holes:
        while hi >= h and holes[hi] == last:  # skip holes at the end
            hi -= 1
            last -= 1
        if holes[h] >= last:
            break
        pb.call[holes[h]] = pb.call[last]
        h += 1
        last -= 1
    pb.par[1] = n
    for k in range(n):
        pb.order[k] = pb.index[pb.call[k]]


@kernel
def _preempt(p, c, qu, victim):
    free_call(p, c, victim)
    c.calls.num_computed[victim] = 0
    c.calls.draft_len[victim] = 0
    c.calls.status[victim] = S_WAITING
    c.calls.decoding[victim] = False
    c.calls.preemptions[victim] += 1
    qu.q[3] += 1
    cap = qu.waiting.shape[0]
    qu.q[1] = (qu.q[1] - 1 + cap) % cap  # to the front of the waiting queue
    qu.waiting[qu.q[1]] = victim
    qu.q[2] += 1


@kernel
def _record(sb, i, r, n, context, decode, spec, position, slot):
    sb.rows.call[i] = r
    sb.rows.slot[i] = slot
    sb.rows.n[i] = n
    sb.rows.context[i] = context
    sb.rows.decode[i] = decode
    sb.rows.spec[i] = spec
    sb.rows.position[i] = position


@kernel
def schedule_step(p, c, qu, sb, max_num_batched_tokens, max_num_seqs, max_model_len):
    """Steps 1 and 2 of the module docstring; the batch goes to `sb`, num_computed advances."""
    bs = p.params[0]
    budget = max_num_batched_tokens
    rows = 0
    preempted = 0
    i = 0
    while i < qu.q[0] and budget > 0:
        r = qu.running[i]
        computed = c.calls.num_computed[r]
        num_tokens = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        n = min(num_tokens + c.calls.draft_len[r] - computed, budget, max_model_len - computed - 1)
        if n <= 0:
            i += 1
            continue
        scheduled = True
        while not allocate_slots(p, c, r, n, sb.hits, 0, False):
            qu.q[0] -= 1
            victim = qu.running[qu.q[0]]
            _preempt(p, c, qu, victim)
            sb.lists.preempted[preempted] = victim
            preempted += 1
            if victim == r:
                scheduled = False
                break
        if not scheduled:
            break
        _record(sb, rows, r, n, computed, c.calls.decoding[r], max(0, n + computed - num_tokens),
                c.calls.num_emitted[r], c.calls.slot[r])
        rows += 1
        c.calls.draft_len[r] = 0
        budget -= n
        i += 1

    bound = B_NONE
    if preempted:
        bound = B_KV
    else:
        cap = qu.waiting.shape[0]
        while qu.q[2] > 0:
            if budget <= 0:
                bound = B_TOKENS
                break
            if qu.q[0] >= max_num_seqs:
                bound = B_SEQS
                break
            r = qu.waiting[qu.q[1]]
            nhits = lookup(p, c, r, sb.hits) if c.calls.num_computed[r] == 0 else 0
            computed = c.calls.num_computed[r] + nhits * bs
            n = min(c.calls.prompt_len[r] + c.calls.num_emitted[r] - computed, budget)
            if not allocate_slots(p, c, r, n, sb.hits, nhits, True):
                bound = B_KV
                break
            qu.q[1] = (qu.q[1] + 1) % cap
            qu.q[2] -= 1
            qu.running[qu.q[0]] = r
            qu.q[0] += 1
            c.calls.status[r] = S_RUNNING
            c.calls.num_computed[r] = computed
            c.calls.prefix_hit_tokens[r] += nhits * bs
            c.calls.decoding[r] = False
            _record(sb, rows, r, n, computed, False, 0, c.calls.num_emitted[r], c.calls.slot[r])
            rows += 1
            budget -= n

    top = 0
    for k in range(rows):
        c.calls.num_computed[sb.rows.call[k]] += sb.rows.n[k]
        top = max(top, sb.rows.context[k] + sb.rows.n[k])
    sb.sc[0] = rows
    sb.sc[1] = preempted
    sb.sc[2] = bound
    sb.sc[6] = top


@kernel
def update_step(p, c, qu, sb, step):
    """Emission after the forward pass of the batch in `sb` (see `Scheduler.update_from_output`).

    A row with drafts accepts the first min(draft_acc, drafted) of them (`draft_acc` was set by
    `verify` against the recording) and emits one more token unless that ends the call; a row
    without drafts emits the recording's next token. Returns −1 (and the row in sb.sc[5]) when the
    accepted drafts are not the recording (the lossless check) or were never verified, else 0.
    """
    rows = sb.sc[0]
    finished = 0
    sampled = 0
    for i in range(rows):
        r = sb.rows.call[i]
        sb.rows.started[i] = False
        pos = c.calls.num_emitted[r]
        if c.calls.num_computed[r] < c.calls.prompt_len[r] + pos:
            sb.rows.accepted[i] = 0  # a prefill chunk that did not reach the end of the known tokens samples nothing
            sb.rows.emitted[i] = 0
            continue
        spec = sb.rows.spec[i]
        remaining = c.calls.target_len[r] - pos
        a = 0
        if spec > 0:
            a = min(c.calls.draft_acc[r], spec)
            if a < 0 or a > remaining:
                sb.sc[5] = i
                return -1
            at = c.calls.hist_off[r] + c.calls.prompt_len[r] + pos
            drafts = c.slot_drafts[sb.rows.slot[i]]
            for k in range(a):
                if drafts[k] != c.tokens[at + k]:
                    sb.sc[5] = i
                    return -1
            c.calls.drafted[r] += spec
            c.calls.accepted[r] += a
            c.calls.draft_steps[r] += 1
        e = min(a + 1, remaining)
        c.calls.num_emitted[r] = pos + e
        c.calls.num_computed[r] -= spec - a
        sb.rows.accepted[i] = a
        sb.rows.emitted[i] = e
        if sb.rows.decode[i]:
            c.calls.decode_steps[r] += 1
        if not c.calls.started[r]:
            c.calls.started[r] = True
            c.calls.first_step[r] = step
            sb.rows.started[i] = True
        if pos + e >= c.calls.target_len[r]:
            c.calls.status[r] = S_FINISHED
            sb.lists.finished[finished] = r
            finished += 1
        else:
            c.calls.decoding[r] = True
            sb.lists.sampled[sampled] = r
            sampled += 1
    if finished:
        kept = 0
        for k in range(qu.q[0]):
            r = qu.running[k]
            if c.calls.status[r] != S_FINISHED:
                qu.running[kept] = r
                kept += 1
        qu.q[0] = kept
        for k in range(finished):
            free_call(p, c, sb.lists.finished[k])
    sb.sc[3] = finished
    sb.sc[4] = sampled
    return 0


@kernel
def _event(lg, kind, r, step):
    k = lg.ctr[2]
    lg.events.kind[k] = kind
    lg.events.call[k] = r
    lg.events.step[k] = step
    lg.ctr[2] = k + 1


@kernel
def log_step(lg, c, sb, running, waiting, free_blocks):
    """Append the step in `sb` (scheduled and updated) to the log; returns its step index.

    `running` / `waiting`: the queues after scheduling; `free_blocks`: after the update.
    """
    rows = sb.sc[0]
    base = lg.ctr[0]
    tokens = 0
    decode = 0
    drafted = 0
    accepted = 0
    for i in range(rows):
        lg.rows.call[base + i] = sb.rows.call[i]
        lg.rows.decode[base + i] = sb.rows.decode[i]
        lg.rows.position[base + i] = sb.rows.position[i]
        lg.rows.context_len[base + i] = sb.rows.context[i]
        lg.rows.scheduled[base + i] = sb.rows.n[i]
        lg.rows.drafted[base + i] = sb.rows.spec[i]
        lg.rows.accepted[base + i] = sb.rows.accepted[i]
        lg.rows.emitted[base + i] = sb.rows.emitted[i]
        if sb.rows.spec[i]:
            t = lg.ctr[3]
            for k in range(sb.rows.spec[i]):
                lg.draft_tokens[t + k] = c.slot_drafts[sb.rows.slot[i], k]
            lg.ctr[3] = t + sb.rows.spec[i]
        tokens += sb.rows.n[i]
        decode += sb.rows.decode[i]
        drafted += sb.rows.spec[i]
        accepted += sb.rows.accepted[i]
    lg.ctr[0] = base + rows
    k = lg.ctr[1]
    lg.steps.batch_size[k] = rows
    lg.steps.scheduled_tokens[k] = tokens
    lg.steps.decode_calls[k] = decode
    lg.steps.running[k] = running
    lg.steps.waiting[k] = waiting
    lg.steps.bound[k] = sb.sc[2]
    lg.steps.D[k] = drafted
    lg.steps.acc[k] = accepted
    lg.steps.free_blocks[k] = free_blocks
    lg.ctr[1] = k + 1
    return k


@kernel
def _verify_drafts(c, r, slot, n):
    """Call r's next drafts are slot_drafts[slot, :n]: record them and how many the recording accepts."""
    accepted = 0
    if n:
        out = c.calls.hist_off[r] + c.calls.prompt_len[r]
        accepted, _ = verify(c.slot_drafts[slot, :n], c.tokens[out:out + c.calls.target_len[r]],
                             c.calls.num_emitted[r], c.calls.target_len[r])
    c.calls.draft_len[r] = n
    c.calls.draft_acc[r] = accepted


@kernel
def drafts_from(c, rows, source, starts, lengths):
    """Set the drafts of calls rows[i] to source[starts[i]:starts[i] + lengths[i]] (the token arena, where
    the n-gram proposer's drafts lie, or the proposals laid end to end) and verify them against the
    recording (`Scheduler.set_drafts`)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        n = lengths[i]
        slot = c.calls.slot[r]
        for k in range(n):
            c.slot_drafts[slot, k] = source[starts[i] + k]
        _verify_drafts(c, r, slot, n)


@kernel
def drafts_from_rows(c, buf, source, m):
    """`drafts_from` for the first m columns of `buf` (rows: table rows, draft starts, draft lengths)."""
    drafts_from(c, buf[0, :m], source, buf[1, :m], buf[2, :m])


@kernel
def _proposer_skipped(sb, dr, max_model_len):
    """vLLM's V1 runner does not run the proposer for the batch in `sb` (`_input_fits_in_drafter` fails:
    some call's num_computed + num_scheduled + k exceeds max_model_len), for drafters that follow it."""
    return dr.par[IN_SKIP_UNFIT] != 0 and sb.sc[0] > 0 and sb.sc[6] + dr.par[IN_K_MAX] > max_model_len


@kernel
def _batch_k(sb, dr):
    """The draft length the policy allows at the batch size of the step in `sb` (`InlineDrafts.k_of_batch`)."""
    return dr.k_of_batch[min(sb.sc[0], dr.k_of_batch.shape[0] - 1)]


@kernel
def propose_inline(c, sb, dr, max_model_len):
    """Drafts for the calls that sampled in the step in `sb`, as `Simulator._propose` makes them; returns
    the drafting seconds, or −1.0 when the n-gram index needs room (then nothing is set: the event loop
    proposes, growing the index)."""
    n_sampled = sb.sc[4]
    k_max = dr.par[IN_K_MAX]
    if _proposer_skipped(sb, dr, max_model_len):  # k token-0 drafts each
        for j in range(n_sampled):
            r = sb.lists.sampled[j]
            slot = c.calls.slot[r]
            for k in range(k_max):
                c.slot_drafts[slot, k] = 0
            _verify_drafts(c, r, slot, k_max)
        return 0.0
    k = _batch_k(sb, dr)
    m = 0
    for j in range(n_sampled):
        r = sb.lists.sampled[j]
        length = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        limit = min(k, max_model_len - length)  # the V1 proposer drafts ≤ max_model_len − num_tokens
        if limit > 0:
            dr.rows[m] = r
            dr.starts[m] = c.calls.hist_off[r]
            dr.lengths[m] = length
            dr.max_lens[m] = limit
            m += 1
    if m == 0:
        return 0.0
    if dr.par[IN_RULE] == RULE_MODEL:
        return propose_model_rows(c, dr.rows[:m], dr.max_lens[:m], dr)
    if dr.par[IN_RULE] == RULE_TABLE:
        return propose_table_rows(c, dr.rows[:m], dr.max_lens[:m], dr)
    if dr.par[IN_NGRAM_TABLE]:
        ngram_table_drafts(c, dr.rows[:m], dr.starts[:m], dr.lengths[:m], dr.max_lens[:m], dr.ngram_at,
                           dr.ngram_match, dr.par[IN_RULE] == RULE_V2, dr.drafts[:, :m])
        return dr.draft_s[m]
    if dr.par[IN_RULE] == RULE_V2:
        if ngram_v2_rows_indexed(c.tokens, dr.starts[:m], dr.lengths[:m], dr.par[IN_MIN_N], dr.par[IN_MAX_N],
                                 dr.drafts[0, :m], dr.entries, dr.regions, dr.counts, 0) < m:
            return -1.0
        drafts_padded(c, dr.rows[:m], dr.drafts[0, :m], dr.max_lens[:m])
        return dr.draft_s[m]
    if _ngram_rows_indexed(c.tokens, dr.starts[:m], dr.lengths[:m], dr.max_lens[:m], dr.par[IN_MIN_N],
                           dr.par[IN_MAX_N], dr.drafts[:, :m], dr.entries, dr.regions, dr.counts, 0) < m:
        return -1.0
    drafts_from(c, dr.rows[:m], c.tokens, dr.drafts[0, :m], dr.drafts[1, :m])
    return dr.draft_s[m]


@kernel
def ngram_table_drafts(c, rows, starts, lengths, max_lens, at, match, rightmost, work):
    """The n-gram proposers' drafts of calls rows[i] (histories tokens[starts[i]:starts[i] + lengths[i]],
    draft limits max_lens[i]) from the workload's table (drafters/ngram_tables.py), set and verified as
    the index's: `ngram-v2` padded (`drafts_padded`), `ngram` the arena stretch after the match (`drafts_from`)."""
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


@kernel
def propose_model_rows(c, rows, lengths, dr):
    """A model-based drafter's drafts of calls rows[i], lengths[i] tokens each, from `dr`'s
    `AcceptanceTables` (`draft_from_tables`), verified as `drafts_from`; returns the draft network's
    seconds for them (`draft_seconds`: max(lengths) passes over the rows and their contexts)."""
    k_max = 0
    ctx = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        k = lengths[i]
        slot = c.calls.slot[r]
        n = c.calls.num_emitted[r]
        target = c.calls.target_len[r]
        out = c.calls.hist_off[r] + c.calls.prompt_len[r]
        at = dr.copy_at[r] + n
        code = dr.code[dr.code_at[r] + n] if n < target else 0
        draft_from_tables(c.tokens, out, n, target, k, dr.copy[at:at + max(0, min(k, target - n))], code,
                          dr.keys[r], dr.a, dr.coef, c.slot_drafts[slot])
        _verify_drafts(c, r, slot, k)
        k_max = max(k_max, k)
        ctx += c.calls.prompt_len[r] + n
    m = rows.shape[0]
    if m == 0:
        return 0.0
    t = dr.draft_terms
    return draft_seconds(dr.pass_s[m], t[0], t[1], t[2], t[3], m, k_max, float(ctx))


@kernel
def propose_model_buffered(c, dr, m):
    """`propose_model_rows` of the first m entries of dr's work space (rows, max_lens)."""
    return propose_model_rows(c, dr.rows[:m], dr.max_lens[:m], dr)


@kernel
def propose_table_rows(c, rows, max_lens, dr):
    """AgentSpec's drafts of calls rows[i] (draft limits max_lens[i]) from the workload's lookup table
    (`TableDrafts`), as the drafter's propose makes them from its live history: each call's lookup at its
    position, the budget over these rows and the caps (`capped_lengths`), the draft P[:L], verified as
    `drafts_from`; returns the drafting seconds."""
    tb = dr.tables
    m = rows.shape[0]
    if m == 0:
        return 0.0
    for i in range(m):
        j = tb.at[rows[i]] + c.calls.num_emitted[rows[i]]
        for f in range(5):
            tb.lookups[i, f] = tb.meta[j, f]
    capped_lengths(tb.lookups[:m], max_lens, tb.budget_of[m], tb.g_min[0], tb.par[TB_K], tb.par[TB_BUDGETED] != 0,
                   tb.par[TB_CT_MIN], tb.par[TB_SINGLE_CT] != 0, _step_break_even(c, rows, tb.break_even), tb.lens[:m],
                   tb.fwork, tb.iwork)
    for i in range(m):
        r = rows[i]
        start = tb.path[tb.at[r] + c.calls.num_emitted[r]]
        slot = c.calls.slot[r]
        length = tb.lens[i]
        for t in range(length):
            c.slot_drafts[slot, t] = tb.pool[start + t]
        _verify_drafts(c, r, slot, length)
    return dr.draft_s[m]


@kernel
def _step_break_even(c, rows, grid):
    """τ for a step whose drafting calls are `rows` (their mean context), or −1 when `grid` is off."""
    m = rows.shape[0]
    if grid.shape[0] < 2 or m == 0:
        return -1.0
    ctx = 0
    for i in range(m):
        ctx += c.calls.prompt_len[rows[i]] + c.calls.num_emitted[rows[i]]
    return break_even_at(grid, float(m), ctx / m)


@kernel
def propose_table_buffered(c, dr, m):
    """`propose_table_rows` of the first m entries of dr's work space (rows, max_lens)."""
    return propose_table_rows(c, dr.rows[:m], dr.max_lens[:m], dr)


@kernel
def _run_end(tok_block, at, j, end):
    """The end of the run of equal blocks from output token j (< end) of the call whose blocks start at `at`."""
    b = tok_block[at + j]
    t = j + 1
    while t < end and tok_block[at + t] == b:
        t += 1
    return t


@kernel
def propose_history_inline(c, sb, dr, ah, max_model_len):
    """`Simulator._drafter_hooks` (observe) then `_propose` for AgentSpec's history (`InlineHistory`), for
    the step in `sb`, the rows marked in `ah.hooked` already observed by the event loop; returns the
    drafting seconds, or −1.0 with nothing changed when the event loop must do it: a call that started or
    finished and was not hooked (its Python hooks), the V1 proposer skip, or no room in the arena."""
    n = sb.sc[0]
    if _proposer_skipped(sb, dr, max_model_len):
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
                    if ah.bk[b, BA_LEN] + ah.need[b] > ah.bk[b, BA_CAP]:
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
            ops[nops, 0] = BA_APPEND
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
    k = _batch_k(sb, dr)
    m = 0
    for j in range(sb.sc[4]):
        r = sb.lists.sampled[j]
        length = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        limit = min(k, max_model_len - length)
        if limit > 0:
            dr.rows[m] = r
            dr.max_lens[m] = limit
            cn = min(max_n, length)
            ops[nops, 0] = BA_LOOKUP
            ops[nops, 1] = ah.tok_block[ah.row_at[r] + c.calls.num_emitted[r]]
            ops[nops, 2] = c.calls.hist_off[r] + length - cn
            ops[nops, 3] = cn
            ops[nops, 4] = m
            nops += 1
            m += 1
    ba_run_ops(ah.pool, ah.pv, ah.bk, ah.hk, ah.hv, ah.used, ah.levels, ops[:nops], c.tokens, ah.par[AH_MAX_CAND],
               ah.par[AH_MAX_SCAN], ah.par[AH_MIN_SUPPORT], ah.out[:m], ah.meta[:m], ah.cands, ah.keys)
    ah.live[1] += added
    if m == 0:
        return 0.0
    capped_lengths(ah.meta[:m], dr.max_lens[:m], ah.budget_of[m], ah.g_min[0], ah.par[AH_K], ah.par[AH_BUDGETED] != 0,
                   ah.par[AH_CT_MIN], ah.par[AH_SINGLE_CT] != 0, _step_break_even(c, dr.rows[:m], ah.break_even),
                   ah.lens[:m], ah.fwork, ah.iwork)
    _drafts_from_out(c, dr.rows, ah.out, ah.lens, m)
    return dr.draft_s[m]


@kernel
def _drafts_from_out(c, rows, out, lengths, m):
    """The drafts of calls rows[j], j < m: out[j, :lengths[j]], verified as `drafts_from`."""
    for j in range(m):
        r = rows[j]
        slot = c.calls.slot[r]
        length = lengths[j]
        for t in range(length):
            c.slot_drafts[slot, t] = out[j, t]
        _verify_drafts(c, r, slot, length)


@kernel
def propose_suffix_inline(c, sb, dr, sx, pb, max_model_len):
    """`Simulator._suffix_step` for the step in `sb` from `InlineSuffix`, its rows in vLLM's persistent-batch
    order (`pb.order`, when on); returns the drafting seconds, or
    −1.0 with nothing changed when the event loop must do it: the V1 runner's proposer skip, a call that
    starts, stops (active, not in the batch), finishes or reached max_model_len, or no room in the forest.
    Called by the event loop (par[SX_EVENT_LOOP]), the drafter has started the calls that start, and a
    call that finishes has its tokens appended and drafts nothing (`SuffixDrafter.finish_rows` follows).
    Inside a run, a call drafting from the workload's table (`InlineSuffix.table_at`) that starts fresh —
    its first tokens, never started before, no cached response to evict — or finishes is started or
    finished here: a start only opens its response (made up front), so doing it before the rows ahead of
    it changes nothing they see (as `SuffixDrafter.start_fresh`); a finish follows its row's tokens; both
    are logged for `SuffixDrafter.sync`."""
    n = sb.sc[0]
    event_loop = sx.par[SX_EVENT_LOOP] != 0
    if _proposer_skipped(sb, dr, max_model_len):
        return -1.0
    depth = sx.par[SX_DEPTH]
    k = _batch_k(sb, dr)
    # The step's OP_STEP batch, in batch-row order, built in work space only (ops, dr.rows): a row the
    # kernel cannot do returns before anything changes.
    ops = sx.ops
    need = 0
    m = 0
    nops = 0
    starts = 0
    max_cached = sx.par[SX_MAX_CACHED]
    for row in range(n):
        i = pb.order[row] if pb.par[0] else row
        e = sb.rows.emitted[i]
        if e == 0:
            continue
        r = sb.rows.call[i]
        flags = 0
        if r < sx.row_state.shape[0] and sx.row_state[r, 3] == 1 and (event_loop or not sb.rows.started[i]):
            local, glob, tabled = sx.row_state[r, 1], sx.row_state[r, 2], sx.row_state[r, 4]
        elif (not event_loop and sb.rows.started[i] and r < sx.kernel_fresh.shape[0] and sx.kernel_fresh[r]
              and (max_cached == 0 or sx.n_cached[0] + starts < max_cached)):
            local, glob, tabled = -1, sx.response_seq[r], sx.table_at[r]
            flags = 1
            starts += 1
        else:
            return -1.0
        if c.calls.status[r] == S_FINISHED and not event_loop:
            if tabled < 0:  # its own prompt tree: the drafter keeps or frees it
                return -1.0
            flags |= 2
        end = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        if end >= max_model_len:
            return -1.0
        sx.marks[nops, 0] = r
        sx.marks[nops, 1] = flags
        if ((tabled < 0 and sx.seq_len[local] + e > sx.sq[local, ST_SCAP])
                or (glob >= 0 and sx.seq_len[glob] + e > sx.sq[glob, ST_SCAP])):
            return -1.0
        need += (depth if tabled >= 0 else 2 * depth) * e + 1
        base = c.calls.hist_off[r]
        ctx = min(depth, end)
        if tabled >= 0:  # the prompt tree's draft after num_emitted tokens, from the table
            ops[nops, 0] = ST_OP_TABLE_STEP
            ops[nops, 1] = tabled + c.calls.num_emitted[r]
        else:
            ops[nops, 0] = ST_OP_STEP
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
    if nops != sx.n_active[0] + starts or not st_room(sx.nd, sx.ht, sx.meta, need):
        return -1.0
    if nops == 0:
        return 0.0
    for j in range(nops):  # fresh starts: an active call with its (empty) response
        if sx.marks[j, 1] & 1:
            r = sx.marks[j, 0]
            sx.row_state[r, 0] = -1
            sx.row_state[r, 1] = -1
            sx.row_state[r, 2] = ops[j, 3]
            sx.row_state[r, 3] = 1
            sx.row_state[r, 4] = sx.table_at[r]
            sx.kernel_fresh[r] = 0
            sx.n_active[0] += 1
            if ops[j, 3] >= 0:
                sx.n_cached[0] += 1
            _suffix_event(sx, SX_START, r)
    for j in range(nops):  # the sequences' lengths as `SuffixForest.reserve` keeps them
        if ops[j, 0] == ST_OP_STEP:
            sx.seq_len[ops[j, 2]] += ops[j, 5]
        if ops[j, 3] >= 0:
            sx.seq_len[ops[j, 3]] += ops[j, 5]
    st_run_ops(sx.nd, sx.gp, sx.sq, sx.act, sx.pool, sx.ht, sx.meta, sx.par[SX_GLOBAL_ROOT], ops[:nops], c.tokens,
               sx.fpar[0], sx.fpar[1], sx.fpar[2], sx.out, sx.out_n, 0, 0, sx.work, sx.local, sx.score)
    for j in range(nops):  # finishes (inside a run): no longer active
        if sx.marks[j, 1] & 2:
            r = sx.marks[j, 0]
            sx.row_state[r, 3] = 0
            sx.n_active[0] -= 1
            _suffix_event(sx, SX_FINISH, r)
    _drafts_from_out(c, dr.rows, sx.out, sx.out_n, m)
    return dr.draft_s[m]


@kernel
def _suffix_event(sx, kind, r):
    sx.events[sx.n_events[0], 0] = kind
    sx.events[sx.n_events[0], 1] = r
    sx.n_events[0] += 1


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
        _verify_drafts(c, r, slot, n)


@kernel
def _log_full(lg, c, max_num_seqs):
    return (lg.rows.shape[0] - lg.ctr[0] < max_num_seqs or lg.steps.shape[0] == lg.ctr[1]
            or lg.events.shape[0] - lg.ctr[2] < 4 * max_num_seqs
            or lg.draft_tokens.shape[0] - lg.ctr[3] < max_num_seqs * c.slot_drafts.shape[1])


@kernel
def run_steps(p, c, qu, sb, lg, max_num_batched_tokens, max_num_seqs, max_model_len, max_steps, step0, chain,
              stop_on_emit, dr, ah, sx, pb):
    """Up to `max_steps` steps, logged to `lg`; returns (steps, why it stopped).

    Stops before a step when nothing can run or the log has no room, and after a step in which a
    call finished whose query's next call does not arrive at once (or `chain` is off: other events
    are pending), or — with `stop_on_emit`, when a drafter must see every token — a call emitted,
    unless the drafter drafts inline (`dr`: `propose_inline` for the n-gram and model-based rules,
    `propose_history_inline` with `ah` for agentspec, `propose_suffix_inline` with `sx` for suffix, which
    is driven after every step, emitting or not) and can do this step: then the run goes on with the
    drafts set, each step's drafting time in the log's `draft_s` (the run's first step gets the event
    loop's); a step it cannot do ends the run. The last step of a run is always left to the event loop.
    A finished call's next call that arrives at once (think time 0, no recorded arrival, a prompt
    that fits) joins the waiting queue here, as the event loop would add it before the next step.
    RUN_LOSSLESS: the update's lossless check failed (the step is not logged; see `update_step`).
    `pb` (when on: suffix runs) follows vLLM's persistent batch through every schedule, empty ones included.
    """
    s = 0
    draft_s = 0.0
    while s < max_steps:
        if qu.q[0] == 0 and qu.q[2] == 0:
            return s, RUN_IDLE
        if _log_full(lg, c, max_num_seqs):
            return s, RUN_FULL
        schedule_step(p, c, qu, sb, max_num_batched_tokens, max_num_seqs, max_model_len)
        rows = sb.sc[0]
        if pb.par[0]:
            persistent_batch_update(pb, sb.rows.call[:rows])
        for j in range(sb.sc[1]):  # victims in preemption order, with the step that runs next
            _event(lg, EV_PREEMPT, sb.lists.preempted[j], step0 + s)
        if rows == 0:
            if sb.sc[1] > 0:
                # The only running calls preempted themselves (vLLM: an empty scheduler output, the
                # model runner returns at once): no step happens; the next schedule re-admits them.
                continue
            return s, RUN_EMPTY
        step = step0 + s
        running, waiting = qu.q[0], qu.q[2]
        if update_step(p, c, qu, sb, step) < 0:
            return s, RUN_LOSSLESS
        log_step(lg, c, sb, running, waiting, p.ctr[0])
        lg.steps.draft_s[lg.ctr[1] - 1] = draft_s
        draft_s = 0.0
        emitted = False
        for i in range(rows):
            if sb.rows.emitted[i]:
                emitted = True
            if sb.rows.started[i]:
                _event(lg, EV_FIRST, sb.rows.call[i], step)
        stop = False
        finished = sb.sc[3]
        if finished:
            at_once = chain
            for j in range(finished):
                if c.calls.chain_next[sb.lists.finished[j]] == NOT_CHAINED:
                    at_once = False
            cap = qu.waiting.shape[0]
            for j in range(finished):
                r = sb.lists.finished[j]
                _event(lg, EV_FINISH, r, step)
                nxt = c.calls.chain_next[r]
                if at_once and nxt >= 0:
                    c.calls.status[nxt] = S_WAITING
                    qu.waiting[(qu.q[1] + qu.q[2]) % cap] = nxt
                    qu.q[2] += 1
                    _event(lg, EV_ARRIVE, nxt, step)
            if not at_once:
                stop = True
        # Suffix decoding runs its proposer after every step, emitting or not (`propose_suffix_inline`).
        if stop_on_emit and (emitted or dr.par[IN_RULE] == RULE_SUFFIX) and not stop:
            # Draft inline only where the loop goes on (room for another step, a call left to step); else the
            # event loop does (it always takes the last step of a run).
            if (dr.par[IN_ON] == 0 or s + 1 >= max_steps or _log_full(lg, c, max_num_seqs)
                    or (qu.q[0] == 0 and qu.q[2] == 0)):
                stop = True
            elif dr.par[IN_RULE] == RULE_SUFFIX:
                draft_s = propose_suffix_inline(c, sb, dr, sx, pb, max_model_len)
                if draft_s < 0.0:
                    draft_s = 0.0
                    stop = True
            elif dr.par[IN_RULE] == RULE_HISTORY:  # also with nobody drafting: the emitted tokens are observed
                draft_s = propose_history_inline(c, sb, dr, ah, max_model_len)
                if draft_s < 0.0:
                    draft_s = 0.0
                    stop = True
            elif sb.sc[4]:
                draft_s = propose_inline(c, sb, dr, max_model_len)
                if draft_s < 0.0:
                    draft_s = 0.0
                    stop = True
        if stop:
            return s + 1, RUN_STOPPED
        s += 1
    return max_steps, RUN_MAX


# -- Python API ----------------------------------------------------------------------------------------
_INLINE_OFF = InlineDrafts.off()
_HISTORY_OFF = InlineHistory.off()
_SUFFIX_OFF = InlineSuffix.off()

class ScheduledBatch:
    """What one step runs: one entry per scheduled request, in batch-row order.

    `rows`, `num_new` (tokens scheduled: the query length), `context` (num_computed before the
    step), `decode` (past its prefill, so it verifies; else a prefill chunk), `drafts` (draft tokens
    scheduled, after truncation), `position` (tokens emitted before the step) and `preempted` are
    lists built on first use; `arrays` holds (call rows, num_new, context, decode, position, number of
    drafts) as numpy arrays. `bound`: why requests were left waiting: "kv" (no room, or a
    preemption), "seqs" (max_num_seqs), "tokens" (budget spent), None (nobody waiting).
    """

    def __init__(self, table: CallTable, arrays: tuple[np.ndarray, ...], drafted: dict[int, np.ndarray],
                 preempted: np.ndarray, bound: str | None) -> None:
        self._table, self.arrays, self._drafted, self._preempted, self.bound = table, arrays, drafted, preempted, bound

    def __len__(self) -> int:
        return self.arrays[0].shape[0]

    @cached_property
    def rows(self) -> list[CallState]:
        handles = self._table.handles
        return [handles[r] for r in self.arrays[0].tolist()]

    @property
    def num_new(self) -> list[int]:
        return self.arrays[1].tolist()

    @property
    def context(self) -> list[int]:
        return self.arrays[2].tolist()

    @property
    def decode(self) -> list[bool]:
        return self.arrays[3].tolist()

    @property
    def position(self) -> list[int]:
        return self.arrays[4].tolist()

    @cached_property
    def drafts(self) -> list[np.ndarray]:
        return [self._drafted.get(i, _EMPTY) for i in range(len(self))]

    @property
    def preempted(self) -> list[CallState]:
        handles = self._table.handles
        return [handles[r] for r in self._preempted.tolist()]


@dataclass
class StepOutput:
    """What the step produced, aligned with the batch rows."""

    accepted: np.ndarray  # int64: draft tokens accepted (bonus not included)
    emitted: np.ndarray  # int64: tokens appended to the request (0 for a partial prefill chunk)
    finished: list[CallState]
    sampled: list[CallState]  # requests that emitted ≥ 1 token and go on (candidates for drafting)
    started: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # first token, by row
    sampled_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # their table rows


class Scheduler:
    """Running list, waiting queue and KV manager of one engine; see the module docstring.

    Requests are rows of the KV manager's `CallTable`; `running` and `waiting` give their handles.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.kv = kv
        self.table = kv.table
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._run_steps = FastCall(run_steps, containers=(0, 1, 2, 3, 4, 12, 13, 14, 15))
        # set_drafts' work space (rows, starts, lengths; the proposals end to end), kept so that its
        # kernel call is a FastCall too.
        self._draft_rows = np.zeros((3, max(max_num_seqs, 1)), dtype=np.int64)
        self._draft_tokens = np.zeros(max(max_num_seqs, 1) * 8, dtype=np.int32)
        self._drafts_from = FastCall(drafts_from_rows, containers=(0, 1, 2))
        self._model_drafts = FastCall(propose_model_buffered, containers=(0, 1))
        self._table_drafts = FastCall(propose_table_buffered, containers=(0, 1))
        self._history_drafts = FastCall(propose_history_inline, containers=(0, 1, 2, 3))
        self._suffix_drafts = FastCall(propose_suffix_inline, containers=(0, 1, 2, 3, 4))
        self.table.reserve_slots(max_num_seqs, kv.blocks_per_call)
        self.qu = Queues(zeros(max_num_seqs, dtype=np.int64), zeros(max(self.table.capacity, 1), dtype=np.int64),
                         zeros(4, dtype=np.int64))
        self.sb = StepBuf(zeros(max_num_seqs, dtype=ROW), zeros(max_num_seqs, dtype=LISTS),
                          zeros(kv.blocks_per_call, dtype=np.int64), zeros(7, dtype=np.int64))
        self.pb = PersistentBatch.off()  # vLLM's persistent-batch rows, followed once `track_batch_rows` asks

    def track_batch_rows(self) -> None:
        """Follow vLLM's persistent batch from now on (`PersistentBatch`): every schedule updates it and
        `batch_order` gives the step's rows in its order. For drafters that depend on that order (suffix)."""
        if not self.pb.par[0]:
            self.pb = PersistentBatch.make(self.max_num_seqs, self.table.capacity)

    def batch_order(self, n: int) -> np.ndarray:
        """The last schedule's n rows in vLLM's persistent-batch order: step-buffer indices, row 0 first
        (the step buffer's own order when the batch is not tracked)."""
        return self.pb.order[:n] if self.pb.par[0] else np.arange(n)

    # -- queues ------------------------------------------------------------------------------------
    def add_request(self, state: CallState) -> None:
        self.add_row(self.kv._row(state))

    def add_row(self, row: int) -> None:
        """The call in table row `row` joins the back of the waiting queue."""
        self.table.cols["status"][row] = S_WAITING
        q = self.qu.q
        cap = self.qu.waiting.shape[0]
        if q[2] == cap:
            order = self._waiting_rows()
            grown = zeros(2 * cap, dtype=np.int64)
            grown[:cap] = order
            self.qu = self.qu._replace(waiting=grown)
            q[1], cap = 0, 2 * cap
        self.qu.waiting[(q[1] + q[2]) % cap] = row
        q[2] += 1
        if self.pb.par[0]:
            self.pb = self.pb.grown(self.table.capacity)

    def _waiting_rows(self) -> np.ndarray:
        head, count, cap = int(self.qu.q[1]), int(self.qu.q[2]), self.qu.waiting.shape[0]
        return self.qu.waiting[(head + np.arange(count)) % cap]

    def has_work(self) -> bool:
        return bool(self.qu.q[0] or self.qu.q[2])

    @property
    def running(self) -> list[CallState]:
        handles = self.table.handles
        return [handles[r] for r in self.qu.running[:self.qu.q[0]].tolist()]

    @property
    def waiting(self) -> list[CallState]:
        handles = self.table.handles
        return [handles[r] for r in self._waiting_rows().tolist()]

    @property
    def num_running(self) -> int:
        return int(self.qu.q[0])

    @property
    def num_waiting(self) -> int:
        return int(self.qu.q[2])

    @property
    def num_preemptions(self) -> int:
        return int(self.qu.q[3])

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        sb = self.sb
        schedule_step(self.kv.pool.p, self.table.nt, self.qu, sb, self.max_num_batched_tokens, self.max_num_seqs,
                      self.max_model_len)
        n, npre = int(sb.sc[0]), int(sb.sc[1])
        if self.pb.par[0]:
            persistent_batch_update(self.pb, sb.rows["call"][:n])
        rows = sb.rows[:n]
        arrays = tuple(rows[f].copy() for f in ("call", "n", "context", "decode", "position", "spec"))
        drafts, slots = self.table.slot_drafts, rows["slot"]
        drafted = {i: drafts[slots[i], :arrays[5][i]].copy() for i in arrays[5].nonzero()[0].tolist()}
        return ScheduledBatch(self.table, arrays, drafted, sb.lists["preempted"][:npre].copy(), BOUNDS[sb.sc[2]])

    def update_from_output(self, batch: ScheduledBatch, step: int = -1) -> StepOutput:
        """Verify, emit and roll back (vLLM `update_from_output`); finished requests leave `running`
        and free their KV blocks (their full blocks stay cached). `step` is recorded as a call's
        first-token step."""
        idx, _, _, _, position, _ = batch.arrays
        n = idx.shape[0]
        sb = self.sb
        if n != sb.sc[0] or not np.array_equal(idx, sb.rows["call"][:n]):
            raise ValueError("update_from_output must follow the schedule() that made the batch")
        target, acc, handles = self.table.cols["target_len"], self.table.cols["draft_acc"], self.table.handles
        for i, drafts in batch._drafted.items():
            r = int(idx[i])
            acc[r] = verify(drafts, handles[r].call.output_tokens, int(position[i]), int(target[r]))[0]
        self._update(step)
        rows, lists = sb.rows[:n], sb.lists
        sampled = lists["sampled"][:sb.sc[4]].copy()
        return StepOutput(rows["accepted"].copy(), rows["emitted"].copy(),
                          [handles[r] for r in lists["finished"][:sb.sc[3]].tolist()],
                          [handles[r] for r in sampled.tolist()], rows["started"].copy(), sampled)

    def _update(self, step: int) -> None:
        if update_step(self.kv.pool.p, self.table.nt, self.qu, self.sb, step) < 0:
            self._lossless_error()

    def _lossless_error(self) -> None:
        bad = self.table.handles[int(self.sb.rows["call"][int(self.sb.sc[5])])]
        raise SimulationError(f"lossless check failed: call {bad.call_id!r} emitted tokens that differ from its "
                              "recording")

    def set_drafts(self, rows: np.ndarray, drafts: list[np.ndarray]) -> None:
        """The drafts of running calls (table rows `rows`) for their next step, verified now with `verify`
        against the recording: a truncated draft accepts the same prefix, cut to its length."""
        n = len(drafts)
        if not n:
            return
        buf = self._draft_rows
        if n > buf.shape[1]:
            buf = self._draft_rows = np.zeros((3, 2 * n), dtype=np.int64)
        if n == 1:  # the usual case at small max_num_seqs: scalars, not array calls
            total = width = drafts[0].shape[0]
            buf[0, 0], buf[1, 0], buf[2, 0] = rows[0], 0, total
        else:
            buf[0, :n] = rows
            lengths = buf[2, :n]
            lengths[:] = [d.shape[0] for d in drafts]
            buf[1, 0] = 0
            np.cumsum(lengths[:-1], out=buf[1, 1:n])
            total, width = int(buf[1, n - 1] + lengths[n - 1]), int(lengths.max())
        self.table.reserve_draft_width(width)
        if total > self._draft_tokens.shape[0]:
            self._draft_tokens = np.zeros(2 * total, dtype=np.int32)
        if n == 1:
            self._draft_tokens[:total] = drafts[0]
        elif total:
            np.concatenate(drafts, out=self._draft_tokens[:total], casting="unsafe")
        self._drafts_from(self.table.nt, buf, self._draft_tokens, n)

    def set_model_drafts(self, rows: np.ndarray, lengths: np.ndarray, dr: InlineDrafts) -> float:
        """A model-based drafter's drafts (`propose_model_rows`) for calls `rows`, `lengths` tokens each;
        returns the draft network's seconds for them."""
        return self._buffered_drafts(self._model_drafts, rows, lengths, dr, int(lengths.max()))

    def set_table_drafts(self, rows: np.ndarray, lengths: np.ndarray, dr: InlineDrafts) -> float:
        """AgentSpec's drafts from the workload's lookup table (`propose_table_rows`) for calls `rows`, draft
        limits `lengths`; returns the drafting seconds."""
        return self._buffered_drafts(self._table_drafts, rows, lengths, dr, int(dr.par[IN_K_MAX]))

    def _buffered_drafts(self, kernel: FastCall, rows: np.ndarray, lengths: np.ndarray, dr: InlineDrafts,
                         width: int) -> float:
        """`kernel` (a `*_buffered` one) over calls `rows` with draft limits `lengths`, put in dr's work space,
        with room for drafts of `width` tokens."""
        m = rows.shape[0]
        dr.rows[:m] = rows
        dr.max_lens[:m] = lengths
        self.table.reserve_draft_width(width)
        return float(kernel(self.table.nt, dr, m))

    def history_drafts(self, dr: InlineDrafts, ah: InlineHistory) -> float:
        """`propose_history_inline` for the step in the step buffer (the event loop's call): the drafting
        seconds, or −1.0 when the event loop must observe and propose itself."""
        self.table.reserve_draft_width(int(dr.par[IN_K_MAX]))
        return float(self._history_drafts(self.table.nt, self.sb, dr, ah, self.max_model_len))

    def suffix_drafts(self, dr: InlineDrafts, sx: InlineSuffix) -> float:
        """`propose_suffix_inline` for the step in the step buffer, called by the event loop (the drafter
        has started the calls that start): the drafting seconds, or −1.0 with nothing changed."""
        self.table.reserve_draft_width(int(dr.par[IN_K_MAX]))
        sx.par[SX_EVENT_LOOP] = 1
        try:
            return float(self._suffix_drafts(self.table.nt, self.sb, dr, sx, self.pb, self.max_model_len))
        finally:
            sx.par[SX_EVENT_LOOP] = 0

    def set_ngram_table_drafts(self, rows: np.ndarray, lengths: np.ndarray, dr: InlineDrafts) -> None:
        """`set_drafts` for the n-gram proposers' drafts read from the workload's table (`ngram_table_drafts`),
        in dr's work space."""
        m = rows.shape[0]
        if m:
            self.table.reserve_draft_width(int(lengths.max()))
        cols = self.table.cols
        ngram_table_drafts(self.table.nt, rows.astype(np.int64), cols["hist_off"][rows].astype(np.int64),
                           (cols["prompt_len"][rows] + cols["num_emitted"][rows]).astype(np.int64),
                           lengths.astype(np.int64), dr.ngram_at, dr.ngram_match, dr.par[IN_RULE] == RULE_V2,
                           dr.drafts[:, :m])

    def set_drafts_from_tokens(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """`set_drafts` for drafts that are stretches of the token arena: tokens[starts[i]:starts[i] + lengths[i]]."""
        if lengths.shape[0]:
            self.table.reserve_draft_width(int(lengths.max()))
        drafts_from(self.table.nt, rows, self.table.nt.tokens, starts, lengths)

    # -- a run of steps ----------------------------------------------------------------------------------
    def run(self, log, max_steps: int, step0: int, chain: bool, stop_on_emit: bool,
            inline: InlineDrafts | None = None, history: InlineHistory | None = None,
            suffix: InlineSuffix | None = None) -> tuple[int, int]:
        """`run_steps` over this scheduler's state, logging into `log` (a `StepLogBuilder`'s buffers)."""
        if self.pb.par[0]:
            self.pb = self.pb.grown(self.table.capacity)
        steps, why = self._run_steps(self.kv.pool.p, self.table.nt, self.qu, self.sb, log,
                                     self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len, max_steps,
                                     step0, chain, stop_on_emit, inline if inline is not None else _INLINE_OFF,
                                     history if history is not None else _HISTORY_OFF,
                                     suffix if suffix is not None else _SUFFIX_OFF, self.pb)
        if why == RUN_LOSSLESS:
            self._lossless_error()
        return int(steps), int(why)
