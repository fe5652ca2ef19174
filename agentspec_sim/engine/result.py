"""What a run returns: the per-step log and per-call / per-query statistics, as polars DataFrames.

The log is accumulated in numpy record buffers by the compiled engine step (`StepLogBuilder`) and
turned into frames at the end, so the hot loop never builds per-row Python objects; `steps`, the
largest frame, is built the first time it is read.

`steps` (one row per call-step; `--steps` writes it): step, time_s (step start), drafter, call_id,
phase ('prefill' | 'decode'), position (output tokens emitted before the step), context_len (tokens
in the KV cache before the step), scheduled_tokens (this call's tokens in the forward pass), draft
(list[int32] of draft ids actually scheduled), drafted (its length), accepted, emitted, then the
engine step's batch_size, step_time_s (= draft_s + forward_s + host_s), forward_s, draft_s, host_s (the host work a
synchronous engine's GPU waits for each step: 0 with async scheduling, `StepCostModel.sync_host_time`), and the paper's
ΔT(b) decomposition (AgentSpec §3.1) for the step, null when it verified no draft:
  D     draft tokens verified in the step;
  rho   rejected / drafted tokens in the step;
  t_A   per-token time an accepted draft saves: the same batch's forward time without its drafts,
        divided by the batch size (cost/base.py's t_A);
  t_V   per-token verification cost: (forward time − forward time without drafts) / D;
  t_D   per-token drafting cost: draft_s / D.
`engine_steps` has one row per engine step with these step-level columns plus running and waiting
(after the step's scheduling), free KV blocks, the budget M(b) and `bound` (what left requests waiting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import polars as pl

from agentspec_sim.engine.config import EngineConfig, ResolvedLimits
from agentspec_sim.engine.counters import LG_DRAFT_TOKENS, LG_ROWS, LG_STEPS
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.engine.request import S_FINISHED, S_REFUSED, S_SKIPPED, CallState, CallTable, QueryRun, zeros

STEP_COLUMNS = (
    "step", "time_s", "drafter", "call_id", "phase", "position", "context_len", "scheduled_tokens", "draft",
    "drafted", "accepted", "emitted", "batch_size", "step_time_s", "forward_s", "draft_s", "host_s", "D", "rho",
    "t_A", "t_V", "t_D",
)


@dataclass
class RunResult:
    """One simulation: its configuration, the logs, and the per-call and per-query statistics.

    `steps` (one row per call-step, by far the largest frame) is built from the engine's log
    buffers the first time it is read, then kept; a summary never needs it.
    """

    config: EngineConfig
    limits: ResolvedLimits
    spec: SpeculativeConfig
    drafter: str
    engine_steps: pl.DataFrame
    calls: pl.DataFrame
    queries: pl.DataFrame
    num_preemptions: int = 0
    wall_s: float = 0.0
    # One row per preemption, in order: the step whose scheduling preempted the call (recompute), call_id.
    preemptions: pl.DataFrame | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Where a watch ended the run early (engine/watch.py): the simulated second it stopped at; None: ran to the end.
    stopped_s: float | None = None
    steps_source: pl.DataFrame | Callable[[], pl.DataFrame] | None = field(default=None, repr=False, compare=False)
    emissions_source: pl.DataFrame | Callable[[], pl.DataFrame] | None = field(default=None, repr=False,
                                                                             compare=False)

    @property
    def steps(self) -> pl.DataFrame:
        if callable(self.steps_source):
            self.steps_source = self.steps_source()
        return self.steps_source

    @property
    def emissions(self) -> pl.DataFrame:
        """One row per call-step that emitted tokens, in step order: `call` (the call's row in `calls`), `time_s`
        (the step's end, when its tokens reach the client as one streamed chunk), `tokens`. Built on first read
        from the log's rows (a fraction of `steps`: no drafts, no step columns)."""
        if callable(self.emissions_source):
            self.emissions_source = self.emissions_source()
        return self.emissions_source


# The step log's records (numba reads field f of record array a as `a.f[i]`).
LOG_ROW = np.dtype([(name, np.int32) for name in (  # one per call-step
    "call", "decode", "position", "context_len", "scheduled", "drafted", "accepted", "emitted")], align=True)
LOG_EVENT = np.dtype([("kind", np.int64), ("call", np.int64), ("step", np.int64)], align=True)
_FLOAT_STEP_FIELDS = frozenset(("time_s", "forward_s", "draft_s", "host_s", "t_A", "t_V", "t_D"))


class StepColumns(NamedTuple):
    """The engine-step log, one array per field (numba writes field f of step i as `steps.f[i]`, as it would
    a record array's): the engine-steps frame takes the columns as they are, where a record per step would
    need a transposing copy of the whole log (2.3M steps at max_num_seqs 1 on the default trace)."""

    batch_size: np.ndarray  # int64, as every field up to `time_s`
    scheduled_tokens: np.ndarray
    decode_calls: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    free_blocks: np.ndarray
    bound: np.ndarray
    D: np.ndarray
    acc: np.ndarray
    budget: np.ndarray
    time_s: np.ndarray  # float64, as every field from here
    forward_s: np.ndarray
    draft_s: np.ndarray
    host_s: np.ndarray  # a synchronous engine's host work the GPU waits for (0 with async scheduling)
    t_A: np.ndarray
    t_V: np.ndarray
    t_D: np.ndarray

    @classmethod
    def empty(cls, n: int) -> StepColumns:
        return cls(*(np.empty(n, dtype=np.float64 if name in _FLOAT_STEP_FIELDS else np.int64)
                     for name in cls._fields))

    @property
    def capacity(self) -> int:
        return self.batch_size.shape[0]

    @property
    def duration_s(self) -> np.ndarray:
        """Each step's length: its forward, its drafting and a synchronous engine's host wait (the pricer's)."""
        return self.forward_s + self.draft_s + self.host_s

    def head(self, n: int) -> StepColumns:
        """The first n steps (views)."""
        return self.window(0, n)

    def window(self, k0: int, k1: int) -> StepColumns:
        """Steps k0 … k1 − 1 (views)."""
        return StepColumns(*(a[k0:k1] for a in self))

    def grown(self, n: int, used: int) -> StepColumns:
        """A copy with room for n steps, holding the first `used`."""
        out = StepColumns.empty(n)
        for old, new in zip(self, out, strict=True):
            new[:used] = old[:used]
        return out


STEP_LOG_BYTES = 8 * len(StepColumns._fields)  # one engine step's log entry, every field


class LogBuf(NamedTuple):
    """The step log's growable buffers as the compiled `scheduler.log_step` writes them.

    `bound` is a `scheduler.BOUNDS` code; `events` are a run's effects the event loop still has to
    time (`scheduler.EV_*`), cleared after each run; `draft_tokens` holds the scheduled drafts of the
    call-steps, in order.
    """

    rows: np.ndarray  # LOG_ROW
    steps: StepColumns
    events: np.ndarray  # LOG_EVENT
    draft_tokens: np.ndarray  # int32
    ctr: np.ndarray  # int64: [call-steps, steps, events, draft tokens]


class StepLogBuilder:
    """Collects the step log in growable numpy buffers (`buf`) and makes the two step frames.

    The compiled `scheduler.log_step` appends each step (call-steps, step counters, drafts) straight
    into the buffers; the event loop fills in the times.
    """

    def __init__(self, rows: int = 1 << 15, steps: int = 1 << 11, events: int = 1 << 11, drafts: int = 1 << 12) -> None:
        # Written before read, so no need to zero them (see `request.zeros`).
        self.buf = LogBuf(np.empty(rows, dtype=LOG_ROW), StepColumns.empty(steps),
                          np.empty(events, dtype=LOG_EVENT), np.empty(drafts, dtype=np.int32),
                          zeros(4, dtype=np.int64))

    @property
    def num_rows(self) -> int:
        return int(self.buf.ctr[LG_ROWS])

    @property
    def num_steps(self) -> int:
        return int(self.buf.ctr[LG_STEPS])

    def reserve(self, rows: int, steps: int, events: int, drafts: int) -> None:
        """Room for `rows` more call-steps, `steps` steps, `events` events and `drafts` draft tokens."""
        b = self.buf
        changes: dict[str, Any] = {}
        for i, (name, more) in enumerate((("rows", rows), ("steps", steps), ("events", events),
                                          ("draft_tokens", drafts))):
            have, used = getattr(b, name), int(b.ctr[i])
            if name == "steps":
                if used + more > have.capacity:
                    changes[name] = have.grown(max(2 * have.capacity, used + more), used)
            elif used + more > have.shape[0]:
                grown = np.empty(max(2 * have.shape[0], used + more), dtype=have.dtype)
                grown[:used] = have[:used]
                changes[name] = grown
        if changes:
            self.buf = b._replace(**changes)

    def engine_frame(self) -> pl.DataFrame:
        """One row per engine step (see the module docstring)."""
        col = self.buf.steps.head(self.num_steps)
        ns = col.batch_size.shape[0]
        with np.errstate(invalid="ignore", divide="ignore"):
            d = col.D.astype(np.float64)
            rho = np.where(d > 0, (d - col.acc) / d, np.nan)
        return pl.DataFrame({
            "step": np.arange(ns, dtype=np.int64), "time_s": col.time_s, "batch_size": col.batch_size,
            "decode_calls": col.decode_calls, "scheduled_tokens": col.scheduled_tokens,
            "D": col.D, "accepted": col.acc,
            "step_time_s": col.duration_s, "forward_s": col.forward_s,
            "draft_s": col.draft_s, "host_s": col.host_s, "rho": rho, "t_A": col.t_A, "t_V": col.t_V, "t_D": col.t_D,
            "running": col.running, "waiting": col.waiting, "free_blocks": col.free_blocks,
            "budget": col.budget,
            "bound": pl.Series(_BOUND_NAMES, dtype=pl.Utf8).gather(col.bound),
        }).with_columns(pl.col("rho", "t_A", "t_V", "t_D").fill_nan(None))

    def emissions_frame(self, engine: pl.DataFrame) -> pl.DataFrame:
        """`RunResult.emissions`: the log's call-steps that emitted tokens, each at its engine step's end (the engine's
        clock: a client has them the call's front-end time later, where the calls frame's first_token_s and
        finish_s are; gaps between them, ITL, are the same on either clock)."""
        rows = self.buf.rows[:int(self.buf.ctr[LG_ROWS])]
        step = np.repeat(np.arange(engine.height, dtype=np.int64), engine["batch_size"].to_numpy())
        end = (engine["time_s"] + engine["step_time_s"]).to_numpy()
        emitted = np.ascontiguousarray(rows["emitted"])
        keep = emitted > 0
        return pl.DataFrame({"call": np.ascontiguousarray(rows["call"])[keep].astype(np.int64),
                             "time_s": end[step[keep]], "tokens": emitted[keep].astype(np.int64)})

    def steps_frame(self, engine: pl.DataFrame, drafter: str, call_ids: list[str]) -> pl.DataFrame:
        """One row per call-step: the rows of the log with their engine step's columns."""
        b = self.buf
        rows = b.rows[:int(b.ctr[LG_ROWS])]
        batch = engine["batch_size"].to_numpy()
        row_step = pl.Series("step", np.repeat(np.arange(batch.shape[0], dtype=np.int64), batch))
        per_step = engine.select("time_s", "batch_size", "step_time_s", "forward_s", "draft_s", "host_s", "D", "rho",
                                 "t_A", "t_V", "t_D")

        def column(name: str) -> pl.Series:
            return pl.Series(np.ascontiguousarray(rows[name])).cast(pl.Int64)

        drafted = np.ascontiguousarray(rows["drafted"]).astype(np.int64)
        frame = pl.DataFrame({
            "step": row_step,
            "call_id": pl.Series(call_ids, dtype=pl.Utf8).gather(np.ascontiguousarray(rows["call"])),
            "phase": pl.Series(["prefill", "decode"], dtype=pl.Utf8).gather(np.ascontiguousarray(rows["decode"])),
            "position": column("position"),
            "context_len": column("context_len"),
            "scheduled_tokens": column("scheduled"),
            "draft": _list_column(b.draft_tokens[:int(b.ctr[LG_DRAFT_TOKENS])], drafted),
            "drafted": drafted,
            "accepted": column("accepted"),
            "emitted": column("emitted"),
        })
        return pl.concat([frame, per_step[row_step]], how="horizontal").with_columns(
            pl.lit(drafter, dtype=pl.Utf8).alias("drafter")).select(STEP_COLUMNS)


_BOUND_NAMES = ("none", "max_num_seqs", "kv_cache", "token_budget")  # by `scheduler.BOUNDS` code


def _list_column(values: np.ndarray, lengths: np.ndarray) -> pl.Series:
    """A list[int32] column from the drafts' tokens (in row order) and every row's length."""
    n = lengths.shape[0]
    frame = pl.DataFrame({"row": np.arange(n, dtype=np.int64)})
    empty = pl.lit([], dtype=pl.List(pl.Int32))
    if not values.shape[0]:
        return frame.with_columns(empty.alias("draft"))["draft"]
    rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
    grouped = pl.DataFrame({"row": rows, "draft": values.astype(np.int32)}).group_by("row", maintain_order=True).agg(
        pl.col("draft"))
    return (frame.join(grouped, on="row", how="left", maintain_order="left")
            .with_columns(pl.col("draft").fill_null(empty)))["draft"]


def calls_frame(t: CallTable, states: Sequence[CallState], query_ids: Sequence[str],
                frontend_s: np.ndarray | None = None) -> pl.DataFrame:
    """A run's calls, one row each (RunResult.calls): the call table's columns at the run's end. `frontend_s` (by
    table row): each call's time outside the engine core (the cost model's `frontend_time`), which moves its
    first-token and finish times to when the client has them (TTFT and E2EL as `vllm bench serve` measures)."""
    st, n = states, t.rows
    ids = [s.call_id for s in st]
    col = {k: v[:n].copy() for k, v in t.cols.items()}
    if frontend_s is not None:
        col["first_token_s"] += frontend_s[:n]
        col["finish_s"] += frontend_s[:n]
    status = t.status_names()
    finished = col["status"] == S_FINISHED
    return pl.DataFrame({
        "call_id": ids,
        "query_id": list(query_ids),
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


def queries_frame(qs: Sequence[QueryRun], emitted: np.ndarray, frontend_s: np.ndarray | None = None,
                  status: np.ndarray | None = None) -> pl.DataFrame:
    """A run's query instances, one row each (RunResult.queries); `emitted`: each call's tokens, by table row.
    `frontend_s` / `status` (by table row): a query ends when the client has its last call's answer (`calls_frame`)."""
    finish = np.fromiter((q.finish_s for q in qs), dtype=np.float64, count=len(qs))
    if frontend_s is not None and status is not None:
        finish += np.fromiter((frontend_s[[s.index for s in q.calls if status[s.index] != S_SKIPPED][-1]]
                               for q in qs), dtype=np.float64, count=len(qs))
    return pl.DataFrame({
        "query_id": [q.query_id for q in qs],
        "tenant": np.fromiter((q.tenant for q in qs), dtype=np.int64, count=len(qs)),
        "calls": np.fromiter((len(q.calls) for q in qs), dtype=np.int64, count=len(qs)),
        "arrival_s": np.fromiter((q.arrival_s for q in qs), dtype=np.float64, count=len(qs)),
        "finish_s": finish,
        "completed": [q.completed for q in qs],
        "output_tokens": np.fromiter((int(emitted[[s.index for s in q.calls]].sum()) for q in qs), dtype=np.int64,
                                     count=len(qs)),
    }).with_columns((pl.col("finish_s") - pl.col("arrival_s")).alias("latency_s")).with_columns(
        pl.col("arrival_s", "finish_s", "latency_s").fill_nan(None))
