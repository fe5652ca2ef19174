"""The event loop: call arrivals, engine steps, and the agent workflow between calls.

A heap of (time, sequence number, event); ties go to the earlier-pushed event. Three events, each
with its whole effect in one handler:

- ARRIVE(call): a call reaches the server. A prompt of ≥ max_model_len tokens is refused as vLLM
  refuses it (`_validate_prompt_len`); the agent gets an error, so the rest of its query is skipped
  (counted). Otherwise it joins the waiting queue, no earlier than the step the scheduler's lag allows
  (`_first_step_for_arrival`, engine/scheduler.py), and, if the engine is idle, a step starts now.
- STEP: the scheduler builds the batch and the engine runs it (`Scheduler.run`: schedule, forward,
  verification and emission); its duration is the drafting time spent proposing the drafts it
  verifies (model-free proposers run on the CPU after the previous step, serialized with it as in
  vLLM's synchronous V1 loop) plus `cost.step_time(batch)`. DONE is pushed at the end.
- DONE: the effects that wait for the step's end time: first-token and finish times, the next call of
  each finished call's query (`layout.next_arrival_s`: think_s after the finish, never before its
  recorded arrival_s), the drafting owed to the step (below), then STEP at the same instant. (Emission
  happens at STEP time but only touches the running calls, which no ARRIVE in between reads: arrivals
  only join the waiting queue.)

Drafts for step t+1 are proposed at the end of step t (after sampling) for the calls that sampled
a token and go on; a call's first step after its prefill emits its first token with no draft. Who
drafts is fixed when the run is built, one of four (`_draft_after_run`): nothing (`normal`); vLLM's V1
runner driving a suffix proposer after every step (`_per_step_drafts`); the drafter's fast path observing
and proposing in one compiled call (`EngineDrafting.after_step`); or the drafter's hooks, then its
proposal (`_propose`: the fast path's compiled proposal where it has one, else `propose`).

Runs of steps. A STEP event runs as many steps as nothing outside the engine can change: no other
event pending, no drafter that must see the tokens (a drafter proposes after every step that
emitted — except where its fast path drafts between steps inside the compiled loop, engine/drafting.py
`compiled_step`: the n-gram proposers, `eagle3`/`mtp` from their acceptance tables, `agentspec` from its
history in steps where no call starts or finishes, `suffix` in steps where exactly the active calls
emitted; a step its kernel declines stops the run and the event loop does it), every next call of a
query arriving the instant its predecessor ends (those join the waiting queue inside the run). With an
event pending (a query sent later under a load protocol, a call after its think time) a run takes as
many steps as surely all start before that event (`_step_bound`: an upper bound on a step's time from
the cost model, which is MONOTONE) and ends at the first step in which a call finishes, so no step of
it could have seen the event. engine/pricing.py prices the run's steps at once and DONE is pushed at
the end of the last; DONE then does for the run what it does for one step. The steps, their order and
their times are those of one step per STEP event (`max_run_steps = 1`; tests/test_engine_golden.py pins
whole runs, tests/test_engine_fast_paths.py compares the two), only without a trip through the heap per
step: with `normal`, the default trace is a handful of runs. The t_A / t_V reference (each drafting step
priced without its drafts) times nothing and is priced for the whole log when the run ends.

With `--data-parallel-size` a `Simulator` is one rank of engine/data_parallel.py's front (`Front`): the heap is
the front's, ARRIVE events go to it (it routes each call to a rank), every finish stops a run of steps (the
router's counts move), and for a MoE model STEP asks the front for a step of all ranks at once.
"""

from __future__ import annotations

import heapq
import itertools
import time as wallclock
import weakref
from collections.abc import Callable
from functools import partial
from typing import Protocol

import numpy as np
import polars as pl

from agentspec_sim.cost.base import BatchShape, StepCostModel
from agentspec_sim.engine.budget import make_budget_policy
from agentspec_sim.engine.config import MAX_CLOCK_S, EngineConfig, ResolvedLimits
from agentspec_sim.engine.counters import LG_EVENTS, Q_ADMIT_LAG, Q_RUNNING, Q_WAITING, SC_ROWS, SC_SAMPLED, SC_TOP
from agentspec_sim.engine.drafting import BaseDrafter, RunView, SpeculativeConfig, new_drafter
from agentspec_sim.engine.invariants import check_run, check_step
from agentspec_sim.engine.kv import KVCacheManager, cdiv
from agentspec_sim.engine.layout import call_layout, next_arrival_s
from agentspec_sim.engine.load import is_gated, request_rate_arrivals, send_order, shuffles
from agentspec_sim.engine.pricing import StepPricer
from agentspec_sim.engine.request import (
    FINISHED,
    NO_NEXT,
    NOT_CHAINED,
    REFUSED,
    S_FINISHED,
    SKIPPED,
    CallState,
    CallTable,
    QueryRun,
)
from agentspec_sim.engine.result import RunResult, StepLogBuilder, calls_frame, queries_frame
from agentspec_sim.engine.scheduler import (
    EV_ARRIVE,
    EV_FINISH,
    EV_FIRST,
    EV_PREEMPT,
    RUN_EMPTY,
    RUN_FULL,
    Scheduler,
    SimulationError,
)
from agentspec_sim.engine.watch import RunWatch, emitted_between
from agentspec_sim.trace.schema import Workload

ARRIVE, STEP, DONE = 0, 1, 2
_UNKNOWN = object()

__all__ = ["SimulationError", "Simulator"]


class Front(Protocol):
    """What a data-parallel rank sees of the deployment it is part of (engine/data_parallel.py)."""

    heap: list[tuple[float, int, int, object]]  # the one event heap of all ranks
    seq: itertools.count  # event order among equal times, over all ranks
    ranks: list[Simulator]
    lockstep: bool  # the ranks step together (a MoE model)

    def wake(self, t: float) -> None: ...  # a rank has work: a lockstep step at t

    def call_finished(self, rank: int) -> None: ...

    def count_done(self, n: int) -> None: ...


class Simulator:
    # AgentSpec's lookups and suffix decoding's prompt-tree drafts come from tables made once per workload
    # where that is exact (drafters/agentspec/tables.py, suffix_tables.py); tests turn it off to compare.
    draft_tables = True

    def __init__(self, workload: Workload, spec: SpeculativeConfig, config: EngineConfig, limits: ResolvedLimits,
                 cost: StepCostModel, progress: Callable[[int, int], None] | None = None, *,
                 fast_path: bool = True, front: Front | None = None, rank: int = 0) -> None:
        self.spec, self.config, self.limits, self.cost = spec, config, limits, cost
        # With data parallelism this is one rank of `front` (engine/data_parallel.py), which routes the calls,
        # holds the shared event heap and, for a MoE model, steps the ranks in lockstep.
        self.front, self.rank = front, rank
        self.progress = progress
        seeds = np.random.SeedSequence(config.seed).spawn(2)
        self.rng_arrivals = np.random.default_rng(seeds[0])
        self.rng_stagger = np.random.default_rng(seeds[1])
        # One drafter per tenant: copies never share drafter state.
        self.drafters = [new_drafter(spec) for _ in range(config.tenants)]
        for drafter in self.drafters:
            drafter.bind_workload(workload)
            drafter.bind_cost_model(cost)
        kind = type(self.drafters[0])
        self.policy = make_budget_policy(spec, cost, kind.budget_policy)
        # Hooks a drafter does not override are no-ops and are not called; a drafter that proposes
        # nothing and has no hooks (normal) need not see each step.
        self.hooks = tuple(getattr(kind, hook) is not getattr(BaseDrafter, hook)
                           for hook in ("start_call", "observe", "finish_call"))
        self.inert = spec.num_speculative_tokens == 0 and not any(self.hooks)
        # vLLM's V1 runner drives a suffix proposer its own way after every step (`_per_step_drafts`).
        self.per_step = kind.driven_per_step
        # The V1 runner skips its proposer for a batch near max_model_len (`_propose`); Model Runner V2
        # drafters (ngram-v2) do not.
        self.skips_unfit_batches = kind.v1_runner
        self.states: list[CallState] = []
        self.queries: list[QueryRun] = []
        self.position_in_query: list[int] = []  # call index → its position in its query
        self.heap: list[tuple[float, int, int, object]] = front.heap if front is not None else []
        self.gate_groups: list[list[QueryRun]] | None = None  # gated protocols (engine/load.py)
        self._k_bound: int | object | None = _UNKNOWN  # the policy's longest draft (`_draft_len_bound`), once
        # `_step_bound` of the calls in the engine, kept until a call joins them or ends its prefill (`_UNKNOWN`:
        # to compute).
        self._bound: float | object | None = _UNKNOWN
        self.seq = front.seq if front is not None else itertools.count()  # event order among equal times
        # This engine's event kinds: a rank's own STEP / DONE (ARRIVE goes to whoever routes the calls).
        self.kinds = (ARRIVE, STEP + 2 * rank, DONE + 2 * rank)
        self.now = 0.0
        self.step_pending = False
        self.pending_draft_s = 0.0
        self.preempted: list[tuple[int, int]] = []  # (step, call index) in preemption order
        self.step_count = 0
        self.done_calls = 0
        self.num_refused = 0
        # Longest run of steps per STEP event (1: one step per event, the plain loop; tests compare). The
        # invariant checks run on the path users run: after each run of steps, and over the whole log at the end.
        # A per-step drafter must see every step, emitting or not: its runs are one step long.
        self.max_run_steps = 1 if self.per_step else 1 << 40
        self._build(workload)
        # vLLM's async scheduling (engine/scheduler.py): steps the scheduler makes before it reads a call that
        # reaches the core while a step runs (1 async, 0 synchronous), and one more for a call a client sends on
        # reading a step's output (none where the process stepping the engine adds calls between steps).
        async_scheduling = kind.async_scheduling if config.async_scheduling is None else config.async_scheduling
        self._core_lag = 1 if async_scheduling else 0
        # A synchronous engine also waits for its host work every step (the pricer adds it).
        self.pricer = StepPricer(cost, limits.max_num_batched_tokens, config.check_invariants,
                                 synchronous=not async_scheduling)
        self.scheduler.qu.q[Q_ADMIT_LAG] = self._core_lag + (0 if config.in_process_client else 1)
        self._in_flight = (-1, -np.inf)
        self._continues = False
        if progress is not None:
            progress(0, len(self.states))  # started (the drafters' workload tables may take a while to build)
        # The drafter's fast path for this run (engine/drafting.py), if it has one (tests turn it off to compare).
        self.fast = self.drafters[0].engine_drafting(self._run_view()) if fast_path else None
        if self.fast is not None and self.per_step:
            self.max_run_steps = 1 << 40  # the compiled loop drives the proposer after every step itself
        if self.fast is not None and self.fast.replaces_hooks:
            self.hooks = (False, False, False)  # drafting reads the tables, not per-call drafter state
        # What the event loop drafts after each run of steps, for its last step: one way for the whole run (a
        # function of the class, not a bound method: the simulator holding its own method would be a cycle).
        if self.inert:
            self._draft_after_run = _no_drafting
        elif self.per_step:
            self._draft_after_run = Simulator._per_step_drafts  # vLLM's V1 runner driving a suffix proposer
        elif self.fast is not None and self.fast.observes_steps:
            self._draft_after_run = Simulator._fast_observes_then_propose
        else:
            self._draft_after_run = Simulator._hooks_then_propose

    # -- setup -------------------------------------------------------------------------------------
    def _run_view(self) -> RunView:
        """What the drafter's fast path sees of this run (engine/drafting.py `RunView`)."""
        return RunView(drafters=self.drafters, spec=self.spec, states=self.states, table=self.table,
                       scheduler=self.scheduler, cost=self.cost, max_num_seqs=self.limits.max_num_seqs,
                       max_model_len=self.limits.max_model_len, tokens_digest=self.layout.tokens_digest,
                       k_of_batch=self.policy.k_of_batch(self.limits.max_num_seqs), fixed_k=self.policy.fixed,
                       skips_unfit_batches=self.skips_unfit_batches, use_tables=self.draft_tables,
                       sees_every_call=self.front is None,
                       runnable=_weak(self._runnable_calls), drafter_hooks=_weak(self._drafter_hooks))

    def _runnable_calls(self) -> tuple[list[np.ndarray], list[np.ndarray | None], np.ndarray]:
        """Every call's prompt and the output it emits in this run (cut at max_model_len), None for the calls
        that never run (refused at max_model_len, and their query's later calls); the outputs' lengths (−1:
        never runs), the tables' keys."""
        max_len = self.limits.max_model_len
        prompts: list[np.ndarray] = []
        outputs: list[np.ndarray | None] = []
        refused: set[int] = set()
        for state in self.states:
            runs = state.query_index not in refused and state.prompt_len < max_len
            if not runs:
                refused.add(state.query_index)
            history_tokens = state.history
            prompts.append(history_tokens[:state.prompt_len])
            outputs.append(history_tokens[state.prompt_len:] if runs else None)
        lengths = np.array([-1 if o is None else o.shape[0] for o in outputs], dtype=np.int64)
        return prompts, outputs, lengths

    def _build(self, workload: Workload) -> None:
        cfg, max_len, bs = self.config, self.limits.max_model_len, self.config.block_size
        layout = call_layout(workload, cfg.tenants, max_len, bs, cfg.think_time)
        cols = layout.columns
        if self.front is not None:
            # With data parallelism each call is routed when it arrives and each finish moves the router's
            # counts: every call's end stops a run of steps, and its successor arrives through the event loop.
            cols = {**cols, "chain_next": np.full_like(cols["chain_next"], NOT_CHAINED)}
        elif is_gated(cfg):
            # A query's end frees its slot (engine/load.py) at that instant: its last call stops a run of steps.
            cols = {**cols, "chain_next": np.where(cols["chain_next"] == NO_NEXT, NOT_CHAINED, cols["chain_next"])}
        # The first call no run can replay: an empty output, or more KV blocks than the cache holds.
        usable = self.limits.num_kv_blocks - 1
        over = np.flatnonzero((cols["prompt_len"] < max_len) & (layout.blocks_needed > usable))
        first_over = int(over[0]) if over.shape[0] else len(layout.calls)
        if 0 <= layout.first_empty < first_over:
            raise SimulationError(f"call {layout.calls[layout.first_empty].id!r} has an empty output (a call emits "
                                  "at least one token)")
        if first_over < len(layout.calls):
            call, needed = layout.calls[first_over], int(layout.blocks_needed[first_over])
            tokens = call.prompt_len + int(cols["target_len"][first_over])
            raise SimulationError(
                f"call {call.id!r} needs {needed} KV blocks ({tokens} tokens) but the cache holds {usable} blocks "
                f"of {bs}; raise gpu_memory_utilization, num_kv_blocks or tensor_parallel_size, or lower max_model_len")
        self.queries = [QueryRun(q, query_id, tenant, [], 0.0) for q, (query_id, tenant) in enumerate(layout.queries)]
        self.position_in_query = layout.position
        table = CallTable.build(cols, layout.tokens, layout.region_caps, slots=self.limits.max_num_seqs,
                                blocks_per_slot=cdiv(max_len, bs) + 1)
        query_of = layout.query_of
        # Identical copies draw the same acceptance (engine/load.py): their random keys are the trace call's id.
        draw_ids = [call.id for call in layout.calls] if cfg.copies_protocol else None
        self.states = CallState.in_table(table, layout.calls, layout.ids, query_of, draw_ids)
        for state in self.states:
            self.queries[state.query_index].calls.append(state)
        for query in self.queries:
            if query.calls:
                query.calls[-1].last_in_query = True
        self.table = table
        self.layout = layout
        # One call-step per output token at most, plus the prefill chunks: room for all of it up front.
        rows = int((cols["target_len"] + cols["prompt_len"] // self.limits.max_num_batched_tokens + 2).sum())
        if self.front is not None:  # a data-parallel rank runs its share of the calls (the log grows if need be)
            rows = rows // self.config.data_parallel_size + 1024
        self.log = StepLogBuilder(rows, rows // min(self.limits.max_num_seqs, 8) + 1024, 4 * len(layout.calls) + 1024)
        self.kv = KVCacheManager(self.limits.num_kv_blocks, bs, max_len, cfg.enable_prefix_caching, table)
        self.scheduler = Scheduler(self.kv, self.limits.max_num_seqs, self.limits.max_num_batched_tokens, max_len)
        if self.per_step:
            # The suffix proposer walks vLLM's persistent batch row by row (`_per_step_drafts`).
            self.scheduler.track_batch_rows()
        if self.front is None:  # with data parallelism the front has rank 0 place them once every rank exists
            self._place_arrivals()

    def _place_arrivals(self) -> None:
        cfg = self.config
        order = send_order(len(self.queries), cfg.seed, shuffles(cfg))
        if cfg.arrival == "request-rate":
            starts = np.empty(len(self.queries))
            starts[order] = request_rate_arrivals(len(self.queries), cfg.rate, cfg.burstiness, cfg.seed)
        elif cfg.arrival == "poisson":
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
        if starts.shape[0] and not float(starts.max()) <= MAX_CLOCK_S:
            late = int(np.argmax(starts))
            raise SimulationError(
                f"query {self.queries[late].query_id!r} would be sent at {float(starts[late]):.3g} s: past "
                f"{MAX_CLOCK_S:.0e} s (~3,000 years) the simulated clock (float64) can no longer resolve one step; "
                "raise the request rate (or check the trace's arrival_s)")
        if is_gated(cfg):
            self._gate_queries(starts, order)
            return
        for i in order:  # sends at one instant reach the server in the client's order
            self._send(self.queries[i], float(starts[i]))

    def _send(self, query: QueryRun, at: float) -> None:
        """Query `query`'s first call reaches the server at `at` (its later calls follow it)."""
        query.offset_s = at - (query.calls[0].call.arrival_s or 0.0)
        query.arrival_s = at
        if self.front is not None:  # every rank's copy of the query: its later calls may run anywhere
            for other in self.front.ranks[1:]:
                copy = other.queries[query.index]
                copy.offset_s, copy.arrival_s = query.offset_s, at
        self._push(at, ARRIVE, (query, 0))

    def _gate_queries(self, starts: np.ndarray, order: np.ndarray) -> None:
        """Hold the queries for their turn (engine/load.py): max concurrency lets `max_concurrency` queries be
        in flight, in the order they arrive; copies send one query's copies together, the next query's when
        all have ended."""
        cfg = self.config
        if cfg.copies_protocol:
            per_copy = len(self.queries) // cfg.copies  # instances are copy-major (engine/layout.py)
            groups = [[self.queries[t * per_copy + q] for t in range(cfg.copies)] for q in range(per_copy)]
            self.gate_limit = 1
            self.gate_due = [0.0] * len(groups)  # each batch the instant the previous one ends
        else:
            position = np.empty_like(order)
            position[order] = np.arange(order.shape[0])  # ties (all sent at 0) go in the client's send order
            groups = [[q] for q in sorted(self.queries, key=lambda q: (starts[q.index], position[q.index]))]
            self.gate_limit = int(cfg.max_concurrency)
            self.gate_due = [float(starts[g[0].index]) for g in groups]
        self.gate_groups = groups
        self.gate_of = {q.index: i for i, g in enumerate(groups) for q in g}
        self.gate_left = [len(g) for g in groups]
        self.gate_next = 0
        self.gate_in_flight = 0
        self._open_gate(0.0)

    def _open_gate(self, now: float) -> None:
        while self.gate_in_flight < self.gate_limit and self.gate_next < len(self.gate_groups):
            i = self.gate_next
            self.gate_next += 1
            self.gate_in_flight += 1
            at = max(now, self.gate_due[i])  # a slot freed before the query arrives is taken when it does
            for query in self.gate_groups[i]:
                self._send(query, at)

    def _query_ended(self, query: QueryRun, now: float) -> None:
        """A query's last call finished (or one of its calls was refused): under a gated protocol its slot
        passes on at this instant."""
        if self.rank:  # rank 0 holds the gate
            ranks = self.front.ranks
            ranks[0]._query_ended(ranks[0].queries[query.index], now)
            return
        if self.gate_groups is None:
            return
        g = self.gate_of[query.index]
        self.gate_left[g] -= 1
        if self.gate_left[g] == 0:
            self.gate_in_flight -= 1
            self._open_gate(now)

    def _push(self, t: float, kind: int, payload: object) -> None:
        if kind == STEP and self.front is not None and self.front.lockstep:
            self.front.wake(t)  # the ranks step together
            return
        heapq.heappush(self.heap, (t, next(self.seq), self.kinds[kind], payload))

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, watch: RunWatch | None = None) -> RunResult:
        """The whole run; with `watch` (engine/watch.py), until the watch stops it."""
        started = wallclock.perf_counter()
        handlers = {ARRIVE: self._on_arrive, STEP: self._on_step, DONE: self._on_done}
        if watch is not None:
            return self._run_watched(watch, handlers, started)
        while self.heap:
            self.now, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
        return self._ended(started)

    def _run_watched(self, watch: RunWatch, handlers: dict, started: float) -> RunResult:
        """The loop of `run`, asking `watch` after each DONE at or past its `next_s` (every step run so far has
        then ended): a separate loop, so a run nobody watches pays nothing for it."""
        so_far = EngineSoFar(self)
        while self.heap:
            self.now, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
            if kind == DONE and self.now >= watch.next_s and watch.look(so_far):
                result = self._result(wallclock.perf_counter() - started)
                result.stopped_s = self.now
                return result
        return self._ended(started)

    def _ended(self, started: float) -> RunResult:
        if self.scheduler.has_work():
            raise SimulationError("the event queue ran dry with calls still waiting or running")
        if self.fast is not None:
            self.fast.finish_run()
        if self.config.check_invariants:
            # CLOCK, CAUSALITY, WORK, DONE over the whole log (engine/invariants.py)
            check_run(self.log, self.table, self.states, [q.calls for q in self.queries])
        return self._result(wallclock.perf_counter() - started)

    def _on_arrive(self, payload: tuple[QueryRun, int]) -> None:
        query, k = payload
        state = query.calls[k]
        if not self.now <= MAX_CLOCK_S:
            raise SimulationError(
                f"call {state.call_id!r} would arrive at {self.now:.3g} s: past {MAX_CLOCK_S:.0e} s (~3,000 years) the "
                "simulated clock (float64) can no longer resolve one step; check the request rate, --think-time and "
                "the trace's arrival_s / think_s")
        state.arrival_s = self.now
        if state.prompt_len >= self.limits.max_model_len:
            state.status = REFUSED
            state.finish_s = self.now
            self.num_refused += 1
            for later in query.calls[k + 1:]:
                later.status = SKIPPED
            query.finish_s = self.now
            self._count_done(len(query.calls) - k)
            self._query_ended(query, self.now)
            return
        self.table.cols["not_before"][state._r] = self._first_step_for_arrival()
        self.scheduler.add_row(state._r)
        self._bound = _UNKNOWN
        if not self.step_pending:
            self.step_pending = True
            self._push(self.now, STEP, None)

    def _first_step_for_arrival(self) -> int:
        """The first step whose schedule sees a call reaching the engine now (engine/scheduler.py): the one after
        the step in flight plus the lag. A call sent the instant a step ends (the client read a finish, or a send
        time that falls there) arrives while the next step runs, where the engine goes on; an idle engine
        sees it at once."""
        last, end = self._in_flight
        if self.now < end:
            return last + 1 + self._core_lag
        if self.now == end and self._continues:
            return last + 1 + int(self.scheduler.qu.q[Q_ADMIT_LAG])
        return 0

    def _on_step(self, _: object) -> None:
        """Run the scheduler (`Scheduler.run`) for as many steps as nothing outside it can change
        (one when other events are pending), price them, and push DONE at the end of the last."""
        chain = not self.heap
        room = self.max_run_steps if chain or self.max_run_steps == 1 else min(self.max_run_steps,
                                                                               self._steps_before(self.heap[0][0]))
        steps = self._schedule_run(room, chain)
        if steps == 0:
            return
        end = self.pricer.price(self.log, self.step_count, self.step_count + steps, self.now, self.pending_draft_s)
        self.pending_draft_s = 0.0
        self._in_flight = (self.step_count + steps - 1, end)
        self._push(end, DONE, (self.step_count, self.step_count + steps))

    def _schedule_run(self, room: int, chain: bool) -> int:
        """Schedule and run up to `room` steps (logged, not yet priced); 0 when there was nothing to run (the
        engine then idles until the next arrival)."""
        sched, log = self.scheduler, self.log
        seqs = self.limits.max_num_seqs
        steps = 0
        drafting = self.fast.run_state() if self.fast is not None else None  # also for one step: same containers
        while True:
            done, why = sched.run(log.buf, room - steps, self.step_count + steps, chain, not self.inert, drafting)
            steps += done
            if why != RUN_FULL:
                break
            log.reserve(seqs * 64, 64, seqs * 192, seqs * self.table.slot_drafts.shape[1])
        if why == RUN_EMPTY and steps:
            raise SimulationError("an engine step scheduled nothing while calls wait (invariant CLOCK)")
        if steps == 0:
            if sched.has_work():
                raise SimulationError("an engine step scheduled nothing while calls wait (invariant CLOCK)")
            self.step_pending = False
            self.pending_draft_s = 0.0
        return steps

    def _steps_before(self, t_next: float) -> int:
        """How many steps a run may take with an event pending at `t_next` (an arrival): as many as surely all
        start before it, so none of them would have seen it — m with (m − 1)·τ < t_next − now, τ an upper
        bound on one step's drafting plus forward time over the next steps (`_step_bound`). The run stops
        anyway at the first step in which a call finishes (its successor arrives through the event loop), so
        nothing joins the engine inside it. At least 1 (the one step per event of the plain loop)."""
        gap = t_next - self.now
        if gap <= 0.0:
            return 1
        bound = self._step_bound()
        if bound is None or not bound > 0.0:
            return 1
        steps = gap / (bound * (1.0 + 1e-9))  # the margin covers the rounding of summed step times
        return max(1, int(min(steps, float(self.max_run_steps))))

    def _step_bound(self) -> float | None:
        """Seconds no step can exceed while the calls now in the engine (running and waiting) are all it holds:
        the cost model priced on a batch that dominates every batch they can form (MONOTONE: more tokens or
        context never cost less) — min(max_num_seqs, calls) calls, each at the largest final context of
        those calls, each with the most tokens one can schedule in a step: 1 + the longest draft the budget
        policy allows, or its prefill left (capped by the token budget); any call's whole context when the
        KV cache could run out (a preempted call is recomputed) — plus, on a synchronous engine, the host work
        of a step of that many calls, and the drafter's bound on one proposal over those rows. None where that
        cannot be bounded (a policy or drafter with no stated maximum).

        Kept until a call joins the engine or ends its prefill: it still bounds the steps of any subset of the
        calls it was made for (fewer calls, each with no more context; no more tokens left to prefill, and none
        recomputed where all fit without preemption), so the steps are the same (HORIZON), with fewer bounds made. (Kept
        past a prefill's end it would still be a bound, but a prefill chunk's: the runs after it, all decodes,
        would be cut far shorter than they need be.)"""
        if self._bound is _UNKNOWN:
            self._bound = self._new_step_bound()
        return self._bound

    def _new_step_bound(self) -> float | None:
        qu = self.scheduler.qu
        running, waiting = int(qu.q[Q_RUNNING]), int(qu.q[Q_WAITING])
        rows = qu.running[:running] if not waiting else np.concatenate([qu.running[:running],
                                                                         self.scheduler._waiting_rows()])
        if rows.shape[0] == 0:
            return None
        k = self._draft_len_bound()
        col = self.table.cols
        final = col["prompt_len"][rows] + col["target_len"][rows]
        n = min(rows.shape[0], self.limits.max_num_seqs)
        # The n largest final contexts (order within a batch does not change its price).
        context = final if n == final.shape[0] else np.partition(final, final.shape[0] - n)[final.shape[0] - n:]
        budget = self.limits.max_num_batched_tokens
        bs = self.config.block_size
        demand = int(((final + (k or budget)) // bs + 2).sum())
        if k is not None and demand <= self.kv.pool.usable:  # every call fits at once: nothing is preempted
            left = col["prompt_len"][rows] + col["num_emitted"][rows] - col["num_computed"][rows]
            tokens = max(1 + k, min(budget, int(left.max())))
        else:
            tokens = min(budget, int(final.max()))
        forward = float(self.cost.step_time(BatchShape(np.full(n, tokens, dtype=np.int64), context,
                                                       np.zeros(n, dtype=bool))).total_s)
        if self.pricer.synchronous:  # the host work a synchronous step waits for (non-decreasing in the batch)
            forward += float(self.cost.sync_host_time(np.array([n]))[0])
        if self.spec.num_speculative_tokens == 0 and k == 0:
            return forward
        draft = self.drafters[0].draft_time_bound(self.cost, n, max(k or 1, 1), context)
        return None if draft is None else forward + draft

    def _draft_len_bound(self) -> int | None:
        """The longest draft the budget policy lets a call propose (drafters propose within it); None: unstated."""
        if self._k_bound is not _UNKNOWN:
            return self._k_bound
        longest = self.policy.longest_draft(self.limits.max_num_seqs)
        self._k_bound = None if longest is None else max(longest, self.spec.num_speculative_tokens)
        return self._k_bound

    def _on_done(self, payload: tuple[int, int]) -> None:
        """DONE of steps k0 … k1 − 1: time the run's events (first tokens, finishes, next calls that
        arrived at once), then the last step's drafter hooks, finishes and the next drafts."""
        k0, k1 = payload
        b = self.log.buf
        ends = [*b.steps.time_s[k0 + 1:k1].tolist(), self.now] if k1 - k0 > 1 else [self.now]
        n_ev = int(b.ctr[LG_EVENTS])
        if n_ev:
            events = b.events[:n_ev]
            kinds, rows, at = events["kind"].tolist(), events["call"].tolist(), (events["step"] - k0).tolist()
            b.ctr[LG_EVENTS] = 0
            col = self.table.cols
            chained = {r for kind, r in zip(kinds, rows, strict=True) if kind == EV_ARRIVE}
            for kind, r, j in zip(kinds, rows, at, strict=True):
                if kind == EV_FIRST:
                    col["first_token_s"][r] = ends[j]
                    self._bound = _UNKNOWN  # its prefill is over: the steps ahead are decodes, far shorter
                elif kind == EV_FINISH:
                    self._finish(self.states[r], ends[j], chained)
                elif kind == EV_PREEMPT:
                    self.preempted.append((k0 + j, r))
                else:  # EV_ARRIVE
                    col["arrival_s"][r] = ends[j]
                    self._bound = _UNKNOWN
        self._draft_after_run(self, int(self.scheduler.sb.sc[SC_ROWS]))  # the run's last step: in the step buffer
        if self.config.check_invariants:
            check_step(self.scheduler, self.kv.pool, self.table, self.states, self.limits.max_num_seqs,
                       self.config.block_size)
        self.step_count = k1
        self._continues = self.scheduler.has_work()  # the engine steps on from here, whatever arrives now
        self._push(self.now, STEP, None)

    # -- pieces of DONE: drafting after a run (one of these, chosen at construction) -------------------
    def _hooks_then_propose(self, n_rows: int) -> None:
        """The drafter's hooks for the step's rows that emitted, then its proposal for the calls that sampled."""
        if any(self.hooks):
            rows = self.scheduler.sb.rows[:n_rows]
            self._drafter_hooks([self.states[r] for r in rows["call"].tolist()], rows["emitted"], rows["started"])
        self._propose_sampled(n_rows)

    def _fast_observes_then_propose(self, n_rows: int) -> None:
        """The fast path observes and proposes the step in one compiled call (`EngineDrafting.after_step`), or,
        where it declines, the proposal goes the usual way."""
        seconds = self.fast.after_step(n_rows)
        if seconds is None:
            self._propose_sampled(n_rows)
        else:
            self.pending_draft_s = seconds

    def _propose_sampled(self, n_rows: int) -> None:
        sb = self.scheduler.sb
        if self.spec.num_speculative_tokens and sb.sc[SC_SAMPLED]:
            sampled = sb.lists["sampled"][:sb.sc[SC_SAMPLED]].copy()
            self._propose([self.states[r] for r in sampled.tolist()], sampled, n_rows)

    def _drafter_hooks(self, rows: list[CallState], emitted: np.ndarray, started: np.ndarray,
                       may_observe: np.ndarray | None = None) -> None:
        """start_call / observe / finish_call for the rows that emitted, in row order (`may_observe`
        False: no observe for that row)."""
        start_call, observe, finish_call = self.hooks
        for i in emitted.nonzero()[0].tolist():
            state = rows[i]
            drafter = self.drafters[state.tenant]
            if start_call and started[i]:
                drafter.start_call(state)
            if observe and (may_observe is None or may_observe[i]):
                e = int(emitted[i])
                end = state.prompt_len + state.num_emitted
                drafter.observe(state, state.history[end - e:end])
            if finish_call and state.status == FINISHED:
                drafter.finish_call(state)

    def _finish(self, state: CallState, now: float | None = None, chained: set[int] = frozenset()) -> None:
        now = self.now if now is None else now
        state.finish_s = now
        if state.num_emitted != state.target_len:
            raise SimulationError(f"lossless check failed: call {state.call_id!r} emitted tokens that differ from "
                                  "its recording")
        if self.front is not None:
            self.front.call_finished(self.rank)
        self._count_done(1)
        query = self.queries[state.query_index]
        position = self.position_in_query[state.index]
        if position + 1 < len(query.calls):
            nxt = query.calls[position + 1]
            if nxt.index in chained:
                return
            self._push(next_arrival_s(now, nxt.call, self.config.think_time, query.offset_s), ARRIVE,
                       (query, position + 1))
        else:
            query.finish_s = now
            query.completed = True
            self._query_ended(query, now)

    def _propose(self, sampled: list[CallState], rows: np.ndarray, num_scheduled: int) -> None:
        """Drafts for the calls that sampled a token in the step just ended (`rows`: their table rows)."""
        col = self.table.cols
        if self.skips_unfit_batches:
            k = self.spec.num_speculative_tokens
            if num_scheduled and int(self.scheduler.sb.sc[SC_TOP]) + k > self.limits.max_model_len:
                # vLLM's V1 runner (`_input_fits_in_drafter`, as `_per_step_drafts`): when one request of
                # the batch is within k tokens of max_model_len the proposer does not run for anyone
                # and every request gets k token-0 drafts, which the scheduler clips and verifies.
                self.scheduler.set_drafts(rows, [np.zeros(k, dtype=np.int32)] * len(sampled))
                self.pending_draft_s = 0.0
                return
        lens = self.policy.max_draft_lens(num_scheduled, sampled)
        # The V1 proposer drafts at most max_model_len − num_tokens tokens.
        lens = np.minimum(lens, self.limits.max_model_len - (col["prompt_len"][rows] + col["num_emitted"][rows]))
        keep = lens > 0
        if not keep.all():
            if not keep.any():
                return
            kept = keep.nonzero()[0]
            sampled, rows, lens = [sampled[i] for i in kept.tolist()], rows[kept], lens[kept]
        if self.fast is not None:
            seconds = self.fast.propose(sampled, rows, lens)
            if seconds is not None:
                self.pending_draft_s = seconds
                return
        if len(self.drafters) == 1:
            proposals = self.drafters[0].propose(sampled, lens)
        else:
            proposals = [None] * len(sampled)
            by_tenant: dict[int, list[int]] = {}
            for j, row in enumerate(sampled):
                by_tenant.setdefault(row.tenant, []).append(j)
            for tenant, idx in by_tenant.items():
                # Each copy has its own drafter but the batch is shared: drafters that size drafts by
                # the batch (agentspec's B_t) hear how many calls draft in all.
                self.drafters[tenant].begin_step(len(sampled))
                for j, draft in zip(idx, self.drafters[tenant].propose([sampled[j] for j in idx], lens[idx]),
                                    strict=True):
                    proposals[j] = draft
        self.scheduler.set_drafts(rows, proposals)
        # One proposer pass over all drafting rows (the engine runs one, whatever the tenants).
        self.pending_draft_s = float(self.drafters[0].draft_time(self.cost, sampled, lens))

    def _per_step_drafts(self, n_rows: int) -> None:
        """After every step that ran a forward pass, what vLLM 0.33's V1 runner does with a suffix
        proposer (`GPUModelRunner.sample_tokens` → `SuffixDecodingProposer.propose`):

        - if `_input_fits_in_drafter` fails — some row's num_computed + num_scheduled + k exceeds
          max_model_len — the proposer does not run at all (no tokens added, nobody stopped) and
          every request gets k token-0 drafts for the next step (vLLM's zero-filled draft tensor;
          the scheduler ignores them for prefill chunks and clips them as any draft);
        - else it runs once, also when no row sampled: rows whose tokens reached max_model_len add
          nothing; each drafting row gets min(k, max_model_len − num_tokens − 1); active requests
          absent from the batch are stopped (the drafter does that when a round passes unseen).

        The proposer walks the rows of vLLM's persistent batch (`Scheduler.batch_order`: its rows are not
        the scheduling order), so the rows go to the drafter in that order.
        """
        sb, col, max_len = self.scheduler.sb, self.table.cols, self.limits.max_model_len
        if self.fast is not None:
            self.fast.sync()  # what the compiled steps changed
        batch = sb.rows[:n_rows][self.scheduler.batch_order(n_rows)]
        rows = [self.states[r] for r in batch["call"].tolist()]
        # The calls that sampled and go on (sb.lists' "sampled"), in batch-row order.
        sampled = batch["call"][(batch["emitted"] > 0) & (col["status"][batch["call"]] != S_FINISHED)]
        k = self.spec.num_speculative_tokens
        fits = not n_rows or int(sb.sc[SC_TOP]) + k <= max_len
        if not fits:
            self._drafter_hooks(rows, batch["emitted"], batch["started"], np.zeros(n_rows, dtype=bool))
            for i in batch["emitted"].nonzero()[0].tolist():  # tokens no tree gets (a drafter with a table must know)
                if rows[i].status != FINISHED:
                    self.drafters[rows[i].tenant].skip_tokens(rows[i], int(batch["emitted"][i]))
            if k and sampled.shape[0]:
                zeros = np.zeros(k, dtype=np.int32)
                self.scheduler.set_drafts(sampled, [zeros] * sampled.shape[0])
            self.pending_draft_s = 0.0
            return
        num_tokens = col["prompt_len"][batch["call"]] + col["num_emitted"][batch["call"]]
        started = batch["started"]
        if self.fast is not None:
            compiled = self.fast.per_step_drafts(rows, batch["call"], batch["emitted"], num_tokens)
            if compiled is not None:
                self.pending_draft_s = compiled
                return
            # No start_call: it may have started calls before giving up, and `observe` starts a call
            # that has no state yet (a started row's) as start_call would (the protocol's contract).
            started = np.zeros(n_rows, dtype=bool)
        self._drafter_hooks(rows, batch["emitted"], started, num_tokens < max_len)
        states = [self.states[r] for r in sampled.tolist()]
        lens = self.policy.max_draft_lens(n_rows, states) if states else np.zeros(0, dtype=np.int64)
        lens = np.minimum(lens, max_len - (col["prompt_len"][sampled] + col["num_emitted"][sampled]) - 1)
        kept = (lens > 0).nonzero()[0]
        drafting, rows_kept, lens = [states[i] for i in kept.tolist()], sampled[kept], lens[kept]
        proposals: list[np.ndarray] = [np.zeros(0, dtype=np.int32)] * len(drafting)
        for tenant, drafter in enumerate(self.drafters):
            # Every tenant's proposer runs, with its own rows (maybe none): a round it sits out would
            # merge two steps and miss a stop.
            idx = [j for j, s in enumerate(drafting) if s.tenant == tenant]
            for j, draft in zip(idx, drafter.propose([drafting[j] for j in idx], lens[idx]), strict=True):
                proposals[j] = draft
        if drafting:
            self.scheduler.set_drafts(rows_kept, proposals)
        self.pending_draft_s = float(self.drafters[0].draft_time(self.cost, drafting, lens))

    def _count_done(self, n: int) -> None:
        self.done_calls += n
        if self.front is not None:
            self.front.count_done(n)
        elif self.progress is not None:
            self.progress(self.done_calls, len(self.states))

    # -- result ------------------------------------------------------------------------------------------
    def _result(self, wall_s: float) -> RunResult:
        ids = [s.call_id for s in self.states]
        self.pricer.price_references(self.log)
        engine_steps = self.log.engine_frame()
        st, t = self.states, self.table
        n = t.rows
        frontend = self.cost.frontend_time(t.cols["prompt_len"][:n])
        calls = calls_frame(t, st, [self.queries[s.query_index].query_id for s in st], frontend)
        queries = queries_frame(self.queries, t.cols["num_emitted"][:n], frontend, t.cols["status"][:n])
        # A live AgentSpec history over the simulator's memory bound dropped idle queries' histories: say so.
        evicted = sum(d.evictions() for d in self.drafters)
        preemptions = pl.DataFrame({"step": [k for k, _ in self.preempted],
                                    "call_id": [ids[r] for _, r in self.preempted]},
                                   schema={"step": pl.Int64, "call_id": pl.Utf8})
        return RunResult(self.config, self.limits, self.spec, self.spec.name, engine_steps, calls, queries,
                         num_preemptions=self.scheduler.num_preemptions, wall_s=wall_s, preemptions=preemptions,
                         extra={"history_evictions": evicted} if evicted else {},
                         steps_source=partial(self.log.steps_frame, engine_steps, self.spec.name, ids),
                         emissions_source=partial(self.log.emissions_frame, engine_steps))


class EngineSoFar:
    """`RunSoFar` of one engine (`Simulator` without data parallelism), looked at after a DONE: every step it
    ran has ended by `now`."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._call_queries = np.array([s.query_index for s in sim.states], dtype=np.int64)

    @property
    def known_s(self) -> float:
        return self.sim.now

    @property
    def max_model_len(self) -> int:
        return self.sim.limits.max_model_len

    def column(self, name: str) -> np.ndarray:
        return self.sim.table.cols[name][:self.sim.table.rows]

    def query_sends(self) -> np.ndarray:
        return np.array([q.arrival_s for q in self.sim.queries], dtype=np.float64)

    def call_queries(self) -> np.ndarray:
        return self._call_queries

    def emitted_between(self, start: float, end: float) -> int:
        return emitted_between(self.sim.log, start, end)


def _no_drafting(sim: Simulator, n_rows: int) -> None:
    """A drafter that proposes nothing and has no hooks (`normal`) sees no step."""


def _weak(method: Callable) -> Callable:
    """`method` (bound to the simulator) without a strong reference to its object: the fast path the
    simulator holds may keep it, and a cycle would keep a finished run's arrays alive until the garbage
    collector's next pass (the next run then pays fresh pages for all of its own)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)
