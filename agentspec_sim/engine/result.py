"""What a run returns: the per-step log and per-call / per-query statistics, as polars DataFrames.

The log is accumulated as numpy arrays per engine step (`StepLogBuilder`) and turned into frames
once at the end, so the hot loop never builds per-row Python objects.

`steps` (one row per call-step; `--steps` writes it): step, time_s (step start), drafter, call_id,
phase ('prefill' | 'decode'), position (output tokens emitted before the step), context_len (tokens
in the KV cache before the step), scheduled_tokens (this call's tokens in the forward pass), draft
(list[int32] of draft ids actually scheduled), drafted (its length), accepted, emitted, then the
engine step's batch_size, step_time_s (= draft_s + forward_s), forward_s, draft_s, and the paper's
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

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from agentspec_sim.drafters.base import SpeculativeConfig
from agentspec_sim.engine.config import EngineConfig, ResolvedLimits

STEP_COLUMNS = (
    "step", "time_s", "drafter", "call_id", "phase", "position", "context_len", "scheduled_tokens", "draft",
    "drafted", "accepted", "emitted", "batch_size", "step_time_s", "forward_s", "draft_s", "D", "rho", "t_A",
    "t_V", "t_D",
)
BOUND_CODES = {None: "none", "seqs": "max_num_seqs", "kv": "kv_cache", "tokens": "token_budget"}


@dataclass
class RunResult:
    """One simulation: its configuration, the logs, and the per-call and per-query statistics."""

    config: EngineConfig
    limits: ResolvedLimits
    spec: SpeculativeConfig
    drafter: str
    steps: pl.DataFrame
    engine_steps: pl.DataFrame
    calls: pl.DataFrame
    queries: pl.DataFrame
    num_preemptions: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class StepLogBuilder:
    """Collects per-step numpy arrays; `build()` makes the two step frames."""

    def __init__(self) -> None:
        self.row_parts: dict[str, list[np.ndarray]] = {k: [] for k in (
            "call", "decode", "position", "context_len", "scheduled_tokens", "drafted", "accepted", "emitted")}
        self.draft_parts: list[np.ndarray] = []
        self.step_values: dict[str, list[float]] = {k: [] for k in (
            "time_s", "batch_size", "scheduled_tokens", "forward_s", "draft_s", "D", "accepted", "t_A", "t_V",
            "t_D", "running", "waiting", "free_blocks", "budget", "decode_calls")}
        self.bounds: list[str] = []

    def add_step(self, *, call: np.ndarray, decode: np.ndarray, position: np.ndarray, context_len: np.ndarray,
                 scheduled: np.ndarray, drafts: list[np.ndarray], accepted: np.ndarray, emitted: np.ndarray,
                 step: dict[str, float], bound: str | None) -> None:
        drafted = np.fromiter((d.shape[0] for d in drafts), dtype=np.int64, count=len(drafts))
        for key, value in (("call", call), ("decode", decode), ("position", position), ("context_len", context_len),
                           ("scheduled_tokens", scheduled), ("drafted", drafted), ("accepted", accepted),
                           ("emitted", emitted)):
            self.row_parts[key].append(value)
        if drafted.any():
            self.draft_parts.extend(d for d in drafts if d.shape[0])
        for key, values in self.step_values.items():
            values.append(step[key])
        self.bounds.append(BOUND_CODES[bound])

    def build(self, drafter: str, call_ids: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
        cols = {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for k, v in self.row_parts.items()}
        sv = {k: np.asarray(v, dtype=np.float64) for k, v in self.step_values.items()}
        batch = sv["batch_size"].astype(np.int64)
        num_steps = batch.shape[0]
        step_idx = np.arange(num_steps, dtype=np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            d = sv["D"]
            rho = np.where(d > 0, (d - sv["accepted"]) / d, np.nan)
        engine = pl.DataFrame({
            "step": step_idx, "time_s": sv["time_s"], "batch_size": batch,
            "decode_calls": sv["decode_calls"].astype(np.int64),
            "scheduled_tokens": sv["scheduled_tokens"].astype(np.int64),
            "D": d.astype(np.int64), "accepted": sv["accepted"].astype(np.int64),
            "step_time_s": sv["forward_s"] + sv["draft_s"], "forward_s": sv["forward_s"], "draft_s": sv["draft_s"],
            "rho": rho, "t_A": sv["t_A"], "t_V": sv["t_V"], "t_D": sv["t_D"],
            "running": sv["running"].astype(np.int64), "waiting": sv["waiting"].astype(np.int64),
            "free_blocks": sv["free_blocks"].astype(np.int64), "budget": sv["budget"].astype(np.int64),
            "bound": pl.Series(self.bounds, dtype=pl.Utf8),
        }).with_columns(pl.col("rho", "t_A", "t_V", "t_D").fill_nan(None))
        per_row = {name: np.repeat(engine[name].to_numpy(), batch) for name in (
            "time_s", "step_time_s", "forward_s", "draft_s", "D", "rho", "t_A", "t_V", "t_D")}
        ids = np.asarray(call_ids, dtype=object)
        steps = pl.DataFrame({
            "step": np.repeat(step_idx, batch),
            "time_s": per_row["time_s"],
            "call_id": pl.Series(ids[cols["call"]] if cols["call"].size else [], dtype=pl.Utf8),
            "phase": pl.Series(np.where(cols["decode"].astype(bool), "decode", "prefill"), dtype=pl.Utf8),
            "position": cols["position"].astype(np.int64),
            "context_len": cols["context_len"].astype(np.int64),
            "scheduled_tokens": cols["scheduled_tokens"].astype(np.int64),
            "draft": _list_column(self.draft_parts, cols["drafted"]),
            "drafted": cols["drafted"].astype(np.int64),
            "accepted": cols["accepted"].astype(np.int64),
            "emitted": cols["emitted"].astype(np.int64),
            "batch_size": np.repeat(batch, batch),
            **{k: per_row[k] for k in ("step_time_s", "forward_s", "draft_s")},
            "D": per_row["D"].astype(np.int64),
            **{k: per_row[k] for k in ("rho", "t_A", "t_V", "t_D")},
        }).with_columns(pl.col("rho", "t_A", "t_V", "t_D").fill_nan(None),
                        pl.lit(drafter, dtype=pl.Utf8).alias("drafter"))
        return steps.select(STEP_COLUMNS), engine


def _list_column(parts: list[np.ndarray], lengths: np.ndarray) -> pl.Series:
    """A list[int32] column from the non-empty drafts (in row order) and every row's length."""
    n = lengths.shape[0]
    frame = pl.DataFrame({"row": np.arange(n, dtype=np.int64)})
    empty = pl.lit([], dtype=pl.List(pl.Int32))
    if not parts:
        return frame.with_columns(empty.alias("draft"))["draft"]
    values = np.concatenate(parts).astype(np.int32)
    rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
    grouped = pl.DataFrame({"row": rows, "draft": values}).group_by("row", maintain_order=True).agg(pl.col("draft"))
    return (frame.join(grouped, on="row", how="left", maintain_order="left")
            .with_columns(pl.col("draft").fill_null(empty)))["draft"]
