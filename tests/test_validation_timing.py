"""validate timing on CPU: the torch forward on tiny configs, step shapes from a real run, outputs, the
polars-free launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.extra("torch")
torch = pytest.importorskip("torch")

from agentspec_sim.cost.profiles import load_model  # noqa: E402
from agentspec_sim.cost.roofline import Calibration  # noqa: E402
from agentspec_sim.validation.schedule import (  # noqa: E402
    SCHEDULE_DIR,
    ScheduleError,
    StepShapes,
    bundled_schedule,
    shapes_from_columns,
    step_kinds,
    stratified_sample,
)
from agentspec_sim.validation.timing import TimingConfig, run_timing, write_outputs  # noqa: E402
from agentspec_sim.validation.torch_model import ArchSpec, TimingModel, _attention_loop, profile_for  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from simhelpers import agent_query, config, workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_run_shapes() -> StepShapes:
    """Every engine step of a small ngram run: prefill chunks, decode and verify steps at batch 1-4."""
    from agentspec_sim import simulate

    rng = np.random.default_rng(0)
    wl = workload(*[agent_query(rng, f"q{i}", 2, prompt_len=60, out_len=12, vocab=8) for i in range(4)])
    steps = simulate(wl, "ngram", config(max_num_seqs=4, max_num_batched_tokens=32)).steps
    columns = {c: steps[c].to_numpy() for c in ("step", "phase", "context_len", "scheduled_tokens", "forward_s",
                                                "drafter")}
    return shapes_from_columns(columns, "small run")


def test_small_run_covers_decode_verify_and_prefill(small_run_shapes):
    kinds = set(step_kinds(small_run_shapes).tolist())
    assert kinds == {0, 1, 2}
    assert small_run_shapes.batch_sizes.max() == 4
    assert "forward_s" in small_run_shapes.times


@pytest.mark.parametrize("model", ["qwen3-8b", "gpt-oss-20b"])
def test_tiny_forward_runs_every_step_of_a_small_run(small_run_shapes, model):
    spec = ArchSpec.from_profile(load_model(model)).tiny()
    tm = TimingModel(spec)
    for k in range(len(small_run_shapes)):
        q, c, pf = small_run_shapes.step(k)
        inputs = tm.prepare(q, c, pf, seed=k)
        kv = tm.allocate_kv(inputs.total_k)
        tokens = tm.forward(inputs, kv)
        # one sampled token per decode/verify token, one per prefill chunk
        assert tokens.shape[0] == int(q[~pf].sum()) + int(pf.sum())
        assert int(tokens.min()) >= 0 and int(tokens.max()) < spec.vocab_size
        # the step's new K/V landed in the last query_len slots of each call's run
        written = inputs.slot_mapping.numpy()
        ends = np.cumsum(c + q)
        assert np.array_equal(written, np.concatenate([np.arange(e - qi, e) for e, qi in zip(ends, q, strict=True)]))


def _reference_attention(q, k, v, query_lens, context_lens, window):
    """Dense per-call attention in float64 with an explicit causal/window mask and repeated KV heads."""
    out, qo, ko = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for qn, cn in zip(query_lens, context_lens, strict=True):
        qi = q[qo:qo + qn].double()
        ki = k[ko:ko + cn + qn].double().repeat_interleave(group, dim=1)
        vi = v[ko:ko + cn + qn].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) / np.sqrt(q.shape[-1])
        pos = torch.arange(cn, cn + qn)[:, None]
        keys = torch.arange(cn + qn)[None, :]
        allowed = keys <= pos
        if window:
            allowed &= keys > pos - window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, vi))
        qo += qn
        ko += cn + qn
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 5])
def test_varlen_attention_matches_dense_reference(window):
    spec = ArchSpec("t", 32, 1, 4, 2, 8, 64, 100)
    tm = TimingModel(spec, dtype=torch.float32)
    q_lens, c_lens = np.array([1, 4, 7, 1]), np.array([9, 0, 3, 20])
    inputs = tm.prepare(q_lens, c_lens, np.array([False, False, True, False]))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(int(q_lens.sum()), 4, 8, generator=gen)
    k = torch.randn(inputs.total_k, 2, 8, generator=gen)
    v = torch.randn(inputs.total_k, 2, 8, generator=gen)
    got = _attention_loop(q, k, v, inputs, window)
    want = _reference_attention(q, k, v, q_lens.tolist(), c_lens.tolist(), window)
    assert torch.allclose(got.double(), want, atol=1e-5)


def _loop_as_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), **_):
    """A stand-in for FlashAttention's varlen kernel (CPU torch has none): the reference loop behind the
    kernel's calling convention (cu_seqlens, window_size = (left, right))."""
    from agentspec_sim.validation.torch_model import StepInputs

    q_lens = np.diff(cu_q.numpy()).tolist()
    c_lens = (np.diff(cu_k.numpy()) - np.array(q_lens)).tolist()
    inputs = StepInputs(q, q, q, cu_q, cu_k, q, q_lens, c_lens, max_q, max_k, int(cu_k[-1]))
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    return _attention_loop(q, k, v, inputs, window)


@pytest.mark.parametrize("has_gqa_flag", [True, False])
def test_varlen_adapter_passes_enable_gqa_only_where_the_kernel_takes_it(monkeypatch, has_gqa_flag):
    """torch 2.10-2.12's varlen_attn has no enable_gqa keyword (passing it raised TypeError, which sent a
    whole H200 run to the slow loop); 2.13 has it."""
    import torch.nn.attention.varlen as varlen

    from agentspec_sim.validation.torch_model import _varlen_attention

    seen = {}

    def with_flag(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        seen["enable_gqa"] = enable_gqa
        return "ran"

    def without_flag(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
        seen["enable_gqa"] = None
        return "ran"

    monkeypatch.setattr(varlen, "varlen_attn", with_flag if has_gqa_flag else without_flag)
    assert _varlen_attention()(1, 2, 3, 4, 5, 6, 7, window_size=(-1, 0)) == "ran"
    assert seen["enable_gqa"] is (True if has_gqa_flag else None)


def test_kernel_self_check_keeps_an_agreeing_kernel_and_drops_a_wrong_one(monkeypatch):
    import agentspec_sim.validation.torch_model as tmod

    spec = ArchSpec("t", 32, 1, 4, 2, 8, 64, 100)
    monkeypatch.setattr(tmod, "_varlen_attention", lambda: _loop_as_kernel)
    tm = TimingModel(spec, dtype=torch.float32)
    tm.device = torch.device("cpu")
    tm._varlen, tm.attention_fallback = _loop_as_kernel, None
    tm._check_varlen()
    assert tm._varlen is _loop_as_kernel and tm.attention_fallback is None

    def ignores_window(*args, window_size=(-1, -1), **kw):  # a kernel that drops the sliding window
        return _loop_as_kernel(*args, window_size=(-1, 0), **kw)

    tm._varlen = ignores_window
    tm._check_varlen()
    assert tm._varlen is None and "window 4" in tm.attention_fallback

    def refuses(*args, **kw):
        raise TypeError("varlen_attn() got an unexpected keyword argument 'enable_gqa'")

    tm._varlen, tm.attention_fallback = refuses, None
    tm._check_varlen()
    assert tm._varlen is None and "TypeError" in tm.attention_fallback and "enable_gqa" in tm.attention_fallback


def test_moe_grouped_gemm_matches_expert_loop():
    spec = ArchSpec.from_profile(load_model("gpt-oss-20b")).tiny()
    tm = TimingModel(spec, dtype=torch.float32)
    x = torch.randn(11, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    grouped = tm._moe(x, tm.layers[0])
    tm._grouped_mm = False
    looped = tm._moe(x, tm.layers[0])
    assert torch.allclose(grouped, looped, atol=1e-5)


def test_profile_for_prices_what_runs():
    spec = ArchSpec.from_profile(load_model("gpt-oss-20b"))
    profile = profile_for(spec, 2)
    assert profile.expert_bytes_per_param == 2.0  # bf16 experts run, not MXFP4
    assert profile.num_experts == 32 and profile.num_sliding_layers == 12
    assert profile.layer_active_params() == load_model("gpt-oss-20b").layer_active_params()


def test_run_timing_writes_every_output(small_run_shapes, tmp_path):
    shapes = stratified_sample(small_run_shapes, 12)
    result = run_timing(shapes, TimingConfig(model="qwen3-8b", warmup=0, repeats=1), holdout=0.25)
    assert result.measured_s.shape == (12,) and np.all(result.measured_s > 0)
    assert np.all(result.predicted_s > 0) and not result.graphed.any()
    assert result.fit is not None and result.fit.num_train == 9
    paths = write_outputs(result, tmp_path)
    for role in ("steps", "calls", "hardware", "model", "summary", "calibration", "scatter"):
        assert paths[role].stat().st_size > 0, role
    cal = Calibration.from_file(paths["calibration"])  # what replay --calibration reads
    assert cal.memory_efficiency == result.fit.calibration.memory_efficiency
    summary = json.loads(paths["summary"].read_text())
    assert summary["steps"] == 12 and sum(r["steps"] for r in summary["per_batch_size"]) == 12
    from agentspec_sim.validation.schedule import read_step_log

    back = read_step_log(paths["calls"])  # the calls table is a step log with measured_s
    assert np.array_equal(back.query_lens, shapes.query_lens)
    assert np.allclose(back.times["measured_s"], result.measured_s)


def test_stratified_sample_covers_every_stratum_and_is_seeded(small_run_shapes):
    a = stratified_sample(small_run_shapes, 10, seed=3)
    b = stratified_sample(small_run_shapes, 10, seed=3)
    assert np.array_equal(a.step_ids, b.step_ids) and np.all(np.diff(a.step_ids) > 0)
    from agentspec_sim.validation.schedule import bucket_of

    strata = set(zip(bucket_of(small_run_shapes.batch_sizes).tolist(), step_kinds(small_run_shapes).tolist(),
                     strict=True))
    got = set(zip(bucket_of(a.batch_sizes).tolist(), step_kinds(a).tolist(), strict=True))
    assert len(strata) <= 10 and got == strata


def test_schedule_file_roundtrip(small_run_shapes, tmp_path):
    path = tmp_path / "s.json.gz"
    small_run_shapes.to_file(path, note="x")
    back = StepShapes.from_file(path)
    assert np.array_equal(back.offsets, small_run_shapes.offsets)
    assert np.array_equal(back.context_lens, small_run_shapes.context_lens)
    assert np.array_equal(back.is_prefill, small_run_shapes.is_prefill)
    assert back.meta["note"] == "x"
    path2 = tmp_path / "t.json.gz"
    back.to_file(path2)
    small_run_shapes.to_file(path)
    assert path.read_bytes() != b"" and StepShapes.from_file(path2).meta["note"] == "x"


@pytest.mark.parametrize("model", ["qwen3-8b", "gpt-oss-20b"])
def test_bundled_schedules_reach_the_max_batch(model):
    for seqs in (1, 32, 256):
        shapes = StepShapes.from_file(bundled_schedule(model, seqs))
        assert len(shapes) == 48 and shapes.meta["max_num_seqs"] == seqs
        assert shapes.batch_sizes.max() <= seqs
        assert shapes.batch_sizes.max() >= seqs // 2  # the sample reaches the top bucket
        assert set(step_kinds(shapes).tolist()) == {0, 1, 2}  # decode, verify and prefill steps
    assert len(list(SCHEDULE_DIR.glob("*.json.gz"))) == 6


def test_step_log_errors_name_the_row():
    cols = {"step": np.array([0, 0, 1]), "phase": np.array(["prefill", "decoding", "decode"]),
            "context_len": np.array([0, 3, 4]), "scheduled_tokens": np.array([5, 1, 1])}
    with pytest.raises(ScheduleError, match="row 1: phase"):
        shapes_from_columns(cols, "log.parquet")
    cols["phase"] = np.array(["prefill", "decode", "decode"])
    del cols["scheduled_tokens"]
    with pytest.raises(ScheduleError, match=r"log\.parquet: column 'scheduled_tokens' missing"):
        shapes_from_columns(cols, "log.parquet")


def test_multi_run_log_picks_one_drafter():
    cols = {"step": np.array([0, 1, 0, 1, 1]), "phase": np.array(["decode"] * 5),
            "context_len": np.array([1, 2, 1, 2, 3]), "scheduled_tokens": np.array([1, 1, 1, 3, 2]),
            "drafter": np.array(["normal", "normal", "ngram", "ngram", "ngram"])}
    assert shapes_from_columns(cols).batch_sizes.tolist() == [1, 2]  # the last run: ngram
    assert shapes_from_columns(cols, drafter="normal").batch_sizes.tolist() == [1, 1]
    with pytest.raises(ScheduleError, match="not in the log"):
        shapes_from_columns(cols, drafter="suffix")


_NO_POLARS = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "polars" or name.startswith("polars."):
            raise ModuleNotFoundError("No module named 'polars' (blocked by the test)")
        return None
sys.meta_path.insert(0, _Block())
sys.path.insert(0, {validation!r})
import launch
rc = launch.main({argv!r})
loaded = [m for m in sys.modules if m == "polars" or m.startswith(("agentspec_sim.engine", "agentspec_sim.trace"))]
assert not loaded, loaded
print("LAUNCH-OK", rc)
"""


def test_launcher_runs_from_the_source_tree_without_polars(tmp_path):
    import importlib.util

    fmt = "parquet" if importlib.util.find_spec("pyarrow") else "csv"  # parquet without polars needs pyarrow
    argv = ["timing", str(bundled_schedule("gpt-oss-20b", 32)), "--model", "gpt-oss-20b", "--tiny", "--device", "cpu",
            "--steps", "2", "--repeats", "1", "--out", str(tmp_path / "out"), "--table-format", fmt]
    code = _NO_POLARS.format(validation=str(ROOT / "validation"), argv=argv)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Run from an empty folder so nothing but the launcher's bootstrap can supply agentspec_sim's source.
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LAUNCH-OK 0" in proc.stdout
    out = tmp_path / "out"
    assert (out / f"timing.{fmt}").exists() and (out / "scatter.png").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_validate_timing_cli(small_run_shapes, tmp_path, monkeypatch, capsys):
    from agentspec_sim.cli.app import app
    from agentspec_sim.cli.errors import run_guarded

    small_run_shapes.to_file(tmp_path / "s.json")
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "validate", "timing", str(tmp_path / "s.json"), "--sample", "6",
                                      "--repeats", "1", "--warmup", "0", "-o", str(tmp_path / "o"), "--json"])
    assert run_guarded(app) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == 6 and doc["device"] == "cpu" and doc["model"] == "qwen3-8b-tiny"
    assert Path(doc["files"]["calls"]).exists()
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "validate", "timing", str(tmp_path / "nope.json"),
                                      "-o", str(tmp_path / "o2")])
    assert run_guarded(app) == 2
    err = capsys.readouterr().err
    assert "nope.json" in err and "Traceback" not in err
