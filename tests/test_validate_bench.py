"""`validate bench` / `calibrate bench` (validation/bench.py): a user's `vllm bench serve` result file replayed.

The fixture tests/data/bench/random-rate4-seed0.json was written by vLLM 0.33.0's own `vllm/benchmarks/serve.py`
(unchanged; `--dataset-name random --random-input-len 512 --random-output-len 64 --random-range-ratio 0.25
--num-prompts 8 --request-rate 4 --burstiness 1 --seed 0 --save-result --save-detailed`) against a stand-in
streaming server (its latencies are synthetic, its format and aggregates are vLLM's): what the reader must parse and
what its aggregates must reproduce.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentspec_sim import EngineConfig
from agentspec_sim.cost.build import cost_model_for
from agentspec_sim.validation.bench import (
    BenchFileError,
    Replay,
    fit_frontend,
    measured_metrics,
    read_bench_results,
    replay_bench,
)

FIXTURE = Path(__file__).parent / "data" / "bench" / "random-rate4-seed0.json"
ENGINE = EngineConfig(hardware="h100-80g", model="llama-3.1-8b")


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentspec_sim.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_the_client_metrics_are_vllm_bench_serves_own():
    """From the per-request arrays, the aggregates vLLM wrote into the file (TPOT over requests of > 1 token, ITL
    pooled, numpy's percentiles), to the last digit."""
    doc = json.loads(FIXTURE.read_text())
    (run,) = read_bench_results(FIXTURE)
    got = measured_metrics(run)
    for metric in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "p99"):
            assert got[metric][stat] == pytest.approx(doc[f"{stat}_{metric}_ms"], rel=1e-12), (metric, stat)
    assert got["request_throughput"] == pytest.approx(doc["request_throughput"], rel=1e-12)
    assert got["output_throughput"] == pytest.approx(doc["output_throughput"], rel=1e-12)
    assert run.num_requests == doc["completed"] and run.request_rate == 4.0 and run.max_concurrency is None


def test_the_replay_sends_what_vllm_bench_serve_sent_for_the_seed():
    """Same requests (lengths in send order), same send times: vLLM's schedule for seed 0, 8 requests at rate 4."""
    (run,) = read_bench_results(FIXTURE)
    replay = replay_bench(run, ENGINE, cost_model_for(ENGINE), seed=0)
    assert isinstance(replay, Replay) and replay.ttft_engine.shape == (8,)
    from agentspec_sim import simulate
    from agentspec_sim.validation.bench import bench_config, bench_workload

    cost = cost_model_for(ENGINE)
    calls = simulate(bench_workload(run, 0, cost.model.vocab_size), "normal", bench_config(run, ENGINE, 0),
                     cost_model=cost).calls.sort("arrival_s")
    np.testing.assert_allclose(calls["arrival_s"].to_numpy(),
                               [0.1953, 0.5035, 0.7300, 0.9232, 1.0584, 1.3132, 1.4544, 2.0], atol=1e-4)
    assert calls["call_id"].to_list() == [f"bench-{i}" for i in range(8)]
    assert calls["prompt_len"].to_list() == run.input_lens.tolist()
    assert calls["output_len"].to_list() == run.output_lens.tolist()


def test_calibrate_bench_recovers_a_known_front_end():
    """A run whose TTFTs are the replay's engine TTFT plus 30 ms + 8 µs a prompt token: the fit finds both."""
    (run,) = read_bench_results(FIXTURE)
    cost = cost_model_for(ENGINE)
    replay = replay_bench(run, ENGINE, cost, seed=0)
    truth = replay.ttft_engine + 0.030 + 8e-6 * run.input_lens
    synthetic = dataclasses.replace(run, ttfts=truth)
    fit = fit_frontend([synthetic], [replay], request_s=0.02, prompt_token_s=2e-6)
    assert fit.request_s == pytest.approx(0.030, rel=1e-3) and fit.prompt_token_s == pytest.approx(8e-6, rel=1e-2)
    assert fit.ttft_error_after < 1e-4 < fit.ttft_error_before


def _write(tmp_path: Path, doc, name: str = "result.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("input_lens"), "input_lens: missing (run vllm bench serve with --save-detailed)"),
    (lambda d: d.update(request_rate="fast"), "request_rate: expected a number or \"inf\""),
    (lambda d: d.update(burstiness=0), "burstiness: must be > 0"),
    (lambda d: d.update(output_lens=d["output_lens"][:-1]), "output_lens: 7 entries for 8 requests"),
    (lambda d: d["ttfts"].__setitem__(2, -1.0), "ttfts[2]: expected a time ≥ 0"),
    (lambda d: d.update(errors=["boom"] * 8), "errors: no request succeeded"),
    (lambda d: d.update(ramp_up_strategy="linear"), "ramp_up_strategy: a ramp-up's send times are not replayed"),
])
def test_a_bad_result_file_is_refused_naming_the_field(tmp_path, change, message):
    doc = json.loads(FIXTURE.read_text())
    change(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(BenchFileError) as info:
        read_bench_results(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_failed_requests_are_left_out_and_appended_results_are_read_line_by_line(tmp_path):
    doc = json.loads(FIXTURE.read_text())
    failed = json.loads(FIXTURE.read_text())
    failed["errors"][3], failed["output_lens"][3] = "Internal Server Error", 0
    path = _write(tmp_path, json.dumps(doc) + "\n" + json.dumps(failed))  # as --append-result writes them
    first, second = read_bench_results(path)
    assert (first.num_requests, first.failed) == (8, 0)
    assert (second.num_requests, second.failed) == (7, 1)
    assert second.input_lens.tolist() == doc["input_lens"][:3] + doc["input_lens"][4:]
    path = _write(tmp_path, json.dumps(doc) + "\n{\"request_rate\": 1", "broken.json")
    with pytest.raises(BenchFileError, match=r"broken\.json:2: "):
        read_bench_results(path)


def test_cli_validate_and_calibrate_bench_end_to_end(tmp_path):
    run = _cli("validate", "bench", str(FIXTURE), "--model", "llama-3.1-8b", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    rows = {r["metric"]: r for r in doc["runs"][0]["rows"]}
    assert set(rows) >= {"mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "request_throughput"}
    assert rows["mean_ttft_ms"]["measured"] == pytest.approx(json.loads(FIXTURE.read_text())["mean_ttft_ms"])
    out = tmp_path / "front.json"
    run = _cli("calibrate", "bench", str(FIXTURE), "--model", "llama-3.1-8b", "-o", str(out), "--json")
    assert run.returncode == 0, run.stderr
    fit = json.loads(run.stdout)
    assert fit["ttft_median_abs_error_after"] < fit["ttft_median_abs_error_before"]
    factors = json.loads(out.read_text())["factors"]
    assert factors["frontend_request_s"] == fit["frontend_request_s"]
    assert factors["step_overhead_s"] == fit["step_overhead_s"]
    assert fit["tpot_median_abs_error_after"] <= fit["tpot_median_abs_error_before"]
    run = _cli("validate", "bench", str(FIXTURE), "--model", "llama-3.1-8b", "--calibration", str(out), "--json")
    assert run.returncode == 0, run.stderr
    after = {r["metric"]: r for r in json.loads(run.stdout)["runs"][0]["rows"]}
    assert abs(after["median_ttft_ms"]["error"]) < abs(rows["median_ttft_ms"]["error"])


def test_cli_bad_inputs_are_one_line(tmp_path):
    doc = json.loads(FIXTURE.read_text())
    del doc["itls"]
    bad = _write(tmp_path, doc)
    run = _cli("validate", "bench", str(bad), "--model", "llama-3.1-8b")
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"error: {bad}: itls: missing (run vllm bench serve with --save-detailed)"]
    run = _cli("calibrate", "bench", str(FIXTURE), "--model", "llama-3.1-8b", "-o", str(FIXTURE))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert json.loads(FIXTURE.read_text())["completed"] == 8  # the input is untouched
    run = _cli("validate", "bench", str(FIXTURE), "--model", "llama-3.1-8b", "--index", "3")
    assert run.returncode == 2 and "--index 3: the file holds 1 result(s)" in run.stderr


def test_calibrate_bench_fits_the_per_step_host_time_from_tpot():
    """A run whose every decode gap is 1 ms longer than the replay's: the per-step host term (async scheduling:
    step_overhead_s) moves by about that, and the replayed TPOT comes to the measured."""
    from agentspec_sim.validation.bench import fit_step_host

    (run,) = read_bench_results(FIXTURE)
    cost = cost_model_for(ENGINE)
    replay = replay_bench(run, ENGINE, cost, seed=0)
    slower = replay.e2el_engine + 0.001 * (run.output_lens - 1)  # +1 ms a decode step
    synthetic = dataclasses.replace(run, ttfts=replay.ttft_engine, latencies=slower)
    fit, fitted = fit_step_host([synthetic], [replay], ENGINE, cost, 0, synchronous=False)
    assert fit.factor == "step_overhead_s"
    assert fit.value_s - cost.calibration.step_overhead_s == pytest.approx(0.001, rel=0.3)
    assert fit.tpot_error_after < 0.3 * fit.tpot_error_before
    assert fitted.calibration.step_overhead_s == pytest.approx(fit.value_s)
    sync_engine = dataclasses.replace(ENGINE, async_scheduling=False)
    sync_replay = replay_bench(synthetic, sync_engine, cost, seed=0)
    sync = fit_step_host([synthetic], [sync_replay], sync_engine, cost, 0, synchronous=True)[0]
    assert sync.factor == "sync_host_step_s"
