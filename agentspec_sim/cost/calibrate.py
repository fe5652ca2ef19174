"""Fit the roofline's efficiency factors and overheads to measured step times (`calibrate cost`).

Input: steps as flat per-call rows (query_lens, context_lens, is_prefill with step offsets, the layout
of `RooflineCostModel.step_times`) and each step's measured forward time; optionally each step's
measured drafting time and how many calls drafted.

The forward fit is a bounded nonlinear least squares (scipy `least_squares`, trust-region
reflective) over the factors in `FORWARD_FACTORS`, on relative residuals predicted/measured − 1
(so a 1 ms decode step and a 100 ms prefill step weigh alike, and the objective tracks MAPE), with a
soft-L1 loss so a few outlier steps (a GC pause, a clock blip) do not drag the fit. `layer_overhead_s`
is not fitted (with one model it is indistinguishable from `step_overhead_s`), nor `combine_p`
(it trades off against the efficiencies). The model-free drafting cost is linear in the drafting
calls and fitted separately (`lsq_linear`, non-negative) when drafting times are given.

Steps are split into a fitted set and a held-out set (seeded); the report gives MAPE before
(starting calibration) and after, on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agentspec_sim.cost.profiles import HardwareProfile, ModelProfile, load_hardware, load_model, profile_mismatch
from agentspec_sim.cost.roofline import Calibration, RooflineCostModel

FORWARD_FACTORS = (
    "memory_efficiency", "compute_efficiency", "attention_bandwidth_efficiency", "attention_compute_efficiency",
    "step_overhead_s", "per_call_overhead_s",
)
DRAFT_FACTORS = ("model_free_draft_step_s", "model_free_draft_per_call_s")
# Efficiencies above 1 are allowed: they mean the profile's peak is below what the hardware reached
# (a spec sheet that undersells, or a measured CPU profile from a different kernel).
BOUNDS = {
    "memory_efficiency": (0.01, 2.0),
    "compute_efficiency": (0.01, 2.0),
    "attention_bandwidth_efficiency": (0.01, 2.0),
    "attention_compute_efficiency": (0.01, 2.0),
    "step_overhead_s": (0.0, 1.0),
    "per_call_overhead_s": (0.0, 0.01),
}


class CalibrationFitError(ValueError):
    """Measurements a fit cannot use (too few steps, non-positive times, mismatched lengths)."""


class ProfileMismatchError(CalibrationFitError):
    """Timings that record other hardware or another model than the profiles they are to be fitted against."""


@dataclass(frozen=True)
class StepTimings:
    """Measured steps: step k is rows offsets[k]:offsets[k + 1] of the call arrays.

    forward_s: each step's measured forward time; draft_s / drafting_calls (optional): its measured
    model-free drafting time and the number of calls that drafted in it. hardware / model (optional): what
    the times were measured on, as the input records it (`validate timing` does; a profile id or name).
    """

    offsets: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    is_prefill: np.ndarray
    forward_s: np.ndarray
    draft_s: np.ndarray | None = None
    drafting_calls: np.ndarray | None = None
    hardware: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        n = self.offsets.shape[0] - 1
        if n < 1 or int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.query_lens.shape[0]:
            raise CalibrationFitError("step offsets do not cover the call rows")
        if np.any(np.diff(self.offsets) < 1):
            raise CalibrationFitError("every step needs at least one call")
        if self.forward_s.shape[0] != n:
            raise CalibrationFitError(f"{self.forward_s.shape[0]} measured times for {n} steps")
        if not np.all(np.isfinite(self.forward_s)) or np.any(self.forward_s <= 0):
            raise CalibrationFitError("measured step times must be finite and > 0")

    @property
    def num_steps(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def subset(self, picks: np.ndarray) -> StepTimings:
        sizes = np.diff(self.offsets)[picks]
        rows = np.concatenate([np.arange(self.offsets[k], self.offsets[k + 1]) for k in picks])

        def take(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[picks]

        return StepTimings(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), self.query_lens[rows],
                           self.context_lens[rows], self.is_prefill[rows], self.forward_s[picks],
                           take(self.draft_s), take(self.drafting_calls), self.hardware, self.model)


@dataclass(frozen=True)
class CalibrationFit:
    """A fitted calibration and how well it predicts, before and after, fitted and held-out steps."""

    calibration: Calibration
    fitted: tuple[str, ...]
    num_train: int
    num_holdout: int
    mape_before_train: float
    mape_after_train: float
    mape_before_holdout: float | None
    mape_after_holdout: float | None
    draft_mape_before: float | None = None
    draft_mape_after: float | None = None
    start: Calibration = field(default_factory=Calibration)

    def to_dict(self) -> dict:
        return {
            "fitted": list(self.fitted),
            "factors": {name: getattr(self.calibration, name) for name in Calibration.factor_names()},
            "start": {name: getattr(self.start, name) for name in self.fitted},
            "num_train": self.num_train, "num_holdout": self.num_holdout,
            "mape_before_train": self.mape_before_train, "mape_after_train": self.mape_after_train,
            "mape_before_holdout": self.mape_before_holdout, "mape_after_holdout": self.mape_after_holdout,
            "draft_mape_before": self.draft_mape_before, "draft_mape_after": self.draft_mape_after,
        }


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    predicted, measured = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return float(np.mean(np.abs(predicted - measured) / measured) * 100.0)


def predict_forward(timings: StepTimings, hardware: HardwareProfile | str, model: ModelProfile | str,
                    calibration: Calibration, *, tensor_parallel_size: int = 1, kv_dtype_bytes: int = 2) -> np.ndarray:
    """The cost model's forward time for every step of `timings`."""
    cost = RooflineCostModel(hardware, model, tensor_parallel_size, calibration, kv_dtype_bytes=kv_dtype_bytes)
    return cost.step_times(timings.query_lens, timings.context_lens, timings.is_prefill, timings.offsets)


def split_holdout(num_steps: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, holdout) step indices: a seeded `fraction` of the steps held out, both sorted."""
    if not 0 <= fraction < 1:
        raise CalibrationFitError(f"holdout fraction must be in [0, 1), got {fraction}")
    held = round(num_steps * fraction)
    order = np.random.default_rng(seed).permutation(num_steps)
    return np.sort(order[held:]), np.sort(order[:held])


def fit_calibration(timings: StepTimings, hardware: HardwareProfile | str, model: ModelProfile | str, *,
                    start: Calibration | None = None, factors: tuple[str, ...] = FORWARD_FACTORS,
                    holdout: float = 0.25, seed: int = 0, tensor_parallel_size: int = 1, kv_dtype_bytes: int = 2,
                    loss: str = "soft_l1", source: str = "calibrate cost",
                    allow_profile_mismatch: bool = False) -> CalibrationFit:
    """Fit `factors` of the calibration to `timings` (see the module docstring); deterministic for a seed.

    start: the calibration the fit starts from and keeps for every factor it does not fit (default:
    the documented defaults). Needs at least len(factors) + 1 fitted steps. Timings that record the
    hardware and model they were measured on are fitted only against those profiles (ProfileMismatchError
    otherwise, unless `allow_profile_mismatch`): fitted against another device's peaks, CPU timings gave an
    A100 efficiencies of 2.0 and 1.43, numbers that describe neither.
    """
    hw, m = load_hardware(hardware), load_model(model)
    mismatch = profile_mismatch(timings.hardware, timings.model, hw, m)
    if mismatch and not allow_profile_mismatch:
        raise ProfileMismatchError(f"the timings were measured on {mismatch}: fit them against the profiles they "
                                   "were measured on (`validate timing` writes hardware.json and model.json beside "
                                   "them)")
    start = start or Calibration()
    unknown = [f for f in factors if f not in BOUNDS]
    if unknown:
        raise CalibrationFitError(f"cannot fit {', '.join(unknown)} (fittable: {', '.join(BOUNDS)})")
    train_idx, hold_idx = split_holdout(timings.num_steps, holdout, seed)
    if train_idx.shape[0] < len(factors) + 1:
        raise CalibrationFitError(f"{train_idx.shape[0]} fitted steps cannot determine {len(factors)} factors "
                                  f"(need ≥ {len(factors) + 1}; measure more steps or lower the held-out share)")
    train = timings.subset(train_idx)
    hold = timings.subset(hold_idx) if hold_idx.shape[0] else None

    def calibrated(x: np.ndarray) -> Calibration:
        return start.replace(**{name: float(v) for name, v in zip(factors, x, strict=True)}, source=source)

    def residuals(x: np.ndarray) -> np.ndarray:
        pred = predict_forward(train, hw, m, calibrated(x), tensor_parallel_size=tensor_parallel_size,
                               kv_dtype_bytes=kv_dtype_bytes)
        return pred / train.forward_s - 1.0

    from scipy.optimize import least_squares

    lo = np.array([BOUNDS[f][0] for f in factors])
    hi = np.array([BOUNDS[f][1] for f in factors])
    x0 = np.clip([getattr(start, f) for f in factors], lo, hi)
    # Overheads start off zero so the trust region can scale them; their size is ~1e-4 s.
    x0 = np.where((x0 == 0) & (hi < 1.5), np.minimum(hi, 1e-5), x0)
    scale = np.where(hi <= 1.0, 1e-4, 0.1)  # seconds vs efficiencies
    result = least_squares(residuals, x0, bounds=(lo, hi), x_scale=scale, loss=loss, f_scale=0.05,
                           xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=400 * len(factors))
    fitted = calibrated(result.x)

    def forward_mape(t: StepTimings | None, cal: Calibration) -> float | None:
        if t is None:
            return None
        return mape(predict_forward(t, hw, m, cal, tensor_parallel_size=tensor_parallel_size,
                                    kv_dtype_bytes=kv_dtype_bytes), t.forward_s)

    draft_before = draft_after = None
    names = tuple(factors)
    if timings.draft_s is not None and timings.drafting_calls is not None:
        drafted = (timings.drafting_calls > 0) & (timings.draft_s > 0)
        if int(drafted.sum()) >= 3:
            n, t = timings.drafting_calls[drafted].astype(np.float64), timings.draft_s[drafted]
            draft_before = mape(start.model_free_draft_step_s + start.model_free_draft_per_call_s * n, t)
            a, b = _fit_draft(n, t)
            fitted = fitted.replace(model_free_draft_step_s=a, model_free_draft_per_call_s=b)
            draft_after = mape(a + b * n, t)
            names += DRAFT_FACTORS
    return CalibrationFit(
        calibration=fitted, fitted=names, num_train=train.num_steps, num_holdout=0 if hold is None else hold.num_steps,
        mape_before_train=forward_mape(train, start), mape_after_train=forward_mape(train, fitted),
        mape_before_holdout=forward_mape(hold, start), mape_after_holdout=forward_mape(hold, fitted),
        draft_mape_before=draft_before, draft_mape_after=draft_after, start=start,
    )


def _fit_draft(calls: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """draft_s ≈ a + b·calls with a, b ≥ 0, in relative error (rows weighted by 1 / measured)."""
    from scipy.optimize import lsq_linear

    w = 1.0 / seconds
    design = np.column_stack([w, calls * w])
    solution = lsq_linear(design, np.ones_like(seconds), bounds=(0.0, np.inf))
    return float(solution.x[0]), float(solution.x[1])
