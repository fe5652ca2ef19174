"""Measured step timings for `calibrate cost` from a per-call-step table.

Accepted tables (parquet or CSV), one row per call per step, with the simulator's step-log columns
step, phase, context_len, scheduled_tokens and a step-level time column:
  * `measured_s`  — `validate timing`'s timing_calls.parquet (a measured forward pass);
  * `forward_s`   — a step log, or a vLLM export that separates forward and drafting time;
  * `step_time_s` — a vLLM export of whole steps; with `draft_s` the forward time is the difference.
Optional `hardware` and `model` columns (one value each; `validate timing` writes them) say what the times
were measured on, so `calibrate cost` fits them only against those profiles.
With a `draft_s` column, steps that drafted also fit the model-free drafting cost against the number
of decode calls in the step (the rows a model-free proposer runs over).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from agentspec_sim.cost.calibrate import StepTimings
from agentspec_sim.validation.schedule import ScheduleError, read_table, shapes_from_columns

TIME_COLUMNS = ("measured_s", "forward_s", "step_time_s")


def timings_from_columns(columns: Mapping[str, np.ndarray], where: str = "<table>",
                         time_column: str | None = None, drafter: str | None = None) -> tuple[StepTimings, str]:
    """(timings, the time column used) from a per-call-step table (see the module docstring)."""
    if time_column is not None and time_column not in TIME_COLUMNS:
        raise ScheduleError(f"{where}: time column {time_column!r}: expected one of {', '.join(TIME_COLUMNS)}")
    name = time_column or next((c for c in TIME_COLUMNS if c in columns), None)
    if name is None or name not in columns:
        raise ScheduleError(f"{where}: no time column (need one of {', '.join(TIME_COLUMNS)})")
    shapes = shapes_from_columns(columns, where, time_columns=(name, "draft_s"), drafter=drafter)
    draft = shapes.times.get("draft_s")
    forward = shapes.times[name]
    if name == "step_time_s" and draft is not None:
        forward = forward - np.nan_to_num(draft)
    bad = ~np.isfinite(forward) | (forward <= 0)
    if bad.any():
        k = int(bad.nonzero()[0][0])
        raise ScheduleError(f"{where}: step {int(shapes.step_ids[k])}: {name}: forward time must be > 0, "
                            f"got {forward[k]!r}")
    decode_calls = np.add.reduceat((~shapes.is_prefill).astype(np.int64), shapes.offsets[:-1])
    timings = StepTimings(shapes.offsets, shapes.query_lens, shapes.context_lens, shapes.is_prefill, forward,
                          None if draft is None else np.nan_to_num(draft), None if draft is None else decode_calls,
                          _recorded(columns, "hardware", where), _recorded(columns, "model", where))
    return timings, name


def _recorded(columns: Mapping[str, np.ndarray], name: str, where: str) -> str | None:
    """The one value of a `hardware` / `model` column (what the times were measured on), None without one."""
    if name not in columns:
        return None
    values = sorted({str(v) for v in columns[name].tolist() if v is not None and str(v)})
    if len(values) > 1:
        raise ScheduleError(f"{where}: {name}: the timings mix {', '.join(map(repr, values))}; fit each on its own")
    return values[0] if values else None


def timings_from_table(path: str | Path, time_column: str | None = None, drafter: str | None = None) -> StepTimings:
    """`timings_from_columns` of a parquet / CSV file."""
    return timings_from_columns(read_table(path), where=str(path), time_column=time_column, drafter=drafter)[0]
