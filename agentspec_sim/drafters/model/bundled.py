"""The parameter files bundled in drafters/model/acceptance/, rebuilt from their sources: `regenerate_measured`
from SpecDecode-Bench's measured per-step vLLM data, `regenerate_bundled` from the published per-position
figures (`PUBLIC_TARGETS`, sources in each entry) and the Spec-Bench answers (docs/model-based-drafters.md)."""


from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------
# The bundled parameter files
from agentspec_sim.drafters.model.calibrate import (
    FitResult,
    _ratio_band,
    calibrate_specdecode_bench,
    fit_steps,
    fit_targets,
    model_rates,
)
from agentspec_sim.drafters.model.observations import load_spec_bench
from agentspec_sim.drafters.model.rule import (
    ACCEPTANCE_DIR,
    FEATURES,
    AcceptanceParams,
    load_params,
)
from agentspec_sim.drafters.model.streams import REFERENCE_STREAM, Streams, reference_streams, workload_streams
from agentspec_sim.io.atomic import write_json_atomic
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace


def _constant_tail(first: float, total: float, k: int) -> list[float]:
    """Cumulative rates P(≥ i+1) = first · r^i, i < k, with Σ = total (r by bisection)."""
    lo, hi = 1e-6, 1.0 - 1e-9
    for _ in range(200):
        r = 0.5 * (lo + hi)
        s = first * sum(r**i for i in range(k))
        lo, hi = (r, hi) if s < total else (lo, r)
    r = 0.5 * (lo + hi)
    return [first * r**i for i in range(k)]


def _deepseek_targets() -> list[float]:
    # DeepSeek-V3 MTP reused autoregressively, k = 7, length 3.20 at T = 0 → Σ P(≥ i+1) = 2.20, with
    # the second token (first draft) accepted 85–90% (midpoint 0.875) and a constant conditional rate after.
    return _constant_tail(0.875, 2.20, 7)


def _mimo_targets() -> list[float]:
    # MiMo-7B: one MTP layer, ~90% acceptance at k = 1; deeper slots reuse the layer (vLLM warns of
    # lower acceptance) and take DeepSeek-V3's conditional decay (assumption, see the file's sources).
    ds = _deepseek_targets()
    r = ds[1] / ds[0]
    return [0.90 * r**i for i in range(7)]


# A small same-family draft model (vLLM's draft_model method): per-token acceptance ALPHA at every position.
DRAFT_MODEL_ALPHA = 0.7


def _draft_model_targets() -> list[float]:
    return [DRAFT_MODEL_ALPHA ** (i + 1) for i in range(7)]


PUBLIC_TARGETS: dict[tuple[str, str], dict[str, Any]] = {
    ("eagle3", "gpt-oss-20b"): {
        "targets": lambda: [0.622, 0.356, 0.203, 0.119, 0.060],
        "aliases": ["openai/gpt-oss-20b", "gpt-oss-120b", "openai/gpt-oss-120b"],
        "source": "EAGLE-3 on gpt-oss, k=5, vLLM per-position acceptance 0.622 / 0.356 / 0.203 / 0.119 / 0.060 "
                  "(mean acceptance length 2.36), as collected in VLLM-NOTES 'Public acceptance figures'; the "
                  "prompt set is not stated, so the MT-Bench reference stream stands in. Positions >= 5 reuse "
                  "the last intercept (conditional ~0.50).",
    },
    ("mtp", "mimo-7b"): {
        "targets": _mimo_targets,
        "ks": [1, 7, 7, 7, 7, 7, 7],
        "aliases": ["XiaomiMiMo/MiMo-7B-RL", "XiaomiMiMo/MiMo-7B-Base", "mimo-7b-rl"],
        "source": "MiMo-7B (one MTP layer, num_nextn_predict_layers = 1): ~90% acceptance at k=1 (MiMo report; "
                  "recommended k=1); the first target is matched at k=1. Slots >= 1 reuse the single layer "
                  "autoregressively; their conditional acceptance is ASSUMED equal to DeepSeek-V3's (see "
                  "mtp.default.json): P(>= i+1) = 0.90 r^i, matched at k=7.",
    },
    ("draft_model", "default"): {
        "targets": _draft_model_targets,
        "aliases": [],
        "source": "ASSUMPTION: no public per-position vLLM figures for a small same-family draft model (e.g. "
                  "Qwen3-0.6B drafting Qwen3-32B) were found. Speculative decoding's own measurements put the "
                  "per-token acceptance of a same-family draft 10-100x smaller at alpha 0.6-0.8 under greedy "
                  "decoding (Leviathan et al. 2023, Fast Inference from Transformers via Speculative Decoding, "
                  "Table 3: T5-small/base/large drafting T5-XXL); alpha = 0.7 is used at every position, "
                  "P(>= i+1) = 0.7^(i+1), k = 7 (mean acceptance length 2.14 at k = 7). Recalibrate with "
                  "`agentspec-sim calibrate acceptance` from per-step data of the pair you deploy.",
    },
    ("mtp", "default"): {
        "targets": _deepseek_targets,
        "aliases": ["deepseek-v3", "deepseek-ai/DeepSeek-V3", "deepseek-r1", "deepseek-ai/DeepSeek-R1"],
        "source": "DeepSeek-V3 MTP (DeepSeek-V3 technical report): second-token acceptance 85-90% (0.875 used); "
                  "reused autoregressively with k=7 at temperature 0, mean acceptance length 3.20 (as collected "
                  "in VLLM-NOTES). Shape: P(>= 1) = 0.875, then a constant conditional rate r fitted so that "
                  "1 + sum P(>= i+1) = 3.20.",
    },
}

SPEC_BENCH_EAGLE = "spec-bench/model_answer/vicuna-7b-v1.3-eagle-float16-temperature-0.0.jsonl"

# The EAGLE-3 files fitted to measured per-step vLLM data: SpecDecode-Bench/simulator (commit 2fdccbd),
# data/llama3.1-8B/combined_<dataset>.jsonl, Llama-3.1-8B-Instruct with its EAGLE-3 head on an H100, k = 20.
# The fit sees gsm8k and sharegpt only; instructcoder and cnn are the held-out evaluation.
SPECDECODE_BENCH_TRAIN = ("gsm8k", "sharegpt")
SPECDECODE_BENCH_HELD_OUT = ("instructcoder", "cnn")
SPECDECODE_BENCH = "SpecDecode-Bench/simulator (commit 2fdccbd) data/llama3.1-8B"
MEASURED_FITS: dict[tuple[str, str], dict[str, Any]] = {
    ("eagle3", "llama-3.1-8b"): {
        "aliases": ["meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"],
        "draft_model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "source": "MEASURED: Llama-3.1-8B-Instruct with its EAGLE-3 head on an H100 in vLLM, per-step accepted "
                  f"lengths at every output position ({SPECDECODE_BENCH}), k = 20; fitted on gsm8k and "
                  "sharegpt, instructcoder and cnn held out (docs/model-based-drafters.md).",
    },
    ("eagle3", "default"): {
        "aliases": [],
        "source": "default for EAGLE-3 heads without a file of their own: the Llama-3.1-8B-Instruct EAGLE-3 fit to "
                  f"measured per-step vLLM data ({SPECDECODE_BENCH}; gsm8k + sharegpt, k = 20), the one EAGLE-3 "
                  "head with public per-step data.",
    },
    ("eagle3", "qwen3-8b"): {
        "aliases": ["Qwen/Qwen3-8B", "RedHatAI/Qwen3-8B-speculator.eagle3", "AngelSlim/Qwen3-8B_eagle3"],
        "source": "ASSUMPTION: no public per-step vLLM data for an EAGLE-3 head on Qwen3-8B was found; this file "
                  "reuses the Llama-3.1-8B-Instruct EAGLE-3 fit to measured per-step vLLM data "
                  f"({SPECDECODE_BENCH}; gsm8k + sharegpt, k = 20): same one-layer head architecture and training "
                  "recipe (SpecForge configs/qwen3-8b-eagle3.json). Published Qwen3-8B heads report MT-Bench "
                  "acceptance lengths from 1.97 (AngelSlim/Qwen3-8B_eagle3 on vLLM, k unstated); recalibrate with "
                  "`agentspec-sim calibrate acceptance` when per-step data for the head you deploy is available.",
    },
}


def regenerate_measured(specdecode_bench_dir: str | Path, out_dir: str | Path = ACCEPTANCE_DIR) -> list[Path]:
    """Rewrite the `MEASURED_FITS` files (atomically) from SpecDecode-Bench's Llama-3.1-8B files in
    `specdecode_bench_dir`: per-position intercepts by maximum likelihood on the training datasets, every
    step at its output position, feature coefficients held at zero (see docs/model-based-drafters.md:
    on this data the copy feature, fitted, makes the training walk worse, and code has no tokenizer),
    the per-dataset band, and the fit report (training and held-out) in `calibration`."""
    paths = [Path(specdecode_bench_dir) / f"combined_{d}.jsonl" for d in (*SPECDECODE_BENCH_TRAIN,
                                                                        *SPECDECODE_BENCH_HELD_OUT)]
    zero = {f: 0.0 for f in FEATURES}
    result, rows, _ = calibrate_specdecode_bench(paths, method="eagle3", model="llama-3.1-8b", k=20,
                                                 train=SPECDECODE_BENCH_TRAIN, coefficients=zero)
    fit = result.params
    written = []
    for (method, model), entry in MEASURED_FITS.items():
        params = replace(
            fit, model=model, positions=tuple(round(a, 6) for a in fit.positions), source=entry["source"],
            sources={**fit.sources, "data": f"{SPECDECODE_BENCH}: " + ", ".join(p.name for p in paths)},
            aliases=tuple(entry["aliases"]), draft_model=entry.get("draft_model"),
            calibration={**fit.calibration, "report": [r.to_json() for r in rows],
                         "regenerate": "agentspec_sim.drafters.model.bundled.regenerate_measured(<SpecDecode-Bench "
                                       "data/llama3.1-8B>)"})
        path = Path(out_dir) / f"{method}.{model}.json"
        write_json_atomic(path, params.to_json())
        written.append(path)
    return written


def fit_coefficients(spec_bench_answers: str | Path) -> tuple[dict[str, float], FitResult]:
    """The feature coefficients every bundled file uses: fitted (with free intercepts, then discarded)
    on Spec-Bench's EAGLE answers, each turn tied to its own call of the bundled spec-bench trace."""
    observations = load_spec_bench(spec_bench_answers)
    k = max(int(o.drafted.max()) for o in observations)
    streams = workload_streams(load_trace(bundled_trace("spec-bench.jsonl.zst")))
    result = fit_steps(observations, streams, k, method="eagle", model="vicuna-7b-v1.3")
    return {f: round(result.params.coefficient(f), 4) for f in FEATURES}, result


def regenerate_bundled(spec_bench_answers: str | Path, out_dir: str | Path = ACCEPTANCE_DIR) -> list[Path]:
    """Rewrite every file of `PUBLIC_TARGETS` (atomically): coefficients from Spec-Bench, intercepts
    solved for the public per-position targets on the MT-Bench reference stream."""
    coefficients, coef_fit = fit_coefficients(spec_bench_answers)
    coef_source = (f"fitted by maximum likelihood on Spec-Bench EAGLE answers ({Path(spec_bench_answers).name}: "
                   f"Vicuna-7B v1.3, EAGLE-1 tree depth 5, greedy; {coef_fit.num_steps} steps, all 13 categories, "
                   "each turn tied to its call of traces/spec-bench.jsonl.zst); only the feature coefficients are "
                   "kept (the intercepts of that fit describe EAGLE-1 tree drafting, not this drafter)")
    stream = reference_streams()
    return [write_public_target(method, model, coefficients, coef_source, out_dir, stream)
            for method, model in PUBLIC_TARGETS]


def write_public_target(method: str, model: str, coefficients: dict[str, float], coef_source: str,
                        out_dir: str | Path = ACCEPTANCE_DIR, stream: Streams | None = None) -> Path:
    """Write one `PUBLIC_TARGETS` file (atomically): its intercepts solved for its targets on the MT-Bench reference
    stream with these feature coefficients (`regenerate_bundled` fits them on Spec-Bench; a new entry can take the
    bundled files' own). `stream`: the reference stream, when the caller has it loaded."""
    stream = stream if stream is not None else reference_streams()
    entry = PUBLIC_TARGETS[(method, model)]
    targets = [round(float(x), 6) for x in entry["targets"]()]
    ks = entry.get("ks") or [len(targets)] * len(targets)
    params = fit_targets(stream, targets, coefficients, method=method, model=model, ks=ks)
    rates = {k: model_rates(stream, params, k) for k in set(ks)}
    achieved = [rates[k][i] for i, k in enumerate(ks)]
    params = AcceptanceParams(
        method, model, tuple(round(a, 6) for a in params.positions), coefficients, source=entry["source"],
        sources={"positions": "solved (scipy least_squares) so that the model's cumulative per-position "
                              "acceptance on the reference stream equals the targets",
                 "coefficients": coef_source, "targets": entry["source"]},
        aliases=tuple(entry["aliases"]),
        calibration={"k": ks[-1], **({"k_per_target": ks} if len(set(ks)) > 1 else {}),
                     "targets_cumulative": targets,
                     "model_cumulative": [round(float(x), 4) for x in achieved],
                     "stream": REFERENCE_STREAM,
                     "regenerate":
                         "agentspec_sim.drafters.model.bundled.regenerate_bundled(<spec-bench answers>)"})
    params = replace(params, band=borrowed_band(params, stream, ks[-1]))
    path = Path(out_dir) / f"{method}.{model}.json"
    write_json_atomic(path, params.to_json())
    return path


def borrowed_band(params: AcceptanceParams, stream: Streams, k: int,
                  measured: AcceptanceParams | None = None) -> dict[str, Any]:
    """A band for a file solved for published figures, which has no error spread of its own: the measured
    EAGLE-3 fit's (`measured`, default the bundled Llama-3.1-8B file) observed / expected ratio quantiles,
    applied as a logit shift of every intercept that scales this file's expected mean acceptance length on
    `stream` at draft length k by each ratio. An assumption, and the band's source says so."""
    measured = measured or load_params("eagle3", "llama-3.1-8b")
    lo, hi = measured.band["ratio"]
    source = (f"ASSUMPTION: borrowed from the measured EAGLE-3 fit ({measured.model}: observed / expected mean "
              f"acceptance length {lo:.4f}–{hi:.4f} over samples of its training data); each bound shifts every "
              f"intercept by the δ that scales this file's expected length on the reference stream at k = {k} by "
              "that ratio. A file solved for one published figure has no error spread of its own; its real "
              "uncertainty is likely wider")
    return _ratio_band(params, stream, k, lo, hi, source)
