"""Parallel layouts as a sweep and plan axis: which layouts fit a model on a GPU (vLLM's rules), cells at each,
one plan per layout and a ranking of the layouts by load per GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import polars as pl
import pytest

from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.sweep_options import layout_choice
from agentspec_sim.cost.layout import TP_SIZES, Layout, LayoutSearch
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.sweep import SweepError
from agentspec_sim.sweep.cells import expand_cells
from agentspec_sim.sweep.plan import hardware_summary, layout_summary, plan, with_layout

TRACES = Path(__file__).resolve().parents[1] / "traces"


def test_sizes_parse_and_refuse_what_is_not_a_gpu_count():
    assert layout_choice("8", False) == (8, 1, None)
    assert layout_choice("1, 2,4", True) == (1, 1, LayoutSearch((1, 2, 4), True))
    assert layout_choice("AUTO", False) == (1, 1, LayoutSearch(None, None))
    assert layout_choice("auto", True) == (1, 1, LayoutSearch(None, True))
    assert layout_choice("1", True, "8") == (1, 8, None)
    assert layout_choice("1,8", True, "1,8") == (1, 1, LayoutSearch((1, 8), True, (1, 8)))
    for bad in ("0", "x", ",", "-2", "2,2"):
        with pytest.raises(UsageError, match="--tensor-parallel-size"):
            layout_choice(bad, False)
        with pytest.raises(UsageError, match="--data-parallel-size"):
            layout_choice("1", False, bad)


def test_a_layout_search_keeps_what_vllm_would_start():
    auto = LayoutSearch()
    assert auto.most == 2 * len(TP_SIZES)
    # Qwen3-8B fits one H100 at its 40,960-token context: every size; a dense model has no expert parallelism.
    assert auto.layouts("h100-80g", "qwen3-8b") == [Layout(1), Layout(2), Layout(4), Layout(8)]
    # DeepSeek-V3 (671 GB of FP8) leaves a 163,840-token sequence's KV only at tp 8 on B200; both MoE layouts.
    assert auto.layouts("b200", "deepseek-v3") == [Layout(8), Layout(8, True)]
    assert auto.layouts("h100-80g", "deepseek-v3") == []  # two nodes' worth of weights
    assert LayoutSearch(None, True).layouts("h200", "qwen3-235b-a22b") == [Layout(4, True), Layout(8, True)]
    assert LayoutSearch(None, True).layouts("h100-80g", "qwen3-235b-a22b") == [Layout(8, True)]
    # A shorter context needs less KV: tp 4 holds a 32k-token sequence beside DeepSeek-V3's weights on B200.
    assert LayoutSearch(None, True).layouts("b200", "deepseek-v3", max_model_len=32768) == [Layout(4, True),
                                                                                             Layout(8, True)]
    # Explicit sizes are kept when the heads split (64 heads do not split over 3).
    assert LayoutSearch((3, 4), False).layouts("h100-80g", "qwen3-32b") == [Layout(4)]


def test_cells_are_crossed_with_each_pairs_layouts():
    spec = parse_drafter("ngram")
    cells = expand_cells("t.jsonl", [spec], [8], ["b200"], ["deepseek-v3", "qwen3-8b"], [0],
                         EngineConfig(), None, LayoutSearch((4, 8), None))
    got = [(c.config.model, c.config.tensor_parallel_size, c.config.enable_expert_parallel) for c in cells]
    # DeepSeek-V3 at tp 4 on B200 cannot hold one max_model_len sequence beside its weights (vLLM would not start)
    # while tp 8 can: the list's tp 4 is left out for it, and said so (`LayoutSearch.left_out`).
    assert got == [("deepseek-v3", 8, False), ("deepseek-v3", 8, True), ("qwen3-8b", 4, False), ("qwen3-8b", 8, False)]
    assert [(lay.tensor_parallel_size, lay.expert_parallel)
            for lay in LayoutSearch((4, 8), None).left_out("b200", "deepseek-v3")] == [(4, False), (4, True)]
    assert len({c.cell_id for c in cells}) == len(cells)
    with pytest.raises(SweepError, match="no parallel layout of deepseek-v3 fits h100-80g"):
        expand_cells("t.jsonl", [spec], [8], ["h100-80g"], ["deepseek-v3"], [0], EngineConfig(), None, LayoutSearch())


ENGINE = {k: v for k, v in asdict(EngineConfig()).items()
          if k not in ("max_num_seqs", "hardware", "model", "seed", "check_invariants")}


def _rows(tp: int, goodput: float, hardware: str = "h200") -> list[dict]:
    engine = json.dumps({**ENGINE, "tensor_parallel_size": tp}, sort_keys=True)
    return [{"trace": "t.jsonl", "hardware": hardware, "model": "qwen3-32b", "seed": 0, "drafter": "normal",
             "speculative_config": json.dumps({"method": "normal"}), "max_num_seqs": b, "goodput_tok_s": goodput * b,
             "speedup": 1.0, "query_latency_p99": 1.0, "ttft_p99": 0.1, "tpot_p99": 0.01, "preemptions": 0,
             "incomplete_queries": 0, "limits_num_kv_blocks": 1000, "limits_block_size": 16, "engine_config": engine}
            for b in (1, 2)]


def test_one_plan_per_layout_and_the_layouts_ranked_per_gpu():
    results = pl.DataFrame(_rows(1, 100.0) + _rows(2, 150.0))
    assert with_layout(results)["tensor_parallel_size"].to_list() == [1, 1, 2, 2]
    plans = plan(results)
    assert [p.engine["tensor_parallel_size"] for p in plans] == [1, 2]
    assert "--tensor-parallel-size" in plans[1].vllm_args and "--tensor-parallel-size" not in plans[0].vllm_args
    (pair,) = layout_summary(plans)
    # tp 2 has 1.5× the goodput on 2× the GPUs: tp 1 serves more per GPU.
    assert [r["layout"] for r in pair["layouts"]] == ["tp 1", "tp 2"]
    assert [r["per_gpu"] for r in pair["layouts"]] == pytest.approx([200.0, 150.0])
    assert layout_summary(plan(pl.DataFrame(_rows(1, 100.0)))) == []  # one layout: nothing to rank


def test_the_gpus_ranked_by_their_best_layout_per_gpu():
    results = pl.DataFrame(_rows(1, 100.0) + _rows(2, 150.0) + _rows(2, 500.0, "b200") + _rows(1, 180.0, "b200"))
    plans = plan(results)
    (model,) = hardware_summary(plans)
    # b200: tp 2 carries 500 tok/s per GPU at max_num_seqs 2 (its best layout); h200: tp 1, 200.
    assert [(r["hardware"], r["layout"]) for r in model["hardware"]] == [("b200", "tp 2"), ("h200", "tp 1")]
    assert [r["per_gpu"] for r in model["hardware"]] == pytest.approx([500.0, 200.0])
    assert hardware_summary(plan(pl.DataFrame(_rows(1, 100.0) + _rows(2, 150.0)))) == []  # one GPU: nothing


def test_plan_searches_the_layouts_that_fit_from_the_command_line(tmp_path):
    trace = TRACES / "swe-agent.jsonl.zst"
    run = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "plan", str(trace), "--drafter", "ngram",
                          "--max-num-seqs", "8", "--hardware", "h200", "--model", "qwen3-235b-a22b",
                          "--tensor-parallel-size", "auto", "--enable-expert-parallel", "--max-model-len", "32768",
                          "--slo-ttft", "5", "--slo-tpot", "0.2", "--executor", "inline", "--json",
                          "--capacity-seeds", "2", "--capacity-max-tenants", "128"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    layouts = {(p["engine"]["tensor_parallel_size"], p["engine"]["enable_expert_parallel"]) for p in doc["plans"]}
    assert layouts == {(4, True), (8, True)}  # tp 1 and 2 leave no KV cache beside 470 GB of weights
    (pair,) = doc["layouts"]
    assert {r["flags"] for r in pair["layouts"]} == {"--tensor-parallel-size 4 --enable-expert-parallel",
                                                     "--tensor-parallel-size 8 --enable-expert-parallel"}
    for p in doc["plans"]:  # a layout whose capacity this short trace cannot state gets no serve line
        assert ("--enable-expert-parallel" in p["vllm_args"]) if p["best"] else (p["vllm_args"] == []
                                                                                 and "too short" in p["reason"])
    assert any(p["best"] for p in doc["plans"])
    assert pair["layouts"][0]["told_apart_from_best"] is None  # the best has nothing to be told apart from


def test_a_layout_not_told_apart_from_the_best_is_marked():
    """Capacities whose intervals (and the step cost's error) overlap the best layout's are not told apart: the
    layouts table marks them, where the plan printed margins to 0.1 % for rates the search resolves to ±5 %."""
    from types import SimpleNamespace

    from agentspec_sim.sweep.capacity_plan import CapacityChoice
    from agentspec_sim.sweep.plan import layout_summary

    def plan_at(tp: int, rate: float, low: float, high: float):
        choice = CapacityChoice(drafter="ngram", speculative_config={"method": "ngram"}, max_num_seqs=8,
                                capacity_rate=rate, capacity_low=low, capacity_high=high, at_least=None,
                                inconclusive=None, capacity_per_gpu=rate / tp, output_tok_s=rate * 100,
                                output_tokens_per_query=100.0, gpus=tp, ttft_p99_s=1.0, tpot_p99_s=0.05,
                                query_latency_p99_s=10.0, attainment=0.95, stopped="bisected to ±5%")
        engine = {"tensor_parallel_size": tp, "enable_expert_parallel": True, "data_parallel_size": 1}
        return SimpleNamespace(trace="t", hardware="h200", model="qwen3-235b-a22b", engine=engine, best=choice,
                               search={}, model_error=0.03)

    (pair,) = layout_summary([plan_at(4, 2.8, 2.0, 3.6), plan_at(8, 5.8, 5.6, 6.0), plan_at(2, 1.0, 0.95, 1.05)])
    marks = {r["layout"]: r["told_apart_from_best"] for r in pair["layouts"]}
    # per GPU: tp 4 0.70 ± 29 % and tp 8 0.725 ± 3 % overlap; tp 2 0.50 ± 5 % is told apart from tp 8
    assert marks == {"tp 8 + EP": None, "tp 4 + EP": False, "tp 2 + EP": True}
