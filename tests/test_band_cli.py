"""The uncertainty band on the command line, each command in a fresh process (as tests/test_cli_fresh.py runs
them): replay's intervals and --no-band, sweep's band columns, plan's message, report's plot and tables. No
bundled parameter file has a band yet, so each test writes one (the Llama-3.1-8B EAGLE-3 file, shifted in logit)
and points the config at it with `acceptance_params`."""

from __future__ import annotations

import json
import os

import polars as pl
import pytest
from test_band import banded_file
from test_cli_fresh import run, trace_text

from agentspec_sim.run.band import COLUMNS


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "AGENTSPEC_SIM_CACHE": str(cache), "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("band-cli") / "t.jsonl"
    path.write_text(trace_text())
    return path


def _eagle(params) -> str:
    return json.dumps({"method": "eagle3", "num_speculative_tokens": 3, "acceptance_params": str(params)})


def test_replay_json_and_table_show_the_band(trace, env, tmp_path):
    params = banded_file(tmp_path / "p.json", 0.3)
    args = ("replay", trace, "--drafter", "ngram", "--speculative-config", _eagle(params), "--max-num-seqs", "4")
    document = json.loads(run(*args, "--json", env=env).stdout)
    normal, ngram, eagle = document["runs"]
    for plain in (normal, ngram):
        assert plain["mean_acceptance_length_band"] is None and plain["goodput_tok_s_band"] is None
        assert plain["speedup_band"] is None
    low, high = eagle["mean_acceptance_length_band"]
    assert low < eagle["mean_acceptance_length"] < high  # the high file's logits are higher: longer acceptance
    g_low, g_high = eagle["goodput_tok_s_band"]
    assert g_low < eagle["goodput_tok_s"] < g_high
    # Speedup against the same normal run as the point value.
    assert eagle["speedup_band"] == pytest.approx([g_low / normal["goodput_tok_s"], g_high / normal["goodput_tok_s"]])
    assert json.loads(run(*args, "--json", env=env).stdout) == document  # deterministic
    # What each model-based drafter's acceptance rests on: its file and that file's source.
    assert list(document["acceptance_models"]) == ["eagle3"]
    assert document["acceptance_models"]["eagle3"].startswith("p.json: ")

    skipped = json.loads(run(*args, "--json", "--no-band", env=env).stdout)["runs"][2]
    assert skipped["speedup_band"] is None and skipped["goodput_tok_s"] == eagle["goodput_tok_s"]

    table = run(*args, env=env).stdout
    assert f"[{low:.2f}–{high:.2f}]" in table and "uncertainty band" in table
    assert "acceptance model of eagle3: p.json" in table


def test_sweep_plan_and_report_carry_the_band(trace, env, tmp_path):
    # The low bound all but never accepts: below normal's goodput, so normal lies inside eagle3's band.
    params = banded_file(tmp_path / "p.json", 0.3)
    body = json.loads(params.read_text())
    body["band"]["low"]["positions"] = [a - 6.0 for a in body["positions"]]
    params.write_text(json.dumps(body))
    results = tmp_path / "s.parquet"
    done = run("sweep", trace, "-o", results, "--drafter", "normal", "--speculative-config", _eagle(params),
               "--max-num-seqs", "1,4", "-j", "1", env=env)
    assert "results' *_low / *_high columns" in done.stdout
    frame = pl.read_parquet(results)
    assert set(COLUMNS) <= set(frame.columns)
    eagle = frame.filter(pl.col("drafter").str.starts_with("eagle3"))
    assert eagle["goodput_tok_s_low"].null_count() == 0 and frame.filter(pl.col("drafter") == "normal")[
        "goodput_tok_s_low"].null_count() == 2
    assert (eagle["speedup_low"] < eagle["speedup"]).all() and (eagle["speedup"] < eagle["speedup_high"]).all()

    (p,) = json.loads(run("plan", "--results", results, "--json", env=env).stdout)
    assert p["best"]["drafter"].startswith("eagle3") and p["band_overlaps"] == ["normal"]
    assert "normal's goodput at max_num_seqs 4" in p["band_note"] and "inside the chosen one's band" in p["band_note"]
    assert len(p["best"]["goodput_tok_s_band"]) == 2
    text = run("plan", "--results", results, env=env).stdout
    assert "uncertain: within the acceptance model's uncertainty band" in text
    refused = run("plan", "--results", results, "--no-band", env=env, ok=False)
    assert refused.returncode == 2 and "--no-band" in refused.stderr

    out = tmp_path / "report"
    run("report", results, "-o", out, env=env)
    assert (out / "speedup-t-a100-80g-qwen3-8b.png").stat().st_size > 1000
    markdown = (out / "report.md").read_text()
    assert "uncertainty band" in markdown and "× [" in markdown
