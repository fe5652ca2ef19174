"""Data parallelism (`--data-parallel-size`): the layout, KV capacity and prices of a rank, vLLM's routing of calls
to ranks, independent ranks for a dense model and lockstep ranks for a MoE model, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim.cost.base import BatchShape
from agentspec_sim.cost.build import build_cost_model
from agentspec_sim.cost.layout import Layout, LayoutSearch
from agentspec_sim.cost.profiles import kv_capacity_tokens, load_hardware, load_model
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import resolve
from agentspec_sim.engine.data_parallel import DataParallelSimulator
from agentspec_sim.engine.simulator import Simulator
from agentspec_sim.run.simulation import simulate

TRACES = Path(__file__).resolve().parents[1] / "traces"


def _agents(queries: int = 6, calls: int = 4, seed: int = 3):
    rng = np.random.default_rng(seed)
    return workload(*(agent_query(rng, f"q{i}", calls, think_s=0.05) for i in range(queries)))


def _run(dp: int, moe: bool, drafter: str = "ngram", **kw):
    cfg = config(data_parallel_size=dp, **kw)
    spec = parse_drafter(drafter)
    return DataParallelSimulator(_agents(), spec, cfg, resolve(cfg), ConstantCost(step_s=0.01, per_token_s=1e-4),
                                 moe=moe).run()


def test_a_layout_names_its_data_parallel_ranks():
    layout = Layout(1, True, 8)
    assert layout.gpus == 8
    assert layout.tag == "dp8-ep"
    assert Layout(2, True, 4).tag == "tp2-dp4-ep"
    assert layout.flags() == "--data-parallel-size 8 --enable-expert-parallel"
    assert layout.label == "tp 1 × dp 8 + EP"
    assert Layout.of({"tensor_parallel_size": 2, "data_parallel_size": 4}) == Layout(2, False, 4)
    assert Layout.of({"tensor_parallel_size": 8}) == Layout(8)  # settings written before data parallelism
    search = LayoutSearch((1, 8), True, (1, 8))
    assert Layout(1, True, 8) in search.layouts("h200", "deepseek-v3")
    assert search.most == 4


def test_a_moe_rank_holds_its_share_of_the_experts_and_the_rest_whole():
    hw = load_hardware("h200")
    moe, dense = load_model("deepseek-v3"), load_model("qwen3-8b")
    # Eight ranks of one GPU: 1/8 of the experts per GPU, every other weight whole — more KV than nothing fits,
    # less than tp 8, which splits everything.
    assert kv_capacity_tokens(hw, moe, tp=1) == 0
    dp8 = kv_capacity_tokens(hw, moe, tp=1, data_parallel_size=8)
    assert dp8 > 0
    assert kv_capacity_tokens(hw, dense, tp=1, data_parallel_size=4) == kv_capacity_tokens(hw, dense, tp=1)


def test_a_rank_is_priced_with_the_tokens_of_every_rank_at_its_experts():
    dp8 = build_cost_model("h200", "deepseek-v3", 1, expert_parallel=True, data_parallel_size=8)
    shape = BatchShape.decode(32, 4096)
    balanced = dp8.step_time(shape)
    explicit = dp8.step_time(BatchShape(shape.query_lens, shape.context_lens, shape.is_prefill, 32 * 8))
    assert explicit.total_s == balanced.total_s  # 0 means the ranks in balance: this rank's tokens × 8
    alone = dp8.step_time(BatchShape(shape.query_lens, shape.context_lens, shape.is_prefill, 32))
    busy = dp8.step_time(BatchShape(shape.query_lens, shape.context_lens, shape.is_prefill, 32 * 64))
    assert alone.moe_s < balanced.moe_s < busy.moe_s
    assert alone.communication_s < balanced.communication_s < busy.communication_s
    assert alone.attention_s == balanced.attention_s == busy.attention_s  # attention is the rank's own
    # A dense model's ranks are replicas: a rank costs what the tensor-parallel layout alone costs.
    dense = build_cost_model("h100-80g", "qwen3-8b", 2, data_parallel_size=4).step_time(shape).total_s
    assert dense == build_cost_model("h100-80g", "qwen3-8b", 2).step_time(shape).total_s


def test_calls_are_routed_to_the_least_loaded_rank_ties_in_turn():
    sim = DataParallelSimulator(_agents(), parse_drafter("normal"), config(data_parallel_size=3),
                                resolve(config(data_parallel_size=3)), ConstantCost(), moe=False)
    # Nothing in flight anywhere: round-robin from a start index that moves on by one per call.
    assert [sim._route() for _ in range(4)] == [0, 1, 2, 0]
    sim.in_flight = [2, 0, 1]
    assert sim._route() == 1
    sim.in_flight = [1, 1, 0]
    assert sim._route() == 2


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("drafter", ["normal", "ngram", "suffix"])
def test_every_call_runs_once_on_one_rank_with_the_invariants_on(moe, drafter):
    result = _run(2, moe, drafter)
    calls = result.calls
    assert calls["status"].unique().to_list() == ["finished"]
    assert (calls["output_len"] == calls["recorded_output_len"]).all()
    assert sorted(calls["dp_rank"].unique().to_list()) == [0, 1]
    assert result.extra["calls_per_rank"] == [calls.filter(pl.col("dp_rank") == r).height for r in (0, 1)]
    queries = result.queries
    assert queries["completed"].all()
    assert queries["latency_s"].null_count() == 0 and (queries["latency_s"] > 0).all()
    assert queries["output_tokens"].sum() == calls["output_len"].sum()
    steps = result.engine_steps
    assert set(steps["dp_rank"].unique().to_list()) == {0, 1}
    assert result.steps.height == steps["batch_size"].sum()


def test_moe_ranks_step_in_lockstep_and_dense_ranks_do_not():
    def ends_by_start(result):
        steps = result.engine_steps.with_columns((pl.col("time_s") + pl.col("step_time_s")).alias("end"))
        return steps.group_by("time_s").agg(pl.col("end").n_unique().alias("ends"), pl.len().alias("ranks"))

    lockstep = ends_by_start(_run(2, True))
    assert (lockstep["ends"] == 1).all()  # the ranks of one step all end when the slowest does
    assert (lockstep["ranks"] == 2).any()
    # Dense ranks keep their own clocks: steps that start together need not end together.
    free = _run(2, False).engine_steps
    starts = set(free.filter(pl.col("dp_rank") == 0)["time_s"].to_list())
    assert not starts >= set(free.filter(pl.col("dp_rank") == 1)["time_s"].to_list())


def test_a_query_keeps_its_send_time_on_every_rank_and_protocols_gate_all_ranks():
    # Calls recorded at 10, 15, 20 s, the query sent at 0: wherever a call runs, it arrives at its recorded time
    # shifted by the query's send offset (−10 s), as on one engine.
    rng = np.random.default_rng(0)
    calls = agent_query(rng, "q0", 3)
    calls = [replace(c, arrival_s=10.0 + 5.0 * k) for k, c in enumerate(calls)]
    one = simulate(workload(calls), "normal", config(arrival="zero"), cost_model=ConstantCost())
    two = simulate(workload(calls), "normal", config(arrival="zero", data_parallel_size=2), cost_model=ConstantCost())
    assert one.calls["arrival_s"].to_list() == [0.0, 5.0, 10.0]
    assert two.calls["arrival_s"].to_list() == one.calls["arrival_s"].to_list()
    assert two.calls["dp_rank"].n_unique() == 2  # its calls ran on both ranks
    # max concurrency 1: one query at a time over both ranks.
    gated = simulate(_agents(queries=4), "normal", config(data_parallel_size=2, arrival="zero", max_concurrency=1),
                     cost_model=ConstantCost())
    q = gated.queries.sort("arrival_s")
    assert (q["arrival_s"][1:].to_numpy() >= q["finish_s"][:-1].to_numpy() - 1e-12).all()


def test_a_prompt_over_max_model_len_is_refused_before_routing():
    rng = np.random.default_rng(1)
    calls = agent_query(rng, "long", 4, prompt_len=40, out_len=20, append=30)  # prompts 40, 90, 140, 190
    result = simulate(workload(calls, agent_query(rng, "short", 2)), "normal",
                      config(data_parallel_size=2, max_model_len=120), cost_model=ConstantCost())
    status = dict(zip(result.calls["call_id"].to_list(), result.calls["status"].to_list(), strict=True))
    assert [status[f"long-{k}"] for k in range(4)] == ["finished", "finished", "refused", "skipped"]
    assert status["short-0"] == status["short-1"] == "finished"
    assert not result.queries.filter(pl.col("query_id") == "long")["completed"].item()


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "agentspec"])
def test_a_rank_drafts_from_the_tables_exactly_as_live(monkeypatch, drafter):
    # Per-request tables (n-gram matches, suffix prompt trees) hold on a rank that runs a share of the calls;
    # AgentSpec's history table does not, and a rank drafts from its own history instead.
    fast = _run(3, True, drafter)
    monkeypatch.setattr(Simulator, "draft_tables", False)
    live = _run(3, True, drafter)
    assert fast.calls.equals(live.calls)
    assert fast.engine_steps.equals(live.engine_steps)


def test_data_parallel_runs_are_deterministic():
    a, b = _run(3, True, "ngram"), _run(3, True, "ngram")
    assert a.calls.equals(b.calls)
    assert a.engine_steps.equals(b.engine_steps)


def test_two_ranks_serve_a_burst_sooner_than_one():
    one = simulate(_agents(queries=12), "normal", config(arrival="zero"), cost_model=ConstantCost(step_s=0.01,
                                                                                               per_token_s=1e-3))
    two = simulate(_agents(queries=12), "normal", config(arrival="zero", data_parallel_size=2),
                   cost_model=ConstantCost(step_s=0.01, per_token_s=1e-3))
    assert two.queries["latency_s"].mean() < one.queries["latency_s"].mean()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentspec_sim.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_too_many_ranks_for_memory_are_refused_naming_the_flag(monkeypatch):
    from agentspec_sim.host.resources import ResourceError

    monkeypatch.setenv("AGENTSPEC_SIM_MEMORY_GIB", "2")
    cfg = config(data_parallel_size=100_000, check_invariants=False)
    with pytest.raises(ResourceError) as err:
        simulate(_agents(), "ngram", cfg, cost_model=ConstantCost())
    assert err.value.knob == "data_parallel_size" and "at 100,000" in str(err.value)


def test_cost_prices_a_data_parallel_rank_from_the_cli(tmp_path):
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text('{"kind": "decode", "batch": 64, "context": 4096}\n')
    out = _cli("cost", "--hardware", "b200", "--model", "deepseek-v3", "--data-parallel-size", "8",
               "--enable-expert-parallel", "--shapes", str(shapes), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["data_parallel_size"] == 8 and doc["expert_parallel"] is True
    assert doc["steps"][0]["seconds"] > 0


def test_replay_runs_ranks_and_says_so(tmp_path):
    out = _cli("replay", str(TRACES / "default.jsonl.zst"), "--hardware", "h200", "--model", "deepseek-v3",
               "--data-parallel-size", "8", "--enable-expert-parallel", "--drafter", "ngram", "--request-rate", "1",
               "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["config"]["data_parallel_size"] == 8
    assert "--data-parallel-size 8" in doc["cost_model"]
