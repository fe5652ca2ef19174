"""The event loop: call arrivals, engine steps, and the agent workflow between calls.

A heap of (time, sequence number, event); ties go to the earlier-pushed event. Three events, each
with its whole effect in one handler:

- ARRIVE(call): a call reaches the server. A prompt of ≥ max_model_len tokens is refused as vLLM
  refuses it (`_validate_prompt_len`); the agent gets an error, so the rest of its query is skipped
  (counted). Otherwise it joins the waiting queue and, if the engine is idle, a step starts now.
- STEP: the scheduler builds the batch; its duration is the drafting time spent proposing the
  drafts it verifies (model-free proposers run on the CPU after the previous step, serialized with
  it as in vLLM's synchronous V1 loop) plus `cost.step_time(batch)`. DONE is pushed at the end.
- DONE(batch): verification and emission (`Scheduler.update_from_output`), drafter hooks, the next
  call of each finished call's query (it arrives think_s after the finish, or at its recorded
  arrival_s, never before), the drafts for the next step, then STEP at the same instant.

Drafts for step t+1 are proposed at the end of step t (after sampling) for the calls that sampled
a token and go on; a call's first step after its prefill emits its first token with no draft.
"""

from __future__ import annotations

import heapq
import math
import time as wallclock
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from agentspec_sim.budget import make_budget_policy
from agentspec_sim.cost.base import BatchShape, StepCostModel
from agentspec_sim.drafters.base import SpeculativeConfig, make_drafter
from agentspec_sim.engine.config import EngineConfig, ResolvedLimits
from agentspec_sim.engine.kv import KVCacheManager, cdiv
from agentspec_sim.engine.request import FINISHED, REFUSED, RUNNING, SKIPPED, WAITING, CallState
from agentspec_sim.engine.result import RunResult, StepLogBuilder
from agentspec_sim.engine.scheduler import ScheduledBatch, Scheduler, StepOutput
from agentspec_sim.trace.schema import Workload

ARRIVE, STEP, DONE = 0, 1, 2


class SimulationError(RuntimeError):
    """The run cannot go on (a call that can never fit, a broken invariant); says which and why."""


@dataclass
class _QueryRun:
    """One query instance (a tenant's copy of a trace query): its calls in order."""

    index: int
    query_id: str
    tenant: int
    calls: list[CallState]
    offset_s: float  # added to the trace's arrival_s of its calls
    arrival_s: float = math.nan
    finish_s: float = math.nan
    completed: bool = False


class Simulator:
    def __init__(self, workload: Workload, spec: SpeculativeConfig, config: EngineConfig, limits: ResolvedLimits,
                 cost: StepCostModel, progress: Callable[[int, int], None] | None = None) -> None:
        self.spec, self.config, self.limits, self.cost = spec, config, limits, cost
        self.progress = progress
        seeds = np.random.SeedSequence(config.seed).spawn(2)
        self.rng_arrivals = np.random.default_rng(seeds[0])
        self.rng_stagger = np.random.default_rng(seeds[1])
        self.kv = KVCacheManager(limits.num_kv_blocks, config.block_size, limits.max_model_len,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len)
        # One drafter per tenant: copies never share drafter state.
        self.drafters = [make_drafter(spec) for _ in range(config.replicate)]
        self.policy = make_budget_policy(spec)
        self.states: list[CallState] = []
        self.queries: list[_QueryRun] = []
        self.position_in_query: list[int] = []  # call index → its position in its query
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.step_pending = False
        self.pending_draft_s = 0.0
        self.step_count = 0
        self.done_calls = 0
        self.log = StepLogBuilder()
        self.num_refused = 0
        self._build(workload)

    # -- setup -------------------------------------------------------------------------------------
    def _build(self, workload: Workload) -> None:
        max_len = self.limits.max_model_len
        usable = self.limits.num_kv_blocks - 1
        for tenant in range(self.config.replicate):
            for query in workload.queries:
                suffix = "" if tenant == 0 else f"#{tenant}"
                states = []
                for call in query.calls:
                    if call.output_len == 0:
                        raise SimulationError(f"call {call.id!r} has an empty output (a call emits at least one token)")
                    target = max(0, min(call.output_len, max_len - call.prompt_len))
                    state = CallState(len(self.states), call, f"{call.id}{suffix}", tenant, len(self.queries), target)
                    needed = cdiv(call.prompt_len + target, self.config.block_size)
                    if call.prompt_len < max_len and needed > usable:
                        raise SimulationError(
                            f"call {call.id!r} needs {needed} KV blocks ({call.prompt_len + target} tokens) but the "
                            f"cache holds {usable} blocks of {self.config.block_size}; raise gpu_memory_utilization, "
                            "num_kv_blocks or tensor_parallel_size, or lower max_model_len")
                    self.position_in_query.append(len(states))
                    self.states.append(state)
                    states.append(state)
                self.queries.append(_QueryRun(len(self.queries), f"{query.query_id}{suffix}", tenant, states, 0.0))
        self._place_arrivals()

    def _place_arrivals(self) -> None:
        cfg = self.config
        if cfg.arrival == "poisson":
            gaps = self.rng_arrivals.exponential(1.0 / cfg.rate, size=len(self.queries))
            starts = np.cumsum(gaps) - gaps[0]  # the first query arrives at 0
        else:
            starts = np.zeros(len(self.queries))
            for q in self.queries:
                first = q.calls[0].call.arrival_s
                starts[q.index] = first if (cfg.arrival == "recorded" and first is not None) else 0.0
            copies = [q.index for q in self.queries if q.tenant > 0]
            if copies and cfg.replicate_stagger_s > 0:
                starts[copies] += self.rng_stagger.uniform(0.0, cfg.replicate_stagger_s, size=len(copies))
        for q in self.queries:
            recorded_first = q.calls[0].call.arrival_s or 0.0
            q.offset_s = float(starts[q.index]) - recorded_first
            q.arrival_s = float(starts[q.index])
            self._push(q.arrival_s, ARRIVE, (q, 0))

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        self.seq += 1

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        started = wallclock.perf_counter()
        handlers = {ARRIVE: self._on_arrive, STEP: self._on_step, DONE: self._on_done}
        while self.heap:
            self.now, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
        if self.scheduler.has_work():
            raise SimulationError("the event queue ran dry with calls still waiting or running")
        return self._result(wallclock.perf_counter() - started)

    def _on_arrive(self, payload: tuple[_QueryRun, int]) -> None:
        query, k = payload
        state = query.calls[k]
        state.arrival_s = self.now
        if state.prompt_len >= self.limits.max_model_len:
            state.status = REFUSED
            state.finish_s = self.now
            self.num_refused += 1
            for later in query.calls[k + 1:]:
                later.status = SKIPPED
            query.finish_s = self.now
            self._count_done(len(query.calls) - k)
            return
        self.scheduler.add_request(state)
        if not self.step_pending:
            self.step_pending = True
            self._push(self.now, STEP, None)

    def _on_step(self, _: object) -> None:
        batch = self.scheduler.schedule()
        if not batch.rows:
            if self.scheduler.has_work():
                raise SimulationError("an engine step scheduled nothing while calls wait (invariant CLOCK)")
            self.step_pending = False
            self.pending_draft_s = 0.0
            return
        query = np.asarray(batch.num_new, dtype=np.int64)
        context = np.asarray(batch.context, dtype=np.int64)
        decode = np.asarray(batch.decode, dtype=bool)
        forward = float(self.cost.step_time(BatchShape(query, context, ~decode)).total_s)
        drafted = np.fromiter((d.shape[0] for d in batch.drafts), dtype=np.int64, count=len(batch))
        base = forward
        if drafted.any():
            # The same batch without its drafts: the reference for t_A and t_V (paper §3.1).
            base = float(self.cost.step_time(BatchShape(query - drafted, context, ~decode)).total_s)
        draft_s, self.pending_draft_s = self.pending_draft_s, 0.0
        if self.config.check_invariants:
            self._check_step(batch, query)
        occupancy = (len(self.scheduler.running), len(self.scheduler.waiting))
        self._push(self.now + draft_s + forward, DONE, (batch, self.now, forward, draft_s, base, drafted, occupancy))

    def _on_done(self, payload: tuple) -> None:
        batch, start, forward, draft_s, base, drafted, occupancy = payload
        out = self.scheduler.update_from_output(batch)
        self._drafter_hooks(batch, out)
        for state in out.finished:
            self._finish(state)
        self._log_step(batch, out, start, forward, draft_s, base, drafted, occupancy)
        self._propose(out.sampled, len(batch))
        self.step_count += 1
        self._push(self.now, STEP, None)

    # -- pieces of DONE ---------------------------------------------------------------------------------
    def _drafter_hooks(self, batch: ScheduledBatch, out: StepOutput) -> None:
        for i, state in enumerate(batch.rows):
            e = int(out.emitted[i])
            if not e:
                continue
            drafter = self.drafters[state.tenant]
            if not state.started:
                state.started = True
                state.first_token_s = self.now
                drafter.start_call(state)
            end = state.prompt_len + state.num_emitted
            drafter.observe(state, state.history[end - e:end])
            if state.status == FINISHED:
                drafter.finish_call(state)

    def _finish(self, state: CallState) -> None:
        state.finish_s = self.now
        produced = state.history[state.prompt_len:]
        if not np.array_equal(produced, state.call.output_tokens[:state.target_len]):
            raise SimulationError(f"lossless check failed: call {state.call_id!r} emitted tokens that differ from "
                                  "its recording")
        self._count_done(1)
        query = self.queries[state.query_index]
        position = self.position_in_query[state.index]
        if position + 1 < len(query.calls):
            nxt = query.calls[position + 1]
            think = self.config.think_time if self.config.think_time is not None else nxt.call.think_s
            arrival = self.now + think
            if nxt.call.arrival_s is not None:
                arrival = max(arrival, nxt.call.arrival_s + query.offset_s)
            self._push(arrival, ARRIVE, (query, position + 1))
        else:
            query.finish_s = self.now
            query.completed = True

    def _propose(self, sampled: list[CallState], num_scheduled: int) -> None:
        if not sampled or self.spec.num_speculative_tokens == 0:
            return
        lens = self.policy.max_draft_lens(num_scheduled, sampled)
        # The V1 proposer drafts at most max_model_len − num_tokens tokens.
        room = np.fromiter((self.limits.max_model_len - s.num_tokens for s in sampled), dtype=np.int64,
                           count=len(sampled))
        lens = np.minimum(lens, room)
        keep = np.flatnonzero(lens > 0)
        if keep.size == 0:
            return
        rows = [sampled[i] for i in keep]
        lens = lens[keep]
        if len(self.drafters) == 1:
            proposals = self.drafters[0].propose(rows, lens)
            for row, draft in zip(rows, proposals, strict=True):
                row.drafts = draft
        else:
            by_tenant: dict[int, list[int]] = {}
            for j, row in enumerate(rows):
                by_tenant.setdefault(row.tenant, []).append(j)
            for tenant, idx in by_tenant.items():
                proposals = self.drafters[tenant].propose([rows[j] for j in idx], lens[idx])
                for j, draft in zip(idx, proposals, strict=True):
                    rows[j].drafts = draft
        # One proposer pass over all drafting rows (the engine runs one, whatever the tenants).
        self.pending_draft_s = float(self.drafters[0].draft_time(self.cost, rows, lens))

    def _count_done(self, n: int) -> None:
        self.done_calls += n
        if self.progress is not None:
            self.progress(self.done_calls, len(self.states))

    def _log_step(self, batch: ScheduledBatch, out: StepOutput, start: float, forward: float, draft_s: float,
                  base: float, drafted: np.ndarray, occupancy: tuple[int, int]) -> None:
        b = len(batch)
        d = int(drafted.sum())
        acc = int(out.accepted.sum())
        self.log.add_step(
            call=np.fromiter((s.index for s in batch.rows), dtype=np.int64, count=b),
            decode=np.asarray(batch.decode, dtype=bool),
            position=np.asarray(batch.position, dtype=np.int64),
            context_len=np.asarray(batch.context, dtype=np.int64),
            scheduled=np.asarray(batch.num_new, dtype=np.int64),
            drafts=batch.drafts, accepted=out.accepted, emitted=out.emitted,
            step={
                "time_s": start, "batch_size": b, "scheduled_tokens": float(sum(batch.num_new)),
                "forward_s": forward, "draft_s": draft_s, "D": d, "accepted": acc,
                "t_A": base / b if d else math.nan,
                "t_V": (forward - base) / d if d else math.nan,
                "t_D": draft_s / d if d else math.nan,
                "running": occupancy[0], "waiting": occupancy[1],
                "free_blocks": self.kv.pool.num_free, "budget": self.cost.token_budget(b),
                "decode_calls": int(sum(batch.decode)),
            },
            bound=batch.bound,
        )

    # -- checks ----------------------------------------------------------------------------------------
    def _check_step(self, batch: ScheduledBatch, query: np.ndarray) -> None:
        sched = self.scheduler
        if int(query.sum()) > self.limits.max_num_batched_tokens:
            raise SimulationError(f"step scheduled {int(query.sum())} tokens > max_num_batched_tokens (BUDGET)")
        if len(sched.running) > self.limits.max_num_seqs:
            raise SimulationError(f"{len(sched.running)} running > max_num_seqs (SEQS)")
        pool = self.kv.pool
        held = sum(1 for r in pool.ref[1:] if r > 0)
        if held + pool.num_free != pool.usable:
            raise SimulationError(f"KV blocks: {held} held + {pool.num_free} free ≠ {pool.usable} usable (BLOCKS)")
        refs = sum(len(s.block_ids) for s in sched.running)
        if refs != sum(pool.ref):
            raise SimulationError(f"KV references {sum(pool.ref)} ≠ blocks held by running calls {refs} (REFS)")
        for s in sched.running:
            if s.status != RUNNING or len(s.block_ids) * self.config.block_size < s.num_computed:
                raise SimulationError(f"call {s.call_id!r}: {s.num_computed} computed tokens in "
                                      f"{len(s.block_ids)} blocks (SLOTS)")
        for s in sched.waiting:
            if s.status != WAITING or s.block_ids:
                raise SimulationError(f"waiting call {s.call_id!r} holds KV blocks (SLOTS)")
        arrived = sum(1 for s in self.states if not math.isnan(s.arrival_s))
        finished = sum(1 for s in self.states if s.status in (FINISHED, REFUSED))
        if arrived != finished + len(sched.running) + len(sched.waiting):
            raise SimulationError(f"CALLS: {arrived} arrived ≠ {finished} finished or refused + "
                                  f"{len(sched.running)} running + {len(sched.waiting)} waiting")

    # -- result ------------------------------------------------------------------------------------------
    def _result(self, wall_s: float) -> RunResult:
        ids = [s.call_id for s in self.states]
        steps, engine_steps = self.log.build(self.spec.name, ids)
        st = self.states
        calls = pl.DataFrame({
            "call_id": ids,
            "query_id": [self.queries[s.query_index].query_id for s in st],
            "tenant": np.fromiter((s.tenant for s in st), dtype=np.int64, count=len(st)),
            "seq": np.fromiter((s.call.seq for s in st), dtype=np.int64, count=len(st)),
            "status": [s.status for s in st],
            "arrival_s": np.fromiter((s.arrival_s for s in st), dtype=np.float64, count=len(st)),
            "first_token_s": np.fromiter((s.first_token_s for s in st), dtype=np.float64, count=len(st)),
            "finish_s": np.fromiter((s.finish_s for s in st), dtype=np.float64, count=len(st)),
            "prompt_len": np.fromiter((s.prompt_len for s in st), dtype=np.int64, count=len(st)),
            "output_len": np.fromiter((s.num_emitted for s in st), dtype=np.int64, count=len(st)),
            "recorded_output_len": np.fromiter((s.output_len for s in st), dtype=np.int64, count=len(st)),
            "truncated": np.fromiter((s.target_len < s.output_len and s.status == FINISHED for s in st), dtype=bool,
                                     count=len(st)),
            "prefix_hit_tokens": np.fromiter((s.prefix_hit_tokens for s in st), dtype=np.int64, count=len(st)),
            "drafted": np.fromiter((s.drafted for s in st), dtype=np.int64, count=len(st)),
            "accepted": np.fromiter((s.accepted for s in st), dtype=np.int64, count=len(st)),
            "draft_steps": np.fromiter((s.draft_steps for s in st), dtype=np.int64, count=len(st)),
            "decode_steps": np.fromiter((s.decode_steps for s in st), dtype=np.int64, count=len(st)),
            "preemptions": np.fromiter((s.preemptions for s in st), dtype=np.int64, count=len(st)),
            "refused": [s.status == REFUSED for s in st],
        }).with_columns(pl.col("arrival_s", "first_token_s", "finish_s").fill_nan(None))
        qs = self.queries
        queries = pl.DataFrame({
            "query_id": [q.query_id for q in qs],
            "tenant": np.fromiter((q.tenant for q in qs), dtype=np.int64, count=len(qs)),
            "calls": np.fromiter((len(q.calls) for q in qs), dtype=np.int64, count=len(qs)),
            "arrival_s": np.fromiter((q.arrival_s for q in qs), dtype=np.float64, count=len(qs)),
            "finish_s": np.fromiter((q.finish_s for q in qs), dtype=np.float64, count=len(qs)),
            "completed": [q.completed for q in qs],
            "output_tokens": np.fromiter((sum(s.num_emitted for s in q.calls) for q in qs), dtype=np.int64,
                                         count=len(qs)),
        }).with_columns((pl.col("finish_s") - pl.col("arrival_s")).alias("latency_s")).with_columns(
            pl.col("arrival_s", "finish_s", "latency_s").fill_nan(None))
        return RunResult(self.config, self.limits, self.spec, self.spec.name, steps, engine_steps, calls, queries,
                         num_preemptions=self.scheduler.num_preemptions, wall_s=wall_s)
