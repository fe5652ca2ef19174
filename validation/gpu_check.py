"""The one-command GPU check: timing validation of Qwen3-8B and GPT-OSS-20B shapes at max_num_seqs 1, 32, 256.

For each model the timing model is built once (random bf16 weights) and replays the committed
schedule samples (validation/schedules/, 48 steps each; `quick`: 16 of them, fewer repeats), then a
calibration is fitted on all of that model's steps (a quarter held out). Everything goes under one
folder:

  OUT/<model>/seqs<N>/   timing.parquet, timing_calls.parquet, scatter.png, summary.json, … per schedule
  OUT/<model>/           calibration.json (fitted on the model's steps), hardware.json, model.json
  OUT/mape.json          the table printed at the end

Runs from the source tree through validation/launch.py (no install, no polars).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from agentspec_sim.cost.calibrate import mape
from agentspec_sim.validation.schedule import StepShapes, bundled_schedule, stratified_sample
from agentspec_sim.validation.timing import (
    TimingConfig,
    TimingResult,
    attach_fit,
    attention_kind,
    open_session,
    predict,
    run_timing,
    write_outputs,
)
from agentspec_sim.validation.torch_model import free_gpu_memory

MODELS = ("qwen3-8b", "gpt-oss-20b")
MAX_NUM_SEQS = (1, 32, 256)
QUICK_STEPS = 16


def _concat(shapes: list[StepShapes]) -> StepShapes:
    sizes = np.concatenate([s.batch_sizes for s in shapes])
    return StepShapes(np.concatenate([s.step_ids for s in shapes]),
                      np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                      np.concatenate([s.query_lens for s in shapes]), np.concatenate([s.context_lens for s in shapes]),
                      np.concatenate([s.is_prefill for s in shapes]), {}, {"schedules": [s.meta for s in shapes]})


def run_gpu_check(out_dir: str | Path, *, quick: bool = False, models: tuple[str, ...] = MODELS,
                  max_num_seqs: tuple[int, ...] = MAX_NUM_SEQS, config: TimingConfig | None = None,
                  steps: int | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Run the check (module docstring); returns the MAPE table rows (also written to OUT/mape.json)."""
    from agentspec_sim.io.atomic import write_json_atomic

    out = Path(out_dir)
    base = config or TimingConfig()
    if quick:
        base = replace(base, warmup=1, repeats=3)
    per_schedule = steps if steps is not None else (QUICK_STEPS if quick else None)
    rows: list[dict] = []
    began = time.perf_counter()
    for model in models:
        t0 = time.perf_counter()
        session = open_session(replace(base, model=model))
        log(f"{model}: built {session.spec.name} on {session.device} in {time.perf_counter() - t0:.1f} s; "
            f"predicting with {session.hardware.name}; attention: {attention_kind(session.model)}")
        results: list[TimingResult] = []
        for seqs in max_num_seqs:
            shapes = StepShapes.from_file(bundled_schedule(model, seqs))
            if per_schedule is not None:
                shapes = stratified_sample(shapes, per_schedule, seed=0)
            result = run_timing(shapes, session=session, fit=False)
            write_outputs(result, out / model / f"seqs{seqs}")
            results.append(result)
            log(f"  max_num_seqs {seqs}: {len(shapes)} steps in {result.wall_s:.1f} s, MAPE {result.mape:.1f}%")
        combined = TimingResult(_concat([r.shapes for r in results]), np.concatenate([r.measured_s for r in results]),
                                np.concatenate([r.predicted_s for r in results]),
                                np.concatenate([r.graphed for r in results]), session.spec, session.profile,
                                session.hardware, session.calibration, session.device, base.dtype)
        attach_fit(combined, session)
        paths = write_outputs(combined, out / model, plot=True)
        for seqs, r in zip(max_num_seqs, results, strict=True):
            row = {"model": model, "max_num_seqs": seqs, "steps": len(r.shapes), "mape": r.mape,
                   "measured_ms_median": float(np.median(r.measured_s) * 1e3),
                   "cuda_graph_steps": int(r.graphed.sum())}
            if combined.fit is not None:
                row["mape_calibrated"] = mape(predict(session, r.shapes, combined.fit.calibration), r.measured_s)
            rows.append(row)
        if combined.fit is not None:
            f = combined.fit
            rows.append({"model": model, "max_num_seqs": "all", "steps": len(combined.shapes), "mape": combined.mape,
                         "mape_calibrated": mape(combined.calibrated_s, combined.measured_s),
                         "held_out_before": f.mape_before_holdout, "held_out_after": f.mape_after_holdout,
                         "calibration": str(paths.get("calibration"))})
        del session
        free_gpu_memory()
    write_json_atomic(out / "mape.json", {"rows": rows, "wall_s": time.perf_counter() - began, "quick": quick})
    return rows


def format_table(rows: list[dict]) -> str:
    """The MAPE table as plain text (the GPU machine may lack rich's terminal)."""
    header = f"{'model':<14}{'max_num_seqs':>13}{'steps':>7}{'MAPE':>9}{'calibrated':>12}{'held-out':>18}"
    lines = [header, "-" * len(header)]
    for r in rows:
        cal = f"{r['mape_calibrated']:.1f}%" if r.get("mape_calibrated") is not None else "—"
        held = (f"{r['held_out_before']:.1f}→{r['held_out_after']:.1f}%"
                if r.get("held_out_after") is not None else "")
        lines.append(f"{r['model']:<14}{r['max_num_seqs']!s:>13}{r['steps']:>7}{r['mape']:>8.1f}%{cal:>12}{held:>18}")
    return "\n".join(lines)
