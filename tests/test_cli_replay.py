"""`agentspec-sim replay`: the table, --json, --steps parquet, and bad input as one error line."""

from __future__ import annotations

import json
import sys

import polars as pl
import pytest
from typer.testing import CliRunner

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.engine.result import STEP_COLUMNS
from agentspec_sim.trace.io import write_records


@pytest.fixture
def trace(tmp_path):
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 1000}]
    for q in range(3):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [q]
        out0 = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 99]
        records.append({"type": "call", "id": f"q{q}-0", "agent_id": 0, "query_id": q, "seq": 0,
                        "prompt_tokens": prompt, "output_tokens": out0})
        records.append({"type": "call", "id": f"q{q}-1", "agent_id": 0, "query_id": q, "seq": 1, "think_s": 0.5,
                        "prompt_extends": f"q{q}-0", "prompt_append_tokens": [20, 21],
                        "output_tokens": [10, 11, 12, 13, 10, 11, 12, 13, 98]})
    path = tmp_path / "tiny.jsonl"
    write_records(records, path)
    return path


def test_table(trace, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["replay", str(trace), "--max-num-seqs", "4"])
    assert result.exit_code == 0, result.output
    for word in ("normal", "ngram", "goodput", "speedup"):
        assert word in result.output


def test_a_live_history_over_the_memory_bound_is_reported(trace, monkeypatch):
    """agentspec drafting from live histories (a drafter per copy; the workload table turned off, as where it is
    not exact — a data-parallel rank's history holds only its own calls); past the simulator's memory bound they
    drop idle queries' histories, and the table says so."""
    import agentspec_sim.drafters.agentspec.history as agentspec
    from agentspec_sim.engine.simulator import Simulator

    monkeypatch.setattr(Simulator, "draft_tables", False)
    monkeypatch.setenv("COLUMNS", "200")
    args = ["replay", str(trace), "--drafter", "agentspec", "--max-num-seqs", "1", "--replicate", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "memory bound" not in result.output
    assert "history_evictions" not in CliRunner().invoke(app, [*args, "--json"]).output
    monkeypatch.setattr(agentspec, "MAX_LIVE_TOKENS", 20)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "passed the simulator's memory bound and dropped" in " ".join(result.output.split())
    runs = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)["runs"]
    assert "history_evictions" not in runs[0] and runs[1]["history_evictions"] > 0  # normal has no history


def test_json_and_steps(trace, tmp_path):
    steps = tmp_path / "steps.parquet"
    out = tmp_path / "summary.json"
    result = CliRunner().invoke(app, [
        "replay", str(trace), "--json", "--steps", str(steps), "-o", str(out),
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}',
        "--max-num-seqs", "2", "--seed", "3", "--replicate", "2",
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [r["drafter"] for r in doc["runs"]] == ["normal", "ngram", "ngram k=3 n=2..2"]
    assert doc["runs"][0]["speedup"] == pytest.approx(1.0)
    assert doc["runs"][1]["mean_acceptance_length"] > 1
    assert doc["config"]["replicate"] == 2 and doc["runs"][0]["calls"] == 12
    assert json.loads(out.read_text()) == doc
    frame = pl.read_parquet(steps)
    assert tuple(frame.columns) == STEP_COLUMNS
    assert set(frame["drafter"].unique()) == {"normal", "ngram", "ngram k=3 n=2..2"}
    assert set(frame["phase"].unique()) == {"prefill", "decode"}
    assert frame.schema["draft"] == pl.List(pl.Int32)


def test_bad_speculative_config_is_one_error_line(trace, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "replay", str(trace), "--speculative-config",
                                      '{"method": "ngram"}'])
    assert run_guarded(app) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens" in err and "Traceback" not in err
