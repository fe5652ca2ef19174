"""Issue 39 (first contact, round 3), the classes fixed so far: concurrent writers of one baseline, late or silent
failures refused up front (a clock past what float64 resolves, `-j 0`), and `--version`."""

from __future__ import annotations

import math

import pytest
from test_capacity_cli import trace  # noqa: F401  (fixture)
from test_plan_and_units import one_error_line, run_cli

from agentspec_sim.outputs import OutputError, sole_writer


def test_check_update_refuses_a_second_writer_of_the_same_baseline(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Two `check --update` of one baseline at once: the second is refused while the first holds the baseline
    (before, both printed "wrote" and one update was lost)."""
    baseline = tmp_path / "b.json"
    args = ["check", str(trace), "--baseline", str(baseline), "--update", "--drafter", "ngram", "--max-num-seqs", "2"]
    lock = tmp_path / "b.json.lock"
    with sole_writer(baseline, lock):  # another `check --update` mid-run
        code, _, err = run_cli(args, monkeypatch, capsys)
        assert "another process is writing it now" in one_error_line(code, err)
        assert not baseline.exists()
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0 and "wrote" in out, err
    assert not lock.exists()  # the lock goes with its writer
    with sole_writer(baseline, lock), pytest.raises(OutputError), sole_writer(baseline, lock):
        pass  # the lock itself: a second holder is refused


@pytest.mark.parametrize("args", [["--request-rate", "1e-300"], ["--think-time", "1e300"]])
def test_a_clock_past_what_float64_resolves_is_refused(trace, args, monkeypatch, capsys):  # noqa: F811
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", *args], monkeypatch, capsys)
    assert "resolve one step" in one_error_line(code, err)


def test_unix_timestamps_as_arrival_times_still_replay(tmp_path, monkeypatch, capsys):
    from agentspec_sim.trace.io import write_records

    t0 = 1.8e9  # a Unix timestamp: far from 0, well inside what the clock resolves
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100}]
    for q in range(3):
        records.append({"type": "call", "id": f"q{q}", "agent_id": 0, "query_id": q, "seq": 0, "arrival_s": t0 + q,
                        "prompt_tokens": [1, 2, 3, q], "output_tokens": [5, 6, 7, 8]})
    path = tmp_path / "epoch.jsonl"
    write_records(records, path)
    code, out, err = run_cli(["replay", str(path), "--drafter", "ngram", "--json"], monkeypatch, capsys)
    assert code == 0, err
    import json

    runs = json.loads(out)["runs"]
    assert all(math.isfinite(r["goodput_tok_s"]) and r["goodput_tok_s"] > 0 for r in runs)


def test_zero_jobs_is_refused_like_negative_ones(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    for jobs in ("0", "-3"):
        code, _, err = run_cli(["sweep", str(trace), "-o", str(tmp_path / "s.parquet"), "-j", jobs],
                               monkeypatch, capsys)
        assert "jobs must be ≥ 1" in one_error_line(code, err)


def test_version(monkeypatch, capsys):
    from importlib.metadata import version

    code, out, _ = run_cli(["--version"], monkeypatch, capsys)
    assert code == 0 and out.strip() == f"agentspec-sim {version('agentspec-sim')}"
