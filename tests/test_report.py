"""`report`: sweep-schema rows from compare, seed averaging, the Markdown report and its PNGs, the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from simhelpers import agent_query, config, workload

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.drafters.registry import speculative_config
from agentspec_sim.report.build import write_report
from agentspec_sim.report.results import (
    KEY_COLUMNS,
    METRIC_COLUMNS,
    ResultsError,
    compare_rows,
    load_results,
    rows_frame,
    seed_means,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIZES = (1, 2, 8)


@pytest.fixture(scope="module")
def results() -> pl.DataFrame:
    """A tiny agent workload swept over three batch sizes with ngram and an oracle drafter (real cost model)."""
    rng = np.random.default_rng(7)
    tiny = workload(*[agent_query(rng, f"q{i}", calls=3, vocab=6) for i in range(4)])
    oracle = speculative_config({"method": "test-oracle", "num_speculative_tokens": 4}, label="test-oracle")
    rows = compare_rows(tiny, "tiny.jsonl", ["ngram", oracle], SIZES, config())
    return rows_frame(rows)


def test_rows_follow_the_sweep_schema(results):
    for column in (*KEY_COLUMNS, *METRIC_COLUMNS, "rejection_rate_tokens", "ttft_p50"):
        assert column in results.columns
    assert results.height == 3 * len(SIZES)
    assert sorted(set(results["max_num_seqs"].to_list())) == list(SIZES)
    assert results["cell_id"].n_unique() == results.height
    normal = results.filter(pl.col("drafter") == "normal")
    assert normal["speedup"].to_list() == pytest.approx([1.0] * len(SIZES))
    assert normal["rejection_rate"].null_count() == len(SIZES)
    # The oracle drafts the recorded continuation: nothing it drafts is rejected.
    assert results.filter(pl.col("drafter") == "test-oracle")["rejection_rate"].to_list() == [0.0] * len(SIZES)
    assert all(len(lat) == 4 for lat in results["query_latencies_s"].to_list())
    assert json.loads(results["speculative_config"][1])["method"] == "ngram"


def test_seed_means_average_metrics_and_pool_latencies(results):
    other = results.with_columns(pl.lit(1, dtype=pl.Int64).alias("seed"),
                                 (pl.col("goodput_tok_s") * 3).alias("goodput_tok_s"))
    means = seed_means(pl.concat([results, other]))
    assert means.height == results.height
    assert set(means["seeds"].to_list()) == {2}
    row = means.filter((pl.col("drafter") == "ngram") & (pl.col("max_num_seqs") == 2))
    base = results.filter((pl.col("drafter") == "ngram") & (pl.col("max_num_seqs") == 2))
    assert row["goodput_tok_s"][0] == pytest.approx(2 * base["goodput_tok_s"][0])
    assert len(row["query_latencies_s"][0]) == 8
    assert means["drafter"].to_list()[:3] == ["normal", "normal", "normal"]


def test_report_writes_markdown_linking_non_trivial_pngs(results, tmp_path):
    report = write_report(results, tmp_path / "out", sources=["agentspec-sim report tiny.parquet"])
    text = report.markdown.read_text()
    names = {p.name for p in report.figures}
    assert names == {f"{kind}-tiny-a100-80g-qwen3-8b.png" for kind in
                     ("speedup", "drafts-budget", "latency-cdf", "time-breakdown")} | {"pareto-tiny-qwen3-8b.png"}
    for path in report.figures:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 15_000, path.name
        assert f"]({path.name})" in text
    for heading in ("Rejection rate (paper Table 1)", "Goodput (paper Table 2 layout)",
                    "Time breakdown at max batch size 8 (paper Table 5)", "paper Figure 8", "paper Figure 3"):
        assert heading in text
    # Table 1 row for the oracle: 0.0% at every batch size, call-mean and token-level alike.
    assert text.count("| test-oracle | 0.0% | 0.0% | 0.0% | 0.0% |") == 2
    assert "Token rejection rate (1 − vLLM's draft acceptance rate)" in text
    assert "| ngram |" in text and "b=8" in text


def test_report_gives_each_traces_figure_5_premise(results, tmp_path):
    text = write_report(results, tmp_path / "missing").markdown.read_text()
    assert "### Where repeated output comes from (paper Figure 5)" in text
    assert "Not computed: `tiny.jsonl` is not a file here" in text
    trace = str(Path(__file__).resolve().parents[1] / "traces" / "deep-research.jsonl.zst")
    text = write_report(results.with_columns(pl.lit(trace).alias("trace")), tmp_path / "real").markdown.read_text()
    assert "| 4 | 41.2% | 0.4% | 0.0% | 41.6% |" in text  # `inspect`'s numbers for the bundled trace
    assert "AgentSpec's premise holds at k = 4: 41.2% same block vs 0.4% elsewhere" in text


def test_report_is_deterministic(results, tmp_path):
    first = write_report(results, tmp_path / "a")
    second = write_report(results, tmp_path / "b")
    for a, b in zip([first.markdown, *first.figures], [second.markdown, *second.figures], strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_batch_size_must_exist(results, tmp_path):
    with pytest.raises(ResultsError, match=r"no cells at that max_num_seqs .*1, 2, 8"):
        write_report(results, tmp_path / "x", batch=4)
    report = write_report(results, tmp_path / "y", batch=2)
    assert "Query latency CDF at max batch size 2" in report.markdown.read_text()


def test_step_logs_add_the_per_step_budget_plot(results, tmp_path):
    steps = tmp_path / "steps.parquet"
    pl.DataFrame({"step": [0, 0, 1, 2, 0, 1], "drafter": ["ngram"] * 4 + ["normal"] * 2,
                  "batch_size": [3, 3, 1, 2, 3, 1], "D": [6, 6, 2, None, None, None]}).write_parquet(steps)
    report = write_report(results, tmp_path / "out", step_logs=[steps])
    figure = tmp_path / "out" / "step-drafts-budget.png"
    assert figure in report.figures and figure.read_bytes().startswith(PNG_MAGIC)
    assert "](step-drafts-budget.png)" in report.markdown.read_text()


def test_cli_report_from_parquet(results, tmp_path, monkeypatch, capsys):
    path = tmp_path / "results.parquet"
    results.write_parquet(path)
    out = tmp_path / "rep"
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "report", str(path), "-o", str(out)])
    assert run_guarded(app) == 0
    assert (out / "report.md").exists() and len(list(out.glob("*.png"))) == 5  # the setting's 4, the Pareto view
    assert load_results([path]).height == results.height


def test_cli_report_bad_input_is_one_line_exit_2(results, tmp_path, monkeypatch, capsys):
    path = tmp_path / "results.parquet"
    results.drop("rejection_rate").write_parquet(path)
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "report", str(path), "-o", str(tmp_path / "o")])
    assert run_guarded(app) == 2
    err = capsys.readouterr().err
    assert "results.parquet: missing column(s) rejection_rate" in err and "Traceback" not in err

    bad = tmp_path / "results.jsonl"
    bad.write_text('{"cell_id": "a"}\nnot json\n')
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "report", str(bad)])
    assert run_guarded(app) == 2
    assert "results.jsonl:2: not JSON" in capsys.readouterr().err
