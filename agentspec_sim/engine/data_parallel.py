"""Data parallelism: `--data-parallel-size D` as vLLM 0.33 serves it — D engines ("ranks"), each a whole
engine (`Simulator`: its own scheduler, KV cache, prefix cache and drafter, max_num_seqs and
max_num_batched_tokens each) on tensor_parallel_size GPUs, one event loop for all.

Routing (`DPLBAsyncMPClient.get_core_engine_for_request`, one API server): each call goes, when it arrives,
to the rank with the lowest score max(in-flight calls, waiting + running) + waiting × 6 × max(0, KV usage −
0.5) — the in-flight count is the front end's own (exact), the queue lengths and KV usage the ranks' current
ones (vLLM's coordinator publishes them at most every 100 ms: this model reads them fresh) — scanning from a
start index that moves on by one per call, so ties go round-robin. The calls of one agent query are routed
one by one, so a query's next call may land on a rank without its prefix cached. Prompts of ≥ max_model_len
tokens are refused before routing, as vLLM's input processor does.

Stepping. A dense model's ranks are independent engines (vLLM: "Non-MoE DP ranks are completely
independent"): each steps on its own clock. A MoE model's ranks run `DPEngineCoreProc`: every MoE layer
gathers the tokens of all ranks to the expert GPUs, so the ranks step in lockstep — a rank with nothing to
run executes a dummy batch — and a step ends when the slowest rank's does. Here a lockstep step schedules
each rank that has work, prices each rank's batch with the routed experts seeing the tokens of all ranks
(`BatchShape.moe_tokens`), and ends all of them at the latest end (a rank's logged forward time includes its
wait at the collectives). The dummy batches of idle ranks take no time of their own (they finish inside the
busy ranks' step); the finish-sync all-reduce every 16 steps (`dp_sync_interval`) is not modelled.

Each rank drafts with its own drafter (vLLM: one proposer per engine): a drafter's workload tables stand in
for its state where they hold per request (the n-gram matches, suffix decoding's prompt trees, eagle3/mtp's
acceptance draws), and AgentSpec's history, carried from call to call, lives in each rank for the calls it ran
(`RunView.sees_every_call`).

The result is one `RunResult` for the deployment: each call's row from the rank that ran it (column
`dp_rank`), each query's from the rank of its last call, the engine steps of all ranks (column `dp_rank`; a
rank's steps in order, `step` numbered per rank)."""

from __future__ import annotations

import heapq
import itertools
import time as wallclock
from collections.abc import Callable
from functools import partial

import numpy as np
import polars as pl

from agentspec_sim.cost.base import StepCostModel
from agentspec_sim.engine.config import EngineConfig, ResolvedLimits
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.engine.invariants import (
    check_causality,
    check_clock,
    check_completion,
    check_work_conservation,
    first_scheduled,
    predecessors,
)
from agentspec_sim.engine.result import RunResult
from agentspec_sim.engine.scheduler import SimulationError
from agentspec_sim.engine.simulator import ARRIVE, DONE, STEP, Simulator
from agentspec_sim.engine.watch import RunWatch, emitted_between
from agentspec_sim.trace.schema import Workload

# vLLM's routing penalty on waiting requests under KV pressure (`get_core_engine_for_request`).
KV_PRESSURE_WEIGHT = 6.0
KV_PRESSURE_FROM = 0.5


class DataParallelSimulator:
    """`data_parallel_size` ranks of `Simulator` behind vLLM's load balancer, on one clock."""

    def __init__(self, workload: Workload, spec: SpeculativeConfig, config: EngineConfig, limits: ResolvedLimits,
                 cost: StepCostModel, progress: Callable[[int, int], None] | None = None, *, moe: bool,
                 fast_path: bool = True) -> None:
        self.config, self.limits, self.cost, self.progress = config, limits, cost, progress
        self.lockstep = moe  # DPEngineCoreProc: MoE ranks step together
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.step_pending = False  # a lockstep step is queued
        self.in_step = False  # a lockstep step is running
        self.done_calls = 0
        self.ranks: list[Simulator] = []
        for rank in range(config.data_parallel_size):
            self.ranks.append(Simulator(workload, spec, config, limits, cost, None, fast_path=fast_path, front=self,
                                        rank=rank))
        # Rank 0 sends the queries (and holds a gated protocol's slots); each send stamps every rank's copy of
        # the query, whose later calls may run anywhere.
        self.ranks[0]._place_arrivals()
        self.total_calls = len(self.ranks[0].states)
        self.in_flight = [0] * len(self.ranks)
        self.start_index = 0
        self.rank_of_call = np.full(self.total_calls, -1, dtype=np.int64)
        if progress is not None:
            progress(0, self.total_calls)

    # -- what the ranks report -----------------------------------------------------------------------
    def wake(self, t: float) -> None:
        """A rank has work (lockstep): a step of all ranks at `t`, unless one is queued or running (the rank
        then joins the next, as an idle rank running dummy batches does)."""
        if not (self.step_pending or self.in_step):
            self.step_pending = True
            heapq.heappush(self.heap, (t, next(self.seq), STEP, None))

    def call_finished(self, rank: int) -> None:
        self.in_flight[rank] -= 1

    def count_done(self, n: int) -> None:
        self.done_calls += n
        if self.progress is not None:
            self.progress(self.done_calls, self.total_calls)

    # -- the loop --------------------------------------------------------------------------------------
    def run(self, watch: RunWatch | None = None) -> RunResult:
        """The whole run; with `watch` (engine/watch.py), until the watch stops it, asked after each DONE."""
        started = wallclock.perf_counter()
        ranks = self.ranks
        so_far = DeploymentSoFar(self) if watch is not None else None
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.now = t
            if kind == ARRIVE:
                self._arrive(payload)
            elif self.lockstep:  # the front's own STEP and DONE, of all ranks at once
                if kind == STEP:
                    self._step_all()
                else:
                    self._done_all(payload)
            else:  # rank r's own STEP (1 + 2r) or DONE (2 + 2r): `Simulator.kinds`
                rank = ranks[(kind - 1) // 2]
                rank.now = t
                if kind % 2:
                    rank._on_step(payload)
                else:
                    rank._on_done(payload)
            if watch is not None and kind and not kind % 2 and t >= watch.next_s and watch.look(so_far):  # a DONE
                result = self._result(wallclock.perf_counter() - started)
                result.stopped_s = so_far.known_s
                return result
        for rank in ranks:
            if rank.scheduler.has_work():
                raise SimulationError(f"the event queue ran dry with calls still waiting or running on data-parallel "
                                      f"rank {rank.rank}")
            if rank.fast is not None:
                rank.fast.finish_run()
        result = self._result(wallclock.perf_counter() - started)
        if self.config.check_invariants:
            self._check_run(result)
        return result

    def _arrive(self, payload) -> None:
        """A call reaches the front end: refused there if its prompt is too long, else routed."""
        query, k = payload
        q = query.index
        refused = self.ranks[0].queries[q].calls[k].prompt_len >= self.limits.max_model_len
        target = self.ranks[0] if refused else self.ranks[self._route()]
        if not refused:
            self.in_flight[target.rank] += 1
        query_there = target.queries[q]
        # A refused call's query skips its later calls on the same rank: their rows come from it.
        calls = query_there.calls[k:] if refused else query_there.calls[k:k + 1]
        self.rank_of_call[[c.index for c in calls]] = target.rank
        target.now = self.now
        target._on_arrive((query_there, k))

    def _route(self) -> int:
        """vLLM's choice of engine for a request (module docstring)."""
        n = len(self.ranks)
        best, best_score = 0, float("inf")
        for i in range(n):
            r = (self.start_index + i) % n
            sched = self.ranks[r].scheduler
            waiting = sched.num_waiting
            score = float(max(self.in_flight[r], waiting + sched.num_running))
            if waiting:
                pool = self.ranks[r].kv.pool
                usage = 1.0 - pool.num_free / pool.usable
                score += waiting * KV_PRESSURE_WEIGHT * max(0.0, usage - KV_PRESSURE_FROM)
            if score < best_score:
                best, best_score = r, score
        self.start_index = (self.start_index + 1) % n
        return best

    def _step_all(self) -> None:
        """One lockstep step: every rank with work runs one step; all end when the slowest does."""
        self.step_pending = False
        stepped = []
        for rank in self.ranks:
            if rank.step_pending:
                rank.now = self.now
                if rank._schedule_run(1, False):
                    stepped.append(rank)
        if not stepped:
            return
        tokens = sum(int(rank.log.buf.steps.scheduled_tokens[rank.step_count]) for rank in stepped)
        end = self.now
        for rank in stepped:
            k = rank.step_count
            end = max(end, rank.pricer.price(rank.log, k, k + 1, self.now, rank.pending_draft_s, moe_tokens=tokens))
        for rank in stepped:
            col = rank.log.buf.steps
            k = rank.step_count
            col.forward_s[k] = end - self.now - col.draft_s[k] - col.host_s[k]
            rank.pending_draft_s = 0.0
            rank._in_flight = (rank.step_count, end)  # what an arrival meanwhile waits behind (Simulator)
        self.in_step = True
        heapq.heappush(self.heap, (end, next(self.seq), DONE, stepped))

    def _done_all(self, stepped: list[Simulator]) -> None:
        self.in_step = False
        for rank in stepped:
            rank.now = self.now
            rank._on_done((rank.step_count, rank.step_count + 1))

    # -- result ----------------------------------------------------------------------------------------
    def _owners(self) -> np.ndarray:
        """The rank whose table holds each call's row: the rank it ran on (or was refused or skipped on), else 0."""
        return np.where(self.rank_of_call >= 0, self.rank_of_call, 0)

    def _result(self, wall_s: float) -> RunResult:
        results = [rank._result(wall_s) for rank in self.ranks]
        first = results[0]
        n = self.total_calls
        owner = self._owners()
        calls = _with_ranks([r.calls for r in results])[(owner * n + np.arange(n)).tolist()]
        ranks0 = self.ranks[0]
        last_call = np.array([q.calls[-1].index for q in ranks0.queries], dtype=np.int64)
        q_owner = owner[last_call] if last_call.shape[0] else last_call
        nq = len(ranks0.queries)
        queries = pl.concat([r.queries for r in results])[(q_owner * nq + np.arange(nq)).tolist()]
        # A query's calls ran on several ranks: its output tokens are those of all of them.
        emitted = calls["output_len"].to_numpy()
        queries = queries.with_columns(pl.Series("output_tokens", [int(emitted[[c.index for c in q.calls]].sum())
                                                                   for q in ranks0.queries], dtype=pl.Int64))
        engine = _with_ranks([r.engine_steps for r in results])
        preemptions = _with_ranks([r.preemptions for r in results])
        extra: dict = {"data_parallel_size": len(self.ranks),
                       "calls_per_rank": np.bincount(owner, minlength=len(self.ranks)).tolist()}
        evicted = sum(r.extra.get("history_evictions", 0) for r in results)
        if evicted:
            extra["history_evictions"] = evicted
        return RunResult(first.config, first.limits, first.spec, first.drafter, engine, calls, queries,
                         num_preemptions=sum(r.num_preemptions for r in results), wall_s=wall_s,
                         preemptions=preemptions, extra=extra,
                         steps_source=partial(_steps_of_ranks, results),
                         emissions_source=partial(_emissions_of_ranks, results))

    def _check_run(self, result: RunResult) -> None:
        """The whole-run invariants (engine/invariants.py): CLOCK and WORK per rank, CAUSALITY and DONE over the
        calls as routed."""
        scheduled = np.full(self.total_calls, np.nan)
        for rank in self.ranks:
            log = rank.log
            steps = log.buf.steps.head(log.num_steps)
            duration = steps.duration_s
            check_clock(steps.time_s, duration)
            check_work_conservation(steps.time_s, duration, steps.waiting)
            rows = log.buf.rows[:log.num_rows]
            row_steps = np.repeat(np.arange(log.num_steps), steps.batch_size)
            mine = self.rank_of_call == rank.rank
            at = first_scheduled(np.ascontiguousarray(rows["call"]), row_steps, steps.time_s, self.total_calls)
            scheduled[mine] = at[mine]
        ids = result.calls["call_id"].to_list()
        col = self._routed_column
        check_causality(ids, col("arrival_s"), scheduled, col("first_token_s"), col("finish_s"), col("status"),
                        predecessors((q.calls for q in self.ranks[0].queries), self.total_calls))
        check_completion(ids, col("status"), col("num_emitted"), col("target_len"), col("arrival_s"),
                         col("first_token_s"), col("finish_s"))

    def _routed_column(self, name: str) -> np.ndarray:
        """A call-table column with each call's value from its owner's table (`_owners`)."""
        owner, n = self._owners(), self.total_calls
        out = np.empty(n, dtype=self.ranks[0].table.cols[name].dtype)
        for rank in self.ranks:
            mine = owner == rank.rank
            out[mine] = rank.table.cols[name][:n][mine]
        return out


class DeploymentSoFar:
    """`RunSoFar` (engine/watch.py) of the deployment: each call's columns from the rank that holds it, settled
    up to the earliest start of a run of steps still in flight on some rank."""

    def __init__(self, front: DataParallelSimulator) -> None:
        self.front = front
        self._call_queries = np.array([s.query_index for s in front.ranks[0].states], dtype=np.int64)

    @property
    def known_s(self) -> float:
        busy = [rank.now for rank in self.front.ranks if rank.step_pending]
        return min([self.front.now, *busy])

    @property
    def max_model_len(self) -> int:
        return self.front.limits.max_model_len

    def column(self, name: str) -> np.ndarray:
        return self.front._routed_column(name)

    def query_sends(self) -> np.ndarray:
        return np.array([q.arrival_s for q in self.front.ranks[0].queries], dtype=np.float64)

    def call_queries(self) -> np.ndarray:
        return self._call_queries

    def emitted_between(self, start: float, end: float) -> int:
        return sum(emitted_between(rank.log, start, end) for rank in self.front.ranks)


def _steps_of_ranks(results: list[RunResult]) -> pl.DataFrame:
    return _with_ranks([r.steps for r in results])


def _emissions_of_ranks(results: list[RunResult]) -> pl.DataFrame:
    """The ranks' emissions by time (a rank's call rows are the same calls as the routed calls frame's)."""
    return pl.concat([r.emissions for r in results]).sort("time_s", maintain_order=True)


def _with_ranks(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """The ranks' frames, one after another, each row with its rank (`dp_rank`)."""
    return pl.concat([frame.with_columns(pl.lit(i, dtype=pl.Int64).alias("dp_rank")) for i, frame in enumerate(frames)])
