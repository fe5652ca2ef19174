"""Acceptance vs redundancy (analysis/redundancy.py, paper Figure 6) and `agentspec-sim analyze redundancy`."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from simhelpers import call, workload
from typer.testing import CliRunner

import agentspec_sim.cli.analyze  # noqa: F401  (registers `analyze` on the app)
from agentspec_sim.analysis.redundancy import plot_redundancy, redundancy_profile
from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.trace.io import write_records

OUTPUT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]


def test_hand_replay():
    # One call, prompt [9], no structure: history = one segment 9 1 2 3 1 2 4 1 2 3 1 2 as it grows.
    # Match length 2, before output token t (context = the last 2 tokens):
    #   t=5  ctx (1,2): one earlier occurrence → [3 1 2 …]; n=1, c=1, CT* = ∅ → draft [3]; truth 4: 0/1
    #   t=8  ctx (1,2): [4 1 2 …] (newest), [3 1 2 …]; 1–1 tie → 4; c/n = 1/2 → draft [4]; truth 3: 0/1
    #   t=9  ctx (2,3): [1 2 4 …] → draft [1], truth 1: 1/1
    #   t=10 ctx (3,1): [2 4 1 …] → draft [2], truth 2: 1/1
    #   every other t: the context occurs only where it is, with nothing after it → no candidates.
    wl = workload([call("c", [9], OUTPUT)])
    prof = redundancy_profile(wl, None, [2])
    by = prof["by_len"][2]
    assert prof["positions"] == len(OUTPUT)
    assert by["overall"] == {"lo": 0.0, "hi": 1.0, "positions": 4, "proposed": 4, "accepted": 2,
                             "acceptance": 0.5, "full_accept": 0.5}
    bins = {round(r["lo"], 1): r for r in by["bins"] if r["positions"]}
    assert set(bins) == {0.5, 0.9}
    assert (bins[0.5]["positions"], bins[0.5]["accepted"]) == (1, 0)
    assert (bins[0.9]["positions"], bins[0.9]["proposed"], bins[0.9]["accepted"]) == (3, 3, 2)
    assert bins[0.9]["acceptance"] == pytest.approx(2 / 3)
    n1, n23 = by["by_n"][0], by["by_n"][1]
    assert (n1["positions"], n1["accepted"], n23["positions"], n23["accepted"]) == (3, 2, 1, 0)


def test_fixed_length_drafts_and_history_across_calls():
    # Call 1 of the same query repeats call 0's output: every context is found in call 0.
    wl = workload([call("a", [9], OUTPUT, seq=0), call("b", [8], OUTPUT, seq=1)])
    one = redundancy_profile(wl, None, [3], draft_len=2)
    other = workload([call("a", [9], OUTPUT, query="q0"), call("b", [8], OUTPUT, query="q1")])
    separate = redundancy_profile(other, None, [3], draft_len=2)
    assert one["draft"] == "P[:2]"
    assert one["by_len"][3]["overall"]["positions"] > separate["by_len"][3]["overall"]["positions"]


def test_plot(tmp_path):
    wl = workload([call("a", [9], OUTPUT * 3)])
    prof = redundancy_profile(wl, None, [1, 2])
    path = plot_redundancy(prof, tmp_path / "fig6.png", min_positions=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def trace(tmp_path):
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100}]
    for q in range(2):
        records.append({"type": "call", "id": f"q{q}-0", "agent_id": 0, "query_id": q, "seq": 0,
                        "prompt_tokens": [50 + q], "output_tokens": OUTPUT * 2})
        records.append({"type": "call", "id": f"q{q}-1", "agent_id": 0, "query_id": q, "seq": 1,
                        "prompt_tokens": [60 + q], "output_tokens": OUTPUT})
    path = tmp_path / "tiny.jsonl"
    write_records(records, path)
    return path


def test_cli_json_and_figure(trace, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    fig = tmp_path / "out.png"
    result = CliRunner().invoke(app, ["analyze", "redundancy", str(trace), "--match-lens", "2,3", "--json",
                                      "-o", str(fig)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["match_lens"] == [2, 3] and doc["figure"] == str(fig) and fig.exists()
    assert doc["by_len"]["2"]["overall"]["positions"] > 0
    table = CliRunner().invoke(app, ["analyze", "redundancy", str(trace)])
    assert table.exit_code == 0 and "match 8" in table.output and "c/n" in table.output


def test_cli_bad_match_lens(trace, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "analyze", "redundancy", str(trace), "--match-lens", "2,x"])
    assert run_guarded(app) == 2
    assert "--match-lens" in capsys.readouterr().err


def test_bundled_trace_subset_shows_the_trend():
    from dataclasses import replace

    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace
    from agentspec_sim.trace.tokenizer import load_tokenizer

    wl = load_trace(default_trace_path())
    wl = replace(wl, queries=wl.queries[:3])
    prof = redundancy_profile(wl, load_tokenizer(wl.meta.tokenizer).token_bytes(), [4], draft_len=1)
    rows = [r for r in prof["by_len"][4]["bins"] if r["positions"] >= 50]
    low, high = rows[0], rows[-1]
    assert high["lo"] > low["lo"] and high["acceptance"] > low["acceptance"]  # more agreement, more accepted
    assert np.isclose(sum(r["positions"] for r in prof["by_len"][4]["bins"]), prof["by_len"][4]["overall"]["positions"])
