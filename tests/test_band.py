"""The uncertainty band of a model-based result (agentspec_sim/band.py): which configs have one, the two bound
configs, and the bound runs (same seed and engine; the high bound's acceptance above the low's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim import band
from agentspec_sim.drafters import model_based
from agentspec_sim.drafters.base import SpeculativeConfig
from agentspec_sim.drafters.model_based import ACCEPTANCE_DIR, AcceptanceParams
from agentspec_sim.engine.run import compare


def banded_file(path, shift: float = 0.5, method: str = "eagle3"):
    """The bundled Llama-3.1-8B EAGLE-3 parameters with a band: every position's logit ∓ `shift`."""
    body = json.loads((ACCEPTANCE_DIR / "eagle3.llama-3.1-8b.json").read_text())
    body["method"] = method
    body["band"] = {"low": {"positions": [a - shift for a in body["positions"]],
                            "coefficients": body["coefficients"]},
                    "high": {"positions": [a + shift for a in body["positions"]],
                             "coefficients": body["coefficients"]},
                    "source": f"test: ±{shift} in logit"}
    path.write_text(json.dumps(body))
    return path


def _spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 4, **kw})


def test_which_configs_have_a_band(tmp_path):
    path = banded_file(tmp_path / "p.json")
    assert band.has_band(_spec(acceptance_params=str(path)))
    assert band.has_band(_spec(acceptance_params=str(path)), model="qwen3-8b")  # the file wins over the model
    assert not band.has_band(_spec())  # no bundled file has a band (yet)
    assert not band.has_band(_spec(acceptance_params=str(path), acceptance_bound="low"))  # one end of it already
    ngram = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3})
    assert band.resolved_params(ngram) is None and not band.has_band(ngram) and band.bound_configs(ngram) is None


def test_the_band_is_looked_up_on_the_params_the_run_resolves(monkeypatch):
    """A run binds target_model from the engine's model: the engine's model picks the (banded) file."""
    plain = AcceptanceParams("eagle3", "default", (0.5,))
    banded = AcceptanceParams("eagle3", "qwen3-8b", (0.5,), band={"low": {"positions": [0.2]},
                                                                    "high": {"positions": [0.8]}})
    monkeypatch.setattr(model_based, "_bundled", lambda method: (plain, banded))
    spec = _spec()
    assert band.has_band(spec, model="qwen3-8b") and band.has_band(spec, model="Qwen/Qwen3-8B")
    assert not band.has_band(spec, model="llama-3.1-8b") and not band.has_band(spec)
    assert not band.has_band(_spec(target_model="llama-3.1-8b"), model="qwen3-8b")  # the config's own wins


def test_bound_configs_set_acceptance_bound_and_nothing_else(tmp_path):
    path = banded_file(tmp_path / "p.json")
    spec = SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 4, "seed": 7,
                                        "acceptance_params": str(path)}, label="mine")
    configs = band.bound_configs(spec)
    assert list(configs) == ["low", "high"]
    for bound, bounded in configs.items():
        assert bounded.to_json() == {**spec.to_json(), "acceptance_bound": bound}
        assert bounded.name == f"mine ({bound} bound)" and spec.option("acceptance_bound") is None
        assert model_based.resolve_params(bounded).positions == tuple(
            a + (0.5 if bound == "high" else -0.5) for a in model_based.resolve_params(spec).positions)
    with pytest.raises(ValueError, match="bound must be one of"):
        band.bound_config(spec, "mid")


def test_helpers_for_rows_and_text():
    assert band.COLUMNS == ("mean_acceptance_length_low", "mean_acceptance_length_high", "goodput_tok_s_low",
                            "goodput_tok_s_high", "speedup_low", "speedup_high")
    assert band.row_values({"speedup_low": 1.1, "speedup_high": 1.4}, "speedup") == [1.1, 1.4]
    assert band.row_values({"speedup_low": None, "speedup_high": 1.4}, "speedup") is None
    assert band.row_values({}, "speedup") is None  # results written before bands
    assert band.span([3.0, 2.0]) == (2.0, 3.0) and band.span(None) is None and band.span([1.0, None]) is None
    assert band.format_interval(3.123, [2.951, 3.304]) == "3.12 [2.95–3.30]"
    assert band.format_interval(1.5, [1.25, 1.75], ".3f", "×") == "1.500× [1.250–1.750×]"
    assert band.format_interval(3.1, None) == "3.10" and band.format_interval(None, [1, 2]) == "—"
    assert band.empty_columns() == dict.fromkeys(band.COLUMNS)
    assert band.empty_fields() == {"mean_acceptance_length_band": None, "goodput_tok_s_band": None,
                                   "speedup_band": None}


def _small_workload():
    rng = np.random.default_rng(5)
    return workload(*(agent_query(rng, f"q{i}", calls=3, prompt_len=30, out_len=40, vocab=20) for i in range(4)))


def test_bound_runs_bracket_the_point_run_and_are_deterministic(tmp_path):
    path = banded_file(tmp_path / "p.json")
    wl, cfg, cost = _small_workload(), config(), ConstantCost(step_s=0.01, per_token_s=1e-4)
    spec = _spec(acceptance_params=str(path))
    runs = compare(wl, [spec, "ngram"], cfg, cost)
    bands = band.run_bands(wl, runs, cfg, cost)
    assert bands[0] is None and bands[2] is None  # normal, ngram
    got = bands[1]
    point = runs[1][1]
    low, high = got.values("mean_acceptance_length")
    assert low < point.mean_acceptance_length < high
    assert got.low.drafter.endswith("(low bound)") and got.high.drafter.endswith("(high bound)")
    g_low, g_high = got.values("goodput_tok_s")
    assert g_low < point.goodput_tok_s < g_high
    s_low, s_high = got.values("speedup")  # against the same normal run
    assert s_low == pytest.approx(g_low / runs[0][1].goodput_tok_s)
    assert s_high == pytest.approx(g_high / runs[0][1].goodput_tok_s)
    assert got.fields()["speedup_band"] == [s_low, s_high]
    assert got.columns()["goodput_tok_s_high"] == g_high
    again = band.run_band(wl, spec, cfg, runs[0][0], cost)
    assert again.fields() == got.fields()
    assert band.run_band(wl, SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3}),
                         cfg, runs[0][0], cost) is None
