"""The uncertainty band of a model-based result (agentspec_sim/run/band.py): which configs have one, the two bound
configs, and the bound runs (same seed and engine; the high bound's acceptance above the low's)."""

from __future__ import annotations

import json
import re

import numpy as np
import polars as pl
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim.drafters.model import rule as model_based
from agentspec_sim.drafters.model.rule import ACCEPTANCE_DIR, AcceptanceParams
from agentspec_sim.drafters.registry import speculative_config
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.run import band
from agentspec_sim.run.simulation import compare


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


def _plain(tmp_path):
    """A parameter file without a band."""
    body = json.loads((ACCEPTANCE_DIR / "eagle3.llama-3.1-8b.json").read_text())
    body.pop("band")
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(body))
    return path


def _spec(**kw) -> SpeculativeConfig:
    return speculative_config({"method": "eagle3", "num_speculative_tokens": 4, **kw})


def test_which_configs_have_a_band(tmp_path):
    path = banded_file(tmp_path / "p.json")
    assert band.has_band(_spec(acceptance_params=str(path)))
    assert band.has_band(_spec(acceptance_params=str(path)), model="qwen3-8b")  # the file wins over the model
    assert band.has_band(_spec())  # the bundled default file has one
    assert not band.has_band(_spec(acceptance_params=str(_plain(tmp_path))))
    assert not band.has_band(_spec(acceptance_params=str(path), acceptance_bound="low"))  # one end of it already
    ngram = speculative_config({"method": "ngram", "num_speculative_tokens": 3})
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
    spec = speculative_config({"method": "eagle3", "num_speculative_tokens": 4, "seed": 7,
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
    # The point just outside its bound runs (scheduling noise larger than the acceptance change): the interval
    # shown spans all three runs, so a value never sits outside its own band.
    assert band.format_interval(1.110, [1.111, 1.122], ".3f", "×") == "1.110× [1.110–1.122×]"
    assert band.format_interval(1.130, [1.111, 1.122], ".3f", "×") == "1.130× [1.111–1.130×]"
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
    assert band.run_band(wl, speculative_config({"method": "ngram", "num_speculative_tokens": 3}),
                         cfg, runs[0][0], cost) is None


# ---- sweep, plan and report ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A banded eagle3 config and ngram at max_num_seqs 1 and 4 on a tiny trace (in this process, -j 1)."""
    from test_sweep import write_trace

    from agentspec_sim.sweep import run_sweep

    root = tmp_path_factory.mktemp("band-sweep")
    trace = write_trace(root / "tiny.jsonl", queries=3, calls=2, out_len=24)
    # ±1 in logit: wide enough that goodput orders with acceptance on a trace this small
    params = banded_file(root / "p.json", 1.0)
    eagle = json.dumps({"method": "eagle3", "num_speculative_tokens": 3, "acceptance_params": str(params)})
    args = dict(drafters=["ngram"], speculative_configs=[eagle], max_num_seqs=[1, 4], jobs=1)
    frame = run_sweep(trace, output=root / "r.parquet", **args)
    return root, trace, args, frame


def _sans_wall(frame):
    return frame.drop("wall_s")


def test_sweep_records_the_bound_runs_as_columns(swept):
    _, _, _, frame = swept
    assert [c for c in frame.columns if c in band.COLUMNS] == list(band.COLUMNS)
    assert frame.columns.index("speedup_high") < frame.columns.index("engine_config")
    eagle = frame.filter(frame["drafter"].str.starts_with("eagle3"))
    others = frame.filter(~frame["drafter"].str.starts_with("eagle3"))
    assert eagle.height == 2 and others.select(band.COLUMNS).null_count().row(0) == (others.height,) * 6
    for row in eagle.iter_rows(named=True):
        assert row["mean_acceptance_length_low"] < row["mean_acceptance_length"] < row["mean_acceptance_length_high"]
        assert row["goodput_tok_s_low"] < row["goodput_tok_s"] < row["goodput_tok_s_high"]
        normal = frame.filter((frame["drafter"] == "normal") & (frame["max_num_seqs"] == row["max_num_seqs"]))
        assert row["speedup_low"] == pytest.approx(row["goodput_tok_s_low"] / normal["goodput_tok_s"][0])
        assert row["speedup_high"] == pytest.approx(row["goodput_tok_s_high"] / normal["goodput_tok_s"][0])


def test_sweep_no_band_and_resume_from_results_without_the_columns(swept, tmp_path):
    from agentspec_sim.sweep import read_results, run_sweep

    _, trace, args, frame = swept
    plain = run_sweep(trace, band=False, **args)
    assert plain.select(band.COLUMNS).null_count().row(0) == (plain.height,) * 6
    assert _sans_wall(plain.drop(band.COLUMNS)).equals(_sans_wall(frame.drop(band.COLUMNS)))
    # An old results file (no band columns): a resumed sweep reruns only the banded cells and ends as a fresh one.
    out = tmp_path / "old.parquet"
    frame.drop(band.COLUMNS).write_parquet(out)
    seen = []
    resumed = run_sweep(trace, output=out, resume=True, progress=lambda d, t, row: seen.append(row), **args)
    assert sorted(r["drafter"] for r in seen if r is not None) == [frame["drafter"][2]] * 2
    assert _sans_wall(resumed).equals(_sans_wall(frame)) and _sans_wall(read_results(out)).equals(_sans_wall(frame))
    # --no-band over a banded file: the band columns null, as a fresh --no-band sweep leaves them.
    resumed = run_sweep(trace, output=out, resume=True, band=False, **args)
    assert _sans_wall(resumed).equals(_sans_wall(plain))


def test_plan_names_the_drafters_within_a_band():
    from test_plan import constructed

    from agentspec_sim.sweep.plan import plan

    frame = constructed()  # results from before bands: every plan as before, no band
    (p,) = plan(frame)
    assert p.best.drafter == "ngram k=2" and p.band_overlaps == [] and p.band_note is None
    assert p.best.goodput_tok_s_band is None
    # ngram k=5 (320 tok/s at 4) gets a band reaching the chosen 340 tok/s; the chosen one's band reaches 300.
    def with_band(row):
        if row["drafter"] == "ngram k=5":
            g = row["goodput_tok_s"]
            return {**row, "goodput_tok_s_low": g - 30, "goodput_tok_s_high": g + 30, "speedup_low": 1.0,
                    "speedup_high": 1.2}
        return {**row, "goodput_tok_s_low": None, "goodput_tok_s_high": None, "speedup_low": None,
                "speedup_high": None}

    banded = pl.DataFrame([with_band(r) for r in frame.to_dicts()])
    (p,) = plan(banded)
    assert p.best.drafter == "ngram k=2" and p.band_overlaps == ["ngram k=5"]
    assert ("the chosen goodput (340 tok/s) lies inside ngram k=5's band at max_num_seqs 4 (290–350 tok/s)"
            in p.band_note)
    k5 = next(d for d in p.drafters if d.drafter == "ngram k=5")
    assert k5.best.goodput_tok_s_band == [290.0, 350.0] and k5.best.speedup_band == [1.0, 1.2]
    assert p.to_dict()["band_overlaps"] == ["ngram k=5"]
    narrow = banded.with_columns(pl.col("goodput_tok_s_high") - 20)
    assert plan(narrow)[0].band_overlaps == []


def test_report_shades_the_band_and_tables_show_it(swept, tmp_path):
    from agentspec_sim.report.build import write_report
    from agentspec_sim.report.results import load_results

    root, _, _, frame = swept
    results = load_results([root / "r.parquet"])
    report = write_report(results, tmp_path / "with")
    text = report.markdown.read_text()
    eagle = frame["drafter"][2]
    line = next(x for x in text.splitlines() if x.startswith(f"| {eagle} |"))
    assert re.search(r"\d\.\d\d× \[\d\.\d\d–\d\.\d\d×\]", line), line
    assert "uncertainty band" in text
    old = write_report(results.drop(band.COLUMNS), tmp_path / "without")  # results from before bands
    assert "uncertainty band" not in old.markdown.read_text()
    name = next(p.name for p in report.figures if p.name.startswith("speedup-"))
    assert (tmp_path / "with" / name).read_bytes() != (tmp_path / "without" / name).read_bytes()
    write_report(results, tmp_path / "again")
    assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "with" / name).read_bytes()
