"""`eagle3` / `mtp`: the seeded acceptance model (determinism, always-k drafts, the drawn prefix is
the true continuation, features equal the calibration's, bundled files reproduce their targets)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from simhelpers import ConstantCost, call, workload

from agentspec_sim.drafters.common.structure import token_bytes_of
from agentspec_sim.drafters.model.calibrate import replay_drafter
from agentspec_sim.drafters.model.rule import (
    ACCEPTANCE_DIR,
    AcceptanceParams,
    CopyIndex,
    accepted_prefix,
    available_params,
    bind_engine_context,
    call_key,
    copy_stream,
    load_params,
    uniform_draw,
)
from agentspec_sim.drafters.model.streams import MT_BENCH_CATEGORIES, build_streams, call_features, sample_steps
from agentspec_sim.drafters.registry import make_drafter, speculative_config
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.engine.request import CallState
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace


@pytest.fixture(scope="module")
def spec_bench():
    return load_trace(bundled_trace("spec-bench.jsonl.zst"))


@pytest.fixture(scope="module")
def mt_bench(spec_bench):
    return [c for c in spec_bench.calls if (c.extra or {}).get("category") in MT_BENCH_CATEGORIES]


def _spec(**kw):
    return speculative_config({"method": "eagle3", "num_speculative_tokens": 4, **kw})


def _state(c, index=0):
    """A CallState right after prefill: the first output token emitted."""
    st = CallState(index, c, c.id, 0, index, c.output_len)
    st.history[c.prompt_len] = c.output_tokens[0]
    st.num_emitted = 1
    return st


def _advance(drafter, st, emitted):
    pos = st.prompt_len + st.num_emitted
    st.history[pos:pos + emitted] = st.call.output_tokens[st.num_emitted:st.num_emitted + emitted]
    st.num_emitted += emitted
    drafter.observe(st, st.history[pos:pos + emitted])


# ---- bundled parameter files ---------------------------------------------------------------------

def test_bundled_files_exist_with_sources():
    names = sorted(p.name for p in ACCEPTANCE_DIR.glob("*.json"))
    for name in ("eagle3.llama-3.1-8b.json", "eagle3.gpt-oss-20b.json", "eagle3.qwen3-8b.json",
                 "eagle3.default.json", "mtp.mimo-7b.json", "mtp.default.json"):
        assert name in names
    for path in ACCEPTANCE_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        params = AcceptanceParams.from_json(data, str(path))
        assert path.name == f"{params.method}.{params.model}.json"
        if "report" in params.calibration:  # fitted to measured per-step data, with its report and band
            assert params.source and {"positions", "coefficients", "data"} <= set(params.sources)
            assert params.has_band and params.calibration["held_out"] and params.calibration["train"]
            assert {r["split"] for r in params.calibration["report"]} == {"train", "held-out"}
        else:  # solved for published per-position figures; the band borrowed from the measured fit, and says so
            assert params.source and {"positions", "coefficients", "targets"} <= set(params.sources)
            assert len(params.calibration["targets_cumulative"]) == len(params.positions)
            assert params.has_band and params.band["source"].startswith("ASSUMPTION")
            assert params.band["ratio"] == load_params("eagle3", "llama-3.1-8b").band["ratio"]


def test_eagle3_files_rest_on_the_measured_llama_fit_and_say_so():
    llama, qwen, default = (load_params("eagle3", m) for m in ("llama-3.1-8b", "qwen3-8b", "default"))
    assert llama.source.startswith("MEASURED") and qwen.source.startswith("ASSUMPTION")
    assert llama.positions == qwen.positions == default.positions and llama.band == qwen.band
    assert llama.calibration["train"] == ["gsm8k", "sharegpt"]
    assert llama.calibration["held_out"] == ["cnn", "instructcoder"]
    lo, hi = (np.asarray(llama.with_bound(b).positions) for b in ("low", "high"))
    assert np.all(lo < np.asarray(llama.positions)) and np.all(np.asarray(llama.positions) < hi)


def test_parameter_file_selection_by_model_alias_and_default():
    assert load_params("eagle3", "llama-3.1-8b").model == "llama-3.1-8b"
    assert load_params("eagle3", "meta-llama/Llama-3.1-8B-Instruct").model == "llama-3.1-8b"
    assert load_params("eagle3", "openai/gpt-oss-20b").model == "gpt-oss-20b"
    assert load_params("eagle3", "some-unknown-model").model == "default"
    assert load_params("mtp", "XiaomiMiMo/MiMo-7B-RL").model == "mimo-7b"
    assert load_params("mtp").model == "default"
    assert "qwen3-8b" in available_params("eagle3")


# Each bundled file: (method, model, k of the check, the target positions checked at that k).
TARGET_CHECKS = [
    ("eagle3", "gpt-oss-20b", 5, slice(0, 5)),
    ("mtp", "default", 7, slice(0, 7)),
    ("mtp", "mimo-7b", 1, slice(0, 1)),  # MiMo's headline figure: ~90% at k = 1
    ("mtp", "mimo-7b", 7, slice(1, 7)),
]


@pytest.mark.parametrize(("method", "model", "k", "positions"), TARGET_CHECKS,
                         ids=[f"{m}.{mo}.k{k}" for m, mo, k, _ in TARGET_CHECKS])
def test_replay_reproduces_the_calibration_targets_within_3_percent(mt_bench, method, model, k, positions):
    targets = np.asarray(load_params(method, model).calibration["targets_cumulative"])
    replay = replay_drafter(mt_bench, {"method": method, "num_speculative_tokens": k, "target_model": model})
    assert replay.steps > 5000
    got = replay.rates[positions]
    want = targets[positions]
    assert np.abs(got - want).max() <= 0.03, (got.round(4), want)


def test_named_public_figures(mt_bench):
    oss = replay_drafter(mt_bench, {"method": "eagle3", "num_speculative_tokens": 5, "target_model": "gpt-oss-20b"})
    assert np.abs(oss.rates - [0.622, 0.356, 0.203, 0.119, 0.060]).max() < 0.03
    deepseek = replay_drafter(mt_bench, {"method": "mtp", "num_speculative_tokens": 7})
    assert abs(deepseek.mean_acceptance_length - 3.20) < 0.1


# ---- the draft itself --------------------------------------------------------------------------

def test_always_k_tokens_and_the_accepted_prefix_is_the_continuation(spec_bench):
    drafter = make_drafter(_spec())
    rng = np.random.default_rng(3)
    checked = rejected = 0
    for c in spec_bench.calls[:60]:
        st = _state(c)
        drafter.start_call(st)
        drafter.observe(st, st.history[c.prompt_len:c.prompt_len + 1])
        while st.num_emitted < st.target_len:
            k = int(rng.integers(1, 9))
            draft = drafter.propose([st], np.array([k]))[0]
            assert draft.shape == (k,) and draft.dtype == np.int32
            cont = c.output_tokens[st.num_emitted:st.num_emitted + k]
            cs = st.drafter_state
            a = accepted_prefix(drafter._a, drafter._b_copy, drafter._b_code, cs.index.window(st.tokens, cont),
                                cs.code(), cs.key, st.num_emitted, k)
            assert np.array_equal(draft[:a], cont[:a])
            if a < cont.shape[0] and a < k:
                assert draft[a] != cont[a]  # the first rejected slot is guaranteed wrong
                rejected += 1
            checked += 1
            _advance(drafter, st, min(a + 1, st.target_len - st.num_emitted))
        drafter.finish_call(st)
        assert st.drafter_state is None
    assert checked > 1000 and rejected > 100


def test_draws_are_counter_based():
    key = np.uint64(call_key(0, "spec-bench/81/0"))
    u = [uniform_draw(key, n, i) for n in range(50) for i in range(8)]
    assert all(0.0 <= x < 1.0 for x in u) and len(set(u)) == len(u)
    assert uniform_draw(key, 7, 3) == uniform_draw(np.uint64(call_key(0, "spec-bench/81/0")), 7, 3)
    assert call_key(0, "a") != call_key(1, "a") and call_key(0, "a") != call_key(0, "b")
    assert 0.45 < float(np.mean(u)) < 0.55


def test_same_seed_same_drafts_whatever_the_batch_order(spec_bench):
    calls = spec_bench.calls[:12]

    def run(order_seed: int, spec) -> dict[str, list[tuple[int, tuple[int, ...]]]]:
        drafter = make_drafter(spec)
        states = [_state(c, i) for i, c in enumerate(calls)]
        for st in states:
            drafter.start_call(st)
            drafter.observe(st, st.history[st.prompt_len:st.prompt_len + 1])
        log: dict[str, list] = {c.id: [] for c in calls}
        rng = np.random.default_rng(order_seed)
        live = list(states)
        while live:
            batch = [live[i] for i in rng.permutation(len(live))[:int(rng.integers(1, len(live) + 1))]]
            drafts = drafter.propose(batch, np.full(len(batch), 5))
            for st, d in zip(batch, drafts, strict=True):
                log[st.call.id].append((st.num_emitted, tuple(d.tolist())))
                cont = st.call.output_tokens[st.num_emitted:st.num_emitted + 5]
                m = min(5, cont.shape[0])
                a = m if np.array_equal(d[:m], cont[:m]) else int(np.argmin(d[:m] == cont[:m]))
                _advance(drafter, st, min(a + 1, st.target_len - st.num_emitted))
            live = [st for st in live if st.num_emitted < st.target_len]
        return log

    spec = _spec(seed=11)
    first = run(0, spec)
    assert run(1, spec) == first == run(2, spec)
    assert run(0, _spec(seed=12)) != first


def test_engine_runs_are_identical_per_call_whatever_the_batching():
    rng = np.random.default_rng(0)
    calls = []
    for i in range(6):
        prompt = rng.integers(0, 60, 50).tolist()
        out = (prompt[5:17] * 6)[:60] + rng.integers(0, 60, 20).tolist()
        calls.append([call(f"c{i}", prompt, out, query=f"q{i}")])
    w = workload(*calls)
    spec = {"method": "eagle3", "num_speculative_tokens": 4, "tokenizer": None, "seed": 5}

    def per_call(max_num_seqs: int):
        from agentspec_sim import simulate

        result = simulate(w, spec, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                                max_model_len=4096, num_kv_blocks=400), ConstantCost())
        steps = result.steps.filter(result.steps["phase"] == "decode").sort("step")
        assert (steps["drafted"] == 4).all()  # EAGLE always drafts k (no budget or length limit here)
        return {cid: list(zip(g["position"].to_list(), g["accepted"].to_list(), strict=True))
                for (cid,), g in steps.group_by("call_id")}

    assert per_call(1) == per_call(8)


def test_code_tables_are_segmented_once_per_workload(tmp_path, monkeypatch, spec_bench):
    """The engine's code(n) tables come from the disk cache on a second run of the same workload (each
    sweep cell), equal to segmenting again and to the per-call features; other outputs segment afresh."""
    from agentspec_sim.drafters.model.rule import ModelBasedDrafter

    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path))
    coding = [c for c in spec_bench.calls if (c.extra or {}).get("category") == "coding"][:8]
    arena = np.concatenate([np.concatenate([c.prompt_tokens, c.output_tokens]) for c in coding]).astype(np.int32)
    lens = np.array([c.prompt_len + c.output_len for c in coding], dtype=np.int64)
    hist_off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    prompt_len = np.array([c.prompt_len for c in coding], dtype=np.int64)
    target_len = np.array([c.output_len for c in coding], dtype=np.int64)
    segmented = []
    segment = ModelBasedDrafter._segment_code
    monkeypatch.setattr(ModelBasedDrafter, "_segment_code", lambda *a: segmented.append(1) or segment(*a))
    drafter = make_drafter(_spec())
    first = drafter._code_tables(arena, hist_off, prompt_len, target_len, coding)
    again = drafter._code_tables(arena, hist_off, prompt_len, target_len, coding)
    assert len(segmented) == 1
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    table = token_bytes_of("qwen3")
    for i, c in enumerate(coding):  # what the per-call features say
        _, code = call_features(c, table)
        assert np.array_equal(first[0][first[1][i]:first[1][i] + c.output_len], code)
    assert int(first[0].sum()) > 100
    cut = drafter._code_tables(arena, hist_off, prompt_len, target_len - 1, coding)  # outputs cut: afresh
    assert len(segmented) == 2 and cut[0].shape[0] == first[0].shape[0] - len(coding)


# ---- features: the drafter's online values equal the calibration's offline ones -------------------

def test_copy_window_equals_the_one_pass_stream_on_real_calls():
    w = load_trace(bundled_trace("default.jsonl.zst"))
    rng = np.random.default_rng(1)
    for c in [w.calls[int(i)] for i in rng.choice(len(w.calls), 25, replace=False)]:
        full = np.concatenate([c.prompt_tokens, c.output_tokens]).astype(np.int32)
        ref = np.zeros(c.output_len, dtype=np.int8)
        copy_stream(full, c.prompt_len, ref)
        index = CopyIndex(16)  # tiny on purpose: exercises the growth path
        n = c.prompt_len + 1
        while n < full.shape[0]:
            k = int(rng.integers(1, 9))
            got = index.window(full[:n], full[n:n + k])
            assert np.array_equal(got, ref[n - c.prompt_len:n - c.prompt_len + got.shape[0]]), (c.id, n)
            n += int(rng.integers(1, k + 1))


def test_copy_feature_definition_small_example():
    # output position p copies when the trigram ending at p−1 occurred before, followed by tokens[p].
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 4, 1, 2, 3, 5], dtype=np.int32)
    out = np.zeros(tokens.shape[0] - 5, dtype=np.int8)
    copy_stream(tokens, 5, out)
    #            p=5 6  7  8  9  10 11 12
    assert out.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]  # p=12: [1,2,3] last seen at 6..8, followed by 4, not 5


def test_code_feature_follows_the_structure_automaton(spec_bench):
    table = token_bytes_of("qwen3")
    coding = [c for c in spec_bench.calls if (c.extra or {}).get("category") == "coding"][:6]
    drafter = make_drafter(_spec())
    for c in coding:
        _, code = call_features(c, table)
        st = _state(c)
        drafter.start_call(st)
        drafter.observe(st, st.history[c.prompt_len:c.prompt_len + 1])
        while st.num_emitted < st.target_len:
            assert st.drafter_state.code() == code[st.num_emitted], (c.id, st.num_emitted)
            _advance(drafter, st, min(3, st.target_len - st.num_emitted))
    assert sum(int(call_features(c, table)[1].sum()) for c in coding) > 100  # fences do occur


def test_sampler_is_the_drafter_process(mt_bench):
    calls = mt_bench[:40]
    params = load_params("eagle3", "gpt-oss-20b")
    sampled = sample_steps(build_streams(calls), params, 5, seed=0)
    replay = replay_drafter(calls, {"method": "eagle3", "num_speculative_tokens": 5, "target_model": "gpt-oss-20b"})
    for a, b in zip(sampled, replay.accepted, strict=True):
        assert np.array_equal(a, b)


# ---- config and cost ---------------------------------------------------------------------------

def test_config_keys_follow_vllm():
    spec = speculative_config({"method": "eagle3", "num_speculative_tokens": 3,
                                        "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"})
    assert spec.num_speculative_tokens == 3 and dict(spec.options) == {}
    with pytest.raises(SpecConfigError, match="num_speculative_tokens"):
        speculative_config({"method": "mtp"})
    with pytest.raises(SpecConfigError, match="unknown key"):
        speculative_config({"method": "eagle3", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    with pytest.raises(SpecConfigError, match="seed"):
        speculative_config({"method": "eagle3", "num_speculative_tokens": 3, "seed": "x"})
    sched = speculative_config({"method": "mtp", "num_speculative_tokens": 3,
                                         "num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 256, 1]]})
    assert sched.num_speculative_tokens_per_batch_size == ((1, 8, 3), (9, 256, 1))


def test_acceptance_params_option_and_engine_binding(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"method": "eagle3", "model": "mine", "positions": [9.0],
                                "coefficients": {"copy": 0.0, "code": 0.0}}))
    drafter = make_drafter(_spec(acceptance_params=str(path)))
    assert drafter.params.model == "mine"
    with pytest.raises(SpecConfigError, match="for method 'eagle3'"):
        speculative_config({"method": "mtp", "num_speculative_tokens": 1, "acceptance_params": str(path)})
    bound = bind_engine_context(_spec(), model="gpt-oss-20b", seed=3, tokenizer=None)
    assert dict(bound.options) == {"target_model": "gpt-oss-20b", "seed": 3, "tokenizer": None}
    assert make_drafter(bound).params.model == "gpt-oss-20b"
    kept = bind_engine_context(_spec(target_model="llama-3.1-8b"), model="gpt-oss-20b")
    assert dict(kept.options)["target_model"] == "llama-3.1-8b"
    ngram = speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert bind_engine_context(ngram, model="qwen3-8b", seed=1) is ngram


def test_acceptance_bound_selects_the_band_parameter_sets(tmp_path):
    path = tmp_path / "p.json"
    body = {"method": "eagle3", "model": "mine", "positions": [0.5], "coefficients": {"copy": 0.2},
            "band": {"low": {"positions": [0.1], "coefficients": {"copy": 0.1}},
                     "high": {"positions": [0.9, 0.8], "coefficients": {"copy": 0.3}}, "source": "test"}}
    path.write_text(json.dumps(body))
    assert make_drafter(_spec(acceptance_params=str(path))).params.positions == (0.5,)
    low = make_drafter(_spec(acceptance_params=str(path), acceptance_bound="low")).params
    high = make_drafter(_spec(acceptance_params=str(path), acceptance_bound="high")).params
    assert (low.positions, low.coefficient("copy")) == ((0.1,), 0.1)
    assert (high.positions, high.coefficient("copy")) == ((0.9, 0.8), 0.3) and not high.band
    with pytest.raises(SpecConfigError, match="acceptance_bound must be one of low, high"):
        speculative_config({"method": "eagle3", "num_speculative_tokens": 1,
                                     "acceptance_params": str(path), "acceptance_bound": "mid"})
    body.pop("band")
    path.write_text(json.dumps(body))
    with pytest.raises(SpecConfigError, match="no uncertainty band"):
        make_drafter(_spec(acceptance_params=str(path), acceptance_bound="low"))
    body["band"] = {"low": {"positions": []}, "high": {"positions": [1.0]}}
    path.write_text(json.dumps(body))
    with pytest.raises(SpecConfigError, match=r"band\.low\.positions"):
        speculative_config({"method": "eagle3", "num_speculative_tokens": 1, "acceptance_params": str(path)})


def test_draft_time_is_k_sequential_draft_passes():
    from agentspec_sim.cost import build_cost_model

    cost = build_cost_model(hardware="h100-80g", model="llama-3.1-8b")
    drafter = make_drafter(_spec())
    rows = [_state(c, i) for i, c in enumerate(load_trace(bundled_trace("spec-bench.jsonl.zst")).calls[:3])]
    lens = np.array([4, 4, 4])
    ctx = np.array([r.num_tokens for r in rows])
    assert drafter.draft_time(cost, rows, lens) == pytest.approx(cost.draft_model_time(3, 4, ctx, kind="eagle3"))
    assert drafter.draft_time(cost, rows, lens) > drafter.draft_time(cost, rows[:1], lens[:1]) > 0
    assert drafter.draft_time(cost, [], np.zeros(0, dtype=np.int64)) == 0.0
    mtp = make_drafter(speculative_config({"method": "mtp", "num_speculative_tokens": 1}))
    mimo = build_cost_model(hardware="h100-80g", model="mimo-7b")
    assert mtp.draft_time(mimo, rows, np.array([1, 1, 1])) == pytest.approx(
        mimo.draft_model_time(3, 1, ctx, kind="mtp"))
    with pytest.raises(SpecConfigError, match="mtp"):
        mtp.draft_time(cost, rows, np.array([1, 1, 1]))  # Llama-3.1-8B has no MTP layer
    assert drafter.draft_time(ConstantCost(), rows, lens) == 0.0  # a cost model without draft kinds
