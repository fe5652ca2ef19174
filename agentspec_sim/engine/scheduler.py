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
   A waiting request the scheduler has not seen yet stops admission too (its `not_before` step is
   later): vLLM's engine core reads new requests between steps (`EngineCore._process_input_queue`), and
   with async scheduling (`step_with_batch_queue`, two batches in flight) step t + 1 is scheduled
   before step t runs, so a request that reaches the core while step t runs joins step t + 2 at the
   earliest (t + 1 synchronously); a query's next call, sent when the client has read the finish of
   step t, joins t + 3 (t + 2). An engine with nothing else to run admits it at once.
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
from numba import njit

from agentspec_sim.engine.counters import (
    KV_FREE,
    LG_DRAFT_TOKENS,
    LG_EVENTS,
    LG_ROWS,
    LG_STEPS,
    PB_ON,
    PB_ROWS,
    PB_TICK,
    Q_ADMIT_LAG,
    Q_PREEMPTIONS,
    Q_RUNNING,
    Q_WAITING,
    Q_WAITING_HEAD,
    SC_BAD_ROW,
    SC_BOUND,
    SC_FINISHED,
    SC_PREEMPTED,
    SC_ROWS,
    SC_SAMPLED,
    SC_TOP,
)
from agentspec_sim.engine.drafting import NoDrafting, caches_loop, draft_between_steps, drafts_every_step
from agentspec_sim.engine.drafts import drafts_from, drafts_from_rows, verify
from agentspec_sim.engine.fastcall import FastCall
from agentspec_sim.engine.kv import (
    KVCacheManager,
    allocate_slots,
    free_call,
    inline_kernel,
    internal_kernel,
    kernel,
    lookup,
)
from agentspec_sim.engine.request import NOT_CHAINED, S_FINISHED, S_RUNNING, S_WAITING, CallState, CallTable, zeros
from agentspec_sim.host.kernel_cache import clear_if_changed, package_sources

_EMPTY = np.zeros(0, dtype=np.int32)
# This module's kernels compile in kv.py's and drafts.py's, and `run_steps` in the drafters' compiled steps it
# drafts with (any module of drafters/, found through the protocol when it is compiled).
# The loop compiles in the engine's kernels (kv, drafts, the counters) and, per drafter, its step: that one is
# stamped when the drafter registers it (engine/drafting.py `compiled_step`).
clear_if_changed(__file__, package_sources("agentspec_sim.engine"))

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

    par: np.ndarray  # int64: PB_ON, PB_ROWS, PB_TICK (engine/counters.py)
    call: np.ndarray  # int64 [max_num_seqs]: the call (table row) in each batch row
    seen: np.ndarray  # int64 [table rows]: the last step (par[PB_TICK]) that scheduled the call, 0: never
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
        off.par[PB_ON] = 0
        return off

    def grown(self, calls: int) -> PersistentBatch:
        """The same batch with room for `calls` table rows."""
        if calls <= self.seen.shape[0]:
            return self
        seen, index = zeros(2 * calls, dtype=np.int64), zeros(2 * calls, dtype=np.int64)
        seen[:self.seen.shape[0]] = self.seen
        index[:self.index.shape[0]] = self.index
        return self._replace(seen=seen, index=index)


@internal_kernel
def persistent_batch_update(pb, calls):
    """`PersistentBatch`'s three parts for a step that scheduled `calls` (table rows, step-buffer order):
    afterwards the batch holds exactly these calls in rows 0 … len(calls) − 1 and pb.order[k] is the
    step-buffer index of the call in row k."""
    n_old = pb.par[PB_ROWS]
    tick = pb.par[PB_TICK] + 1
    pb.par[PB_TICK] = tick
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
    pb.par[PB_ROWS] = n
    for k in range(n):
        pb.order[k] = pb.index[pb.call[k]]


@internal_kernel
def _preempt(p, c, qu, victim):
    free_call(p, c, victim)
    c.calls.num_computed[victim] = 0
    c.calls.draft_len[victim] = 0
    c.calls.status[victim] = S_WAITING
    c.calls.decoding[victim] = False
    c.calls.preemptions[victim] += 1
    qu.q[Q_PREEMPTIONS] += 1
    cap = qu.waiting.shape[0]
    qu.q[Q_WAITING_HEAD] = (qu.q[Q_WAITING_HEAD] - 1 + cap) % cap  # to the front of the waiting queue
    qu.waiting[qu.q[Q_WAITING_HEAD]] = victim
    qu.q[Q_WAITING] += 1


@inline_kernel
def _record(sb, i, r, n, context, decode, spec, position, slot):
    sb.rows.call[i] = r
    sb.rows.slot[i] = slot
    sb.rows.n[i] = n
    sb.rows.context[i] = context
    sb.rows.decode[i] = decode
    sb.rows.spec[i] = spec
    sb.rows.position[i] = position


@internal_kernel
def schedule_step(p, c, qu, sb, max_num_batched_tokens, max_num_seqs, max_model_len, step):
    """Steps 1 and 2 of the module docstring; the batch goes to `sb`, num_computed advances."""
    bs = p.params[0]
    budget = max_num_batched_tokens
    rows = 0
    preempted = 0
    i = 0
    while i < qu.q[Q_RUNNING] and budget > 0:
        r = qu.running[i]
        computed = c.calls.num_computed[r]
        num_tokens = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        n = min(num_tokens + c.calls.draft_len[r] - computed, budget, max_model_len - computed - 1)
        if n <= 0:
            i += 1
            continue
        scheduled = True
        while not allocate_slots(p, c, r, n, sb.hits, np.int64(0), np.bool_(False)):
            qu.q[Q_RUNNING] -= 1
            victim = qu.running[qu.q[Q_RUNNING]]
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
        busy = rows > 0  # the step runs anyway: calls the scheduler has not seen yet wait for a later one
        while qu.q[Q_WAITING] > 0:
            if budget <= 0:
                bound = B_TOKENS
                break
            if qu.q[Q_RUNNING] >= max_num_seqs:
                bound = B_SEQS
                break
            r = qu.waiting[qu.q[Q_WAITING_HEAD]]
            if busy and c.calls.not_before[r] > step:
                # Not yet seen by this schedule (async scheduling made it a step ahead, module docstring); an
                # engine that would otherwise idle takes every call it reads.
                break
            nhits = lookup(p, c, r, sb.hits) if c.calls.num_computed[r] == 0 else 0
            computed = c.calls.num_computed[r] + nhits * bs
            n = min(c.calls.prompt_len[r] + c.calls.num_emitted[r] - computed, budget)
            if not allocate_slots(p, c, r, n, sb.hits, nhits, np.bool_(True)):
                bound = B_KV
                break
            qu.q[Q_WAITING_HEAD] = (qu.q[Q_WAITING_HEAD] + 1) % cap
            qu.q[Q_WAITING] -= 1
            qu.running[qu.q[Q_RUNNING]] = r
            qu.q[Q_RUNNING] += 1
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
    sb.sc[SC_ROWS] = rows
    sb.sc[SC_PREEMPTED] = preempted
    sb.sc[SC_BOUND] = bound
    sb.sc[SC_TOP] = top


@internal_kernel
def update_step(p, c, qu, sb, step):
    """Emission after the forward pass of the batch in `sb` (see `Scheduler.update_from_output`).

    A row with drafts accepts the first min(draft_acc, drafted) of them (`draft_acc` was set by
    `verify` against the recording) and emits one more token unless that ends the call; a row
    without drafts emits the recording's next token. Returns −1 (and the row in sb.sc[SC_BAD_ROW]) when the
    accepted drafts are not the recording (the lossless check) or were never verified, else 0.
    """
    rows = sb.sc[SC_ROWS]
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
                sb.sc[SC_BAD_ROW] = i
                return -1
            at = c.calls.hist_off[r] + c.calls.prompt_len[r] + pos
            drafts = c.slot_drafts[sb.rows.slot[i]]
            for k in range(a):
                if drafts[k] != c.tokens[at + k]:
                    sb.sc[SC_BAD_ROW] = i
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
        for k in range(qu.q[Q_RUNNING]):
            r = qu.running[k]
            if c.calls.status[r] != S_FINISHED:
                qu.running[kept] = r
                kept += 1
        qu.q[Q_RUNNING] = kept
        for k in range(finished):
            free_call(p, c, sb.lists.finished[k])
    sb.sc[SC_FINISHED] = finished
    sb.sc[SC_SAMPLED] = sampled
    return 0


@inline_kernel
def _event(lg, kind, r, step):
    k = lg.ctr[LG_EVENTS]
    lg.events.kind[k] = kind
    lg.events.call[k] = r
    lg.events.step[k] = step
    lg.ctr[LG_EVENTS] = k + 1


@internal_kernel
def log_step(lg, c, sb, running, waiting, free_blocks):
    """Append the step in `sb` (scheduled and updated) to the log; returns its step index.

    `running` / `waiting`: the queues after scheduling; `free_blocks`: after the update.
    """
    rows = sb.sc[SC_ROWS]
    base = lg.ctr[LG_ROWS]
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
            t = lg.ctr[LG_DRAFT_TOKENS]
            for k in range(sb.rows.spec[i]):
                lg.draft_tokens[t + k] = c.slot_drafts[sb.rows.slot[i], k]
            lg.ctr[LG_DRAFT_TOKENS] = t + sb.rows.spec[i]
        tokens += sb.rows.n[i]
        decode += sb.rows.decode[i]
        drafted += sb.rows.spec[i]
        accepted += sb.rows.accepted[i]
    lg.ctr[LG_ROWS] = base + rows
    k = lg.ctr[LG_STEPS]
    lg.steps.batch_size[k] = rows
    lg.steps.scheduled_tokens[k] = tokens
    lg.steps.decode_calls[k] = decode
    lg.steps.running[k] = running
    lg.steps.waiting[k] = waiting
    lg.steps.bound[k] = sb.sc[SC_BOUND]
    lg.steps.D[k] = drafted
    lg.steps.acc[k] = accepted
    lg.steps.free_blocks[k] = free_blocks
    lg.ctr[LG_STEPS] = k + 1
    return k


@internal_kernel
def _log_full(lg, c, max_num_seqs):
    return (lg.rows.shape[0] - lg.ctr[LG_ROWS] < max_num_seqs or lg.steps.batch_size.shape[0] == lg.ctr[LG_STEPS]
            or lg.events.shape[0] - lg.ctr[LG_EVENTS] < 4 * max_num_seqs
            or lg.draft_tokens.shape[0] - lg.ctr[LG_DRAFT_TOKENS] < max_num_seqs * c.slot_drafts.shape[1])


# Python's way into the internal kernels the compiled loop calls (engine/kv.py "Python API": why), for
# `Scheduler`'s step-at-a-time path.
@kernel
def schedule_step_from_python(p, c, qu, sb, max_num_batched_tokens, max_num_seqs, max_model_len, step):
    schedule_step(p, c, qu, sb, max_num_batched_tokens, max_num_seqs, max_model_len, step)


@kernel
def update_step_from_python(p, c, qu, sb, step):
    return update_step(p, c, qu, sb, step)


@kernel
def persistent_batch_update_from_python(pb, calls):
    persistent_batch_update(pb, calls)


@kernel
def run_steps(p, c, qu, sb, lg, max_num_batched_tokens, max_num_seqs, max_model_len, max_steps, step0, chain,
              stop_on_emit, drafting, pb):
    """Up to `max_steps` steps, logged to `lg`; returns (steps, why it stopped).

    Stops before a step when nothing can run or the log has no room, and after a step in which a
    call finished whose query's next call does not arrive at once (or `chain` is off: other events
    are pending), or — with `stop_on_emit`, when a drafter must see every token — a call emitted,
    unless the drafter's compiled side drafts this step (`drafting`: its state, whose kernel
    engine/drafting.py `draft_between_steps` finds; one that `drafts_every_step` is called after every
    step, emitting or not; `NoDrafting` never drafts): then the run goes on with the drafts set, each
    step's drafting time in the log's `draft_s` (the run's first step gets the event loop's); a step it
    cannot do ends the run. The last step of a run is always left to the event loop.
    A finished call's next call that arrives at once (think time 0, no recorded arrival, a prompt
    that fits) joins the waiting queue here, as the event loop would add it before the next step.
    RUN_LOSSLESS: the update's lossless check failed (the step is not logged; see `update_step`).
    `pb` (when on: suffix runs) follows vLLM's persistent batch through every schedule, empty ones included.
    """
    s = 0
    draft_s = 0.0
    while s < max_steps:
        if qu.q[Q_RUNNING] == 0 and qu.q[Q_WAITING] == 0:
            return s, RUN_IDLE
        if _log_full(lg, c, max_num_seqs):
            return s, RUN_FULL
        schedule_step(p, c, qu, sb, max_num_batched_tokens, max_num_seqs, max_model_len, step0 + s)
        rows = sb.sc[SC_ROWS]
        if pb.par[PB_ON]:
            persistent_batch_update(pb, sb.rows.call[:rows])
        for j in range(sb.sc[SC_PREEMPTED]):  # victims in preemption order, with the step that runs next
            _event(lg, EV_PREEMPT, sb.lists.preempted[j], step0 + s)
        if rows == 0:
            if sb.sc[SC_PREEMPTED] > 0:
                # The only running calls preempted themselves (vLLM: an empty scheduler output, the
                # model runner returns at once): no step happens; the next schedule re-admits them.
                continue
            return s, RUN_EMPTY
        step = step0 + s
        running, waiting = qu.q[Q_RUNNING], qu.q[Q_WAITING]
        if update_step(p, c, qu, sb, step) < 0:
            return s, RUN_LOSSLESS
        log_step(lg, c, sb, running, waiting, p.ctr[KV_FREE])
        lg.steps.draft_s[lg.ctr[LG_STEPS] - 1] = draft_s
        draft_s = 0.0
        emitted = False
        for i in range(rows):
            if sb.rows.emitted[i]:
                emitted = True
            if sb.rows.started[i]:
                _event(lg, EV_FIRST, sb.rows.call[i], step)
        stop = False
        finished = sb.sc[SC_FINISHED]
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
                    # Sent once the client has read this finish, it reaches a scheduler that has already made
                    # the next step (and, async, the one after): the step after those is its first.
                    c.calls.not_before[nxt] = step + 1 + qu.q[Q_ADMIT_LAG]
                    qu.waiting[(qu.q[Q_WAITING_HEAD] + qu.q[Q_WAITING]) % cap] = nxt
                    qu.q[Q_WAITING] += 1
                    _event(lg, EV_ARRIVE, nxt, step)
            if not at_once:
                stop = True
        if stop_on_emit and (emitted or drafts_every_step(drafting)) and not stop:
            # Draft inline only where the loop goes on (room for another step, a call left to step); else the
            # event loop does (it always takes the last step of a run).
            if s + 1 >= max_steps or _log_full(lg, c, max_num_seqs) or (qu.q[Q_RUNNING] == 0 and qu.q[Q_WAITING] == 0):
                stop = True
            else:
                draft_s = draft_between_steps(c, sb, pb, drafting, max_model_len)
                if draft_s < 0.0:
                    draft_s = 0.0
                    stop = True
        if stop:
            return s + 1, RUN_STOPPED
        s += 1
    return max_steps, RUN_MAX


# `run_steps` for drafting states registered outside the package (engine/drafting.py `caches_loop`): the same
# function, compiled without numba's on-disk cache, so the shared cache index never names a plugin's module.
run_steps_uncached = njit(cache=False, _nrt=False, no_cfunc_wrapper=True)(run_steps.py_func)


# -- Python API ----------------------------------------------------------------------------------------
_NO_DRAFTING = NoDrafting.make()


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
        self._run_steps = FastCall(run_steps, containers=(0, 1, 2, 3, 4, 12, 13))
        self._run_steps_uncached: FastCall | None = None  # for a drafter's state outside the package (below)
        # set_drafts' work space (rows, starts, lengths; the proposals end to end), kept so that its
        # kernel call is a FastCall too.
        self._draft_rows = np.zeros((3, max(max_num_seqs, 1)), dtype=np.int64)
        self._draft_tokens = np.zeros(max(max_num_seqs, 1) * 8, dtype=np.int32)
        self._drafts_from = FastCall(drafts_from_rows, containers=(0, 1, 2))
        self.table.reserve_slots(max_num_seqs, kv.blocks_per_call)
        self.qu = Queues(zeros(max_num_seqs, dtype=np.int64), zeros(max(self.table.capacity, 1), dtype=np.int64),
                         zeros(5, dtype=np.int64))
        self.sb = StepBuf(zeros(max_num_seqs, dtype=ROW), zeros(max_num_seqs, dtype=LISTS),
                          zeros(kv.blocks_per_call, dtype=np.int64), zeros(7, dtype=np.int64))
        self.pb = PersistentBatch.off()  # vLLM's persistent-batch rows, followed once `track_batch_rows` asks

    def track_batch_rows(self) -> None:
        """Follow vLLM's persistent batch from now on (`PersistentBatch`): every schedule updates it and
        `batch_order` gives the step's rows in its order. For drafters that depend on that order (suffix)."""
        if not self.pb.par[PB_ON]:
            self.pb = PersistentBatch.make(self.max_num_seqs, self.table.capacity)

    def batch_order(self, n: int) -> np.ndarray:
        """The last schedule's n rows in vLLM's persistent-batch order: step-buffer indices, row 0 first
        (the step buffer's own order when the batch is not tracked)."""
        return self.pb.order[:n] if self.pb.par[PB_ON] else np.arange(n)

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
        if self.pb.par[PB_ON]:
            self.pb = self.pb.grown(self.table.capacity)

    def _waiting_rows(self) -> np.ndarray:
        head, count, cap = int(self.qu.q[Q_WAITING_HEAD]), int(self.qu.q[Q_WAITING]), self.qu.waiting.shape[0]
        return self.qu.waiting[(head + np.arange(count)) % cap]

    def has_work(self) -> bool:
        return bool(self.qu.q[Q_RUNNING] or self.qu.q[Q_WAITING])

    @property
    def running(self) -> list[CallState]:
        handles = self.table.handles
        return [handles[r] for r in self.qu.running[:self.qu.q[Q_RUNNING]].tolist()]

    @property
    def waiting(self) -> list[CallState]:
        handles = self.table.handles
        return [handles[r] for r in self._waiting_rows().tolist()]

    @property
    def num_running(self) -> int:
        return int(self.qu.q[Q_RUNNING])

    @property
    def num_waiting(self) -> int:
        return int(self.qu.q[Q_WAITING])

    @property
    def num_preemptions(self) -> int:
        return int(self.qu.q[Q_PREEMPTIONS])

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self, step: int = 1 << 62) -> ScheduledBatch:
        """Schedule step `step` (calls with a later `not_before` stay waiting while others run; by default every
        waiting call is seen)."""
        sb = self.sb
        schedule_step_from_python(self.kv.pool.p, self.table.nt, self.qu, sb, self.max_num_batched_tokens,
                                  self.max_num_seqs, self.max_model_len, step)
        n, npre = int(sb.sc[SC_ROWS]), int(sb.sc[SC_PREEMPTED])
        if self.pb.par[PB_ON]:
            persistent_batch_update_from_python(self.pb, sb.rows["call"][:n])
        rows = sb.rows[:n]
        arrays = tuple(rows[f].copy() for f in ("call", "n", "context", "decode", "position", "spec"))
        drafts, slots = self.table.slot_drafts, rows["slot"]
        drafted = {i: drafts[slots[i], :arrays[5][i]].copy() for i in arrays[5].nonzero()[0].tolist()}
        return ScheduledBatch(self.table, arrays, drafted, sb.lists["preempted"][:npre].copy(), BOUNDS[sb.sc[SC_BOUND]])

    def update_from_output(self, batch: ScheduledBatch, step: int = -1) -> StepOutput:
        """Verify, emit and roll back (vLLM `update_from_output`); finished requests leave `running`
        and free their KV blocks (their full blocks stay cached). `step` is recorded as a call's
        first-token step."""
        idx, _, _, _, position, _ = batch.arrays
        n = idx.shape[0]
        sb = self.sb
        if n != sb.sc[SC_ROWS] or not np.array_equal(idx, sb.rows["call"][:n]):
            raise ValueError("update_from_output must follow the schedule() that made the batch")
        target, acc, handles = self.table.cols["target_len"], self.table.cols["draft_acc"], self.table.handles
        for i, drafts in batch._drafted.items():
            r = int(idx[i])
            acc[r] = verify(drafts, handles[r].call.output_tokens, int(position[i]), int(target[r]))[0]
        self._update(step)
        rows, lists = sb.rows[:n], sb.lists
        sampled = lists["sampled"][:sb.sc[SC_SAMPLED]].copy()
        return StepOutput(rows["accepted"].copy(), rows["emitted"].copy(),
                          [handles[r] for r in lists["finished"][:sb.sc[SC_FINISHED]].tolist()],
                          [handles[r] for r in sampled.tolist()], rows["started"].copy(), sampled)

    def _update(self, step: int) -> None:
        if update_step_from_python(self.kv.pool.p, self.table.nt, self.qu, self.sb, step) < 0:
            self._lossless_error()

    def _lossless_error(self) -> None:
        bad = self.table.handles[int(self.sb.rows["call"][int(self.sb.sc[SC_BAD_ROW])])]
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

    def set_drafts_from_tokens(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """`set_drafts` for drafts that are stretches of the token arena: tokens[starts[i]:starts[i] + lengths[i]]."""
        if lengths.shape[0]:
            self.table.reserve_draft_width(int(lengths.max()))
        drafts_from(self.table.nt, rows, self.table.nt.tokens, starts, lengths)

    # -- a run of steps ----------------------------------------------------------------------------------
    def run(self, log, max_steps: int, step0: int, chain: bool, stop_on_emit: bool,
            drafting: NamedTuple | None = None) -> tuple[int, int]:
        """`run_steps` over this scheduler's state, logging into `log` (a `StepLogBuilder`'s buffers), drafting
        between steps with the compiled state `drafting` (engine/drafting.py; None: nothing drafts)."""
        if self.pb.par[PB_ON]:
            self.pb = self.pb.grown(self.table.capacity)
        state = drafting if drafting is not None else _NO_DRAFTING
        loop = self._run_steps
        if not caches_loop(state):  # a step registered outside the package: not in the shared on-disk cache
            if self._run_steps_uncached is None:
                self._run_steps_uncached = FastCall(run_steps_uncached, containers=(0, 1, 2, 3, 4, 12, 13))
            loop = self._run_steps_uncached
        steps, why = loop(self.kv.pool.p, self.table.nt, self.qu, self.sb, log, self.max_num_batched_tokens,
                          self.max_num_seqs, self.max_model_len, max_steps, step0, chain, stop_on_emit, state, self.pb)
        if why == RUN_LOSSLESS:
            self._lossless_error()
        return int(steps), int(why)
