"""The scheduler's lag behind a client (engine/scheduler.py): vLLM 0.33's async scheduling makes step t + 1 before
step t runs, and a client sends a query's next call only once it has read its predecessor's answer; the
front end's time (tokenization, hand-off, the answer's way back) is in TTFT and E2EL as a client measures them."""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest
from simhelpers import ConstantCost

from agentspec_sim import EngineConfig, simulate
from agentspec_sim.cost import build_cost_model
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload

STEP_S = 0.01


def _call(cid: str, query: str, seq: int, prompt: int, output: int, arrival: float | None = None) -> Call:
    rng = np.random.default_rng(zlib.crc32(cid.encode()))  # ids fixed per call, the same in every process
    return Call(id=cid, agent_id=0, query_id=query, seq=seq, prompt_tokens=rng.integers(1000, 9000, prompt),
                output_tokens=rng.integers(1000, 9000, output), arrival_s=arrival)


def _workload(*queries: tuple[Call, ...]) -> Workload:
    return Workload(meta=TraceMeta(tokenizer=None, vocab_size=10000),
                    queries=tuple(Query(agent_id=0, query_id=q[0].query_id, calls=q) for q in queries))


def _first_step(result, call_id: str) -> int:
    steps = result.steps
    return int(steps.filter(steps["call_id"] == call_id)["step"].min())


# A query of two calls (the second sent the instant the first's answer is read) beside a long call that keeps
# the engine busy: a finishes in step 2 (prefill + 2 decodes), so the scheduler has made step 3 (and, async, 4)
# before b reaches it.
CHAINED = _workload((_call("a", "q1", 0, 8, 3), _call("b", "q1", 1, 8, 2)), (_call("c", "q2", 0, 8, 30),))


@pytest.mark.parametrize(("async_scheduling", "in_process", "first"), [
    (True, False, 5),  # vLLM 0.33 behind a client: steps 3 and 4 made before b is read
    (False, False, 4),  # synchronous behind a client: step 3 made before b is read
    (False, True, 3),  # the validation harness: calls added between steps, b joins the next step
    (True, True, 4),  # async, calls added between steps: step 3 was made before step 2 ran
])
def test_a_successor_joins_the_step_after_those_the_scheduler_made_before_it_arrived(async_scheduling, in_process,
                                                                                       first):
    config = EngineConfig(arrival="zero", async_scheduling=async_scheduling, in_process_client=in_process,
                          enable_prefix_caching=False)
    result = simulate(CHAINED, "normal", config, cost_model=ConstantCost(STEP_S))
    assert _first_step(result, "a") == 0 and _first_step(result, "c") == 0
    assert _first_step(result, "b") == first


def test_the_default_follows_vllm_per_method():
    """None: async for no speculation and Model Runner V2 methods, synchronous for the V1 runner's CPU proposers."""
    config = EngineConfig(arrival="zero", enable_prefix_caching=False)
    normal = simulate(CHAINED, "normal", config, cost_model=ConstantCost(STEP_S))
    ngram = simulate(CHAINED, "ngram", config, cost_model=ConstantCost(STEP_S))
    assert _first_step(normal, "b") == 5
    assert _first_step(ngram, "b") == 4


def test_a_call_arriving_mid_step_waits_for_the_step_already_made():
    """c reaches the engine in the middle of step 1 (10–20 ms): async, step 2 was made before step 1 ran."""
    work = _workload((_call("a", "q1", 0, 8, 10, arrival=0.0),), (_call("c", "q2", 0, 8, 3, arrival=0.015),))
    firsts = {}
    for flag in (True, False):
        config = EngineConfig(arrival="recorded", async_scheduling=flag, enable_prefix_caching=False)
        firsts[flag] = _first_step(simulate(work, "normal", config, cost_model=ConstantCost(STEP_S)), "c")
    assert firsts == {True: 3, False: 2}


def test_an_idle_engine_takes_a_call_at_once():
    work = _workload((_call("a", "q1", 0, 8, 2, arrival=0.0),), (_call("c", "q2", 0, 8, 2, arrival=1.0),))
    config = EngineConfig(arrival="recorded", enable_prefix_caching=False)
    result = simulate(work, "normal", config, cost_model=ConstantCost(STEP_S))
    calls = result.calls.sort("call_id")
    c = calls.filter(calls["call_id"] == "c")
    assert c["first_token_s"][0] - c["arrival_s"][0] == pytest.approx(STEP_S)


def test_the_front_end_time_is_in_ttft_and_e2el_not_in_tpot():
    work = _workload((_call("a", "q1", 0, 100, 5), _call("b", "q1", 1, 400, 5)), (_call("c", "q2", 0, 300, 9),))
    config = EngineConfig(arrival="zero", hardware="h100-80g", model="qwen3-8b")
    cm = build_cost_model("h100-80g", "qwen3-8b", calibration="defaults")
    none = replace(cm.calibration, frontend_request_s=0.0, frontend_prompt_token_s=0.0)
    some = replace(cm.calibration, frontend_request_s=0.02, frontend_prompt_token_s=1e-5)
    runs = {}
    for name, cal in (("none", none), ("some", some)):
        runs[name] = simulate(work, "normal", config, cost_model=build_cost_model("h100-80g", "qwen3-8b",
                                                                                  calibration=cal))
    a, b = (r.calls.sort("call_id") for r in (runs["none"], runs["some"]))
    offset = 0.02 + 1e-5 * a["prompt_len"].to_numpy()
    # The engine is the same: only what the client sees moves.
    assert np.allclose(b["first_token_s"].to_numpy() - a["first_token_s"].to_numpy(), offset)
    assert np.allclose(b["finish_s"].to_numpy() - a["finish_s"].to_numpy(), offset)
    engine = [r.engine_steps["time_s"].to_numpy() for r in (runs["none"], runs["some"])]
    assert np.array_equal(*engine)
    qa, qb = (r.queries.sort("query_id") for r in (runs["none"], runs["some"]))
    last_prompt = np.array([400, 300])  # each query's last call: b (q1), c (q2)
    assert np.allclose(qb["latency_s"].to_numpy() - qa["latency_s"].to_numpy(), 0.02 + 1e-5 * last_prompt)


class _HostCost(ConstantCost):
    """ConstantCost whose synchronous steps wait 2 ms + 1 ms a call for the host."""

    def sync_host_time(self, batch_sizes: np.ndarray) -> np.ndarray:
        return 0.002 + 0.001 * np.asarray(batch_sizes, dtype=np.float64)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_synchronous_engine_waits_for_its_host_work_every_step(async_scheduling):
    """Without async scheduling the GPU idles while the core schedules, prepares inputs and reads the outputs: each
    step lasts its forward plus `sync_host_time` of its batch; async scheduling hides it under the forward."""
    config = EngineConfig(arrival="zero", async_scheduling=async_scheduling, enable_prefix_caching=False)
    steps = simulate(CHAINED, "normal", config, cost_model=_HostCost(STEP_S)).engine_steps.sort("step")
    start, forward, size = (steps[c].to_numpy() for c in ("time_s", "forward_s", "batch_size"))
    host = 0.0 if async_scheduling else 0.002 + 0.001 * size[:-1]
    assert np.allclose(np.diff(start), forward[:-1] + host)
    assert np.allclose(forward, STEP_S)  # the step's forward time is the GPU's alone


def test_the_roofline_prices_a_synchronous_steps_host_work_per_step_and_per_call():
    cm = build_cost_model("h100-80g", "qwen3-8b", calibration="defaults")
    cal = cm.calibration
    assert np.allclose(cm.sync_host_time(np.array([1, 64])),
                       cal.sync_host_step_s + cal.sync_host_call_s * np.array([1, 64]))
