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
rolls num_computed back by its rejected drafts, as vLLM does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from agentspec_sim.engine.kv import KVCacheManager
from agentspec_sim.engine.request import FINISHED, RUNNING, WAITING, CallState

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class ScheduledBatch:
    """What one step runs: one entry per scheduled request, in batch-row order."""

    rows: list[CallState] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens scheduled (query length)
    context: list[int] = field(default_factory=list)  # num_computed before the step
    decode: list[bool] = field(default_factory=list)  # past its prefill (verifies), vs a prefill chunk
    drafts: list[np.ndarray] = field(default_factory=list)  # draft tokens scheduled (after truncation)
    position: list[int] = field(default_factory=list)  # tokens emitted before the step
    preempted: list[CallState] = field(default_factory=list)
    # Why requests were left waiting: "kv" (no room, or a preemption), "seqs" (max_num_seqs),
    # "tokens" (budget spent), None (nobody waiting).
    bound: str | None = None

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class StepOutput:
    """What the step produced, aligned with the batch rows."""

    accepted: np.ndarray  # int64: draft tokens accepted (bonus not included)
    emitted: np.ndarray  # int64: tokens appended to the request (0 for a partial prefill chunk)
    finished: list[CallState]
    sampled: list[CallState]  # requests that emitted ≥ 1 token and go on (candidates for drafting)


def verify(drafts: np.ndarray, output: np.ndarray, position: int, target_len: int) -> tuple[int, int]:
    """(accepted, emitted) for a greedy verification of `drafts` at `position` of the recorded output.

    accepted = the longest prefix of the drafts equal to the recording from `position`; drafts
    past the end of the call's output (`target_len`) can never be accepted. emitted = accepted + 1
    (the target's own next token: the bonus when every draft matched), except when the accepted
    drafts already end the output.
    """
    remaining = target_len - position
    m = min(drafts.shape[0], remaining)
    if m:
        eq = drafts[:m] == output[position:position + m]
        accepted = m if eq.all() else int(np.argmin(eq))
    else:
        accepted = 0
    return accepted, min(accepted + 1, remaining)


class Scheduler:
    """Running list, waiting queue and KV manager of one engine; see the module docstring."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.running: list[CallState] = []
        self.waiting: deque[CallState] = deque()
        self.num_preemptions = 0

    def add_request(self, state: CallState) -> None:
        state.status = WAITING
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _preempt(self, victim: CallState) -> None:
        self.kv.free(victim)
        victim.num_computed = 0
        victim.drafts = _EMPTY
        victim.status = WAITING
        victim.decoding = False
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens + req.drafts.shape[0] - req.num_computed, budget,
                    self.max_model_len - req.num_computed - 1)
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while not self.kv.allocate_slots(req, n):
                victim = running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            num_spec = n + req.num_computed - req.num_tokens
            self._record(batch, req, n, req.drafts[:num_spec] if num_spec > 0 else _EMPTY, decode=True)
            req.drafts = _EMPTY
            budget -= n
            i += 1

        if batch.preempted:
            batch.bound = "kv"
        else:
            waiting = self.waiting
            while waiting:
                if budget <= 0:
                    batch.bound = "tokens"
                    break
                if len(running) >= self.max_num_seqs:
                    batch.bound = "seqs"
                    break
                req = waiting[0]
                hit = self.kv.lookup(req) if req.num_computed == 0 else []
                computed = req.num_computed + len(hit) * self.kv.block_size
                n = min(req.num_tokens - computed, budget)
                if not self.kv.allocate_slots(req, n, hit, full_sequence_must_fit=True):
                    batch.bound = "kv"
                    break
                waiting.popleft()
                running.append(req)
                req.status = RUNNING
                req.num_computed = computed
                req.prefix_hit_tokens += len(hit) * self.kv.block_size
                req.decoding = False
                self._record(batch, req, n, _EMPTY, decode=False)
                budget -= n

        for req, n in zip(batch.rows, batch.num_new, strict=True):
            req.num_computed += n
        return batch

    @staticmethod
    def _record(batch: ScheduledBatch, req: CallState, n: int, drafts: np.ndarray, decode: bool) -> None:
        batch.rows.append(req)
        batch.num_new.append(n)
        batch.context.append(req.num_computed)
        # A running request is decoding once its (re)prefill has sampled a token; a waiting one never is.
        batch.decode.append(decode and req.decoding)
        batch.drafts.append(drafts)
        batch.position.append(req.num_emitted)

    def update_from_output(self, batch: ScheduledBatch) -> StepOutput:
        """Verify, emit and roll back (vLLM `update_from_output`); finished requests leave `running`
        and free their KV blocks (their full blocks stay cached)."""
        n = len(batch)
        accepted = np.zeros(n, dtype=np.int64)
        emitted = np.zeros(n, dtype=np.int64)
        finished: list[CallState] = []
        sampled: list[CallState] = []
        for i, req in enumerate(batch.rows):
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that did not reach the end of the known tokens samples nothing
            drafts = batch.drafts[i]
            pos = req.num_emitted
            a, e = verify(drafts, req.call.output_tokens, pos, req.target_len)
            start = req.prompt_len + pos
            # The emitted tokens are the accepted drafts, then the target's token from the recording;
            # the end-of-call check (lossless) compares the result with the recording.
            req.history[start:start + a] = drafts[:a]
            if e > a:
                req.history[start + a] = req.call.output_tokens[pos + a]
            req.num_emitted += e
            req.num_computed -= drafts.shape[0] - a
            accepted[i], emitted[i] = a, e
            if drafts.shape[0]:
                req.drafted += drafts.shape[0]
                req.accepted += a
                req.draft_steps += 1
            if batch.decode[i]:
                req.decode_steps += 1
            if req.num_emitted >= req.target_len:
                req.status = FINISHED
                finished.append(req)
            else:
                req.decoding = True
                sampled.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self.kv.free(req)
        return StepOutput(accepted, emitted, finished, sampled)
