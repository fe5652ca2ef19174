"""vLLM's `draft_model` method: a small same-family model drafts, priced as its own forward passes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agentspec_sim import EngineConfig, load_trace, simulate
from agentspec_sim.cost import build_cost_model
from agentspec_sim.cost.profiles import default_draft_model, draft_from_model, load_model, model_by_repo
from agentspec_sim.drafters.model.rule import DraftModelDrafter, draft_model_of, load_params
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.metrics import summarize
from agentspec_sim.sweep.plan import serve_flags

TRACE = Path(__file__).resolve().parents[1] / "traces" / "swe-agent.jsonl.zst"


def test_the_draft_model_is_named_or_the_smallest_of_the_targets_family():
    assert model_by_repo("Qwen/Qwen3-0.6B") == "qwen3-0.6b" and model_by_repo("qwen3-1.7b") == "qwen3-1.7b"
    assert default_draft_model(load_model("qwen3-235b-a22b")) == "qwen3-0.6b"
    assert default_draft_model(load_model("llama-3.1-70b")) == "llama-3.1-8b"
    assert default_draft_model(load_model("deepseek-v3")) is None  # no small model with its tokenizer bundled
    spec = parse_drafter('{"method": "draft_model", "model": "Qwen/Qwen3-1.7B", "num_speculative_tokens": 4}')
    assert draft_model_of(spec, "qwen3-32b") == "qwen3-1.7b"
    assert DraftModelDrafter.draft_network(parse_drafter("draft_model"), "qwen3-32b") == "draft_model:qwen3-0.6b"
    with pytest.raises(SpecConfigError, match="no model profile"):
        parse_drafter('{"method": "draft_model", "model": "org/unknown-1b", "num_speculative_tokens": 2}')
    with pytest.raises(SpecConfigError, match="name the draft model"):
        draft_model_of(parse_drafter("draft_model"), "deepseek-v3")


def test_a_draft_model_is_priced_as_its_own_forward_passes():
    spec = draft_from_model(load_model("qwen3-0.6b"))
    m = load_model("qwen3-0.6b")
    assert spec.num_layers == m.num_layers == 28 and spec.lm_head_rows == m.vocab_size
    # Every layer and the full vocabulary head: about the whole model's parameters per pass.
    assert spec.streamed_params() == pytest.approx(m.total_params(), rel=0.05)
    cost = build_cost_model("h200", "qwen3-32b")
    ctx = np.full(16, 4096)
    small, large = (cost.draft_model_time(16, 4, ctx, kind=f"draft_model:{d}") for d in ("qwen3-0.6b", "qwen3-1.7b"))
    head = cost.draft_model_time(16, 4, ctx, kind="eagle3")
    assert head < small < large  # one layer < 28 layers of 1024 < 28 layers of 2048
    assert cost.draft_model_time(16, 8, ctx, kind="draft_model:qwen3-0.6b") > 1.9 * small  # one pass a token
    with pytest.raises(ValueError, match="vocabulary"):
        cost.draft_model_time(1, 1, kind="draft_model:llama-3.1-8b")
    with pytest.raises(ValueError, match="MoE"):
        cost.draft_model_time(1, 1, kind="draft_model:qwen3-235b-a22b")


def test_draft_model_runs_with_its_stated_acceptance_source_and_deterministically():
    params = load_params("draft_model", "qwen3-32b")
    assert params.model == "default" and params.source.startswith("ASSUMPTION")
    assert params.calibration["targets_cumulative"][0] == pytest.approx(0.7)
    workload = load_trace(TRACE)
    workload = replace(workload, queries=workload.queries[:3])
    config = EngineConfig(max_num_seqs=4, hardware="h200", model="qwen3-32b", arrival="zero")
    a, b = (simulate(workload, "draft_model", config) for _ in range(2))
    assert a.steps.equals(b.steps)
    s = summarize(a)
    assert 1.5 < s.mean_acceptance_length < 4.0
    assert float(a.engine_steps["draft_s"].sum()) > 0  # the draft model's passes take time


def test_plan_deploys_the_draft_model_by_its_repo():
    from types import SimpleNamespace

    best = SimpleNamespace(speculative_config={"method": "draft_model", "num_speculative_tokens": 3}, max_num_seqs=8)
    config, _, _, _, served = serve_flags(best, "qwen3-32b", None, [])
    assert config["model"] == "Qwen/Qwen3-0.6B" and served == "Qwen/Qwen3-32B"
    best.speculative_config = {**best.speculative_config, "model": "qwen3-1.7b"}
    config, *_ = serve_flags(best, "qwen3-32b", None, [])
    assert config["model"] == "Qwen/Qwen3-1.7B"


def test_plan_notes_what_data_parallel_attention_leaves_out():
    """A MoE model's dp ranks: lockstep and the session-blind router are simulated, vLLM's prefill interval and
    session pinning are not (docs/cost-model.md, the data-parallel verdict); a dense model's ranks are replicas."""
    from types import SimpleNamespace

    best = SimpleNamespace(speculative_config={"method": "normal"}, max_num_seqs=8)
    dp = {"tensor_parallel_size": 1, "data_parallel_size": 8, "enable_expert_parallel": True}
    tp = {"tensor_parallel_size": 8, "data_parallel_size": 1, "enable_expert_parallel": True}
    note = serve_flags(best, "deepseek-v3", dp, [])[3]
    assert note is not None and "--prefill-schedule-interval" in note and "X-data-parallel-rank" in note
    assert serve_flags(best, "deepseek-v3", tp, [])[3] is None
    _, args, _, note, _ = serve_flags(best, "qwen3-8b", dp, [])
    assert "--enable-expert-parallel" not in args and note == ("--enable-expert-parallel left out: qwen3-8b is a dense "
                                                               "model (no experts to place)")
