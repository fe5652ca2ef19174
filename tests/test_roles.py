"""Per-role draft caps: the offline role profile, the cap file, and the agspec drafter reading it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from simhelpers import ConstantCost, config
from test_agspec import FakeState

from agentspec_sim.analysis.roles import analyze_roles, role_profile, write_cap_file
from agentspec_sim.drafters.agspec.rule import AgSpecDrafter, RoleCaps, read_cap_file
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload


def _workload(seed: int = 0, queries: int = 3, calls: int = 4) -> Workload:
    """Two roles per query: a coder that copies long spans of its prompt, a planner that echoes two
    prompt tokens, adds the one after them, then writes novel text."""
    rng = np.random.default_rng(seed)
    out = []
    for q in range(queries):
        prompt = rng.integers(0, 5000, 300)
        qcalls = []
        for seq in range(calls):
            role = "coder" if seq % 2 == 0 else "planner"
            if role == "coder":
                parts = []
                for _ in range(3):
                    start = int(rng.integers(0, prompt.shape[0] - 40))
                    parts += [prompt[start:start + 30], rng.integers(5000, 9000, 2)]
                output = np.concatenate(parts)
            else:
                parts = []
                for _ in range(6):
                    start = int(rng.integers(0, prompt.shape[0] - 5))
                    parts += [prompt[start:start + 3], rng.integers(5000, 9000, 6)]
                output = np.concatenate(parts)
            call = Call(id=f"q{q}/{seq}", agent_id="a", query_id=f"q{q}", seq=seq,
                        prompt_tokens=prompt.astype(np.int32), output_tokens=output.astype(np.int32), role=role)
            qcalls.append(call)
            prompt = np.concatenate([prompt, output, rng.integers(0, 5000, 20)])
        out.append(Query("a", f"q{q}", tuple(qcalls)))
    return Workload(TraceMeta(tokenizer=None, vocab_size=9000), tuple(out))


SPEC = {"method": "agspec", "tokenizer": None}


def test_profile_gives_each_role_its_curve_and_cap():
    profile = role_profile(_workload(), SPEC, k_max=16, penalty=0.2)
    coder, planner = profile["roles"]["coder"], profile["roles"]["planner"]
    assert profile["caps"] == {"coder": coder["cap"], "planner": planner["cap"]}
    assert coder["cap"] >= 8 and planner["cap"] <= 2
    for role in (coder, planner):
        curve = role["curve"]
        assert len(curve["drafted"]) == len(curve["p_accept"]) == 16
        assert all(a <= d for a, d in zip(curve["accepted"], curve["drafted"], strict=True))
        assert all(x >= y for x, y in zip(curve["drafted"], curve["drafted"][1:], strict=False))  # P(d ≥ i) falls
        assert all(0.0 <= p <= 1.0 for p in curve["p_accept"])
        by_cap = role["by_cap"]
        objective = [a - 0.2 * d for a, d in zip(by_cap["accepted"], by_cap["drafted"], strict=True)]
        assert role["cap"] == int(np.argmax(np.round(objective, 6)))  # the smallest argmax
        assert by_cap["drafted"][0] == by_cap["accepted"][0] == 0  # cap 0: nothing drafted
    assert coder["curve"]["p_accept"][8] > planner["curve"]["p_accept"][8]
    assert profile["all"]["calls"] == coder["calls"] + planner["calls"] == 12
    assert profile["default"] == profile["all"]["cap"]


def test_penalty_trades_drafted_for_accepted_tokens():
    workload = _workload()
    free = role_profile(workload, SPEC, k_max=16, penalty=0.0)
    costly = role_profile(workload, SPEC, k_max=16, penalty=5.0)
    assert costly["caps"]["planner"] <= free["caps"]["planner"]
    assert costly["caps"]["coder"] <= free["caps"]["coder"]
    derived = role_profile(workload, SPEC, k_max=16)  # λ from the roofline cost model
    assert derived["penalty"] > 0 and "t_V/t_A" in derived["penalty_source"]
    with pytest.raises(ValueError, match="penalty"):
        role_profile(workload, SPEC, penalty=-1.0)
    with pytest.raises(ValueError, match="agspec"):
        role_profile(workload, {"method": "ngram", "num_speculative_tokens": 3})


def test_cap_file_round_trip_and_the_drafter_uses_it(tmp_path):
    workload = _workload()
    profile = role_profile(workload, SPEC, k_max=16, penalty=0.2)
    path = write_cap_file(tmp_path / "caps.json", profile)
    assert json.loads(path.read_text())["roles"]["coder"]["curve"]["p_accept"] == \
        profile["roles"]["coder"]["curve"]["p_accept"]
    caps = read_cap_file(path)
    assert caps == RoleCaps(profile["caps"], profile["default"])
    drafter = AgSpecDrafter(parse_drafter({**SPEC, "role_caps": str(path)}))
    for role, want in (("coder", profile["caps"]["coder"]), ("planner", profile["caps"]["planner"]),
                       (None, profile["default"]), ("reviewer", profile["default"])):
        call = replace(workload.queries[0].calls[0], role=role)
        state = FakeState(call)
        drafter.start_call(state)
        assert state.drafter_state.ctl.ceiling == min(want, 16)
    small_k = AgSpecDrafter(parse_drafter({**SPEC, "role_caps": str(path), "num_speculative_tokens": 3}))
    state = FakeState(workload.queries[0].calls[0])
    small_k.start_call(state)
    assert state.drafter_state.ctl.ceiling == min(3, profile["caps"]["coder"])  # k bounds every cap
    (tmp_path / "bad.json").write_text('{"version": 1, "caps": {"coder": -1}}')
    with pytest.raises(SpecConfigError, match="caps"):
        parse_drafter({**SPEC, "role_caps": str(tmp_path / "bad.json")})


def test_replay_agrees_with_the_engine():
    """The profile's walk at cap k is what the engine's run of the drafter accepts (no token-budget cuts)."""
    import agentspec_sim

    workload = _workload(seed=1, queries=2, calls=4)
    profile = role_profile(workload, SPEC, k_max=16, penalty=0.0)
    result = agentspec_sim.simulate(workload, SPEC, config(max_num_batched_tokens=4096, max_num_seqs=4),
                                    cost_model=ConstantCost())
    calls = result.calls
    assert int(calls["accepted"].sum()) == profile["all"]["by_cap"]["accepted"][16]
    assert int(calls["drafted"].sum()) == profile["all"]["by_cap"]["drafted"][16]


def test_analyze_roles_writes_the_cap_file(tmp_path):
    out = tmp_path / "roles.json"
    doc = analyze_roles(None, out, max_queries=1, penalty=0.05, k_max=8)
    assert doc["output"] == str(out) and doc["queries"] == 1 and doc["k_max"] == 8
    assert set(doc["caps"]) == {"coder"}  # the bundled coding-agent trace has one role
    assert read_cap_file(out) == RoleCaps(doc["caps"], doc["default"])


def test_analyze_roles_cli(tmp_path):
    """`agentspec-sim analyze roles` (skipped until the command is registered in cli/analyze.py)."""
    from typer.testing import CliRunner

    from agentspec_sim.cli import analyze as analyze_cli
    from agentspec_sim.cli.app import app
    from agentspec_sim.trace.bundled import bundled_trace

    if "roles" not in {c.name or c.callback.__name__ for c in analyze_cli.analyze.registered_commands}:
        pytest.skip("analyze roles is not wired into cli/analyze.py yet")
    out = tmp_path / "caps.json"
    result = CliRunner().invoke(app, ["analyze", "roles", str(bundled_trace("reflexion.jsonl.zst")), "-o", str(out),
                                      "--max-queries", "40", "--penalty", "0.1"])
    assert result.exit_code == 0, result.output
    caps = read_cap_file(out)
    assert set(caps.caps) == {"generator", "reflector"}
