"""The event loop: call arrivals, engine steps, and the agent workflow between calls.

A heap of (time, sequence number, event); ties go to the earlier-pushed event. Three events, each
with its whole effect in one handler:

- ARRIVE(call): a call reaches the server. A prompt of ≥ max_model_len tokens is refused as vLLM
  refuses it (`_validate_prompt_len`); the agent gets an error, so the rest of its query is skipped
  (counted). Otherwise it joins the waiting queue and, if the engine is idle, a step starts now.
- STEP: the scheduler builds the batch and the engine runs it (`Scheduler.run`: schedule, forward,
  verification and emission); its duration is the drafting time spent proposing the drafts it
  verifies (model-free proposers run on the CPU after the previous step, serialized with it as in
  vLLM's synchronous V1 loop) plus `cost.step_time(batch)`. DONE is pushed at the end.
- DONE: the effects that wait for the step's end time: first-token and finish times, drafter
  hooks, the next call of each finished call's query (it arrives think_s after the finish, or at
  its recorded arrival_s, never before), the drafts for the next step, then STEP at the same
  instant. (Emission happens at STEP time but only touches the running calls, which no ARRIVE in
  between reads: arrivals only join the waiting queue.)

Drafts for step t+1 are proposed at the end of step t (after sampling) for the calls that sampled
a token and go on; a call's first step after its prefill emits its first token with no draft.

Runs of steps. A STEP event runs as many steps as nothing outside the engine can change: no other
event pending, no drafter that must see the tokens (a drafter proposes after every step that
emitted — except where the compiled loop drafts itself between steps, `scheduler.InlineDrafts`:
vLLM's n-gram proposers `ngram` and `ngram-v2`; `eagle3`/`mtp` from their acceptance tables;
`agentspec` from its history in steps where no call starts or finishes (`InlineHistory`); `suffix`
in steps where exactly the active calls emitted (`InlineSuffix`); anything else stops the run and
the drafter's own Python hooks do that step), every next call of a query arriving the instant its
predecessor ends (those join the waiting queue inside the run). It prices them in one `step_times`
call and pushes one DONE at the end of the last; DONE then does for the run what it does for one
step. The steps, their order and their times are those of one step per STEP event
(`max_run_steps = 1`; tests/test_engine_golden.py pins whole runs, tests/test_engine_fast_paths.py
compares the two), only without a trip through the heap per step: with `normal`, the default trace
is a handful of runs. The t_A / t_V reference (each drafting step priced without its drafts)
times nothing and is priced for the whole log when the run ends (`_price_references`).
"""

from __future__ import annotations

import heapq
import math
import time as wallclock
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import polars as pl

from agentspec_sim.budget import BatchSizeSchedule, FixedK, make_budget_policy
from agentspec_sim.cost.base import BatchShape, StepCostModel, step_times
from agentspec_sim.drafters import ngram_tables, suffix_tables
from agentspec_sim.drafters.agentspec import (
    MAX_SCAN,
    MIN_SUPPORT,
    AgentSpecDrafter,
    AgentSpecNDrafter,
    AgentSpecPaperDrafter,
    AgentSpecSDrafter,
    History,
)
from agentspec_sim.drafters.base import BaseDrafter, SpeculativeConfig, make_drafter
from agentspec_sim.drafters.history_tables import HistoryTables, build_tables, cached_tables, table_key
from agentspec_sim.drafters.model_based import ModelBasedDrafter
from agentspec_sim.drafters.ngram import NgramDrafter
from agentspec_sim.drafters.ngram_tables import NgramTable
from agentspec_sim.drafters.ngram_v2 import NgramV2Drafter
from agentspec_sim.drafters.suffix import SuffixDrafter
from agentspec_sim.drafters.suffix_tree import LocalTable
from agentspec_sim.engine.batched import BATCHED, INLINE_NGRAM, MAX_INDEXED_N, prompt_index
from agentspec_sim.engine.config import EngineConfig, ResolvedLimits
from agentspec_sim.engine.invariants import check_run
from agentspec_sim.engine.kv import KVCacheManager, cdiv
from agentspec_sim.engine.layout import call_layout
from agentspec_sim.engine.request import (
    FINISHED,
    REFUSED,
    S_FINISHED,
    S_REFUSED,
    S_RUNNING,
    S_WAITING,
    SKIPPED,
    CallState,
    CallTable,
)
from agentspec_sim.engine.result import RunResult, StepLogBuilder
from agentspec_sim.engine.scheduler import (
    EV_ARRIVE,
    EV_FINISH,
    EV_FIRST,
    EV_PREEMPT,
    IN_K_MAX,
    IN_NGRAM_TABLE,
    IN_ON,
    IN_RULE,
    RULE_HISTORY,
    RULE_MODEL,
    RULE_SUFFIX,
    RULE_TABLE,
    RULE_V1,
    RULE_V2,
    RUN_EMPTY,
    RUN_FULL,
    InlineDrafts,
    InlineHistory,
    InlineSuffix,
    Scheduler,
    SimulationError,
    TableDrafts,
)
from agentspec_sim.trace.schema import Workload

ARRIVE, STEP, DONE = 0, 1, 2


# Drafters whose every lookup a workload table can give (`Simulator._table_drafts`).
TABLE_DRAFTERS = (AgentSpecDrafter, AgentSpecSDrafter, AgentSpecNDrafter, AgentSpecPaperDrafter)
__all__ = ["SimulationError", "Simulator"]


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
    # AgentSpec's lookups and suffix decoding's prompt-tree drafts come from tables made once per workload
    # where that is exact (drafters/history_tables.py, suffix_tables.py); tests turn it off to compare.
    draft_tables = True

    def __init__(self, workload: Workload, spec: SpeculativeConfig, config: EngineConfig, limits: ResolvedLimits,
                 cost: StepCostModel, progress: Callable[[int, int], None] | None = None) -> None:
        self.spec, self.config, self.limits, self.cost = spec, config, limits, cost
        self.progress = progress
        seeds = np.random.SeedSequence(config.seed).spawn(2)
        self.rng_arrivals = np.random.default_rng(seeds[0])
        self.rng_stagger = np.random.default_rng(seeds[1])
        # One drafter per tenant: copies never share drafter state.
        self.drafters = [make_drafter(spec) for _ in range(config.replicate)]
        for drafter in self.drafters:
            # Optional hooks: drafters that index other queries (agspec) or size drafts by M(b) (agentspec).
            if hasattr(drafter, "bind_workload"):
                drafter.bind_workload(workload)
            if hasattr(drafter, "bind_cost_model"):
                drafter.bind_cost_model(cost)
        self.policy = make_budget_policy(spec, cost)
        # Hooks a drafter does not override are no-ops and are not called; a drafter that proposes
        # nothing and has no hooks (normal) need not see each step.
        kind = type(self.drafters[0])
        self.hooks = tuple(getattr(kind, hook) is not getattr(BaseDrafter, hook)
                           for hook in ("start_call", "observe", "finish_call"))
        self.inert = spec.num_speculative_tokens == 0 and not any(self.hooks)
        # vLLM's V1 runner drives a suffix proposer its own way after every step (`_suffix_step`).
        self.per_step = bool(getattr(kind, "driven_per_step", False))
        # The V1 runner skips its proposer for a batch near max_model_len (`_propose`); Model Runner V2
        # drafters (ngram-v2) say they do not follow it.
        self.skips_unfit_batches = bool(getattr(kind, "v1_runner", True))
        self._inline = self._inline_tables()
        self._inline_last: InlineDrafts | None = None
        self.states: list[CallState] = []
        self.queries: list[_QueryRun] = []
        self.position_in_query: list[int] = []  # call index → its position in its query
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.step_pending = False
        self.pending_draft_s = 0.0
        self.preempted: list[tuple[int, int]] = []  # (step, call index) in preemption order
        self.step_count = 0
        self.done_calls = 0
        self.num_refused = 0
        # Longest run of steps per STEP event (1: one step per event, the plain loop; tests compare).
        # A per-step drafter must see every step, emitting or not: its runs are one step long.
        self.max_run_steps = 1 if config.check_invariants or self.per_step else 1 << 40
        self._budget_memo: dict[int, int] = {}
        self._build(workload)
        if progress is not None:
            progress(0, len(self.states))  # started (the drafters' workload tables may take a while to build)
        self._model, self._model_priced = self._model_drafts()
        self._tables = self._table_drafts()
        self._inline = self._ngram_table_drafts(self._inline)
        self._history = self._history_drafts() if self._tables is None else None
        self._history_last: InlineHistory | None = None
        self._suffix = self._suffix_drafts()
        self._suffix_last: InlineSuffix | None = None
        if self._suffix is not None and not config.check_invariants:
            self.max_run_steps = 1 << 40  # the compiled loop drives the proposer after every step itself
        if self._model is not None or self._tables is not None:
            self.hooks = (False, False, False)  # drafting reads the tables, not per-call drafter state

    # -- setup -------------------------------------------------------------------------------------
    def _inline_tables(self) -> InlineDrafts | None:
        """The parts of `InlineDrafts` fixed for the run, where the n-gram proposer can draft inside
        `run_steps` (the batched n-gram path, no hooks, a draft length known from the batch size alone);
        else None and every proposal is `_propose`'s. The index's tables come with each run."""
        drafter = self.drafters[0]
        if (type(drafter) not in INLINE_NGRAM or drafter.max_n > MAX_INDEXED_N or self.spec.num_speculative_tokens <= 0
                or any(self.hooks) or self.per_step or type(self.policy) not in (FixedK, BatchSizeSchedule)):
            return None
        rule = RULE_V2 if isinstance(drafter, NgramV2Drafter) else RULE_V1
        return self._inline_base(rule, True, self._k_of_batch(), self._model_free_draft_s(),
                                 min_n=drafter.min_n, max_n=drafter.max_n)

    def _ngram_table_drafts(self, inline: InlineDrafts | None) -> InlineDrafts | None:
        """`inline` (the n-gram proposers' `InlineDrafts`) drafting from the workload's table instead of the
        index, in the compiled loop and the event loop alike (par[IN_NGRAM_TABLE]); as it was where the
        tables are off or copies of the trace each have their own drafter."""
        if inline is None or not self.draft_tables or len(self.drafters) > 1:
            return inline
        table = self._ngram_table(self.drafters[0], bool(inline.par[IN_RULE] == RULE_V2))
        inline.par[IN_NGRAM_TABLE] = 1
        return inline._replace(ngram_at=table.at[:len(self.states)].copy(), ngram_match=table.match)

    def _ngram_table(self, drafter: NgramDrafter, rightmost: bool) -> NgramTable:
        """Where every call's n-gram draft starts at every position (drafters/ngram_tables.py), from the disk
        cache when a run over the same calls with the same n-gram range made it."""
        cols, n = self.table.cols, len(self.states)
        args = (self.table.tokens, cols["hist_off"][:n], cols["prompt_len"][:n], cols["target_len"][:n])
        key = ngram_tables.table_key(drafter.min_n, drafter.max_n, rightmost, self.layout.tokens_digest, *args[1:])
        return ngram_tables.cached_ngram_table(key, lambda: ngram_tables.build_ngram_table(
            *args, drafter.min_n, drafter.max_n, rightmost))

    def _inline_base(self, rule: int, on: bool, k_of_batch: np.ndarray, draft_s: np.ndarray, min_n: int = 0,
                     max_n: int = 0, **fields: np.ndarray) -> InlineDrafts:
        """`InlineDrafts` for `rule` with fresh work space; the fields of other rules stay `off()`'s."""
        seqs = self.limits.max_num_seqs
        par = np.array([int(on), min_n, max_n, self.spec.num_speculative_tokens, int(self.skips_unfit_batches),
                        rule, 0], dtype=np.int64)
        work = [np.zeros(seqs, dtype=np.int64) for _ in range(4)]
        return InlineDrafts.off()._replace(par=par, k_of_batch=k_of_batch, draft_s=draft_s, rows=work[0],
                                           starts=work[1], lengths=work[2], max_lens=work[3],
                                           drafts=np.zeros((2, seqs), dtype=np.int64), **fields)

    def _model_free_draft_s(self) -> np.ndarray:
        """The drafter's CPU drafting seconds for 0…max_num_seqs drafting calls."""
        drafter = self.drafters[0]
        return np.array([drafter.draft_time(self.cost, [None] * n, np.zeros(n, dtype=np.int64))
                         for n in range(self.limits.max_num_seqs + 1)], dtype=np.float64)

    def _k_of_batch(self) -> np.ndarray:
        """The draft length a FixedK / BatchSizeSchedule policy allows at 0…max_num_seqs scheduled calls."""
        policy = self.policy
        return np.array([policy.k if isinstance(policy, FixedK) else policy.k_for(n)
                         for n in range(self.limits.max_num_seqs + 1)], dtype=np.int64)

    def _model_drafts(self) -> tuple[InlineDrafts | None, bool]:
        """eagle3 / mtp: (`InlineDrafts` holding every call's `AcceptanceTables`, whether it prices the
        drafting too), or (None, False) for other drafters.

        The acceptance inputs of every call are computed once, up front, so each proposal is a compiled
        draw (`Scheduler.set_model_drafts`) with no drafter hooks; and where the draft length follows
        the batch size alone and the cost model gives its draft-network terms, `run_steps` drafts
        inline (par[IN_ON])."""
        drafter = self.drafters[0]
        k_max = self.spec.num_speculative_tokens
        if not isinstance(drafter, ModelBasedDrafter) or k_max <= 0 or self.per_step:
            return None, False
        n, seqs, cols = len(self.states), self.limits.max_num_seqs, self.table.cols
        tables = drafter.acceptance_tables(self.table.tokens, cols["hist_off"][:n], cols["prompt_len"][:n],
                                           cols["target_len"][:n], [s.call for s in self.states],
                                           [s.call_id for s in self.states], tokens_digest=self.layout.tokens_digest)
        try:
            pass_s, terms = self.cost.draft_model_terms(seqs, kind=drafter.name)
            priced = True
        except (AttributeError, TypeError, ValueError):  # not a roofline, or no such draft network: Python prices
            pass_s, terms, priced = np.zeros(seqs + 1), np.ones(4), False
        inline = priced and type(self.policy) in (FixedK, BatchSizeSchedule)
        off = InlineDrafts.off()
        self.table.reserve_draft_width(k_max)
        return self._inline_base(RULE_MODEL, inline, self._k_of_batch() if inline else off.k_of_batch, off.draft_s,
                                 copy_at=tables.copy_at, copy=tables.copy, code_at=tables.code_at, code=tables.code,
                                 keys=tables.keys, a=tables.a, coef=tables.coef, pass_s=pass_s,
                                 draft_terms=terms), priced

    def _table_drafts(self) -> InlineDrafts | None:
        """agentspec, agentspec-s, agentspec-n: `InlineDrafts` drafting from the workload's lookup table
        (RULE_TABLE, drafters/history_tables.py) where it is exact for this run — one drafter, a fixed
        draft length — else None (the live history drafts)."""
        drafter = self.drafters[0]
        if (not self.draft_tables or type(drafter) not in TABLE_DRAFTERS or len(self.drafters) > 1
                or self.spec.num_speculative_tokens <= 0 or self.per_step or type(self.policy) is not FixedK):
            return None
        tables = self._history_tables(drafter.history)
        seqs, k = self.limits.max_num_seqs, drafter.k
        budgeted = bool(drafter.budgeted)
        n = len(self.states)
        self.table.reserve_draft_width(max(k, 1))
        td = TableDrafts(
            at=tables.at[:n].copy(), meta=tables.meta, path=tables.path, pool=tables.pool,
            par=np.array([k, int(budgeted), drafter.ct_min_match, int(drafter.single_ct_only)], dtype=np.int64),
            g_min=np.array([drafter.g_min if budgeted else 0.0]),
            budget_of=np.array([drafter.step_budget(b) if budgeted and b else 0 for b in range(seqs + 1)],
                               dtype=np.int64),
            lookups=np.zeros((seqs, 5), dtype=np.int64), lens=np.zeros(seqs, dtype=np.int64),
            fwork=np.zeros((2, seqs)), iwork=np.zeros((4, seqs), dtype=np.int64),
            break_even=drafter.break_even_grid(seqs) if budgeted else np.zeros((1, 1)))
        return self._inline_base(RULE_TABLE, True, self._k_of_batch(), self._model_free_draft_s(), tables=td)

    def _history_tables(self, history: History) -> HistoryTables:
        """The lookup table of this run's calls (each query's calls up to the first one refused), from the
        disk cache when a run with the same calls and options made it."""
        calls = [state.call for state in self.states]
        prompts, outputs, lengths = self._runnable_calls()
        cols, n = self.table.cols, len(self.states)
        key = table_key(history, self.layout.tokens_digest, cols["hist_off"][:n], cols["prompt_len"][:n], lengths,
                        calls)
        fresh = history.empty_copy()
        return cached_tables(key, lambda: build_tables(fresh, calls, prompts, outputs,
                                                       [s.last_in_query for s in self.states]))

    def _history_drafts(self) -> InlineDrafts | None:
        """agentspec: the `InlineDrafts` part of drafting inside `run_steps` from its history (rule
        RULE_HISTORY; the history's arrays come with each run, `_inline_history`), or None where the
        event loop drafts: replicate copies (a drafter each), draft lengths not fixed, k = 0."""
        drafter = self.drafters[0]
        if (type(drafter) not in (AgentSpecDrafter, AgentSpecPaperDrafter) or len(self.drafters) > 1
                or self.spec.num_speculative_tokens <= 0
                or self.per_step or type(self.policy) is not FixedK):
            return None
        self.table.reserve_draft_width(max(drafter.k, 1))
        return self._inline_base(RULE_HISTORY, True, self._k_of_batch(), self._model_free_draft_s())

    def _suffix_drafts(self) -> InlineDrafts | None:
        """suffix: the `InlineDrafts` part of driving the proposer inside `run_steps` (rule RULE_SUFFIX; the
        forest's arrays come with each run, `_inline_suffix`), or None: replicate copies, draft lengths not
        fixed, k = 0."""
        drafter = self.drafters[0]
        if (type(drafter) is not SuffixDrafter or len(self.drafters) > 1 or self.spec.num_speculative_tokens <= 0
                or type(self.policy) is not FixedK):
            return None
        self.table.reserve_draft_width(max(drafter.k, 1))
        if self.draft_tables:
            table, at = self._suffix_table(drafter)
            drafter.use_local_table(table, at, self.states, self.table.cols["target_len"][:len(self.states)])
        return self._inline_base(RULE_SUFFIX, True, self._k_of_batch(), self._model_free_draft_s())

    def _suffix_table(self, drafter: SuffixDrafter) -> tuple[LocalTable, np.ndarray]:
        """The prompt-tree drafts of this run's calls (drafters/suffix_tables.py) and each table row's first
        position, from the disk cache when a run with the same calls, options and max_model_len made them."""
        prompts, outputs, lengths = self._runnable_calls()
        cols, n = self.table.cols, len(self.states)
        options = {"depth": drafter.depth, "k": drafter.k, "factor": drafter.factor, "min_prob": drafter.min_prob,
                   "offset": drafter.offset, "max_model_len": self.limits.max_model_len}
        key = suffix_tables.table_key(options, self.layout.tokens_digest, cols["hist_off"][:n], cols["prompt_len"][:n],
                                      lengths)
        table, at = suffix_tables.cached_local_table(key, lambda: suffix_tables.build_local_table(
            drafter.depth, drafter.k, drafter.factor, drafter.min_prob, self.limits.max_model_len, prompts, outputs))
        return table, at[:n].copy()

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

    def _inline_suffix(self) -> InlineSuffix:
        """`InlineSuffix` for the next run (a new tuple only when an array was replaced: the scheduler's
        FastCall keys on it). While the drafter holds queued work (a call's finish seen in a step where
        the proposer was skipped) the run drives nothing (par[IN_ON] = 0): its next `propose` applies it."""
        drafter = self.drafters[0]
        self._suffix.par[IN_ON] = 0 if drafter.queue or drafter.touched else 1
        forest = drafter.forest
        current = {"nd": forest.nd, "gp": forest.gp, "sq": forest.sq, "act": forest.act, "pool": forest.pool,
                   "ht": forest.ht, "meta": forest.meta, "seq_len": forest.seq_len, "row_state": drafter.row_state}
        last = self._suffix_last
        if last is None:
            seqs, k = self.limits.max_num_seqs, max(drafter.k, 1)
            last = self._suffix_last = InlineSuffix(
                par=np.array([drafter.depth, drafter.k, drafter.global_root, 0, drafter.max_cached], dtype=np.int64),
                fpar=np.array([drafter.factor, drafter.offset, drafter.min_prob], dtype=np.float32),
                n_active=drafter.n_active, ops=np.zeros((seqs, 10), dtype=np.int64),
                out=np.zeros((seqs, k), dtype=np.int32), out_n=np.zeros(seqs, dtype=np.int32),
                work=np.zeros((3, k), dtype=np.int32), local=forest.local_table,
                score=np.zeros(seqs, dtype=np.float32),
                table_at=drafter.table_at if drafter.table_at is not None else np.zeros(1, dtype=np.int64),
                response_seq=drafter.response_seq, kernel_fresh=drafter.kernel_fresh, events=drafter.events,
                n_events=drafter.n_events, n_cached=drafter.n_cached, marks=np.zeros((seqs, 2), dtype=np.int64),
                **current)
        elif _replaced(last, current):
            last = self._suffix_last = last._replace(**current)
        return last

    def _inline_history(self) -> InlineHistory:
        """`InlineHistory` for the next run: the agentspec history's current arrays (a new tuple only when
        one was replaced: the scheduler's FastCall keys on it). Appends the event loop queued (a started
        call's prompt, a finished call's last tokens) are applied first, as the next lookup would."""
        drafter = self.drafters[0]
        history = drafter.history
        if history.queue or history.room:
            history.lookup(())
        arena = history.arena
        current = {"pool": arena.pool, "pv": arena.pv, "bk": arena.bk, "hk": arena.hk, "hv": arena.hv,
                   "tail_lin": history.tail_lin, "tail_pos": history.tail_pos, "tok_block": history.tok_block,
                   "row_at": history.row_at, "row_lineage": history.row_lineage}
        last = self._history_last
        if last is None:
            seqs, k = self.limits.max_num_seqs, drafter.k
            budgeted = bool(drafter.budgeted)
            last = self._history_last = InlineHistory(
                par=np.array([history.max_n, history.max_candidates, MAX_SCAN, MIN_SUPPORT, k, int(budgeted),
                              drafter.ct_min_match, int(drafter.single_ct_only)], dtype=np.int64),
                g_min=np.array([drafter.g_min if budgeted else 0.0]),
                budget_of=np.array([drafter.step_budget(n) if budgeted and n else 0 for n in range(seqs + 1)],
                                   dtype=np.int64),
                used=arena.used, levels=arena.levels, live=arena.live,
                need=np.zeros(arena.bk.shape[0], dtype=np.int64),
                ops=np.zeros((seqs * (k + 3) + 8, 8), dtype=np.int64),
                out=np.zeros((seqs, history.width), dtype=np.int32), meta=np.zeros((seqs, 5), dtype=np.int64),
                lens=np.zeros(seqs, dtype=np.int64), fwork=np.zeros((2, seqs)),
                iwork=np.zeros((4, seqs), dtype=np.int64),
                cands=np.zeros((3, max(history.max_candidates, 1)), dtype=np.int64),
                keys=np.zeros(arena.levels.shape[0], dtype=np.uint64), hooked=np.zeros(seqs, dtype=np.int8),
                break_even=drafter.break_even_grid(seqs) if budgeted else np.zeros((1, 1)), **current)
        elif _replaced(last, current):
            need = last.need if last.need.shape[0] >= arena.bk.shape[0] else np.zeros(arena.bk.shape[0], dtype=np.int64)
            last = self._history_last = last._replace(need=need, **current)
        return last

    def _inline_drafts(self) -> InlineDrafts | None:
        """`InlineDrafts` for the next run, or None when `run_steps` cannot draft for this drafter (the
        n-gram index's tables may have been replaced since the last run)."""
        if self._model is not None:
            return self._model if self._model.par[IN_ON] else None
        if self._tables is not None:
            return self._tables
        if self._history is not None:
            return self._history
        if self._suffix is not None:
            return self._suffix
        if self._inline is None:
            return None
        if self._inline.par[IN_NGRAM_TABLE]:
            self.table.reserve_draft_width(int(self._inline.par[IN_K_MAX]))
            return self._inline
        index = prompt_index(self.drafters[0], self.table.tokens)
        index.make_room_if_asked()  # the run before stopped because the index was full
        self.table.reserve_draft_width(int(self._inline.par[IN_K_MAX]))
        last = self._inline_last
        current = {"entries": index.entries, "regions": index.regions, "counts": index.counts}
        if last is None or _replaced(last, current):
            # A new tuple only when the index's tables changed: the scheduler's FastCall keys on it.
            last = self._inline_last = self._inline._replace(**current)
        return last

    def _build(self, workload: Workload) -> None:
        cfg, max_len, bs = self.config, self.limits.max_model_len, self.config.block_size
        layout = call_layout(workload, cfg.replicate, max_len, bs, cfg.think_time)
        cols = layout.columns
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
        self.queries = [_QueryRun(q, query_id, tenant, [], 0.0) for q, (query_id, tenant) in enumerate(layout.queries)]
        self.position_in_query = layout.position
        table = CallTable.build(cols, layout.tokens, layout.region_caps, slots=self.limits.max_num_seqs,
                                blocks_per_slot=cdiv(max_len, bs) + 1)
        query_of = layout.query_of
        self.states = CallState.in_table(table, layout.calls, layout.ids, query_of)
        for state in self.states:
            self.queries[state.query_index].calls.append(state)
        for query in self.queries:
            if query.calls:
                query.calls[-1].last_in_query = True
        self.table = table
        self.layout = layout
        # One call-step per output token at most, plus the prefill chunks: room for all of it up front.
        rows = int((cols["target_len"] + cols["prompt_len"] // self.limits.max_num_batched_tokens + 2).sum())
        self.log = StepLogBuilder(rows, rows // min(self.limits.max_num_seqs, 8) + 1024, 4 * len(layout.calls) + 1024)
        self.kv = KVCacheManager(self.limits.num_kv_blocks, bs, max_len, cfg.enable_prefix_caching, table)
        self.scheduler = Scheduler(self.kv, self.limits.max_num_seqs, self.limits.max_num_batched_tokens, max_len)
        if self.per_step:
            # The suffix proposer walks vLLM's persistent batch row by row (`_suffix_step`).
            self.scheduler.track_batch_rows()
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
        if self.config.check_invariants:
            check_run(self)  # CLOCK, CAUSALITY, WORK, DONE over the whole log (engine/invariants.py)
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
        self.scheduler.add_row(state._r)
        if not self.step_pending:
            self.step_pending = True
            self._push(self.now, STEP, None)

    def _on_step(self, _: object) -> None:
        """Run the scheduler (`Scheduler.run`) for as many steps as nothing outside it can change
        (one when other events are pending), price them, and push DONE at the end of the last."""
        sched, log = self.scheduler, self.log
        chain = not self.heap
        room = self.max_run_steps if chain else 1
        seqs = self.limits.max_num_seqs
        steps = 0
        inline = self._inline_drafts()  # also for one step (it drafts nothing then): the same containers
        history = self._inline_history() if inline is not None and self._history is not None else None
        suffix = self._inline_suffix() if inline is not None and self._suffix is not None else None
        while True:
            done, why = sched.run(log.buf, room - steps, self.step_count + steps, chain, not self.inert, inline,
                                  history, suffix)
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
            return
        end = self._price(self.step_count, self.step_count + steps)
        self._push(end, DONE, (self.step_count, self.step_count + steps))

    def _price(self, k0: int, k1: int) -> float:
        """Times of steps k0 … k1 − 1 (logged, not yet priced); returns the end of the last one.

        Each step's duration is the drafting time spent before it (the first step's: the event loop's
        last proposal; the others': `run_steps`'s own, for the n-gram proposer drafting inline) plus
        its forward time. The reference of t_A and t_V (the
        step priced without its drafts, paper §3.1) times nothing, so `_price_references` prices it
        for all steps at once when the run ends.
        """
        if k1 - k0 == 1:
            return self._price_one(k0)
        m, steps = k1 - k0, self.log.buf.steps[k0:k1]
        query, context, prefill = self._shapes(k0, k1)
        sizes = steps["batch_size"]
        offsets = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        forward = step_times(self.cost, query, context, prefill, offsets)
        draft_s = steps["draft_s"].copy()
        draft_s[0], self.pending_draft_s = self.pending_draft_s, 0.0
        # Step j starts when step j − 1 ends and takes its drafting then its forward time, accumulated
        # in that order as one step per event would: end_j = (end_{j−1} + draft_j) + forward_j.
        interleaved = np.empty(2 * m + 1)
        interleaved[0], interleaved[1::2], interleaved[2::2] = self.now, draft_s, forward
        ends = np.cumsum(interleaved)[2::2]
        steps["time_s"][0] = self.now
        steps["time_s"][1:] = ends[:-1]
        steps["forward_s"], steps["draft_s"] = forward, draft_s
        steps["budget"] = self._budgets(sizes)
        self._check_budget(int(steps["scheduled_tokens"].max()))
        return float(ends[-1])

    def _shapes(self, k0: int, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(query lens, context lens, is-prefill) of the call-steps of steps k0 … k1 − 1, the last
        logged (int32 views of the log, but is-prefill)."""
        b = self.log.buf
        r1 = self.log.num_rows
        rows = b.rows[r1 - int(b.steps["batch_size"][k0:k1].sum()):r1]
        return rows["scheduled"], rows["context_len"], rows["decode"] == 0

    def _price_references(self) -> None:
        """t_A, t_V and t_D of every step with drafts (NaN elsewhere), from its reference: the same
        batch priced without its drafts. One batched `step_times` over the whole log (bit-identical
        to pricing each step alone) instead of a second cost-model call per step in the hot loop."""
        b = self.log.buf
        steps = b.steps[:self.log.num_steps]
        rows = b.rows[:self.log.num_rows]
        sizes, d = steps["batch_size"], steps["D"]
        for name in ("t_A", "t_V", "t_D"):
            steps[name] = np.nan
        drafting = d.nonzero()[0]
        if drafting.shape[0] == 0:
            return
        sub = np.zeros(drafting.shape[0] + 1, dtype=np.int64)
        np.cumsum(sizes[drafting], out=sub[1:])
        picked = np.repeat(d > 0, sizes)  # the rows of those steps: four fields, not whole log rows
        base = step_times(self.cost, rows["scheduled"][picked] - rows["drafted"][picked], rows["context_len"][picked],
                          rows["decode"][picked] == 0, sub)
        n, dk = sizes[drafting], d[drafting]
        steps["t_A"][drafting] = base / n
        steps["t_V"][drafting] = (steps["forward_s"][drafting] - base) / dk
        steps["t_D"][drafting] = steps["draft_s"][drafting] / dk

    def _check_budget(self, scheduled_tokens: int) -> None:
        if self.config.check_invariants and scheduled_tokens > self.limits.max_num_batched_tokens:
            raise SimulationError(f"step scheduled {scheduled_tokens} tokens > max_num_batched_tokens (BUDGET)")

    def _price_one(self, k: int) -> float:
        """`_price` of a run of one step, with Python scalars (the common case with drafters)."""
        log = self.log
        r1 = log.num_rows
        n = int(log.col["batch_size"][k])
        rows = log.buf.rows[r1 - n:r1]
        query, context = rows["scheduled"].astype(np.int64), rows["context_len"].astype(np.int64)
        prefill = rows["decode"] == 0
        forward = float(self.cost.step_time(BatchShape(query, context, prefill)).total_s)
        draft_s, self.pending_draft_s = self.pending_draft_s, 0.0
        col = log.col
        col["time_s"][k], col["forward_s"][k], col["draft_s"][k] = self.now, forward, draft_s
        budget = self._budget_memo.get(n)
        if budget is None:
            budget = self._budget_memo[n] = self.cost.token_budget(n)
        col["budget"][k] = budget
        self._check_budget(int(col["scheduled_tokens"][k]))
        return self.now + draft_s + forward

    def _budgets(self, sizes: np.ndarray) -> np.ndarray:
        """M(b) of each step's batch size (memoised: few distinct sizes, all ≤ max_num_seqs, so a lookup
        table by size instead of sorting millions of steps' sizes)."""
        memo = self._budget_memo
        present = np.bincount(sizes)
        table = np.zeros(present.shape[0], dtype=np.int64)
        for n in present.nonzero()[0].tolist():
            if n not in memo:
                memo[n] = self.cost.token_budget(n)
            table[n] = memo[n]
        return table[sizes]

    def _on_done(self, payload: tuple[int, int]) -> None:
        """DONE of steps k0 … k1 − 1: time the run's events (first tokens, finishes, next calls that
        arrived at once), then the last step's drafter hooks, finishes and the next drafts."""
        k0, k1 = payload
        b = self.log.buf
        ends = [*b.steps["time_s"][k0 + 1:k1].tolist(), self.now] if k1 - k0 > 1 else [self.now]
        n_ev = int(b.ctr[2])
        if n_ev:
            events = b.events[:n_ev]
            kinds, rows, at = events["kind"].tolist(), events["call"].tolist(), (events["step"] - k0).tolist()
            b.ctr[2] = 0
            col = self.table.cols
            chained = {r for kind, r in zip(kinds, rows, strict=True) if kind == EV_ARRIVE}
            for kind, r, j in zip(kinds, rows, at, strict=True):
                if kind == EV_FIRST:
                    col["first_token_s"][r] = ends[j]
                elif kind == EV_FINISH:
                    self._finish(self.states[r], ends[j], chained)
                elif kind == EV_PREEMPT:
                    self.preempted.append((k0 + j, r))
                else:  # EV_ARRIVE
                    col["arrival_s"][r] = ends[j]
        if not self.inert:
            # The last step of the run is still in the scheduler's step buffer.
            sb = self.scheduler.sb
            n_last = int(sb.sc[0])
            drafted = False
            if self.per_step:
                self._suffix_step(n_last)
            elif self._history is not None:
                drafted = self._history_step(n_last)
            elif any(self.hooks):
                rows = sb.rows[:n_last]
                self._drafter_hooks([self.states[r] for r in rows["call"].tolist()], rows["emitted"], rows["started"])
            if self.spec.num_speculative_tokens and sb.sc[4] and not self.per_step and not drafted:
                sampled = sb.lists["sampled"][:sb.sc[4]].copy()
                self._propose([self.states[r] for r in sampled.tolist()], sampled, n_last)
        if self.config.check_invariants:
            self._check_step()
        self.step_count = k1
        self._push(self.now, STEP, None)

    # -- pieces of DONE ---------------------------------------------------------------------------------
    def _history_step(self, n_rows: int) -> bool:
        """agentspec after the last step of a run: the drafter's hooks for the calls that started or finished
        (in row order, as `_drafter_hooks`), then the compiled observe and propose for the rest
        (`Scheduler.history_drafts`). Rows of one step are calls of different queries, whose histories
        share no block, so the order between them does not matter; the hooks' appends are applied first,
        as the next lookup would. Returns whether the step was drafted (else the event loop observes the
        other rows and proposes, as without the compiled path)."""
        sb = self.scheduler.sb
        rows = sb.rows[:n_rows]
        emitted, started, calls = rows["emitted"], rows["started"], rows["call"]
        hooked = (emitted > 0) & ((started != 0) | (self.table.cols["status"][calls] == S_FINISHED))
        if hooked.any():
            self._drafter_hooks([self.states[r] for r in calls.tolist()], emitted * hooked, started)
        ah = self._inline_history()
        ah.hooked[:n_rows] = hooked
        seconds = self.scheduler.history_drafts(self._history, ah)
        ah.hooked[:n_rows] = 0
        if seconds < 0.0:
            self._drafter_hooks([self.states[r] for r in calls.tolist()], emitted * ~hooked, started)
            return False
        self.pending_draft_s = seconds
        return True

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
        self._count_done(1)
        query = self.queries[state.query_index]
        position = self.position_in_query[state.index]
        if position + 1 < len(query.calls):
            nxt = query.calls[position + 1]
            if nxt.index in chained:
                return
            think = self.config.think_time if self.config.think_time is not None else nxt.call.think_s
            arrival = now + think
            if nxt.call.arrival_s is not None:
                arrival = max(arrival, nxt.call.arrival_s + query.offset_s)
            self._push(arrival, ARRIVE, (query, position + 1))
        else:
            query.finish_s = now
            query.completed = True

    def _propose(self, sampled: list[CallState], rows: np.ndarray, num_scheduled: int) -> None:
        """Drafts for the calls that sampled a token in the step just ended (`rows`: their table rows)."""
        col = self.table.cols
        if self.skips_unfit_batches:
            k = self.spec.num_speculative_tokens
            if num_scheduled and int(self.scheduler.sb.sc[6]) + k > self.limits.max_model_len:
                # vLLM's V1 runner (`_input_fits_in_drafter`, as `_suffix_step`): when one request of
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
        if self._model is not None:
            seconds = self.scheduler.set_model_drafts(rows, lens, self._model)
            self.pending_draft_s = seconds if self._model_priced else \
                float(self.drafters[0].draft_time(self.cost, sampled, lens))
            return
        if self._tables is not None:
            self.pending_draft_s = self.scheduler.set_table_drafts(rows, lens, self._tables)
            return
        if self._inline is not None and self._inline.par[IN_NGRAM_TABLE]:
            self.scheduler.set_ngram_table_drafts(rows, lens, self._inline)
            self.pending_draft_s = float(self.drafters[0].draft_time(self.cost, sampled, lens))
            return
        batched = BATCHED.get(type(self.drafters[0]))
        if batched is not None:
            # The same drafts as the drafter's propose, for all rows in one compiled call (engine/batched.py).
            starts, lengths = batched(self.drafters[0], self.table.tokens, col["hist_off"][rows],
                                      col["prompt_len"][rows] + col["num_emitted"][rows], lens)
            self.scheduler.set_drafts_from_tokens(rows, starts, lengths)
            self.pending_draft_s = float(self.drafters[0].draft_time(self.cost, sampled, lens))
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
                if hasattr(self.drafters[tenant], "begin_step"):
                    self.drafters[tenant].begin_step(len(sampled))
                for j, draft in zip(idx, self.drafters[tenant].propose([sampled[j] for j in idx], lens[idx]),
                                    strict=True):
                    proposals[j] = draft
        self.scheduler.set_drafts(rows, proposals)
        # One proposer pass over all drafting rows (the engine runs one, whatever the tenants).
        self.pending_draft_s = float(self.drafters[0].draft_time(self.cost, sampled, lens))

    def _suffix_step(self, n_rows: int) -> None:
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
        for drafter in self.drafters:
            if isinstance(drafter, SuffixDrafter):
                drafter.sync()  # the starts and finishes the compiled steps made
        batch = sb.rows[:n_rows][self.scheduler.batch_order(n_rows)]
        rows = [self.states[r] for r in batch["call"].tolist()]
        # The calls that sampled and go on (sb.lists' "sampled"), in batch-row order.
        sampled = batch["call"][(batch["emitted"] > 0) & (col["status"][batch["call"]] != S_FINISHED)]
        k = self.spec.num_speculative_tokens
        fits = not n_rows or int(sb.sc[6]) + k <= max_len
        if not fits:
            self._drafter_hooks(rows, batch["emitted"], batch["started"], np.zeros(n_rows, dtype=bool))
            for i in batch["emitted"].nonzero()[0].tolist():  # tokens no tree gets (a drafter with a table must know)
                skip = getattr(self.drafters[rows[i].tenant], "skip_tokens", None)
                if skip is not None and rows[i].status != FINISHED:
                    skip(rows[i], int(batch["emitted"][i]))
            if k and sampled.shape[0]:
                zeros = np.zeros(k, dtype=np.int32)
                self.scheduler.set_drafts(sampled, [zeros] * sampled.shape[0])
            self.pending_draft_s = 0.0
            return
        num_tokens = col["prompt_len"][batch["call"]] + col["num_emitted"][batch["call"]]
        started = batch["started"]
        if self._suffix is not None:
            compiled = self._suffix_compiled_step(rows, batch["call"], batch["emitted"], num_tokens)
            if compiled is not None:
                self.pending_draft_s = compiled
                return
            # No start_call: it may have started calls before giving up, and `observe` starts a call
            # that has no state yet (a started row's) as start_call would.
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

    def _suffix_compiled_step(self, rows: list[CallState], calls: np.ndarray, emitted: np.ndarray,
                              num_tokens: np.ndarray) -> float | None:
        """`_suffix_step` with the compiled kernel doing the rows' appends and drafts (`SuffixDrafter.
        start_fresh`, `Scheduler.suffix_drafts`, `SuffixDrafter.finish_rows`): the drafting seconds, or
        None when the step needs the drafter's own `propose` (a stop, a restart, an eviction, a call at
        max_model_len), before anything changed or, should the kernel decline, after the fresh starts."""
        drafter: SuffixDrafter = self.drafters[0]
        emitting = emitted.nonzero()[0]
        if (num_tokens[emitting] >= self.limits.max_model_len).any():
            return None
        fresh = [state for state in (rows[i] for i in emitting.tolist())
                 if state.drafter_state is None or not state.drafter_state.active]
        if len(drafter.active) + len(fresh) != emitting.shape[0]:  # an active call did not emit: it stops
            return None
        if fresh and not drafter.start_fresh(fresh):
            return None
        drafter.make_step_room(calls[emitting], emitted[emitting])
        seconds = self.scheduler.suffix_drafts(self._suffix, self._inline_suffix())
        if seconds < 0.0:
            return None
        finished = emitting[self.table.cols["status"][calls[emitting]] == S_FINISHED]
        if finished.shape[0]:
            drafter.finish_rows([rows[i] for i in finished.tolist()])
        return seconds

    def _count_done(self, n: int) -> None:
        self.done_calls += n
        if self.progress is not None:
            self.progress(self.done_calls, len(self.states))

    # -- checks ----------------------------------------------------------------------------------------
    def _check_step(self) -> None:
        """The runtime invariants (config.check_invariants) after a run; BUDGET is checked in `_price`."""
        sched, pool, t = self.scheduler, self.kv.pool, self.table
        if sched.num_running > self.limits.max_num_seqs:
            raise SimulationError(f"{sched.num_running} running > max_num_seqs (SEQS)")
        held = int(np.count_nonzero(pool.ref[1:]))
        if held + pool.num_free != pool.usable:
            raise SimulationError(f"KV blocks: {held} held + {pool.num_free} free ≠ {pool.usable} usable (BLOCKS)")
        col, n = t.cols, t.rows
        running = sched.qu.running[:sched.num_running]
        slots = col["slot"][running]
        blocks = np.where(slots >= 0, t.slot_nblocks[np.maximum(slots, 0)], 0)
        if int(blocks.sum()) != int(pool.ref.sum()):
            raise SimulationError(f"KV references {int(pool.ref.sum())} ≠ blocks held by running calls "
                                  f"{int(blocks.sum())} (REFS)")
        bad = (col["status"][running] != S_RUNNING) | (blocks * self.config.block_size < col["num_computed"][running])
        if bad.any():
            s = self.states[int(running[bad.nonzero()[0][0]])]
            raise SimulationError(f"call {s.call_id!r}: {s.num_computed} computed tokens in "
                                  f"{len(s.block_ids)} blocks (SLOTS)")
        waiting = sched._waiting_rows()
        bad = (col["status"][waiting] != S_WAITING) | (col["slot"][waiting] >= 0)
        if bad.any():
            s = self.states[int(waiting[bad.nonzero()[0][0]])]
            raise SimulationError(f"waiting call {s.call_id!r} holds KV blocks (SLOTS)")
        arrived = int(np.count_nonzero(~np.isnan(col["arrival_s"][:n])))
        finished = int(np.count_nonzero(np.isin(col["status"][:n], (S_FINISHED, S_REFUSED))))
        if arrived != finished + sched.num_running + sched.num_waiting:
            raise SimulationError(f"CALLS: {arrived} arrived ≠ {finished} finished or refused + "
                                  f"{sched.num_running} running + {sched.num_waiting} waiting")

    # -- result ------------------------------------------------------------------------------------------
    def _result(self, wall_s: float) -> RunResult:
        ids = [s.call_id for s in self.states]
        self._price_references()
        engine_steps = self.log.engine_frame()
        st, t = self.states, self.table
        n = t.rows
        col = {k: v[:n].copy() for k, v in t.cols.items()}
        status = t.status_names()
        finished = col["status"] == S_FINISHED
        calls = pl.DataFrame({
            "call_id": ids,
            "query_id": [self.queries[s.query_index].query_id for s in st],
            "tenant": col["tenant"],
            "seq": np.fromiter((s.call.seq for s in st), dtype=np.int64, count=n),
            "status": status,
            "arrival_s": col["arrival_s"],
            "first_token_s": col["first_token_s"],
            "finish_s": col["finish_s"],
            "prompt_len": col["prompt_len"],
            "output_len": col["num_emitted"],
            "recorded_output_len": np.fromiter((s.output_len for s in st), dtype=np.int64, count=n),
            "truncated": (col["target_len"] < np.fromiter((s.output_len for s in st), dtype=np.int64, count=n))
            & finished,
            "prefix_hit_tokens": col["prefix_hit_tokens"],
            "drafted": col["drafted"],
            "accepted": col["accepted"],
            "draft_steps": col["draft_steps"],
            "decode_steps": col["decode_steps"],
            "preemptions": col["preemptions"],
            "refused": col["status"] == S_REFUSED,
        }).with_columns(pl.col("arrival_s", "first_token_s", "finish_s").fill_nan(None))
        qs = self.queries
        emitted = col["num_emitted"]
        queries = pl.DataFrame({
            "query_id": [q.query_id for q in qs],
            "tenant": np.fromiter((q.tenant for q in qs), dtype=np.int64, count=len(qs)),
            "calls": np.fromiter((len(q.calls) for q in qs), dtype=np.int64, count=len(qs)),
            "arrival_s": np.fromiter((q.arrival_s for q in qs), dtype=np.float64, count=len(qs)),
            "finish_s": np.fromiter((q.finish_s for q in qs), dtype=np.float64, count=len(qs)),
            "completed": [q.completed for q in qs],
            "output_tokens": np.fromiter((int(emitted[[s.index for s in q.calls]].sum()) for q in qs), dtype=np.int64,
                                         count=len(qs)),
        }).with_columns((pl.col("finish_s") - pl.col("arrival_s")).alias("latency_s")).with_columns(
            pl.col("arrival_s", "finish_s", "latency_s").fill_nan(None))
        # A live AgentSpec history over the simulator's memory bound dropped idle queries' histories: say so.
        evicted = sum(getattr(getattr(d, "history", None), "evicted", 0) for d in self.drafters)
        preemptions = pl.DataFrame({"step": [k for k, _ in self.preempted],
                                    "call_id": [ids[r] for _, r in self.preempted]},
                                   schema={"step": pl.Int64, "call_id": pl.Utf8})
        return RunResult(self.config, self.limits, self.spec, self.spec.name, engine_steps, calls, queries,
                         num_preemptions=self.scheduler.num_preemptions, wall_s=wall_s, preemptions=preemptions,
                         extra={"history_evictions": evicted} if evicted else {},
                         steps_source=partial(self.log.steps_frame, engine_steps, self.spec.name, ids))


def _replaced(held: tuple, current: dict[str, np.ndarray]) -> bool:
    """Whether any of `current`'s arrays is not the one the named tuple `held` holds (compared by identity)."""
    return any(getattr(held, name) is not array for name, array in current.items())
