"""Issue 51 (first contact, round 4), the classes fixed so far: options that would be ignored are refused, numeric
edge cases named by their option, and the names a vLLM user brings (a Hugging Face id for --model)."""

from __future__ import annotations

import pytest
from test_capacity_cli import trace  # noqa: F401  (fixture)
from test_plan_and_units import one_error_line, run_cli

from agentspec_sim.cost import load_model


@pytest.mark.parametrize("extra", [[], ["--max-concurrency", "4"]])
def test_burstiness_without_a_request_rate_is_refused_not_ignored(trace, extra, monkeypatch, capsys):  # noqa: F811
    """--burstiness shapes the gaps of --request-rate (or a capacity search's rate); alone it changed nothing."""
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", "--burstiness", "0.5", *extra],
                           monkeypatch, capsys)
    assert "--burstiness shapes the gaps between queries sent at --request-rate" in one_error_line(code, err)
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", "--burstiness", "0.5",
                            "--request-rate", "2", *extra], monkeypatch, capsys)
    assert code == 0, err


def test_a_request_rate_too_small_for_a_float_gap_is_named(trace, monkeypatch, capsys):  # noqa: F811
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", "--request-rate", "1e-310"], monkeypatch,
                           capsys)
    line = one_error_line(code, err)
    assert line.startswith("error: --request-rate: 1e-310 queries per second is too small") and "nan" not in line


def test_a_hugging_face_id_names_its_bundled_profile(trace, monkeypatch, capsys):  # noqa: F811
    """What `vllm serve` takes, and what `plan` prints in its serve line, is what --model takes."""
    assert load_model("Qwen/Qwen3-8B").id == "qwen3-8b"
    assert load_model("deepseek-ai/DeepSeek-V3").id == "deepseek-v3"
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", "--model", "Qwen/Qwen3-8B"], monkeypatch,
                           capsys)
    assert code == 0, err
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", "--model", "Nope/Model"], monkeypatch,
                           capsys)
    line = one_error_line(code, err)
    assert "Nope/Model: no such model profile" in line and "Qwen/Qwen3-8B" in line


@pytest.mark.parametrize(("table", "message"), [
    ('{"usd_per_gpu_hour": {"a100": 1.3}}', "usd_per_gpu_hour: a100: no such hardware profile (bundled: a100-80g"),
    ('{"usd_per_gpu_hour": {"h100-80g": true}}', "usd_per_gpu_hour: h100-80g: expected a number of dollars, got true"),
    ('{"usd_per_gpu_hour": {"h100-80g": 1e308}}', "h100-80g: must be a price > 0 and at most $10,000 per GPU-hour"),
    (b"\\xff\\xfe{}", "not UTF-8 text"),
])
def test_a_price_table_is_checked_key_by_key_naming_its_file(table, message):
    """An unknown GPU key was dropped, `true` read as $1, 1e308 printed as a 300-digit price, a binary file not
    named: each is now one line naming the file, the key and what is wrong."""
    import tempfile
    from pathlib import Path

    from agentspec_sim.sweep.capacity_plan import Prices
    from agentspec_sim.sweep.cells import SweepError

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prices.json"
        if isinstance(table, bytes):
            path.write_bytes(table.decode("unicode_escape").encode("latin-1"))
        else:
            path.write_text(table)
        with pytest.raises(SweepError) as info:
            Prices.load(path)
        assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_prices_with_a_goodput_plan_are_refused(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    prices = tmp_path / "p.json"
    prices.write_text('{"usd_per_gpu_hour": {"h100-80g": 3.0}}')
    code, _, err = run_cli(["plan", str(trace), "--goodput", "--prices", str(prices)], monkeypatch, capsys)
    assert "--prices: a goodput plan prices nothing" in one_error_line(code, err)


def test_a_damaged_resume_journal_is_named(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    from agentspec_sim.sweep.results import journal_path

    out = tmp_path / "s.parquet"
    journal_path(out).write_bytes(b"\xff\xfe not json\n")
    code, _, err = run_cli(["sweep", str(trace), "--drafter", "normal", "--max-num-seqs", "2", "-o", str(out),
                            "--resume", "-q"], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert f"{journal_path(out)}:1: the resume journal holds a line that is not UTF-8 text" in line


def test_the_plans_step_error_is_the_layouts_own_fit():
    """`plan` quoted "±5 %, assumed: no bundled calibration" for DeepSeek-V3 while `cost` priced it with the bundled
    tp 8 + EP fit: the stated error is now that of the fit the cost model uses at the plan's layout."""
    from agentspec_sim.sweep.capacity_plan import COST_MODEL_ERROR, cost_model_error

    error, source = cost_model_error("h200", "deepseek-v3", {"tensor_parallel_size": 8, "enable_expert_parallel": True})
    assert error != COST_MODEL_ERROR and source == "held-out median vs measured kernels"
    assert cost_model_error("h200", "deepseek-v3")[0] == COST_MODEL_ERROR  # one H200 holds no DeepSeek-V3


def test_mixed_or_edited_results_are_one_line_naming_the_file_in_plan_and_report(trace, tmp_path, monkeypatch,  # noqa: F811
                                                                                 capsys):
    """A capacity sweep and a goodput sweep reported together ended in an IndexError, a capacity file without
    probe_rate in a KeyError, one with capacity_rate as text in a matplotlib TypeError, and `plan` read mixed rows
    as goodput rows: each is one line now, naming the file and what is mixed or wrong."""
    import polars as pl

    slo = ["--slo-ttft", "0.5", "--slo-tpot", "0.05"]
    cap, good = tmp_path / "cap.parquet", tmp_path / "good.parquet"
    for args, out in ((["--capacity", *slo], cap), ([], good)):
        code, _, err = run_cli(["sweep", str(trace), *args, "--drafter", "ngram", "--max-num-seqs", "1", "-j", "1",
                                "-o", str(out), "-q"], monkeypatch, capsys)
        assert code == 0, err
    code, _, err = run_cli(["report", str(cap), str(good), "-o", str(tmp_path / "r0")], monkeypatch, capsys)
    assert "these results mix 2 capacity row(s) (sweep --capacity) with 2 goodput row(s)" in one_error_line(code, err)
    frame = pl.read_parquet(cap)
    edits = {
        "mixed": (pl.concat([frame, pl.read_parquet(good)], how="diagonal_relaxed"), "these results mix"),
        "noprobe": (frame.drop("probe_rate"), None),
        "norate": (frame.drop("capacity_rate"), "lack column(s) capacity_rate"),
        "textrate": (frame.with_columns(pl.col("capacity_rate").cast(pl.Utf8)),
                     "column capacity_rate: expected numbers, got String"),
    }
    for name, (edited, says) in edits.items():
        path = tmp_path / f"{name}.parquet"
        edited.write_parquet(path)
        commands = [["report", str(path), "-o", str(tmp_path / f"r-{name}")]]
        if says is not None:  # plan reads no probe column
            commands.append(["plan", "--results", str(path)])
        for command in commands:
            code, _, err = run_cli(command, monkeypatch, capsys)
            line = one_error_line(code, err)
            assert line.startswith(f"error: {path}: "), (name, command[0], line)
            assert (says or "lack column(s) probe_rate") in line, (name, command[0], line)


def test_the_bundled_price_table_prices_every_gpu_it_has_a_source_for():
    from agentspec_sim.cost import hardware_ids
    from agentspec_sim.sweep.capacity_plan import Prices

    prices = Prices.load()
    assert set(prices.usd_per_gpu_hour) == set(hardware_ids()) - {"b300", "gb300"}
    assert "No comparable on-demand figure for B300 or GB300" in prices.source
    assert prices.of("a100-80g") < prices.of("h100-80g") < prices.of("h200") < prices.of("b200")


def test_sweep_makes_its_output_folder_as_replay_does(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "new dir" / "s.parquet"
    code, _, err = run_cli(["sweep", str(trace), "--drafter", "normal", "--max-num-seqs", "2", "-o", str(out), "-q"],
                           monkeypatch, capsys)
    assert code == 0 and out.exists(), err
    assert not out.with_name("s.parquet.lock").exists()


def test_a_layout_list_leaves_out_what_does_not_fit_and_says_so():
    """--tensor-parallel-size 1,8 --data-parallel-size 1,8 for DeepSeek-V3 on H200: tp 1 cannot hold the weights;
    the plan went no further. Now it is left out (the sweep notes it) while a layout of the list fits; a single
    layout that does not fit is still run, and the run says why."""
    from agentspec_sim.cost.layout import Layout, LayoutSearch

    search = LayoutSearch(sizes=(1, 8), expert_parallel=True, data_parallel_sizes=(1, 8))
    kept = search.layouts("h200", "deepseek-v3")
    assert Layout(1, False, 1) not in kept and Layout(8, True, 1) in kept and Layout(1, True, 8) in kept
    assert search.left_out("h200", "deepseek-v3") == [Layout(1, False, 1)]
    alone = LayoutSearch(sizes=(1,), expert_parallel=True, data_parallel_sizes=(1,))
    assert alone.layouts("h200", "deepseek-v3") == [Layout(1, False, 1)] and not alone.left_out("h200", "deepseek-v3")


def test_plan_says_what_a_model_based_drafters_acceptance_rests_on(trace, monkeypatch, capsys):  # noqa: F811
    """`replay` printed eagle3's acceptance source (borrowed curves for Qwen3); `plan` did not."""
    import json

    code, out, err = run_cli(["plan", str(trace), "--goodput", "--drafter", "normal,eagle3", "--max-num-seqs", "2",
                              "--no-band"], monkeypatch, capsys)
    assert code == 0, err
    assert "acceptance of eagle3: " in out
    code, out, err = run_cli(["plan", str(trace), "--goodput", "--drafter", "normal,eagle3", "--max-num-seqs", "2",
                              "--no-band", "--json"], monkeypatch, capsys)
    assert code == 0, err
    (doc,) = json.loads(out)
    assert set(doc["acceptance_models"]) == {"eagle3"} and doc["acceptance_models"]["eagle3"]


def test_a_report_of_several_layouts_keeps_each_layouts_plots_and_answers_what_plan_answers(trace, tmp_path,  # noqa: F811
                                                                                             monkeypatch, capsys):
    """Two layouts' plots were written under one name (each overwrote the other), both sections had one title, and
    the report had no layouts or GPUs table and no $ per million tokens."""
    out = tmp_path / "cap.parquet"
    code, _, err = run_cli(["sweep", str(trace), "--capacity", "--slo-ttft", "0.5", "--slo-tpot", "0.05",
                            "--drafter", "ngram", "--max-num-seqs", "1", "--tensor-parallel-size", "1,2",
                            "--hardware", "h100-80g,h200", "-j", "1", "-o", str(out), "-q"], monkeypatch, capsys)
    assert code == 0, err
    report = tmp_path / "rep"
    code, _, err = run_cli(["report", str(out), "-o", str(report)], monkeypatch, capsys)
    assert code == 0, err
    pngs = sorted(p.name for p in report.glob("*.png") if not p.name.startswith("pareto-"))
    assert len(pngs) == 8 and sum("-tp2" in name for name in pngs) == 4  # 2 GPUs × 2 layouts × 2 plots
    text = (report / "report.md").read_text()
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    assert len(titles) == len(set(titles)) and any(t.endswith("· tp 2") for t in titles)
    assert "## Layouts · " in text and "## GPUs · " in text and "per million output tokens" in text


@pytest.mark.parametrize("command", [["sweep", "-q"], ["plan", "--capacity", "--slo-ttft", "5"]])
def test_a_max_model_len_no_call_fits_is_named_before_any_run(trace, tmp_path, command, monkeypatch,  # noqa: F811
                                                              capsys):
    """Every call refused: a capacity search said "misses the SLO with each query alone… relax an SLO"."""
    args = [command[0], str(trace), *command[1:], "--drafter", "normal", "--max-num-seqs", "2", "--max-model-len", "32"]
    if command[0] == "sweep":
        args += ["-o", str(tmp_path / "s.parquet")]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert "--max-model-len 32: no call of the trace fits (its shortest prompt is 65 tokens" in one_error_line(code,
                                                                                                                 err)


def test_a_chat_transcript_ending_with_the_assistants_turn_is_a_query_of_its_calls(tmp_path, monkeypatch, capsys):
    """OpenAI's chat fine-tuning form ({"messages": [..., assistant]}, no `response`), the shape most chat logs
    take, was refused ("missing response"): each assistant turn is a call now, the line one query."""
    import json

    from agentspec_sim.trace.io import load_trace

    log = tmp_path / "chats.jsonl"
    log.write_text("\n".join(json.dumps(line) for line in [
        {"messages": [{"role": "system", "content": "You code."}, {"role": "user", "content": "Hello in Python."},
                      {"role": "assistant", "content": "print('hello')"}, {"role": "user", "content": "In C."},
                      {"role": "assistant", "content": "puts(\"hello\");"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]) + "\n")
    out = tmp_path / "trace.jsonl"
    code, _, err = run_cli(["convert", "openai-chat", str(log), "-o", str(out)], monkeypatch, capsys)
    assert code == 0, err
    workload = load_trace(out)
    assert [len(q.calls) for q in workload.queries] == [2, 1]
    first, second = workload.queries[0].calls
    # the second call's prompt is the first's prompt and output and the next user turn
    assert second.prompt_len > first.prompt_len + first.output_len
    assert list(second.prompt_tokens[:first.prompt_len]) == list(first.prompt_tokens)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, _, err = run_cli(["convert", "openai-chat", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "b.jsonl")],
                           monkeypatch, capsys)
    assert "missing response (a call's response, or a transcript whose last message is the assistant's turn)" in \
        one_error_line(code, err)


def test_the_pareto_frontier_keeps_what_no_other_configuration_beats_on_both():
    """AIConfigurator's first view: output tok/s per GPU against tok/s per user, across drafters, batch sizes,
    layouts and GPUs."""
    import json

    import polars as pl

    from agentspec_sim.sweep.pareto import pareto_points

    def row(hw: str, tp: int, drafter: str, b: int, goodput: float, tpot: float) -> dict:
        return {"trace": "t.jsonl", "model": "qwen3-8b", "hardware": hw, "drafter": drafter, "max_num_seqs": b,
                "seed": 0, "goodput_tok_s": goodput, "tpot_mean": tpot,
                "engine_config": json.dumps({"tensor_parallel_size": tp})}

    frame = pl.DataFrame([row("h100-80g", 1, "normal", 8, 800.0, 0.010),    # 800 /GPU, 100 /user: frontier
                          row("h100-80g", 1, "ngram", 8, 900.0, 0.0125),    # 900 /GPU, 80 /user: frontier
                          row("h100-80g", 2, "normal", 8, 1000.0, 0.005),   # 500 /GPU, 200 /user: frontier
                          row("h200", 1, "normal", 2, 400.0, 0.011)])       # 400 /GPU, 91 /user: beaten
    points = pareto_points(frame)
    on = {(p.hardware, p.layout, p.drafter): (round(p.tok_s_per_gpu), round(p.tok_s_per_user)) for p in points
          if p.on_frontier}
    assert on == {("h100-80g", "tp 1", "ngram"): (900, 80), ("h100-80g", "tp 1", "normal"): (800, 100),
                  ("h100-80g", "tp 2", "normal"): (500, 200)}
    assert [p.on_frontier for p in points] == [True, True, True, False]  # the frontier first, most per GPU first


def test_plan_and_report_show_the_pareto_view(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    import json

    out = tmp_path / "s.parquet"
    code, _, err = run_cli(["sweep", str(trace), "--drafter", "ngram", "--max-num-seqs", "1,2", "-o", str(out), "-q"],
                           monkeypatch, capsys)
    assert code == 0, err
    code, text, err = run_cli(["plan", "--results", str(out), "--pareto"], monkeypatch, capsys)
    assert code == 0 and "Pareto frontier" in text, err
    code, text, err = run_cli(["plan", "--results", str(out), "--pareto", "--json"], monkeypatch, capsys)
    assert code == 0 and any(p["on_frontier"] for p in json.loads(text)["pareto"]), err
    code, _, err = run_cli(["report", str(out), "-o", str(tmp_path / "r")], monkeypatch, capsys)
    assert code == 0 and list((tmp_path / "r").glob("pareto-*.png")), err


def test_an_fp8_kv_cache_holds_twice_the_tokens_and_reads_half_the_bytes():
    """vLLM's --kv-cache-dtype fp8: one byte a KV element. The KV pool doubles, decode attention reads half."""
    from types import SimpleNamespace

    from agentspec_sim import EngineConfig
    from agentspec_sim.cost import BatchShape
    from agentspec_sim.cost.build import cost_model_for
    from agentspec_sim.engine.config import EngineConfigError, resolve
    from agentspec_sim.sweep.plan import serve_flags

    bf16 = EngineConfig(hardware="h100-80g", model="qwen3-8b", max_num_seqs=64)
    fp8 = EngineConfig(hardware="h100-80g", model="qwen3-8b", max_num_seqs=64, kv_cache_dtype="fp8")
    assert resolve(fp8).num_kv_blocks == pytest.approx(2 * resolve(bf16).num_kv_blocks, abs=2)
    batch = BatchShape.decode(64, 16384)
    a, b = (cost_model_for(c).step_time(batch).attention_s for c in (bf16, fp8))
    assert b < 0.6 * a
    with pytest.raises(EngineConfigError, match="kv_cache_dtype must be one of auto"):
        EngineConfig(kv_cache_dtype="int4")
    best = SimpleNamespace(speculative_config={"method": "normal"}, max_num_seqs=64)
    args = serve_flags(best, "qwen3-8b", {"kv_cache_dtype": "fp8"}, [])[1]
    assert args[-2:] == ["--kv-cache-dtype", "fp8"]


def test_plan_ranks_layouts_run_in_separate_sweeps_together(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`plan --results` took one file: layouts swept apart could not be ranked together."""
    import json

    files = []
    for tp in ("1", "2"):
        out = tmp_path / f"tp{tp}.parquet"
        code, _, err = run_cli(["sweep", str(trace), "--capacity", "--slo-ttft", "0.5", "--slo-tpot", "0.05",
                                "--drafter", "ngram", "--max-num-seqs", "1", "--tensor-parallel-size", tp,
                                "--hardware", "h100-80g", "-j", "1", "-o", str(out), "-q"], monkeypatch, capsys)
        assert code == 0, err
        files += ["--results", str(out)]
    code, out, err = run_cli(["plan", *files, "--json"], monkeypatch, capsys)
    assert code == 0, err
    (pair,) = json.loads(out)["layouts"]
    assert {r["layout"] for r in pair["layouts"]} == {"tp 1", "tp 2"}


def test_copies_1_is_the_copies_protocols_first_point(trace, monkeypatch, capsys):  # noqa: F811
    """`--copies 1` ran the trace's own arrivals and gave no per-query speedup; every other B gave one."""
    import json

    for b in ("1", "3"):
        code, out, err = run_cli(["replay", str(trace), "--drafter", "ngram", "--copies", b, "--max-num-seqs", "4",
                                  "--json"], monkeypatch, capsys)
        assert code == 0, err
        runs = json.loads(out)["runs"]
        assert all(r["protocol"].startswith(f"copies {b} (each query alone") for r in runs)
        assert runs[1]["speedup_mean_per_query"] is not None
    code, _, err = run_cli(["replay", str(trace), "--copies", "1", "--request-rate", "2"], monkeypatch, capsys)
    assert "--copies runs each query alone" in one_error_line(code, err)
