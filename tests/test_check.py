"""`check`: a baseline re-run passes, injected regressions fail (exit 1), bad input exits 2, --update, --junit."""

from __future__ import annotations

import json
import shutil
import sys
from xml.etree import ElementTree

import pytest

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.report.check import compare_cells, file_sha256, load_baseline
from agentspec_sim.trace.io import write_records


def _trace_records(extra: int = 0) -> list[dict]:
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 1000}]
    for q in range(3):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [q]
        out0 = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 99 + extra]
        records.append({"type": "call", "id": f"q{q}-0", "agent_id": 0, "query_id": q, "seq": 0,
                        "prompt_tokens": prompt, "output_tokens": out0})
        records.append({"type": "call", "id": f"q{q}-1", "agent_id": 0, "query_id": q, "seq": 1, "think_s": 0.5,
                        "prompt_extends": f"q{q}-0", "prompt_append_tokens": [20, 21],
                        "output_tokens": [10, 11, 12, 13, 10, 11, 12, 13, 5, 6, 98]})
    return records


def run(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "check", *args])
    return run_guarded(app)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A tiny trace and a baseline recorded from it (ngram and suffix at max_num_seqs 1 and 4)."""
    trace = tmp_path / "traces" / "tiny.jsonl"
    trace.parent.mkdir()
    write_records(_trace_records(), trace)
    baseline = tmp_path / "reports" / "baseline.json"
    assert run(monkeypatch, str(trace), "--baseline", str(baseline), "--update", "--drafter", "ngram,suffix",
               "--max-num-seqs", "1,4") == 0
    return trace, baseline


def _edit(baseline, drafter: str, **changes) -> None:
    data = json.loads(baseline.read_text())
    for cell in data["cells"]:
        if cell["drafter"] == drafter:
            for key, fn in changes.items():
                cell[key] = fn(cell[key])
    baseline.write_text(json.dumps(data))


def test_update_records_traces_configs_and_cells(setup):
    trace, baseline = setup
    data = json.loads(baseline.read_text())
    assert data["version"] == 1
    assert data["traces"] == [{"path": "../traces/tiny.jsonl", "sha256": file_sha256(trace)}]
    assert data["max_num_seqs"] == [1, 4]
    assert [d["label"] for d in data["drafters"]] == ["ngram", "suffix"]
    assert data["drafters"][0]["speculative_config"]["num_speculative_tokens"] == 5
    assert data["engine"]["hardware"] == "a100-80g" and "max_num_seqs" not in data["engine"]
    assert len(data["cells"]) == 2 * 3
    ngram = [c for c in data["cells"] if c["drafter"] == "ngram"]
    assert all(0 < c["rejection_rate"] < 1 and c["goodput_tok_s"] > 0 for c in ngram)
    assert load_baseline(baseline).cells == tuple(data["cells"])


def test_unchanged_code_passes_and_writes_junit(setup, monkeypatch, tmp_path, capsys):
    _, baseline = setup
    junit = tmp_path / "check.xml"
    assert run(monkeypatch, "--baseline", str(baseline), "--junit", str(junit)) == 0
    assert "ok: 6 cells within tolerance" in capsys.readouterr().out
    suite = ElementTree.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "6" and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == 6 and not suite.findall(".//failure")


def test_rejection_rate_regression_fails_with_exit_1(setup, monkeypatch, tmp_path, capsys):
    _, baseline = setup
    # The baseline says ngram rejected 2 points less than it really does: the real rate "rose" by 2 pp.
    _edit(baseline, "ngram", rejection_rate=lambda r: r - 0.02)
    junit = tmp_path / "check.xml"
    assert run(monkeypatch, "--baseline", str(baseline), "--junit", str(junit)) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "rejection rate +2.00 pp > 1.00 pp" in out
    suite = ElementTree.parse(junit).getroot()
    failures = suite.findall("testcase/failure")
    assert suite.get("failures") == "2" and len(failures) == 2
    assert all("rejection rate" in f.get("message") for f in failures)
    # A looser tolerance accepts the same difference.
    assert run(monkeypatch, "--baseline", str(baseline), "--tolerance", "0.03") == 0


def test_goodput_regression_fails_and_small_changes_pass(setup, monkeypatch, capsys):
    _, baseline = setup
    _edit(baseline, "suffix", goodput_tok_s=lambda g: g * 1.01)  # −1%: inside the 2% tolerance
    assert run(monkeypatch, "--baseline", str(baseline)) == 0
    _edit(baseline, "suffix", goodput_tok_s=lambda g: g * 1.05)
    assert run(monkeypatch, "--baseline", str(baseline)) == 1
    assert "goodput -" in capsys.readouterr().out
    assert run(monkeypatch, "--baseline", str(baseline), "--goodput-tolerance", "0.1") == 0


def test_speedup_regression_and_improvement(setup, monkeypatch, capsys):
    _, baseline = setup
    _edit(baseline, "ngram", speedup=lambda s: s * 0.9)  # now 11% faster than recorded: improved, not failed
    assert run(monkeypatch, "--baseline", str(baseline)) == 0
    assert "better" in capsys.readouterr().out
    _edit(baseline, "ngram", speedup=lambda s: s / 0.9 * 1.1)
    assert run(monkeypatch, "--baseline", str(baseline)) == 1


def test_update_rewrites_a_regressed_baseline(setup, monkeypatch):
    _, baseline = setup
    original = json.loads(baseline.read_text())
    _edit(baseline, "ngram", rejection_rate=lambda r: r - 0.2)
    assert run(monkeypatch, "--baseline", str(baseline)) == 1
    assert run(monkeypatch, "--baseline", str(baseline), "--update") == 0
    assert json.loads(baseline.read_text()) == original
    assert run(monkeypatch, "--baseline", str(baseline)) == 0


def test_trace_found_by_content_hash(setup, monkeypatch, tmp_path):
    trace, baseline = setup
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(trace, moved)
    assert run(monkeypatch, str(moved), "--baseline", str(baseline)) == 0


def test_changed_trace_is_bad_input_not_regression(setup, monkeypatch, capsys):
    trace, baseline = setup
    write_records(_trace_records(extra=1), trace)
    assert run(monkeypatch, "--baseline", str(baseline)) == 2
    err = capsys.readouterr().err
    assert "tiny.jsonl: trace changed since the baseline was recorded" in err and "Traceback" not in err
    assert run(monkeypatch, str(trace), "--baseline", str(baseline)) == 2
    assert "matches no trace in" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such baseline; create it with --update"),
    ("{\n  oops", ":2: not JSON"),
    ('{"version": 2}', "version: expected 1"),
    ('{"version": 1, "traces": [], "engine": {}, "max_num_seqs": [1], "drafters": [], "cells": []}', "traces: empty"),
])
def test_bad_baseline_is_one_line_exit_2(tmp_path, monkeypatch, capsys, content, message):
    baseline = tmp_path / "baseline.json"
    if content is not None:
        baseline.write_text(content)
    assert run(monkeypatch, "--baseline", str(baseline)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_fields_name_the_field(setup, monkeypatch, capsys):
    _, baseline = setup
    data = json.loads(baseline.read_text())
    data["engine"]["max_num_sequences"] = 3
    baseline.write_text(json.dumps(data))
    assert run(monkeypatch, "--baseline", str(baseline)) == 2
    assert "engine.max_num_sequences: not an engine setting" in capsys.readouterr().err
    del data["engine"]["max_num_sequences"]
    data["cells"][1]["rejection_rate"] = "high"
    baseline.write_text(json.dumps(data))
    assert run(monkeypatch, "--baseline", str(baseline)) == 2
    assert "cells[1].rejection_rate: a number or null" in capsys.readouterr().err


def test_update_only_options_and_tolerances_are_checked(setup, monkeypatch, capsys):
    _, baseline = setup
    assert run(monkeypatch, "--baseline", str(baseline), "--drafter", "ngram") == 2
    assert "--drafter applies only with --update" in capsys.readouterr().err
    assert run(monkeypatch, "--baseline", str(baseline), "--tolerance", "-1") == 2
    assert run(monkeypatch, "--baseline", str(baseline), "--update", "--max-num-seqs", "0") == 2


def test_compare_cells_edges():
    base = [{"trace": "t", "max_num_seqs": 1, "drafter": "d", "rejection_rate": 0.5, "goodput_tok_s": 100.0,
             "speedup": 1.2}]
    same = compare_cells(base, base)
    assert not same.failed and same.diffs[0].status == "ok"
    at_edge = [dict(base[0], rejection_rate=0.5 + 0.0099, goodput_tok_s=98.5)]
    assert not compare_cells(base, at_edge).failed
    gone = [dict(base[0], rejection_rate=None)]
    assert compare_cells(base, gone).failed
    assert compare_cells(base, []).failed[0].regressions == ("cell no longer produced",)
    extra = [*base, dict(base[0], drafter="new")]
    assert compare_cells(base, extra).unexpected == ["t · max_num_seqs 1 · new"]


def test_committed_ci_baseline_matches_the_bundled_traces():
    """The baseline .ci/run checks is valid and records the bundled traces as they are (no run needed)."""
    from pathlib import Path

    from agentspec_sim.report.check import resolve_traces

    path = Path(__file__).resolve().parent.parent / "reports" / "baseline.json"
    baseline = load_baseline(path)
    pairs = resolve_traces(baseline, path)
    assert [p.name for _, p in pairs] == ["swe-agent.jsonl.zst", "reflexion.jsonl.zst"]
    assert len(baseline.cells) == len(pairs) * len(baseline.max_num_seqs) * (len(baseline.drafters) + 1)
