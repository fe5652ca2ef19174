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
from pathlib import Path

import pytest

from agentspec_sim.cli.app import app
from agentspec_sim.cli.common import percent, seconds
from agentspec_sim.cli.errors import run_guarded
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
    assert code == 0 and note in out and "--rate" in out
    code, out, _ = run_cli(["replay", str(trace), "--max-num-seqs", "4", "--rate", "2"], monkeypatch, capsys)
    assert code == 0 and note not in out
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
