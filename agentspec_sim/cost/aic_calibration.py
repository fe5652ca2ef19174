"""Fit the roofline to AIConfigurator's measured vLLM kernels (`agentspec-sim calibrate aic`).

For one (hardware, model) pair: price a grid of the steps the simulator produces (`step_grid`: plain
decodes, verify steps with k ∈ {1, 3, 5, 8, 16}, prefill chunks after a cached prefix, and a prefill
chunk beside decodes) with `AicPricer`, hold out a seeded 30 % of each kind, and fit the cost model part
by part on the rest, each part against the kernels AIC prices for it:

  linear_s    ↔ AIC's dense GEMMs        memory_efficiency, compute_efficiency, combine_p
  moe_s       ↔ AIC's MoE kernels        moe_memory_efficiency, moe_compute_efficiency, moe_layer_floor_s
  attention_s ↔ AIC's attention kernels  attention_bandwidth_efficiency, attention_compute_efficiency,
                                         attention_layer_floor_s, attention_call_layer_s,
                                         prefill_attention_layer_floor_s, attention_query_layer_s
                                         (prefill_only_attention_layer_floor_s = 0: a step of prefill
                                         chunks only pays no decode-kernel floor, as AIC prices it)
  overhead_s  ↔ AIC's norms, activations, embedding: layer_overhead_s, layer_token_overhead_s

Part by part, because each part's factors then describe that part's kernels (the split `cost --json`
prints means something) and no part's error hides in another's. Residuals are relative (a 1 ms decode
and a 100 ms prefill weigh alike) with a soft-L1 loss. AIC has no host time, so the comparison leaves the
cost model's host terms (step_overhead_s, per_call_overhead_s) out; the fitted calibration keeps their
documented defaults. `ridge_tokens` is set from the fitted model: the tokens per step at which the
calibrated linear layers' FLOP time equals their weight-streaming time (M(b) = that − b).

Deterministic: the grid, the split (seeded) and the fit (trust-region, fixed starting point) are
fixed, so `calibrate aic --all` rewrites the bundled files byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentspec_sim.cost.aic import AicPrice, AicPricer, AicUnavailable
from agentspec_sim.cost.collectives import allreduce_curve
from agentspec_sim.cost.layout import SINGLE_GPU, Layout
from agentspec_sim.cost.profiles import kv_capacity_tokens, load_hardware, load_model
from agentspec_sim.cost.roofline import CALIBRATION_FORMAT, CALIBRATION_VERSION, Calibration, RooflineCostModel
from agentspec_sim.cost.shapes import KINDS, StepShape
from agentspec_sim.io.atomic import atomic_text

BUNDLED_DIR = Path(__file__).parent / "profiles" / "calibrations"
HOLDOUT_FRACTION = 0.3
SEED = 0
# vLLM's default max_num_batched_tokens on H100/H200 (`vllm serve`): no step the engine schedules is larger.
MAX_STEP_TOKENS = 8192

_GROUPS: dict[str, tuple[tuple[str, float, float], ...]] = {  # part → (factor, low, high)
    "weights": (("memory_efficiency", 0.05, 1.2), ("compute_efficiency", 0.05, 1.2), ("combine_p", 1.0, 8.0)),
    "moe": (("moe_memory_efficiency", 0.01, 1.2), ("moe_compute_efficiency", 0.01, 1.2),
            ("moe_layer_floor_s", 0.0, 1e-3), ("moe_combine_p", 1.0, 8.0), ("moe_routing_spread", 0.01, 1.0)),
    "attention": (("attention_bandwidth_efficiency", 0.05, 1.2), ("attention_compute_efficiency", 0.05, 1.2),
                  ("attention_layer_floor_s", 0.0, 2e-4), ("attention_call_layer_s", 0.0, 1e-6),
                  ("prefill_attention_layer_floor_s", 0.0, 2e-4), ("attention_query_layer_s", 0.0, 1e-6)),
    "other": (("layer_overhead_s", 0.0, 1e-3), ("layer_token_overhead_s", 0.0, 1e-6)),
    "communication": (("interconnect_efficiency", 0.02, 1.2), ("allreduce_latency_s", 0.0, 2e-4)),
}
_MEASURED_COLLECTIVES = (("collective_scale", 0.05, 20.0),)
_MLA_PREFILL = ("prefill_attention_compute_efficiency", 0.05, 1.2)
_PART_OF = {"weights": "linear_s", "moe": "moe_s", "attention": "attention_s", "other": "overhead_s",
            "communication": "communication_s"}
# Parts whose kernels AIC cuts elsewhere than the cost model, fitted once more together against their sum:
# DeepSeek's MLA block (AIC) holds the attention projections the cost model prices as linear layers, and its
# decode MoE kernel runs the shared expert the cost model counts with the dense weights.
_JOINT_MLA = ("weights", "attention", "moe")


def part_factors(part: str, hardware: str, layout: Layout, mla: bool = False) -> tuple[tuple[str, float, float], ...]:
    """The factors (name, low, high) fitted against a part's kernels: collectives on a measured all-reduce curve
    (cost/collectives.py) fit its one scale, elsewhere the link formula's two; an MLA model's attention also its
    prefill kernel's own compute efficiency (`Calibration.prefill_attention_compute_efficiency`)."""
    tp = layout.tensor_parallel_size
    measured = (tp > 1 and allreduce_curve(hardware, tp) is not None) or (
        layout.data_parallel_size > 1 and allreduce_curve(hardware, layout.gpus) is not None)
    if part == "communication" and measured:
        return _MEASURED_COLLECTIVES
    if part == "attention" and mla:
        return _GROUPS[part] + (_MLA_PREFILL,)
    return _GROUPS[part]


def step_grid(hardware: str, model: str, layout: Layout = SINGLE_GPU) -> list[StepShape]:
    """The shapes priced for one pair and layout: every shape whose KV fits the GPUs' cache (vLLM's sizing at
    the defaults, `kv_capacity_tokens`) and whose tokens fit one step (`MAX_STEP_TOKENS`)."""
    shapes = [StepShape.decode(b, c) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
              for c in (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)]
    shapes += [StepShape.verify(b, c, k) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
               for c in (512, 2048, 8192, 32768) for k in (1, 3, 5, 8, 16)]
    shapes += [StepShape.prefill(q, p) for q in (64, 256, 512, 1024, 2048, 4096, 8192) for p in (0, 2048, 8192, 32768)]
    shapes += [StepShape.mixed(b, c, q, p) for b in (1, 4, 16, 64, 128) for c in (1024, 8192)
               for q in (256, 1024, 2048) for p in (0, 4096)]
    capacity = kv_capacity_tokens(load_hardware(hardware), load_model(model),
                                  tp=layout.tensor_parallel_size, data_parallel_size=layout.data_parallel_size)
    return [s for s in shapes if s.kv_tokens <= capacity and s.num_tokens <= MAX_STEP_TOKENS]


def split_holdout(shapes: list[StepShape], fraction: float = HOLDOUT_FRACTION,
                  seed: int = SEED) -> tuple[list[int], list[int]]:
    """(fitted, held-out) indices: a seeded `fraction` of each kind held out, so every kind is tested."""
    rng = np.random.default_rng(seed)
    fit, held = [], []
    for kind in KINDS:
        idx = [i for i, s in enumerate(shapes) if s.kind == kind]
        order = rng.permutation(len(idx))
        cut = round(len(idx) * fraction)
        held += [idx[j] for j in order[:cut]]
        fit += [idx[j] for j in order[cut:]]
    return sorted(fit), sorted(held)


def gpu_only(calibration: Calibration) -> Calibration:
    """The calibration without the host's per-step and per-call time, which AIC's kernel prices do not hold."""
    return calibration.replace(step_overhead_s=0.0, per_call_overhead_s=0.0)


def model_parts(hardware: str, model: str, calibration: Calibration, shapes: list[StepShape],
                layout: Layout = SINGLE_GPU) -> dict[str, np.ndarray]:
    """The cost model's GPU time per part (and total) for each shape."""
    cost = RooflineCostModel(hardware, model, layout.tensor_parallel_size, gpu_only(calibration),
                             expert_parallel=layout.expert_parallel, data_parallel_size=layout.data_parallel_size)
    rows = [cost.step_time(s.batch_shape()) for s in shapes]
    out = {part: np.array([getattr(r, field) for r in rows]) for part, field in _PART_OF.items()}
    out["total"] = np.array([r.total_s for r in rows])
    return out


def aic_parts(prices: list[AicPrice]) -> dict[str, np.ndarray]:
    out = {part: np.array([getattr(p, part) for p in prices]) for part in _PART_OF}
    out["total"] = np.array([p.total for p in prices])
    return out


@dataclass(frozen=True)
class ErrorSummary:
    """|predicted / AIC − 1| over a set of shapes, overall and by kind (fractions, not percent)."""

    count: int
    median: float
    max: float
    worst: dict
    by_kind: dict[str, dict[str, float]]

    def to_dict(self) -> dict:
        return {"count": self.count, "median_abs_error": self.median, "max_abs_error": self.max,
                "worst_shape": self.worst, "by_kind": self.by_kind}


def summarize(shapes: list[StepShape], predicted: np.ndarray, measured: np.ndarray) -> ErrorSummary:
    err = np.abs(predicted / measured - 1.0)
    by_kind = {}
    for kind in KINDS:
        mask = np.array([s.kind == kind for s in shapes])
        if mask.any():
            by_kind[kind] = {"count": int(mask.sum()), "median_abs_error": float(np.median(err[mask])),
                             "max_abs_error": float(err[mask].max()),
                             "median_ratio": float(np.median(predicted[mask] / measured[mask]))}
    worst = int(np.argmax(err))
    return ErrorSummary(len(shapes), float(np.median(err)), float(err.max()),
                        {**shapes[worst].to_dict(), "ratio": float(predicted[worst] / measured[worst])}, by_kind)


@dataclass(frozen=True)
class AicFit:
    hardware: str
    model: str
    layout: Layout
    calibration: Calibration
    provenance: dict
    shapes: list[StepShape]
    prices: list[AicPrice]
    fitted_idx: list[int]
    held_idx: list[int]
    before: ErrorSummary      # held-out shapes, documented defaults
    after: ErrorSummary       # held-out shapes, fitted
    after_fitted: ErrorSummary

    def record(self) -> dict:
        """The bundled calibration file: factors, provenance, grid and the fit's error."""
        counts = {kind: sum(s.kind == kind for s in self.shapes) for kind in KINDS}
        return {
            "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "source": self.calibration.source,
            "hardware": self.hardware, "model": self.model,
            "provenance": {**self.provenance,
                           "grid": {"shapes": len(self.shapes), "by_kind": counts,
                                    "held_out": len(self.held_idx), "seed": SEED,
                                    "held_out_fraction": HOLDOUT_FRACTION,
                                    "max_step_tokens": MAX_STEP_TOKENS},
                           "fitted_parts": {part: [f for f, _, _ in part_factors(part, self.hardware, self.layout,
                                                                                  load_model(self.model).is_mla)]
                                            for part in _GROUPS
                                            if part != "communication" or self.layout.gpus > 1},
                           "host_terms": "step_overhead_s and per_call_overhead_s keep the documented defaults "
                                         "(AIC prices GPU kernels only)",
                           "ridge_tokens": "where the calibrated linear layers' FLOP time equals their "
                                           "weight-streaming time"},
            "fit": {"held_out_before": self.before.to_dict(), "held_out_after": self.after.to_dict(),
                    "fitted_after": self.after_fitted.to_dict()},
            "factors": {name: getattr(self.calibration, name) for name in Calibration.factor_names()},
        }


# A MoE price that falls by more than this as a decode's tokens rise is not physics (more tokens touch more experts
# and do more FLOPs): the fit that follows it says so.
MONOTONE_SLACK = 0.10


def moe_price_anomaly(shapes: list[StepShape], moe_s: np.ndarray) -> str | None:
    """Where AIC's MoE price of decode steps falls as their tokens rise at one context (beyond MONOTONE_SLACK): the
    largest such fall, in words; None where the price never falls."""
    worst: tuple[float, str] | None = None
    contexts = sorted({s.context for s in shapes if s.kind == "decode"})
    for context in contexts:
        row = sorted((s.batch, float(moe_s[i])) for i, s in enumerate(shapes)
                     if s.kind == "decode" and s.context == context)
        for j, (b_lo, t_lo) in enumerate(row):
            for b_hi, t_hi in row[j + 1:]:
                if t_lo > 0 and t_hi < t_lo * (1 - MONOTONE_SLACK):
                    fall = 1 - t_hi / t_lo
                    if worst is None or fall > worst[0]:
                        worst = (fall, f"AIC's MoE price of a decode falls as its batch grows "
                                       f"({t_lo * 1e3:.1f} ms at batch {b_lo}, {t_hi * 1e3:.1f} ms at batch {b_hi}; "
                                       f"context {context}): the fitted MoE factors follow a price that more tokens "
                                       "cannot lower")
    return None if worst is None else worst[1]


def fit_to_aic(hardware: str, model: str, layout: Layout = SINGLE_GPU, pricer: AicPricer | None = None) -> AicFit:
    """Price the grid with AIC and fit the calibration part by part (module docstring)."""
    from scipy.optimize import least_squares

    hw, m = load_hardware(hardware).id, load_model(model).id
    pricer = pricer or AicPricer(hw, m, layout)
    shapes = step_grid(hw, m, layout)
    if not shapes:
        raise AicUnavailable(f"{m}'s weights leave no KV cache on {layout.tensor_parallel_size}× {hw} "
                             "(vLLM's sizing at the defaults): no step to price")
    prices = [pricer.price(s) for s in shapes]
    fitted_idx, held_idx = split_holdout(shapes)
    measured = aic_parts(prices)
    train = [shapes[i] for i in fitted_idx]
    # AIC prices a step of prefill chunks with its context-attention kernel alone: no decode kernel's floor
    # (left free, the fit puts prefill_only_attention_layer_floor_s at its bound 0 on every covered pair).
    start = Calibration(prefill_only_attention_layer_floor_s=0.0)
    profile = load_model(m)
    is_moe = profile.is_moe
    if is_moe:
        start = start.replace(moe_memory_efficiency=start.memory_efficiency,
                              moe_compute_efficiency=start.compute_efficiency, moe_combine_p=start.combine_p)
    if profile.is_mla:
        start = start.replace(prefill_attention_compute_efficiency=start.attention_compute_efficiency)
    stages = [(part,) for part in _GROUPS if (part != "moe" or is_moe)
              and (part != "communication" or layout.gpus > 1)]
    if is_moe and layout.data_parallel_size > 1:
        # With attention data parallelism AIC prices the tokens' gather to the experts inside its MoE op (its
        # decode steps have no collective of their own): the experts and the collectives are fitted together.
        stages = [s for s in stages if s != ("communication",)]
        stages[stages.index(("moe",))] = ("moe", "communication")
    if profile.is_mla:
        joint = tuple(p for p in _JOINT_MLA if p != "moe" or is_moe)
        stages.append(joint + (("communication",) if is_moe and layout.data_parallel_size > 1 else ()))
    calibration = start
    for parts in stages:
        target = sum(measured[part][fitted_idx] for part in parts)
        group = [factor for part in parts for factor in part_factors(part, hw, layout, profile.is_mla)]
        names = [f for f, _, _ in group]
        lo = np.array([low for _, low, _ in group])
        hi = np.array([high for _, _, high in group])
        x0 = np.clip([getattr(calibration, f) for f in names], lo, hi)
        x0 = np.where(x0 == 0, hi * 0.01, x0)  # times start off zero so the trust region can scale them
        base = calibration

        def residuals(x: np.ndarray, names=names, parts=parts, target=target, base=base) -> np.ndarray:
            cal = base.replace(**{n: float(v) for n, v in zip(names, x, strict=True)})
            # overhead_s holds only the small kernels here: model_parts leaves the host terms out.
            ours = model_parts(hw, m, cal, train, layout)
            return sum(ours[part] for part in parts) / target - 1.0

        result = least_squares(residuals, x0, bounds=(lo, hi), x_scale=np.maximum(hi * 0.1, 1e-9),
                               loss="soft_l1", f_scale=0.02, xtol=1e-10, ftol=1e-10, gtol=1e-10,
                               max_nfev=200 * len(names))
        calibration = calibration.replace(**{n: float(v) for n, v in zip(names, result.x, strict=True)})

    probe = RooflineCostModel(hw, m, layout.tensor_parallel_size, calibration, expert_parallel=layout.expert_parallel,
                              data_parallel_size=layout.data_parallel_size)
    held = [shapes[i] for i in held_idx]
    after_held = summarize(held, model_parts(hw, m, calibration, held, layout)["total"],
                           measured["total"][held_idx])
    prov = pricer.provenance
    where = f"{prov['system']}, {prov['aic_model']}" + (f", {layout.flags()}" if layout.tag else "")
    source = (f"AIConfigurator {prov['aiconfigurator_core']} measured {prov['backend']} {prov['backend_version']} "
              f"kernels ({where}); held-out |error| median "
              f"{after_held.median:.1%}, max {after_held.max:.1%} over {after_held.count} shapes")
    anomaly = moe_price_anomaly(shapes, measured["moe"]) if is_moe else None
    if anomaly:
        source += f"; WARNING: {anomaly}"
        prov = {**prov, "warnings": [anomaly]}
    calibration = calibration.replace(ridge_tokens=round(probe.effective_ridge_tokens, 1), source=source)
    return AicFit(
        hardware=hw, model=m, layout=layout, calibration=calibration, provenance=prov, shapes=shapes,
        prices=prices, fitted_idx=fitted_idx, held_idx=held_idx,
        before=summarize(held, model_parts(hw, m, Calibration(), held, layout)["total"],
                         measured["total"][held_idx]),
        after=after_held,
        after_fitted=summarize(train, model_parts(hw, m, calibration, train, layout)["total"],
                               measured["total"][fitted_idx]),
    )


def bundled_path(hardware: str, model: str, directory: Path = BUNDLED_DIR, layout: Layout = SINGLE_GPU) -> Path:
    """<hardware>--<model>.json at one GPU, <hardware>--<model>--tp8-ep.json (etc.) for a parallel layout."""
    return directory / (f"{hardware}--{model}" + (f"--{layout.tag}" if layout.tag else "") + ".json")


def write_fit(fit: AicFit, directory: Path = BUNDLED_DIR) -> Path:
    path = bundled_path(fit.hardware, fit.model, directory, fit.layout)
    with atomic_text(path) as out:
        out.write(json.dumps(fit.record(), indent=2, ensure_ascii=False) + "\n")
    return path
