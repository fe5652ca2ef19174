"""validate vllm / record: the runner's bookkeeping against a fake vLLM 0.33 at its API boundary
(tests/fake_vllm: same class, method and field names, process-global Prometheus-like counters)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from simhelpers import call, config, workload

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.trace.io import load_trace, write_trace
from agentspec_sim.validation.vllm_runner import (
    build_llm,
    compare,
    methods,
    run_vllm,
    workload_with_outputs,
)

FAKE = Path(__file__).parent / "fake_vllm"


@pytest.fixture
def fake_vllm(monkeypatch):
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    import vllm

    assert vllm.__version__.endswith("+fake")
    yield vllm
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        sys.modules.pop(name, None)


def agent_workload(seed: int = 0, queries: int = 3, calls: int = 3):
    """Agent queries whose prompts repeat 7-token motifs (the fake model copies 7 tokens back), recorded
    outputs of varied length; the second query arrives at 0.25 s."""
    rng = np.random.default_rng(seed)
    out = []
    for qi in range(queries):
        motif = rng.integers(0, 40, 7)
        prompt = np.concatenate([rng.integers(0, 40, 9), np.tile(motif, 3)])
        query = []
        for k in range(calls):
            output = rng.integers(0, 40, int(rng.integers(8, 30)))
            query.append(call(f"q{qi}-{k}", prompt, output, query=f"q{qi}", seq=k,
                              arrival_s=0.25 * qi if k == 0 else None))
            prompt = np.concatenate([prompt, output, np.tile(motif, 2)])
        out.append(query)
    return workload(*out)


class FakeClock:
    """Steps take no time; waiting advances the clock (so arrivals are honoured without waiting)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


def served(fake_vllm, name: str, wl, clock=None):
    m = methods()[name]
    llm = build_llm("fake/model", m, max_num_seqs=4)
    clock = clock or FakeClock()
    return m, llm, run_vllm(wl, llm, name, clock=clock)


def test_every_call_is_served_with_its_output_length_pinned(fake_vllm):
    wl = agent_workload()
    clock = FakeClock()
    _, llm, run = served(fake_vllm, "normal", wl, clock)
    # vLLM's config check refuses per-request spec-decode metrics without a speculative config.
    assert "per_request_spec_decode_metrics" not in llm.kwargs and not llm.kwargs["disable_log_stats"]
    assert "speculative_config" not in llm.kwargs
    assert set(run.calls) == {c.id for q in wl.queries for c in q.calls}
    for q in wl.queries:
        for c in q.calls:
            assert run.calls[c.id].output_tokens.shape == c.output_tokens.shape
    # arrivals: query 2 starts at 0.5 s; a query's calls finish in order
    assert run.calls["q2-0"].finished_s >= 0.5 > run.calls["q0-0"].finished_s
    assert run.calls["q0-0"].finished_s <= run.calls["q0-1"].finished_s <= run.calls["q0-2"].finished_s
    assert run.counters["generation_tokens"] == run.output_tokens
    assert run.acceptance()["mean_acceptance_length"] is None


@pytest.mark.parametrize("name", ["ngram", "ngram-v2"])
def test_counters_are_per_run_and_match_per_request_metrics(fake_vllm, name):
    wl = agent_workload()
    _, _, first = served(fake_vllm, name, wl)
    _, _, second = served(fake_vllm, name, wl)  # the registry keeps counting across engines
    for run in (first, second):
        steps_drafted = [d for r in run.calls.values() for d in r.per_step_drafted]
        steps_accepted = [a for r in run.calls.values() for a in r.per_step_accepted]
        assert run.counters["num_drafts"] == len(steps_drafted) > 0
        assert run.counters["num_draft_tokens"] == sum(steps_drafted)
        assert run.counters["num_accepted_tokens"] == sum(steps_accepted) > 0
        assert sum(run.accepted_per_pos) == sum(steps_accepted)
    assert first.counters == second.counters and first.accepted_per_pos == second.accepted_per_pos
    if name == "ngram-v2":  # the default runner always drafts k
        assert {d for r in first.calls.values() for d in r.per_step_drafted} == {5}
    else:  # V1 (VLLM_USE_V2_MODEL_RUNNER=0 while the engine was built): earliest occurrence, not rightmost
        _, _, v2 = served(fake_vllm, "ngram-v2", wl)
        assert [r.per_step_accepted for r in first.calls.values()] != [r.per_step_accepted for r in v2.calls.values()]
    import os

    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # restored after the build


@pytest.mark.parametrize("name", ["ngram", "ngram-v2"])
def test_simulation_on_vllm_outputs_matches_step_by_step(fake_vllm, name):
    wl = agent_workload(seed=1)
    m, _, run = served(fake_vllm, name, wl)
    result = compare(wl, run, m, config(max_num_seqs=4, max_num_batched_tokens=2048, num_kv_blocks=2048))
    assert result.calls == 9 and result.calls_identical == 9, result.call_mismatches
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        assert result.simulated[key] == result.measured[key]
    assert result.simulated["rejection_rate_tokens"] == pytest.approx(result.measured["rejection_rate_tokens"])
    assert result.simulated["goodput_tok_s"] > 0 and result.measured["goodput_tok_s"] > 0


def test_workload_with_outputs_replaces_outputs_only(fake_vllm):
    wl = agent_workload()
    _, _, run = served(fake_vllm, "normal", wl)
    new = workload_with_outputs(wl, run, model="fake/model")
    for q_old, q_new in zip(wl.queries, new.queries, strict=True):
        for a, b in zip(q_old.calls, q_new.calls, strict=True):
            assert np.array_equal(a.prompt_tokens, b.prompt_tokens) and a.arrival_s == b.arrival_s
            assert np.array_equal(b.output_tokens, run.calls[a.id].output_tokens)
    assert new.meta.model == "fake/model"
    run.calls.pop("q1-1")
    with pytest.raises(ValueError, match="q1-1"):
        workload_with_outputs(wl, run)


def test_record_and_validate_vllm_commands(fake_vllm, tmp_path, monkeypatch, capsys):
    # The commands run each engine in a child process: it finds the fake through PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    trace = tmp_path / "t.jsonl"
    write_trace(agent_workload(queries=2, calls=2), trace)
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "record", str(trace), "--model", "fake/model", "-o",
                                      str(tmp_path / "rec.jsonl"), "--max-num-seqs", "2"])
    assert run_guarded(app) == 0, capsys.readouterr().err
    recorded = load_trace(tmp_path / "rec.jsonl")
    assert recorded.meta.model == "fake/model" and len(recorded.calls) == 4
    out = tmp_path / "cmp.json"
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "validate", "vllm", str(trace), "--model", "fake/model",
                                      "--method", "normal,ngram", "--max-num-seqs", "4", "--clock", "wall",
                                      "--hardware", "h100-80g", "-o", str(out)])
    assert run_guarded(app) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [r["method"] for r in doc["methods"]] == ["normal", "ngram"]
    ngram = doc["methods"][1]
    assert ngram["calls_identical"] == ngram["calls"] == 4
    # The fake has no in-process scheduler: no step-level figures, and no claim that there are.
    assert ngram["engine_steps_vllm"] is None and ngram["verify_steps"] is None
    # Goodput: vLLM ran on a CPU, the simulation priced an H100: not compared, and the reason given.
    assert ngram["goodput"]["comparable"] is False and "cpu" in ngram["goodput"]["why_not"]
    # The simulation used the KV blocks and context the (fake) engine reported.
    from vllm.v1.engine.llm_engine import FAKE_MAX_MODEL_LEN, FAKE_NUM_GPU_BLOCKS

    assert ngram["engine_limits"] == {"num_kv_blocks": FAKE_NUM_GPU_BLOCKS, "max_model_len": FAKE_MAX_MODEL_LEN}
    assert "goodput not compared" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "validate", "vllm", str(trace), "--model", "m", "--method",
                                      "eagle3"])
    assert run_guarded(app) == 2
    assert "--eagle3-model" in capsys.readouterr().err


def test_a_method_the_built_runner_cannot_run_is_refused(fake_vllm, monkeypatch):
    from types import SimpleNamespace

    from agentspec_sim.validation.vllm_runner import MethodUnavailable, check_runner

    m = methods()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=False)))
    assert check_runner(m["ngram"], llm) == "v1"
    with pytest.raises(MethodUnavailable, match="Triton"):
        check_runner(m["ngram-v2"], llm)
    llm.llm_engine.vllm_config.use_v2_model_runner = True
    with pytest.raises(MethodUnavailable, match="V1 model runner"):
        check_runner(m["ngram"], llm)
    assert check_runner(m["normal"], llm) == "v2"
