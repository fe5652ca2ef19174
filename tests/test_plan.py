"""`plan`: choices on results where the answer is known (constructed rows; a tiny trace whose KV cache
forces the batch size), the vLLM flags, the batch-size schedule, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import polars as pl
import pytest
from test_sweep import write_trace

from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.sweep import run_sweep
from agentspec_sim.sweep.plan import SLO, plan

NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 4}
# goodput by (drafter, max_num_seqs); every batch size of 8 preempts (the KV cache is full).
GOODPUT = {"normal": (100, 180, 300, 360), "ngram k=5": (200, 280, 320, 340), "ngram k=2": (150, 260, 340, 350)}
P99 = (10.0, 12.0, 20.0, 40.0)
SIZES = (1, 2, 4, 8)
# The engine settings a sweep records with every row (Cell.engine_config): the defaults, as vLLM picks them.
ENGINE = json.dumps({k: v for k, v in asdict(EngineConfig()).items()
                     if k not in ("max_num_seqs", "hardware", "model", "seed", "check_invariants")}, sort_keys=True)


def _config(label: str) -> str:
    if label == "normal":
        return json.dumps({"method": "normal"})
    return json.dumps({**NGRAM, "num_speculative_tokens": int(label[-1])}, sort_keys=True)


def constructed(seeds: int = 1, slower_seed: dict | None = None) -> pl.DataFrame:
    rows = []
    for seed in range(seeds):
        for i, b in enumerate(SIZES):
            for label, goodputs in GOODPUT.items():
                p99 = P99[i]
                if slower_seed and seed == 1:
                    p99 = slower_seed.get((label, b), p99)
                rows.append({"trace": "t.jsonl", "hardware": "a100-80g", "model": "qwen3-8b", "seed": seed,
                             "drafter": label, "speculative_config": _config(label), "max_num_seqs": b,
                             "goodput_tok_s": float(goodputs[i]), "speedup": goodputs[i] / GOODPUT["normal"][i],
                             "query_latency_p99": p99, "ttft_p99": 0.1 * b, "tpot_p99": 0.01,
                             "preemptions": 7 if b == 8 else 0, "incomplete_queries": 0,
                             "limits_num_kv_blocks": 1000, "limits_block_size": 16, "engine_config": ENGINE})
    return pl.DataFrame(rows)


def test_kv_capacity_bounds_the_batch_and_the_schedule_shrinks_k():
    (p,) = plan(constructed())
    best = {d.drafter: d.best.max_num_seqs for d in p.drafters}
    assert best == {"normal": 4, "ngram k=5": 4, "ngram k=2": 4}  # 8 preempts: over the KV cache
    assert p.best.drafter == "ngram k=2" and p.best.max_num_seqs == 4
    assert "max_num_seqs 8: KV cache full (7 preemptions; 16,000 KV tokens)" in p.reason
    assert "next: ngram k=5 at max_num_seqs 4 (320 tok/s)" in p.reason
    # Up to 2 requests k=5 wins (200, 280 tok/s), at 4 the chosen k=2: k shrinks with the batch.
    assert p.vllm_speculative_config == {**NGRAM, "num_speculative_tokens": 5,
                                         "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 4, 2]]}
    assert p.vllm_args[:2] == ["--max-num-seqs", "4"]
    assert json.loads(p.vllm_args[3]) == p.vllm_speculative_config
    assert p.vllm_env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and p.vllm_note is None  # the V1 n-gram rule


def test_simulator_methods_map_to_vllm():
    frame = constructed().with_columns(pl.col("speculative_config").str.replace('"ngram"', '"ngram-v2"'))
    (p,) = plan(frame)
    assert p.vllm_speculative_config["method"] == "ngram" and p.vllm_env == {}  # V2 is vLLM 0.33's default
    frame = constructed().with_columns(pl.col("speculative_config").str.replace('"ngram"', '"agentspec"'))
    (p,) = plan(frame)
    assert "agentspec is simulated here" in p.vllm_note


def test_latency_slo_bounds_the_batch():
    (p,) = plan(constructed(), SLO(p99_latency_s=15))
    assert {d.drafter: d.best.max_num_seqs for d in p.drafters} == {"normal": 2, "ngram k=5": 2, "ngram k=2": 2}
    assert p.best.drafter == "ngram k=5" and p.best.max_num_seqs == 2
    assert "max_num_seqs 4: query p99 20 s > 15 s" in p.reason
    # k=5 is best at every batch size up to 2: a constant k, no schedule.
    assert p.vllm_speculative_config == {**NGRAM, "num_speculative_tokens": 5}


def test_allowing_preemption_picks_normal_at_the_largest_batch():
    (p,) = plan(constructed(), SLO(allow_preemption=True))
    assert p.best.drafter == "normal" and p.best.max_num_seqs == 8
    assert p.vllm_speculative_config is None and p.vllm_args == ["--max-num-seqs", "8"]
    assert "the largest batch size swept" in p.reason


def test_every_seed_must_meet_the_slo_and_goodput_is_averaged():
    (p,) = plan(constructed(seeds=2, slower_seed={("ngram k=5", 2): 16.0}), SLO(p99_latency_s=15))
    k5 = next(d for d in p.drafters if d.drafter == "ngram k=5")
    assert k5.best.max_num_seqs == 1 and "max_num_seqs 2: query p99 16 s > 15 s" in k5.why
    assert p.best.drafter == "ngram k=2" and p.best.max_num_seqs == 2 and p.best.goodput_tok_s == 260


def test_nothing_feasible_says_so():
    (p,) = plan(constructed(), SLO(ttft_s=0.05, min_goodput_tok_s=10))
    assert p.best is None and p.vllm_args == [] and "no drafter meets the objectives" in p.reason
    assert all("TTFT p99 0.1 s > 0.05 s" in d.why for d in p.drafters)


@pytest.fixture(scope="module")
def kv_bound(tmp_path_factory):
    """A tiny trace on a KV cache that holds two of its calls at once: max_num_seqs 4 and 8 preempt."""
    path = write_trace(tmp_path_factory.mktemp("plan") / "kv.jsonl", queries=6, calls=2, out_len=40, seed=3)
    out = path.with_suffix(".parquet")
    frame = run_sweep(path, ["ngram"], max_num_seqs=[1, 2, 4, 8], engine=EngineConfig(num_kv_blocks=24),
                      output=out, jobs=1)
    return out, frame


def test_kv_capacity_forces_the_batch_size_on_a_real_trace(kv_bound):
    _, frame = kv_bound
    preempting = sorted(frame.filter(pl.col("preemptions") > 0)["max_num_seqs"].unique().to_list())
    assert preempting == [4, 8]  # the premise: only the larger batches overflow the KV cache
    (p,) = plan(frame)
    assert p.best.max_num_seqs == 2 and all(d.best.max_num_seqs <= 2 for d in p.drafters)
    assert "max_num_seqs 4: KV cache full" in p.reason
    (loose,) = plan(frame, SLO(allow_preemption=True))
    assert loose.best.goodput_tok_s >= p.best.goodput_tok_s


def test_cli_json_and_errors(kv_bound, tmp_path):
    out, _ = kv_bound
    cli = [sys.executable, "-m", "agentspec_sim.cli", "plan"]
    result = subprocess.run([*cli, "--results", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (doc,) = json.loads(result.stdout)
    assert doc["best"]["max_num_seqs"] == 2 and doc["vllm_args"][:2] == ["--max-num-seqs", "2"]
    # The sweep's KV size is carried into the flags (vLLM's name for it), the model named as vLLM takes it.
    assert doc["vllm_args"][2:4] == ["--num-gpu-blocks-override", "24"] and doc["vllm_model"] == "Qwen/Qwen3-8B"
    table = subprocess.run([*cli, "--results", str(out), "--slo-p99-latency", "1000"], capture_output=True,
                           text=True, timeout=120, env={"COLUMNS": "100", "PATH": ""})
    assert table.returncode == 0, table.stderr
    assert "vllm serve Qwen/Qwen3-8B --max-num-seqs 2 --num-gpu-blocks-override 24" in table.stdout
    for args, words in ((["--results", str(tmp_path / "none.parquet")], "none.parquet"),
                        (["--results", str(out), "--slo-ttft", "-1"], "--slo-ttft")):
        bad = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr


def test_cli_runs_its_own_sweep(kv_bound):
    from typer.testing import CliRunner

    from agentspec_sim.cli.app import app

    path = kv_bound[0].with_suffix(".jsonl")
    result = CliRunner().invoke(app, ["plan", str(path), "--drafter", "ngram", "--max-num-seqs", "1,2,4,8", "-j", "1",
                                      "--num-kv-blocks", "24", "--json"])
    assert result.exit_code == 0, result.output
    (doc,) = json.loads(result.output)
    assert doc["best"]["max_num_seqs"] == 2 and doc["trace"] == str(path)  # as from the saved sweep above


def test_queries_refused_at_every_batch_size_do_not_make_it_infeasible():
    # 6 queries never complete at any batch size (a prompt over max_model_len): the plan is the same as
    # without them and says so; one more incomplete query at b=4 (an engine failure there) still counts.
    frame = constructed().with_columns(pl.lit(6).alias("incomplete_queries"))
    (p,) = plan(frame)
    assert p.best.drafter == "ngram k=2" and p.best.max_num_seqs == 4
    assert "6 queries never complete at any batch size" in p.reason
    worse = frame.with_columns(pl.when(pl.col("max_num_seqs") == 4).then(7).otherwise(6).alias("incomplete_queries"))
    (p,) = plan(worse)
    assert p.best.max_num_seqs == 2 and "max_num_seqs 4: 1 queries did not complete" in p.reason
