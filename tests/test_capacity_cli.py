"""The load protocols and capacity planning through the command line: replay under each protocol, `sweep
--capacity`, `plan --capacity` (ranked per GPU, replicas for a target rate, $/Mtok, reruns identical), `plan
--results` of capacity results, `report` of them, and the refusals (one line, exit 2)."""

from __future__ import annotations

import json

import polars as pl
import pytest
from test_plan_and_units import one_error_line, run_cli

from agentspec_sim.sweep.capacity_plan import Prices
from agentspec_sim.trace.io import write_records

SLO = ["--slo-ttft", "0.5", "--slo-tpot", "0.05"]


@pytest.fixture
def trace(tmp_path):
    """Twelve two-call agent queries with repeating outputs (so drafters differ) and a tool call between."""
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 1000}]
    for q in range(12):
        records.append({"type": "call", "id": f"q{q}-0", "agent_id": 0, "query_id": q, "seq": 0,
                        "prompt_tokens": [1, 2, 3, 4, 5, 6, 7, 8] * 8 + [q],
                        "output_tokens": [10, 11, 12, 13] * 12 + [99]})
        records.append({"type": "call", "id": f"q{q}-1", "agent_id": 0, "query_id": q, "seq": 1, "think_s": 0.2,
                        "prompt_extends": f"q{q}-0", "prompt_append_tokens": [20, 21],
                        "output_tokens": [10, 11, 12, 13] * 8 + [98]})
    path = tmp_path / "agents.jsonl"
    write_records(records, path)
    return path


@pytest.mark.parametrize("load, shown", [
    (["--request-rate", "2"], "request rate 2/s (Poisson)"),
    (["--request-rate", "inf"], "request rate inf (all at once)"),  # vllm bench serve's default
    (["--request-rate", "2", "--burstiness", "inf"], "request rate 2/s (evenly spaced)"),
    (["--request-rate", "2", "--burstiness", "0.5"], "gamma, burstiness 0.5"),
    (["--max-concurrency", "3"], "max concurrency 3"),
    (["--request-rate", "2"], "shuffled"),  # vllm bench serve shuffles its dataset by default
    (["--request-rate", "2", "--disable-shuffle"], "in trace order"),
    (["--copies", "4"], "copies 4"),
    (["--rate", "2"], "request rate 2/s"),
])
def test_replay_names_the_protocol_and_reports_attainment(trace, load, shown, monkeypatch, capsys):
    code, out, err = run_cli(["replay", str(trace), "--drafter", "ngram", "--max-num-seqs", "4", *load, *SLO,
                              "--json"], monkeypatch, capsys)
    assert code == 0, err
    doc = json.loads(out)
    for run in doc["runs"]:
        assert shown in run["protocol"]
        assert 0 <= run["attainment"]["met"] <= 1 and run["request_throughput"] > 0
    assert doc["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05, "query_latency_s": None, "itl_s": None}
    per_query = [r["speedup_mean_per_query"] for r in doc["runs"]]
    assert (per_query[1] is not None) == ("--copies" in load)


def test_plan_capacity_ranks_per_gpu_and_reruns_identically(trace, tmp_path, monkeypatch, capsys):
    args = ["plan", str(trace), "--capacity", *SLO, "--drafter", "ngram", "--max-num-seqs", "1,2",
            "-j", "1", "--target-rate", "3", "--json", "--capacity-seeds", "2"]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    again = run_cli(args, monkeypatch, capsys)[1]
    assert out == again  # same inputs, same plan
    (p,) = json.loads(out)
    assert p["search"]["target"] == 0.9 and p["search"]["slo"]["ttft_s"] == 0.5
    best = p["best"]
    per_gpu = [(d["best"]["capacity_per_gpu"] or float("inf")) for d in p["drafters"] if d["best"]]
    assert (best["capacity_per_gpu"] or float("inf")) == max(per_gpu)
    assert "runner-up" in p["reason"] and "--max-num-seqs" in p["vllm_args"]
    assert best["replicas"] >= 1 and best["usd_per_million_tokens"] > 0
    price = Prices.load().of("a100-80g")
    assert best["usd_per_million_tokens"] == pytest.approx(price / (best["output_tok_s"] * 3600) * 1e6)
    for d in p["drafters"]:
        assert set(d["by_batch"]) == {"1", "2"}


def test_sweep_capacity_then_plan_and_report_from_its_results(trace, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cap.parquet"
    code, text, err = run_cli(["sweep", str(trace), "--capacity", *SLO, "--drafter", "ngram", "--max-num-seqs", "1,4",
                               "-j", "1", "-o", str(out), "--capacity-seeds", "2"], monkeypatch, capsys)
    assert code == 0, err
    assert "capacity ·" in text
    frame = pl.read_parquet(out)
    assert frame.height == 4 and frame["capacity_probes"].min() >= 1
    assert frame.filter(pl.col("drafter") == "normal")["capacity_vs_normal"].to_list() == [1.0, 1.0]
    code, text, err = run_cli(["plan", "--results", str(out), "--json", "--target-rate", "2"], monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(text)[0]["best"]["drafter"] in ("normal", "ngram")
    assert json.loads(text)[0]["target_rate"] == 2
    code, _, err = run_cli(["plan", "--results", str(out), "--slo-ttft", "9"], monkeypatch, capsys)
    assert "searched under their own SLO" in one_error_line(code, err)
    code, text, err = run_cli(["report", str(out), "-o", str(tmp_path / "rep")], monkeypatch, capsys)
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert any(n.startswith("latency-load-") for n in names) and any(n.startswith("capacity-batch-") for n in names)


@pytest.mark.parametrize("args, says", [
    (["plan", "--capacity", "--drafter", "ngram"], "needs a latency SLO"),
    (["plan", "--capacity", *SLO, "--request-rate", "2"], "varies the request rate itself"),
    (["plan", "--goodput", *SLO, "--slo-query-latency", "9"], "not with --goodput"),
    (["sweep", "-o", "x.parquet", *SLO], "are for --capacity"),
    (["replay", "--copies", "2", "--request-rate", "3"], "takes no --request-rate"),
    (["replay", "--request-rate", "0"], "--request-rate: must be > 0"),
    (["replay", "--request-rate", "nan"], "--request-rate: must be a finite number or inf"),
    (["replay", "--burstiness", "-inf"], "--burstiness: must be a finite number or inf"),
    (["replay", "--burstiness", "0"], "--burstiness: must be > 0"),
    (["replay", "--max-concurrency", "0"], "--max-concurrency: must be ≥ 1"),
    (["replay", "--slo-tpot", "-1"], "--slo-tpot must be > 0"),
    (["plan", "--capacity", *SLO, "--slo-attainment", "1.5"], "--slo-attainment"),
    (["plan", "--capacity", *SLO, "--target-rate", "0"], "--target-rate must be > 0"),
    (["plan", "--capacity", *SLO, "--max-concurrency", "8"], "clocks latency from each query's send"),
    (["sweep", "--capacity", *SLO, "--max-concurrency", "8", "-o", "x.parquet"], "clocks latency from each"),
    (["plan", "--capacity", *SLO, "--capacity-criterion", "tokens"], "criterion must be one of calls, queries"),
    (["plan", "--capacity", *SLO, "--capacity-seeds", "0"], "seeds must be between 1 and 1000"),
    (["plan", "--goodput", "--slo-itl", "0.1"], "not with --goodput"),
    (["plan", "--goodput", "--capacity-seeds", "3"], "not of the batch job's plan"),
    (["replay", "--slo-itl", "0"], "--slo-itl must be > 0"),
])
def test_bad_load_and_slo_options_are_one_line(trace, tmp_path, args, says, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [args[0], str(trace), *args[1:]]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert says in one_error_line(code, err)


def test_a_price_file_overrides_and_bad_ones_are_refused(tmp_path):
    good = tmp_path / "p.json"
    good.write_text('{"source": "our contract", "usd_per_gpu_hour": {"a100-80g": 0.5}}')
    assert Prices.load(good).of("a100-80g") == 0.5 and Prices.load(good).source == "our contract"
    bad = tmp_path / "b.json"
    bad.write_text('{"usd_per_gpu_hour": {"a100-80g": -1}}')
    from agentspec_sim.sweep.cells import SweepError

    with pytest.raises(SweepError, match="must be a price > 0"):
        Prices.load(bad)


def test_sweep_under_copies_records_the_per_query_speedup(trace, tmp_path, monkeypatch, capsys):
    out = tmp_path / "copies.parquet"
    code, text, err = run_cli(["sweep", str(trace), "--copies", "4", "--drafter", "ngram", "--max-num-seqs", "4",
                               "-j", "1", "-o", str(out)], monkeypatch, capsys)
    assert code == 0, err
    assert "per-query mean" in " ".join(text.split())
    frame = pl.read_parquet(out)
    assert frame["drafter"].to_list() == ["normal", "ngram"]
    per_query = frame["speedup_mean_per_query"].to_list()
    assert per_query[0] == pytest.approx(1.0) and per_query[1] is not None and per_query[1] > 0
    assert frame["query_batch_s"].list.len().to_list() == [12, 12]  # one batch time per trace query


def test_too_many_copies_names_copies(trace, monkeypatch, capsys):
    code, _, err = run_cli(["replay", str(trace), "--copies", "100000000"], monkeypatch, capsys)
    assert one_error_line(code, err).startswith("error: --copies: at 100,000,000, the run needs about")


def test_malformed_capacity_results_are_one_line(trace, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cap.parquet"
    code, _, err = run_cli(["sweep", str(trace), "--capacity", *SLO, "--drafter", "ngram", "--max-num-seqs", "1",
                            "-j", "1", "-o", str(out), "-q"], monkeypatch, capsys)
    assert code == 0, err
    frame = pl.read_parquet(out)
    for broken, says in ((frame.drop("capacity_search"), "lack column(s) capacity_search"),
                         (frame.with_columns(pl.lit("oops").alias("capacity_search")), "malformed")):
        path = tmp_path / "broken.parquet"
        broken.write_parquet(path)
        for command in (["plan", "--results", str(path)], ["report", str(path), "-o", str(tmp_path / "rep")]):
            code, _, err = run_cli(command, monkeypatch, capsys)
            assert says in one_error_line(code, err)


def test_a_capacity_sweep_resumes_and_a_changed_slo_is_a_new_search(trace, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cap.parquet"
    base = ["sweep", str(trace), "--capacity", "--drafter", "ngram", "-j", "1", "-o", str(out), "-q",
            "--capacity-seeds", "2"]
    code, _, err = run_cli([*base, *SLO, "--max-num-seqs", "1"], monkeypatch, capsys)
    assert code == 0, err
    first = pl.read_parquet(out)
    code, _, err = run_cli([*base, *SLO, "--max-num-seqs", "1,2", "--resume"], monkeypatch, capsys)
    assert code == 0, err
    resumed = pl.read_parquet(out)
    assert resumed.height == 4
    kept = resumed.filter(pl.col("max_num_seqs") == 1).drop("wall_s")
    assert kept.equals(first.drop("wall_s"))  # the finished searches were kept, not run again
    code, _, err = run_cli([*base, "--slo-ttft", "0.9", "--slo-tpot", "0.05", "--max-num-seqs", "1,2", "--resume"],
                           monkeypatch, capsys)
    assert code == 0, err
    assert "4 finished cell(s)" in " ".join(err.split())  # another SLO: every earlier search dropped, none reused


def test_plan_of_a_trace_under_per_request_slos_is_a_capacity_plan(trace, monkeypatch, capsys):
    """`plan TRACE --slo-ttft S --slo-tpot S` ranks by capacity unless --goodput asks for the batch job's plan."""
    base = ["plan", str(trace), *SLO, "--drafter", "ngram", "--max-num-seqs", "1", "-j", "1", "--json",
            "--capacity-seeds", "2"]
    code, out, err = run_cli(base, monkeypatch, capsys)
    assert code == 0, err
    assert "search" in json.loads(out)[0]
    code, out, err = run_cli([*base[:-2], "--goodput"], monkeypatch, capsys)
    assert code == 0, err
    assert "search" not in json.loads(out)[0] and "slo" in json.loads(out)[0]


def test_the_step_cost_error_is_the_pairs_held_out_median():
    from agentspec_sim.sweep.capacity_plan import COST_MODEL_ERROR, cost_model_error

    error, source = cost_model_error("a100-80g", "qwen3-8b")
    assert 0 < error < COST_MODEL_ERROR and "held-out" in source  # its bundled AIConfigurator calibration
    assert cost_model_error("a100-80g", "gpt-oss-20b") == (COST_MODEL_ERROR, cost_model_error("x", "y")[1])


def test_the_command_lines_capacity_defaults_are_the_librarys():
    from agentspec_sim.capacity import CapacitySearch
    from agentspec_sim.cli.sweep_options import CAPACITY_DEFAULTS
    from agentspec_sim.slo import LatencySLO

    search = CapacitySearch(LatencySLO(ttft_s=1.0))
    assert {key: getattr(search, key) for key in CAPACITY_DEFAULTS} == CAPACITY_DEFAULTS
