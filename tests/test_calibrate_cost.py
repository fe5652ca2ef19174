"""calibrate cost: bounded least squares recovers known factors; inputs from step logs and vLLM exports; CLI."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.cost.calibrate import (
    FORWARD_FACTORS,
    CalibrationFitError,
    StepTimings,
    fit_calibration,
    predict_forward,
    split_holdout,
)
from agentspec_sim.cost.roofline import Calibration
from agentspec_sim.validation.calibration_input import timings_from_columns
from agentspec_sim.validation.schedule import ScheduleError, write_table

TRUE = Calibration(memory_efficiency=0.72, compute_efficiency=0.61, attention_bandwidth_efficiency=0.66,
                   attention_compute_efficiency=0.43, step_overhead_s=400e-6, per_call_overhead_s=5e-6,
                   model_free_draft_step_s=35e-6, model_free_draft_per_call_s=1.5e-6)


def synthetic_steps(seed: int = 1, n_steps: int = 96):
    """Decode, verify, mixed prefill+decode and long-prefill steps over batch sizes 1-256 and long contexts."""
    rng = np.random.default_rng(seed)
    q, c, p, sizes = [], [], [], []
    for k in range(n_steps):
        kind, b = k % 4, int(2 ** rng.integers(0, 9))
        if kind == 0:
            qs, cs, ps = [1] * b, rng.integers(100, 30000, b).tolist(), [0] * b
        elif kind == 1:
            qs, cs, ps = (1 + rng.integers(0, 6, b)).tolist(), rng.integers(100, 30000, b).tolist(), [0] * b
        elif kind == 2:
            b = max(1, b // 4)
            qs = [int(rng.integers(256, 4096))] + [1] * (b - 1)
            cs = [int(rng.integers(0, 30000)), *rng.integers(100, 30000, b - 1).tolist()]
            ps = [1] + [0] * (b - 1)
        else:
            qs, cs, ps = [int(rng.integers(2048, 8192))], [int(rng.integers(0, 60000))], [1]
        q += qs
        c += cs
        p += ps
        sizes.append(len(qs))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return offsets, np.array(q, np.int64), np.array(c, np.int64), np.array(p, bool)


def measured(cal: Calibration = TRUE, hardware: str = "h100-80g", model: str = "qwen3-8b", seed: int = 1):
    offsets, q, c, p = synthetic_steps(seed)
    probe = StepTimings(offsets, q, c, p, np.ones(offsets.shape[0] - 1))
    return StepTimings(offsets, q, c, p, predict_forward(probe, hardware, model, cal))


@pytest.mark.parametrize(("hardware", "model"), [("h100-80g", "qwen3-8b"), ("h200", "gpt-oss-20b")])
def test_fit_recovers_known_factors_to_2_percent(hardware, model):
    timings = measured(hardware=hardware, model=model)
    fit = fit_calibration(timings, hardware, model)  # starts from the documented defaults
    for name in FORWARD_FACTORS:
        got, want = getattr(fit.calibration, name), getattr(TRUE, name)
        assert abs(got / want - 1) < 0.02, (name, got, want)
    assert fit.mape_before_train > 5 and fit.mape_after_train < 0.1
    assert fit.num_holdout == 24 and fit.mape_after_holdout < 0.1 < fit.mape_before_holdout


def test_fit_is_robust_to_noise_and_held_out_error_is_reported():
    timings = measured()
    noisy = np.random.default_rng(5).normal(1.0, 0.02, timings.num_steps)
    fit = fit_calibration(StepTimings(timings.offsets, timings.query_lens, timings.context_lens, timings.is_prefill,
                                      timings.forward_s * noisy), "h100-80g", "qwen3-8b", seed=3)
    assert fit.mape_after_train < 3.0 and fit.mape_after_holdout < 3.0
    assert abs(fit.calibration.compute_efficiency / TRUE.compute_efficiency - 1) < 0.05


def test_draft_cost_is_fitted_from_drafting_times():
    timings = measured()
    calls = np.diff(timings.offsets)
    draft = TRUE.model_free_draft_step_s + TRUE.model_free_draft_per_call_s * calls
    t = StepTimings(timings.offsets, timings.query_lens, timings.context_lens, timings.is_prefill, timings.forward_s,
                    draft, calls)
    fit = fit_calibration(t, "h100-80g", "qwen3-8b")
    assert fit.fitted[-2:] == ("model_free_draft_step_s", "model_free_draft_per_call_s")
    assert fit.calibration.model_free_draft_step_s == pytest.approx(35e-6, rel=1e-6)
    assert fit.calibration.model_free_draft_per_call_s == pytest.approx(1.5e-6, rel=1e-6)
    assert fit.draft_mape_after < 1e-6 < fit.draft_mape_before


def test_holdout_split_is_seeded_and_disjoint():
    a, b = split_holdout(40, 0.25, 7)
    assert len(b) == 10 and not set(a) & set(b) and sorted([*a, *b]) == list(range(40))
    assert np.array_equal(split_holdout(40, 0.25, 7)[1], b)
    with pytest.raises(CalibrationFitError, match="holdout fraction"):
        split_holdout(10, 1.0, 0)


def test_too_few_steps_is_a_clear_error():
    t = measured()
    small = t.subset(np.arange(6))
    with pytest.raises(CalibrationFitError, match="cannot determine 6 factors"):
        fit_calibration(small, "h100-80g", "qwen3-8b", holdout=0.0)


def _rows(timings: StepTimings, time_name: str, extra: dict | None = None) -> dict:
    sizes = np.diff(timings.offsets)
    cols = {"step": np.repeat(np.arange(timings.num_steps) * 3, sizes),
            "phase": np.where(timings.is_prefill, "prefill", "decode"),
            "context_len": timings.context_lens, "scheduled_tokens": timings.query_lens,
            time_name: np.repeat(timings.forward_s, sizes)}
    for name, per_step in (extra or {}).items():
        cols[name] = np.repeat(per_step, sizes)
    return cols


def test_vllm_export_step_time_minus_draft_time():
    t = measured()
    draft = np.full(t.num_steps, 1e-4)
    cols = _rows(t, "step_time_s")
    cols["step_time_s"] = cols["step_time_s"] + 1e-4
    cols["draft_s"] = np.repeat(draft, np.diff(t.offsets))
    got, used = timings_from_columns(cols, "export.csv")
    assert used == "step_time_s"
    assert np.allclose(got.forward_s, t.forward_s)
    assert got.drafting_calls is not None and got.drafting_calls.sum() == int((~t.is_prefill).sum())
    with pytest.raises(ScheduleError, match="no time column"):
        timings_from_columns({k: v for k, v in cols.items() if k != "step_time_s"}, "export.csv")


def test_calibrate_cost_cli_writes_a_calibration_replay_reads(tmp_path, monkeypatch, capsys):
    log = tmp_path / "steps.parquet"
    write_table(log, _rows(measured(), "forward_s"))
    out = tmp_path / "cal.json"
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "calibrate", "cost", str(log), "--hardware", "h100-80g",
                                      "--model", "qwen3-8b", "-o", str(out), "--json"])
    assert run_guarded(app) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mape_after_holdout"] < 0.1 < report["mape_before_holdout"]
    cal = Calibration.from_file(out)
    assert abs(cal.compute_efficiency / TRUE.compute_efficiency - 1) < 0.02
    assert json.loads(out.read_text())["fit"]["num_train"] == 72

    bad = tmp_path / "bad.csv"
    write_table(bad, {"step": np.array([0]), "phase": np.array(["decode"]), "context_len": np.array([3]),
                      "scheduled_tokens": np.array([0]), "forward_s": np.array([0.01])})
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "calibrate", "cost", str(bad), "-o", str(tmp_path / "x.json")])
    assert run_guarded(app) == 2
    err = capsys.readouterr().err
    assert "bad.csv: row 0: scheduled_tokens" in err and "Traceback" not in err


def test_a_simulated_step_log_fits_back_to_the_calibration_it_was_priced_with(tmp_path):
    """replay's step log and the cost model agree exactly; a log simulated under a calibration gives it back."""
    from simhelpers import agent_query, config, workload

    from agentspec_sim.run.simulation import simulate
    from agentspec_sim.validation.calibration_input import timings_from_table

    truth = Calibration(memory_efficiency=0.6, step_overhead_s=300e-6, per_call_overhead_s=8e-6)
    truth.to_file(tmp_path / "truth.json")
    rng = np.random.default_rng(0)
    wl = workload(*[agent_query(rng, f"q{i}", 2, prompt_len=60, out_len=12, vocab=8) for i in range(6)])
    steps = simulate(wl, "ngram", config(max_num_seqs=6, calibration=str(tmp_path / "truth.json"))).steps
    steps.write_parquet(tmp_path / "steps.parquet")
    timings = timings_from_table(tmp_path / "steps.parquet")
    assert timings.num_steps == steps["step"].n_unique()
    exact = predict_forward(timings, "a100-80g", "qwen3-8b", truth)
    assert np.array_equal(exact, timings.forward_s)
    factors = ("memory_efficiency", "step_overhead_s", "per_call_overhead_s")
    fit = fit_calibration(timings, "a100-80g", "qwen3-8b", factors=factors)
    for name in factors:
        assert abs(getattr(fit.calibration, name) / getattr(truth, name) - 1) < 0.02, name
