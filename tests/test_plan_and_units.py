"""Issue 20, classes 9 and 10: the planner's answer is usable as given, and numbers read as vLLM users read them.

Class 9: `plan` takes every engine knob `sweep` takes and carries the ones that change the deployment into
its `vllm serve` flags (only flags and speculative-config keys vLLM 0.33 accepts; EAGLE-3 with the draft
`model` vLLM requires); timings and calibrations stay with the hardware and model they were measured on.
Class 10: replay shows both rejection rates (token-level as vLLM's dashboards, call-mean as the paper),
every time in seconds as in --json and the --slo-* flags, and says when TTFT is queueing under a burst;
`check` gates either rejection rate and still reads a baseline written before the token-level one.

CLI cases run in-process through `run_guarded`, as the console script does, on traces of a few calls.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import typer

from agentspec_sim.cli.app import app
from agentspec_sim.cli.common import percent, seconds
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.sweep.plan import REQUIRED_DRAFT_MODEL, VLLM_SPECULATIVE_KEYS, plan, vllm_engine_args
from agentspec_sim.trace.io import write_records


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", *argv])
    code = run_guarded(app)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def write_trace(path: Path, arrivals: list[float] | None = None) -> Path:
    """Three two-call queries whose outputs repeat (n-gram drafts are partly accepted: the call-mean and the
    token-level rejection rates differ). `arrivals`: each query's first call's arrival_s."""
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 1000}]
    for q in range(3):
        first = {"type": "call", "id": f"q{q}-0", "agent_id": 0, "query_id": q, "seq": 0,
                 "prompt_tokens": [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [q],
                 "output_tokens": [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 99]}
        if arrivals is not None:
            first["arrival_s"] = arrivals[q]
        records.append(first)
        records.append({"type": "call", "id": f"q{q}-1", "agent_id": 0, "query_id": q, "seq": 1, "think_s": 0.5,
                        "prompt_extends": f"q{q}-0", "prompt_append_tokens": [20, 21],
                        "output_tokens": [10, 11, 12, 13, 10, 11, 12, 13, 98]})
    write_records(records, path)
    return path


@pytest.fixture
def trace(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / ".cache"))
    monkeypatch.setenv("COLUMNS", "200")  # no column of the tables cut short
    return write_trace(tmp_path / "tiny.jsonl")


def _row(table: str, drafter: str) -> list[str]:
    return next(line.split() for line in table.splitlines() if line.split()[:1] == [drafter])


# -- class 10: the replay table --------------------------------------------------------------------------------

def test_replay_shows_both_rejection_rates_and_times_in_seconds(trace, monkeypatch, capsys):
    code, out, err = run_cli(["replay", str(trace), "--max-num-seqs", "4", "--json"], monkeypatch, capsys)
    assert code == 0, err
    ngram = json.loads(out)["runs"][1]
    assert ngram["rejection_rate_tokens"] != ngram["rejection_rate"]  # the premise: the two can be told apart
    code, out, err = run_cli(["replay", str(trace), "--max-num-seqs", "4"], monkeypatch, capsys)
    assert code == 0, err
    header = _row(out, "drafter")
    assert header[:5] == ["drafter", "goodput", "speedup", "rej.tok", "rej.call"]
    words = " ".join(out.split())  # the caption wraps at the table's width
    assert "TTFT" in header and "vLLM's draft acceptance rate" in words and "the paper's rejection rate" in words
    row = dict(zip(["drafter", "goodput", "speedup", "rej.tok", "rej.call", "acc.len", "ttft", "tpot", "query"],
                   _row(out, "ngram"), strict=True))
    assert row["rej.tok"] == percent(ngram["rejection_rate_tokens"])
    assert row["rej.call"] == percent(ngram["rejection_rate"])
    # The JSON's seconds, as seconds (the table once showed TTFT and TPOT in ms beside seconds everywhere else).
    assert row["ttft"] == seconds(ngram["ttft"]["p50"]) and float(row["ttft"]) < 1
    assert row["tpot"] == seconds(ngram["tpot"]["p50"]) and row["query"] == seconds(ngram["query_latency"]["p99"])


def test_seconds_read_at_a_glance():
    assert [seconds(v) for v in (233011.2, 233.0, 17.34, 0.174, 0.01134, 0.000123, 0.0, None)] == [
        "233,011", "233", "17.3", "0.174", "0.0113", "0.000123", "0", "—"]


def test_a_burst_at_t0_is_called_queueing(trace, tmp_path, monkeypatch, capsys):
    note = "every query arrives at once"
    code, out, _ = run_cli(["replay", str(trace), "--max-num-seqs", "4"], monkeypatch, capsys)
    assert code == 0 and note in out and "--request-rate" in out and "--max-concurrency" in out
    for load in (["--rate", "2"], ["--request-rate", "2"], ["--max-concurrency", "2"], ["--copies", "2"]):
        code, out, _ = run_cli(["replay", str(trace), "--max-num-seqs", "4", *load], monkeypatch, capsys)
        assert code == 0 and note not in out, load
    spread = write_trace(tmp_path / "spread.jsonl", arrivals=[0.0, 5.0, 10.0])
    code, out, _ = run_cli(["replay", str(spread), "--max-num-seqs", "4"], monkeypatch, capsys)
    assert code == 0 and note not in out


# -- class 10: check gates either rejection rate -----------------------------------------------------------------

@pytest.fixture
def baseline(trace, monkeypatch, capsys):
    path = trace.parent / "baseline.json"
    code, _, err = run_cli(["check", str(trace), "--baseline", str(path), "--update", "--drafter", "ngram",
                            "--max-num-seqs", "4"], monkeypatch, capsys)
    assert code == 0, err
    return path


def _edit_cells(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    for cell in data["cells"]:
        edit(cell)
    path.write_text(json.dumps(data))


def test_check_gates_the_token_rejection_rate_when_asked(baseline, monkeypatch, capsys):
    assert all("rejection_rate_tokens" in c for c in json.loads(baseline.read_text())["cells"])
    code, out, _ = run_cli(["check", "--baseline", str(baseline), "--rejection", "token"], monkeypatch, capsys)
    assert code == 0 and "rej.tok" in out, out

    def lower_token_rate(cell):  # the baseline claims 5 pp fewer rejected tokens than the code gives now
        if cell["rejection_rate_tokens"] is not None:
            cell["rejection_rate_tokens"] -= 0.05
    _edit_cells(baseline, lower_token_rate)
    code, out, _ = run_cli(["check", "--baseline", str(baseline), "--rejection", "token"], monkeypatch, capsys)
    assert code == 1 and "token rejection rate +5.00 pp" in " ".join(out.split()), out
    code, out, _ = run_cli(["check", "--baseline", str(baseline)], monkeypatch, capsys)  # default: the call mean
    assert code == 0 and "rej.call" in out, out


def test_a_baseline_without_the_token_rate_still_checks(baseline, monkeypatch, capsys):
    _edit_cells(baseline, lambda cell: cell.pop("rejection_rate_tokens"))  # as written before it was recorded
    code, out, _ = run_cli(["check", "--baseline", str(baseline)], monkeypatch, capsys)
    assert code == 0, out
    code, _, err = run_cli(["check", "--baseline", str(baseline), "--rejection", "token"], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "baseline.json: cells[0].rejection_rate_tokens: not recorded" in line and "--update" in line
    code, _, err = run_cli(["check", "--baseline", str(baseline), "--rejection", "tokens"], monkeypatch, capsys)
    assert "--rejection: expected call or token" in one_error_line(code, err)


# -- class 9: plan takes sweep's engine knobs and prints what vLLM accepts -------------------------------------

# The vLLM 0.33 `vllm serve` flags the planner may print (vllm/engine/arg_utils.py add_cli_args); a flag
# outside this list is one a user would paste and vLLM would reject.
VLLM_SERVE_FLAGS = {"--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--num-gpu-blocks-override",
                    "--gpu-memory-utilization", "--tensor-parallel-size", "--block-size",
                    "--no-enable-prefix-caching", "--speculative-config"}


def _options(name: str) -> set[str]:
    command = typer.main.get_command(app).commands[name]
    return {opt for param in command.params for opt in param.opts if opt.startswith("--")}


def test_plan_takes_every_option_sweep_takes():
    # sweep's own: --quiet (plan has --json) and --output, which plan has too.
    assert _options("sweep") - {"--quiet"} <= _options("plan")


ENGINE = {k: v for k, v in asdict(EngineConfig()).items()
          if k not in ("max_num_seqs", "hardware", "model", "seed", "check_invariants")}


def frame(configs: dict[str, dict], model: str = "qwen3-8b", engine: dict | None = None) -> pl.DataFrame:
    """Sweep rows at max_num_seqs 1 and 2 where the last configuration has the most goodput."""
    rows = []
    for i, (label, spec) in enumerate(configs.items()):
        for b in (1, 2):
            rows.append({"trace": "t.jsonl", "hardware": "a100-80g", "model": model, "seed": 0, "drafter": label,
                         "speculative_config": json.dumps(spec, sort_keys=True), "max_num_seqs": b,
                         "goodput_tok_s": 100.0 * (i + 1) * b, "speedup": float(i + 1), "query_latency_p99": 1.0,
                         "ttft_p99": 0.1, "tpot_p99": 0.01, "preemptions": 0, "incomplete_queries": 0,
                         "limits_num_kv_blocks": 1000, "limits_block_size": 16,
                         "engine_config": json.dumps(engine or ENGINE, sort_keys=True)})
    return pl.DataFrame(rows)


NORMAL = {"method": "normal"}


def test_eagle3_names_the_draft_head_vllm_requires():
    eagle = {"method": "eagle3", "num_speculative_tokens": 3}
    (p,) = plan(frame({"normal": NORMAL, "eagle3": eagle}, model="llama-3.1-8b"))
    # The head the bundled Llama-3.1-8B acceptance figures were measured with.
    assert p.vllm_speculative_config["model"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" and p.vllm_note is None
    assert p.vllm_model == "meta-llama/Llama-3.1-8B-Instruct"
    (p,) = plan(frame({"normal": NORMAL, "eagle3": eagle}))  # Qwen3-8B's figures come from no one head
    assert p.vllm_speculative_config["model"] == REQUIRED_DRAFT_MODEL and "REQUIRED" in p.vllm_note
    (p,) = plan(frame({"normal": NORMAL, "eagle3": {**eagle, "model": "my-org/qwen3-eagle3"}}))
    assert p.vllm_speculative_config["model"] == "my-org/qwen3-eagle3" and p.vllm_note is None
    (p,) = plan(frame({"normal": NORMAL, "mtp": {"method": "mtp", "num_speculative_tokens": 1}}, model="mimo-7b"))
    assert "model" not in p.vllm_speculative_config  # vLLM's mtp reuses the target's own weights


def test_a_given_draft_model_survives_the_sweep():
    """--speculative-config's "model" (no effect on the simulation) stays in the config a sweep records."""
    from agentspec_sim.drafters.registry import parse_drafter

    spec = parse_drafter('{"method": "eagle3", "num_speculative_tokens": 2, "model": "my-org/head"}')
    assert spec.to_json()["model"] == "my-org/head"


def test_only_vllm_keys_reach_the_printed_speculative_config():
    # Simulator-only keys a sweep's configuration can hold; vLLM's SpeculativeConfig forbids extra fields.
    eagle = {"method": "eagle3", "num_speculative_tokens": 3, "seed": 4, "target_model": "llama-3.1-8b",
             "tokenizer": "qwen3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}
    (p,) = plan(frame({"normal": NORMAL, "eagle3": eagle}))
    assert set(p.vllm_speculative_config) == {"method", "num_speculative_tokens", "model"}
    assert set(p.vllm_speculative_config) <= VLLM_SPECULATIVE_KEYS
    assert json.loads(p.vllm_args[p.vllm_args.index("--speculative-config") + 1]) == p.vllm_speculative_config


def test_engine_knobs_become_vllm_flags():
    assert vllm_engine_args(ENGINE) == []  # the defaults are what vLLM picks by itself
    knobs = {**ENGINE, "max_num_batched_tokens": 1024, "max_model_len": 8192, "num_kv_blocks": 500,
             "gpu_memory_utilization": 0.8, "tensor_parallel_size": 2, "enable_prefix_caching": False,
             "rate": 3.0, "replicate": 2, "think_time": 1.0}  # the last three shape the workload: no flag
    args = vllm_engine_args(knobs)
    assert args == ["--max-num-batched-tokens", "1024", "--max-model-len", "8192", "--num-gpu-blocks-override",
                    "500", "--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "2",
                    "--no-enable-prefix-caching"]
    (p,) = plan(frame({"normal": NORMAL, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}, engine=knobs))
    assert p.vllm_args[:2] == ["--max-num-seqs", "2"] and args == p.vllm_args[2:2 + len(args)]
    assert {a for a in p.vllm_args if a.startswith("--")} <= VLLM_SERVE_FLAGS


def test_results_of_two_engine_configs_are_not_averaged_into_one_plan():
    mixed = pl.concat([frame({"normal": NORMAL}), frame({"normal": NORMAL}, engine={**ENGINE, "max_model_len": 99})])
    from agentspec_sim.sweep import SweepError

    with pytest.raises(SweepError, match="mix 2 engine configurations"):
        plan(mixed)


def test_plan_runs_its_sweep_with_the_knobs_and_prints_them(trace, monkeypatch, capsys):
    args = ["plan", str(trace), "--drafter", "ngram", "--max-num-seqs", "1,2", "--executor", "inline",
            "--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--no-prefix-caching",
            "--gpu-memory-utilization", "0.85", "-o", str(trace.with_suffix(".parquet"))]
    code, out, err = run_cli([*args, "--json"], monkeypatch, capsys)
    assert code == 0, err
    (doc,) = json.loads(out)
    assert doc["engine"]["max_model_len"] == 4096 and doc["engine"]["enable_prefix_caching"] is False
    flags = doc["vllm_args"]
    for pair in (["--max-model-len", "4096"], ["--max-num-batched-tokens", "1024"],
                 ["--gpu-memory-utilization", "0.85"]):
        assert flags[flags.index(pair[0]):flags.index(pair[0]) + 2] == pair
    assert "--no-enable-prefix-caching" in flags
    # The table: p99 latencies in seconds like the JSON and the --slo-* flags, and the line to paste.
    code, out, err = run_cli(["plan", "--results", str(trace.with_suffix(".parquet"))], monkeypatch, capsys)
    assert code == 0, err
    assert "TTFT p99 s" in out and seconds(doc["best"]["ttft_p99_s"]) in out
    assert "vllm serve Qwen/Qwen3-8B --max-num-seqs" in out and "--max-model-len 4096" in out


def test_plan_from_results_refuses_options_of_the_sweep(trace, monkeypatch, capsys):
    frame({"normal": NORMAL}).write_parquet(trace.parent / "r.parquet")  # not read: the options fail first
    code, _, err = run_cli(["plan", "--results", str(trace.parent / "r.parquet"), "--max-model-len", "4096"],
                           monkeypatch, capsys)
    assert "--max-model-len: applies to the sweep plan runs" in one_error_line(code, err)


# -- class 9: calibrations stay with the hardware and model they were measured on -------------------------------

CAL_FORMAT = "agentspec-sim/cost-calibration"


def _timing_table(path: Path, hardware: str, model: str) -> Path:
    """`validate timing`'s timing_calls layout: call-step rows, measured_s, and what they were measured on."""
    from test_calibrate_cost import measured

    from agentspec_sim.validation.schedule import write_table

    t = measured(hardware="a100-80g")
    sizes = np.diff(t.offsets)
    rows = int(sizes.sum())
    write_table(path, {"step": np.repeat(np.arange(t.num_steps), sizes),
                       "phase": np.where(t.is_prefill, "prefill", "decode"), "context_len": t.context_lens,
                       "scheduled_tokens": t.query_lens, "measured_s": np.repeat(t.forward_s, sizes),
                       "hardware": np.full(rows, hardware), "model": np.full(rows, model)})
    return path


def test_calibrate_cost_refuses_timings_from_other_hardware(tmp_path, monkeypatch, capsys):
    cpu = _timing_table(tmp_path / "timing_calls.parquet", "cpu-test", "qwen3-8b-tiny")
    out = tmp_path / "cal.json"
    code, _, err = run_cli(["calibrate", "cost", str(cpu), "-o", str(out)], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "timing_calls.parquet: the timings were measured on hardware 'cpu-test' (not a100-80g)" in line
    assert "model 'qwen3-8b-tiny' (not qwen3-8b)" in line and "--allow-profile-mismatch" in line
    assert not out.exists()
    code, _, err = run_cli(["calibrate", "cost", str(cpu), "-o", str(out), "--allow-profile-mismatch"],
                           monkeypatch, capsys)
    assert code == 0 and out.exists(), err
    gpu = _timing_table(tmp_path / "gpu.parquet", "a100-80g", "qwen3-8b")
    code, _, err = run_cli(["calibrate", "cost", str(gpu), "-o", str(out)], monkeypatch, capsys)
    assert code == 0, err
    recorded = json.loads(out.read_text())
    assert (recorded["hardware"], recorded["model"]) == ("a100-80g", "qwen3-8b")


def _calibration(path: Path, hardware: str | None, model: str | None) -> Path:
    meta = {k: v for k, v in (("hardware", hardware), ("model", model)) if v is not None}
    path.write_text(json.dumps({"format": CAL_FORMAT, "version": 1, "source": "test", **meta,
                                "factors": {"memory_efficiency": 2.0}}))
    return path


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_runs_refuse_a_calibration_fitted_elsewhere(trace, monkeypatch, capsys, command):
    cal = _calibration(trace.parent / "cpu-cal.json", "cpu-test", "qwen3-8b-tiny")
    out = trace.parent / "out.parquet"
    extra = ["-o", str(out), "--executor", "inline"] if command == "sweep" else []
    code, _, err = run_cli([command, str(trace), "--drafter", "ngram", "--max-num-seqs", "2", "--calibration",
                            str(cal), *extra], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "cpu-cal.json: fitted on hardware 'cpu-test' (not a100-80g)" in line and "calibrate cost" in line
    assert not out.exists()


def test_a_calibration_of_the_runs_hardware_and_model_is_used(trace, monkeypatch, capsys):
    for hardware, model in (("a100-80g", "qwen3-8b"), ("A100-80G", "Qwen/Qwen3-8B"), (None, None)):
        cal = _calibration(trace.parent / "cal.json", hardware, model)
        code, _, err = run_cli(["replay", str(trace), "--max-num-seqs", "2", "--calibration", str(cal)],
                               monkeypatch, capsys)
        assert code == 0, (hardware, model, err)
