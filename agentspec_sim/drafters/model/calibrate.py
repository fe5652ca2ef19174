"""Fitting the acceptance model of the `eagle3` / `mtp` drafters (drafters/model/rule.py).

The model: a step that starts at output position t of a call drafts k tokens, and

    P(slot i accepted | slots < i accepted) = σ(a_i + b_copy·copy(t+i) + b_code·code(t)).

What this module does:

- **Feature streams** (`build_streams`): copy / code of every output position of some calls,
  computed exactly as the drafter computes them (`copy_stream`, `structure.segment`).
- **Exact expectations** (`expected_counts`): for one call, the number of steps and of steps with
  ≥ i+1 accepted drafts that the drafter's process produces *in expectation*, by a forward
  recursion over step-start positions (a step at t that accepts j < k moves to t + j + 1; the
  first token comes from prefill, so steps start at t = 1). This is what a replay measures, without
  sampling noise.
- **Sampling** (`sample_steps`): the same process with the drafter's counter-based draws (per-step
  accepted counts), for synthetic data and checks.
- **Fitting** by maximum likelihood on the per-position *conditional* acceptance
  (`fit_steps`): observations are per-step accepted lengths (vLLM's per-request
  `spec_decode_metrics` JSONL, or Spec-Bench's `accept_lengths`); each observed request is tied to a
  feature stream (its own call when the trace holds it, else a pooled reference stream); the
  conditional rate at position i is E[#steps accepting ≥ i+1] / E[#steps accepting ≥ i] of that
  stream, and each observed step that reached slot i is a Bernoulli trial of it.
  `fit_targets` solves the intercepts a_i for published per-position rates (least squares),
  with the feature coefficients held fixed.
- **Reports** (`group_report`): observed vs predicted per-position cumulative acceptance
  (vLLM's `num_accepted_tokens_per_pos / num_drafts`) and mean acceptance length per category.

The feature streams and the process are drafters/model/streams.py, the readers of measured data
drafters/model/observations.py, the bundled parameter files' regeneration drafters/model/bundled.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from agentspec_sim.drafters.model.observations import (
    SPECDECODE_BENCH_PROPOSERS,
    CalibrationError,
    Observation,
    load_spec_bench,
    load_specdecode_bench,
    load_vllm_metrics,
    looks_like_spec_bench,
    specdecode_bench_group,
)
from agentspec_sim.drafters.model.rule import (
    FEATURES,
    AcceptanceParams,
    load_params,
)
from agentspec_sim.drafters.model.streams import (
    REFERENCE_STREAM,
    Streams,
    build_streams,
    expected_counts,
    reference_streams,
    workload_streams,
)
from agentspec_sim.drafters.registry import make_drafter, parse_drafter
from agentspec_sim.engine.drafting import CallState, verify
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace
from agentspec_sim.trace.schema import Call, Workload

# --------------------------------------------------------------------------------------------
# Fitting


@njit(cache=True, nogil=True)
def _aligned_nll(copy, code, offsets, call, start, accepted, drafted, a, b_copy, b_code, grad):
    """−log-likelihood of aligned steps; its gradient (a_0.., b_copy, b_code) is added to `grad`."""
    last = a.shape[0] - 1
    total = 0.0
    for s in range(call.shape[0]):
        lo = offsets[call[s]]
        length = offsets[call[s] + 1] - lo
        t = start[s]
        m = min(drafted[s], length - t)
        acc = accepted[s]
        x_code = code[lo + t]
        for j in range(min(acc + 1, m)):
            x_copy = copy[lo + t + j]
            z = a[min(j, last)] + b_copy * x_copy + b_code * x_code
            p = 1.0 / (1.0 + math.exp(-z))
            if j < acc:
                total += math.log1p(math.exp(-z)) if z > -30 else -z  # −log σ(z)
                dz = p - 1.0
            else:
                total += math.log1p(math.exp(z)) if z < 30 else z  # −log(1 − σ(z))
                dz = p
            grad[min(j, last)] += dz
            grad[last + 1] += dz * x_copy
            grad[last + 2] += dz * x_code
    return total


@dataclass
class _Problem:
    """Observations bound to streams. Aggregated part: per stream key the summed (trials,
    successes) per position, the model's conditional rate from the walk over that key's calls
    (pooled calls share one key). Aligned part: every step at its known start in its call."""

    k: int
    streams: Streams  # the aggregated part's calls
    keys: np.ndarray  # per call of `streams`: its key
    num_keys: int
    trials: np.ndarray  # (num_keys, k)
    wins: np.ndarray
    aligned_streams: Streams | None = None
    step_call: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_drafted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_steps(self) -> int:
        return int(self.trials[:, 0].sum()) + int(self.step_call.shape[0]) if self.num_keys else \
            int(self.step_call.shape[0])

    def conditional(self, params: AcceptanceParams) -> np.ndarray:
        e = expected_counts(self.streams, params, self.k)
        pooled = np.zeros((self.num_keys, self.k + 1))
        np.add.at(pooled, self.keys, e)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = pooled[:, 1:] / pooled[:, :-1]
        return np.clip(np.nan_to_num(q, nan=0.5), 1e-9, 1 - 1e-9)

    def nll(self, params: AcceptanceParams) -> float:
        total = 0.0
        if self.num_keys:
            q = self.conditional(params)
            total -= float((self.wins * np.log(q) + (self.trials - self.wins) * np.log1p(-q)).sum())
        if self.aligned_streams is not None and self.step_call.shape[0]:
            total += self.aligned(params)[0]
        return total

    def aligned(self, params: AcceptanceParams) -> tuple[float, np.ndarray]:
        """The aligned part's −log-likelihood and its gradient in (a_0.., b_copy, b_code)."""
        grad = np.zeros(params.a.shape[0] + 2)
        st = self.aligned_streams
        if st is None or not self.step_call.shape[0]:
            return 0.0, grad
        value = _aligned_nll(st.copy, st.code, st.offsets, self.step_call, self.step_start, self.step_accepted,
                             self.step_drafted, params.a, params.coefficient("copy"), params.coefficient("code"),
                             grad)
        return value, grad


def bind(observations: Sequence[Observation], streams: Streams, k: int,
         reference: Streams | None = None) -> tuple[_Problem, list[int | None]]:
    """Tie each observation to its call's stream (by call id) or, failing that, to the pooled
    `reference` stream (default: `streams` pooled). Observations marked `aligned` whose steps tile
    their call's output exactly are fitted step by step (exact likelihood); the others through the
    walk's expected conditional rates. Returns the problem and each observation's aggregate key
    (None for an aligned one)."""
    index = streams.index()
    lengths = np.diff(streams.offsets)
    matched = [index.get(o.call_id) if o.call_id is not None else None for o in observations]
    starts: list[np.ndarray | None] = [
        o.positions(int(lengths[m])) if (m is not None and o.aligned) else None
        for o, m in zip(observations, matched, strict=True)]
    agg_calls = sorted({m for m, st in zip(matched, starts, strict=True) if m is not None and st is None})
    pooled_needed = any(m is None for m in matched)
    key_of_call = {c: i for i, c in enumerate(agg_calls)}
    parts = [streams.subset(agg_calls)] if agg_calls else []
    keys = list(range(len(agg_calls)))
    num_keys = len(agg_calls)
    pooled_key = None
    if pooled_needed:
        ref = reference if reference is not None else streams
        pooled_key = num_keys
        num_keys += 1
        parts.append(ref)
        keys.extend([pooled_key] * ref.num_calls)
    trials = np.zeros((num_keys, k))
    wins = np.zeros((num_keys, k))
    obs_keys: list[int | None] = []
    al_calls = sorted({m for m, st in zip(matched, starts, strict=True) if st is not None})
    al_index = {c: i for i, c in enumerate(al_calls)}
    step_parts: list[tuple[np.ndarray, ...]] = []
    for o, m, st in zip(observations, matched, starts, strict=True):
        if st is not None:
            n = st.shape[0]
            step_parts.append((np.full(n, al_index[m], dtype=np.int64), st, o.accepted, o.drafted))
            obs_keys.append(None)
            continue
        key = key_of_call[m] if m is not None else pooled_key
        t, w = o.conditional_counts(k)
        trials[key] += t
        wins[key] += w
        obs_keys.append(key)
    empty = Streams((), np.zeros(1, dtype=np.int64), np.zeros(0, np.int8), np.zeros(0, np.int8))
    problem = _Problem(k, _concat(parts) if parts else empty, np.asarray(keys, dtype=np.int64), num_keys,
                       trials, wins)
    if step_parts:
        problem.aligned_streams = streams.subset(al_calls)
        problem.step_call, problem.step_start, problem.step_accepted, problem.step_drafted = (
            np.concatenate([p[i] for p in step_parts]).astype(np.int64) for i in range(4))
    return problem, obs_keys


def _concat(parts: Sequence[Streams]) -> Streams:
    if len(parts) == 1:
        return parts[0]
    lens = np.concatenate([np.diff(p.offsets) for p in parts])
    return Streams(tuple(c for p in parts for c in p.call_ids), np.concatenate(([0], np.cumsum(lens))).astype(np.int64),
                   np.concatenate([p.copy for p in parts]), np.concatenate([p.code for p in parts]),
                   tuple(c for p in parts for c in (p.categories or (None,) * p.num_calls)))


@dataclass
class FitResult:
    params: AcceptanceParams
    nll: float
    num_steps: int
    fitted: tuple[str, ...]  # which parameters were free
    details: dict[str, Any] = field(default_factory=dict)


A_BOUNDS = (-8.0, 8.0)
B_BOUNDS = (-4.0, 4.0)


def fit_steps(observations: Sequence[Observation], streams: Streams, k: int, *, method: str = "eagle3",
              model: str = "custom", coefficients: Mapping[str, float] | None = None,
              reference: Streams | None = None, source: str = "", num_positions: int | None = None) -> FitResult:
    """Maximum-likelihood a_0..a_{P−1} (and the feature coefficients unless `coefficients` fixes them)
    from per-step accepted counts. P = `num_positions` (default k): slots from P−1 on share a_{P−1}, as the
    drafter reuses the last intercept. L-BFGS-B within A_BOUNDS / B_BOUNDS."""
    from scipy.optimize import minimize

    if not observations:
        raise CalibrationError("no observations to fit")
    problem, _ = bind(observations, streams, k, reference)
    if problem.num_steps == 0:
        raise CalibrationError("no drafted steps in the observations")
    free_b = coefficients is None
    fixed = dict(coefficients or {})
    npos = k if num_positions is None else max(1, min(int(num_positions), k))
    x0 = np.concatenate([np.full(npos, 0.5), np.zeros(len(FEATURES) if free_b else 0)])

    def unpack(x: np.ndarray) -> AcceptanceParams:
        coef = {f: float(x[npos + i]) for i, f in enumerate(FEATURES)} if free_b else fixed
        return AcceptanceParams(method, model, tuple(float(v) for v in x[:npos]), coef)

    total = float(problem.num_steps)
    if problem.num_keys == 0:  # every step aligned: exact likelihood with its analytic gradient
        def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
            value, grad = problem.aligned(unpack(x))
            return value / total, (grad if free_b else grad[:npos]) / total
        jac = True
    else:
        def objective(x: np.ndarray) -> float:
            return problem.nll(unpack(x)) / total
        jac = None
    res = minimize(objective, x0, jac=jac, method="L-BFGS-B",
                   bounds=[A_BOUNDS] * npos + ([B_BOUNDS] * len(FEATURES) if free_b else []),
                   options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-8})
    best = unpack(res.x)
    fitted = tuple(f"a{i}" for i in range(npos)) + (tuple(FEATURES) if free_b else ())
    params = AcceptanceParams(method, model, best.positions, best.coefficients, source=source)
    return FitResult(params, float(res.fun * total), int(total), fitted,
                     {"converged": bool(res.success), "message": str(res.message)})


def cumulative_rates(counts: np.ndarray) -> np.ndarray:
    """Per-position cumulative acceptance (≥ i+1 accepted per draft) from summed expected counts."""
    counts = np.asarray(counts, dtype=np.float64)
    return counts[1:] / counts[0] if counts[0] > 0 else np.zeros(counts.shape[0] - 1)


def model_rates(streams: Streams, params: AcceptanceParams, k: int) -> np.ndarray:
    """The model's cumulative per-position acceptance over `streams` (all calls pooled)."""
    return cumulative_rates(expected_counts(streams, params, k).sum(axis=0))


def fit_targets(streams: Streams, targets: Sequence[float], coefficients: Mapping[str, float], *,
                method: str, model: str, ks: Sequence[int] | None = None) -> AcceptanceParams:
    """Intercepts a_0..a_{K−1} whose pooled cumulative rates on `streams` equal `targets`
    (K = len(targets); target i is P(accepted ≥ i+1) per draft when drafting `ks[i]` tokens,
    default K), feature coefficients fixed. Solved by scipy least_squares (K equations, K unknowns)."""
    from scipy.optimize import least_squares

    targets = np.asarray(targets, dtype=np.float64)
    n = targets.shape[0]
    ks = [n] * n if ks is None else [int(x) for x in ks]
    if len(ks) != n or any(k <= i for i, k in enumerate(ks)):
        raise CalibrationError("each target i needs a draft length ks[i] > i")
    if not (np.all(np.diff(targets) <= 0) and targets[-1] > 0 and targets[0] < 1):
        raise CalibrationError("cumulative targets must be non-increasing and inside (0, 1)")
    cond = targets / np.concatenate(([1.0], targets[:-1]))
    x0 = np.log(cond / (1 - np.minimum(cond, 0.999)))

    def residual(x: np.ndarray) -> np.ndarray:
        params = AcceptanceParams(method, model, tuple(x), coefficients)
        rates = {k: model_rates(streams, params, k) for k in set(ks)}
        return np.array([rates[k][i] for i, k in enumerate(ks)]) - targets

    res = least_squares(residual, x0, bounds=A_BOUNDS, xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return AcceptanceParams(method, model, tuple(float(v) for v in res.x), dict(coefficients))


# --------------------------------------------------------------------------------------------
# Reports


def observed_rates(observations: Sequence[Observation], k: int) -> tuple[np.ndarray, int]:
    """vLLM's per-position acceptance (steps accepting ≥ i+1 / drafted steps) and the step count."""
    steps = sum(int(o.accepted.shape[0]) for o in observations)
    if not steps:
        return np.zeros(k), 0
    counts = np.array([sum(int((o.accepted >= i + 1).sum()) for o in observations) for i in range(k)])
    return counts / steps, steps


def predicted_rates(observations: Sequence[Observation], streams: Streams, params: AcceptanceParams, k: int,
                    reference: Streams | None = None) -> np.ndarray:
    """The model's per-position acceptance for these observations: each request's own stream (or
    the pooled reference) weighted by its observed number of steps (expected rates from the walk,
    also for aligned observations)."""
    observations = [replace(o, aligned=False) for o in observations]
    problem, keys = bind(observations, streams, k, reference)
    e = expected_counts(problem.streams, params, k)
    pooled = np.zeros((problem.num_keys, k + 1))
    np.add.at(pooled, problem.keys, e)
    rates = np.zeros(k)
    steps = 0
    for o, key in zip(observations, keys, strict=True):
        n = int(o.accepted.shape[0])
        if n and pooled[key, 0] > 0:
            rates += n * pooled[key, 1:] / pooled[key, 0]
            steps += n
    return rates / steps if steps else rates


@dataclass(frozen=True)
class GroupRow:
    group: str
    split: str  # "train" / "held-out"
    steps: int
    observed: tuple[float, ...]
    predicted: tuple[float, ...]

    @property
    def max_abs_error(self) -> float:
        return float(np.max(np.abs(np.subtract(self.predicted, self.observed)))) if self.observed else 0.0

    @property
    def observed_length(self) -> float:
        return 1.0 + float(sum(self.observed))

    @property
    def predicted_length(self) -> float:
        return 1.0 + float(sum(self.predicted))

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "split": self.split, "steps": self.steps,
                "observed": [round(x, 4) for x in self.observed], "predicted": [round(x, 4) for x in self.predicted],
                "observed_length": round(self.observed_length, 4), "predicted_length": round(self.predicted_length, 4),
                "max_abs_error": round(self.max_abs_error, 4)}


def group_report(observations: Sequence[Observation], streams: Streams, params: AcceptanceParams, k: int,
                 train: set[str] | None = None, reference: Streams | None = None) -> list[GroupRow]:
    """Observed vs predicted per-position acceptance per group (category), then 'train' and
    'held-out' totals when a training set is given, else one 'all' row."""
    groups: dict[str, list[Observation]] = {}
    for o in observations:
        groups.setdefault(o.group, []).append(o)
    rows = []

    def row(name: str, obs: list[Observation], split: str) -> GroupRow:
        observed, steps = observed_rates(obs, k)
        predicted = predicted_rates(obs, streams, params, k, reference)
        return GroupRow(name, split, steps, tuple(map(float, observed)), tuple(map(float, predicted)))

    for name in sorted(groups):
        split = "train" if train is None or name in train else "held-out"
        rows.append(row(name, groups[name], split))
    if train is None:
        rows.append(row("all", list(observations), "train"))
    else:
        for split in ("train", "held-out"):
            obs = [o for o in observations if (o.group in train) == (split == "train")]
            if obs:
                rows.append(row(f"{split} total", obs, split))
    return rows


@dataclass(frozen=True)
class Replay:
    """What `replay_drafter` measured: vLLM's per-position counts and each call's per-step accepted."""

    counts: np.ndarray  # steps accepting ≥ i+1, per position i
    steps: int  # drafted steps
    accepted: tuple[np.ndarray, ...]  # per call, per step

    @property
    def rates(self) -> np.ndarray:
        return self.counts / self.steps if self.steps else np.zeros_like(self.counts, dtype=np.float64)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + float(self.rates.sum())


def replay_drafter(calls: Iterable[Call], spec, k: int | None = None) -> Replay:
    """Run a drafter standalone over `calls`, one call at a time, as the engine drives it (start_call
    after the first token, propose / greedy verify / observe each step, finish_call), with a fixed
    k (default: the config's). No batching, scheduling or cost: the acceptance model alone."""
    spec = parse_drafter(spec)
    drafter = make_drafter(spec)
    k = spec.num_speculative_tokens if k is None else k
    counts = np.zeros(k, dtype=np.int64)
    per_call = []
    lens = np.array([k], dtype=np.int64)
    for index, call in enumerate(calls):
        state = CallState(index, call, call.id, 0, index, call.output_len)
        start = call.prompt_len
        state.history[start] = call.output_tokens[0]  # the prefill step samples the first token
        state.num_emitted = 1
        drafter.start_call(state)
        drafter.observe(state, state.history[start:start + 1])
        accepted = []
        while state.num_emitted < state.target_len:
            draft = drafter.propose([state], lens)[0]
            acc, emitted = verify(draft, call.output_tokens, state.num_emitted, state.target_len)
            pos = start + state.num_emitted
            state.history[pos:pos + emitted] = call.output_tokens[state.num_emitted:state.num_emitted + emitted]
            state.num_emitted += emitted
            counts[:acc] += 1
            accepted.append(acc)
            drafter.observe(state, state.history[pos:pos + emitted])
        drafter.finish_call(state)
        per_call.append(np.asarray(accepted, dtype=np.int64))
    return Replay(counts, sum(a.shape[0] for a in per_call), tuple(per_call))


# --------------------------------------------------------------------------------------------
# One entry point for the CLI


def calibrate_file(path: str | Path, *, method: str = "eagle3", model: str = "custom", k: int | None = None,
                   train_categories: Sequence[str] | None = None, features: Workload | None = None,
                   coefficients: Mapping[str, float] | None = None) -> tuple[FitResult, list[GroupRow]]:
    """Fit parameters from a vLLM per-request metrics JSONL or a Spec-Bench answer file.

    Streams: the requests' own calls from `features` (a trace whose outputs produced the metrics;
    for Spec-Bench the bundled spec-bench trace by default), matched by call id; requests without
    a match use the pooled stream of `features`, or the reference stream (`REFERENCE_STREAM`).
    Feature coefficients are fitted when the data is tied to per-call streams and `coefficients`
    is None; otherwise they are held at `coefficients` (default: the method's bundled default).
    """
    spec_bench = looks_like_spec_bench(path)
    observations = load_spec_bench(path, k) if spec_bench else load_vllm_metrics(path)
    if k is None:
        k = max(int(o.drafted.max()) for o in observations if o.drafted.size)
    if features is None and spec_bench:
        features = load_trace(bundled_trace("spec-bench.jsonl.zst"))
    streams = workload_streams(features) if features is not None else reference_streams()
    reference = streams if features is not None else None
    index = streams.index()
    per_call = features is not None and any(o.call_id in index for o in observations)
    if coefficients is None and not per_call:
        coefficients = dict(load_params(method).coefficients)
    train = set(train_categories) if train_categories else None
    groups = {o.group for o in observations}
    if train is not None:
        unknown = sorted(train - groups)
        if unknown:
            raise CalibrationError(f"unknown categories {unknown} (in the file: {', '.join(sorted(groups))})")
    fit_obs = [o for o in observations if train is None or o.group in train]
    where = "Spec-Bench answers" if spec_bench else "vLLM per-request spec_decode_metrics"
    source = (f"fitted by agentspec_sim.drafters.model.calibrate (maximum likelihood) to {Path(path).name} "
              f"({where}; {len(fit_obs)} requests"
              + (f", categories {', '.join(sorted(train))}" if train else "") + ")")
    result = fit_steps(fit_obs, streams, k, method=method, model=model, coefficients=coefficients,
                       reference=reference, source=source)
    sources = {"positions": source,
               "coefficients": source if coefficients is None else "held fixed (given, or the method's bundled "
                                                                    "default file)"}
    stream_note = "each request's own call" if per_call else REFERENCE_STREAM if features is None else \
        "the pooled calls of the features trace"
    result.params = AcceptanceParams(method, model, result.params.positions, result.params.coefficients,
                                     source=source, sources=sources,
                                     calibration={"k": k, "streams": stream_note, "steps": result.num_steps})
    rows = group_report(observations, streams, result.params, k, train, reference)
    return result, rows


POOLED_POSITIONS = 12  # slots ≥ 11 share one intercept: they are < 1 % of the slot trials at k = 20
BAND_DRAWS = 400
BAND_QUANTILES = (0.025, 0.975)


def _shifted(params: AcceptanceParams, delta: float) -> AcceptanceParams:
    return replace(params, positions=tuple(a + delta for a in params.positions), band={})


def _band(params: AcceptanceParams, observations: Sequence[Observation], streams: Streams, k: int,
          requests: int, seed: int = 0) -> dict[str, Any]:
    """The uncertainty band of a fit from its own error spread: per training dataset, `BAND_DRAWS` seeded
    samples of `requests` requests; in each, the observed mean acceptance length over the expected one
    (the walk over those requests' own streams). The 2.5 % and 97.5 % quantiles of that ratio, over every
    dataset's samples, set the bounds: all intercepts shifted by the one δ that scales the expected mean
    acceptance length over the training requests by that ratio. So the band holds the dataset-to-dataset
    differences the features do not explain and the request-to-request spread of a sample that size."""
    index = streams.index()
    rows = [index[o.call_id] for o in observations]
    sub = streams.subset(rows)
    expected = expected_counts(sub, params, k)  # per request: E[steps], E[steps accepting ≥ i+1]
    exp_tokens = expected[:, 1:].sum(axis=1)
    obs_steps = np.array([o.accepted.shape[0] for o in observations], dtype=np.float64)
    obs_tokens = np.array([float(o.accepted.sum()) for o in observations])
    rng = np.random.default_rng(seed)
    ratios = []
    groups = sorted({o.group for o in observations})
    for g in groups:
        members = np.array([i for i, o in enumerate(observations) if o.group == g])
        n = min(requests, members.shape[0])
        for _ in range(BAND_DRAWS):
            pick = rng.choice(members, size=n, replace=False)
            observed = 1.0 + obs_tokens[pick].sum() / obs_steps[pick].sum()
            predicted = 1.0 + exp_tokens[pick].sum() / expected[pick, 0].sum()
            ratios.append(observed / predicted)
    lo, hi = np.quantile(ratios, BAND_QUANTILES)
    source = (f"the fit's own error spread: {BAND_DRAWS} seeded samples of {requests} requests from each training "
              f"dataset ({', '.join(groups)}); observed / expected mean acceptance length "
              f"{BAND_QUANTILES[0]:.1%} quantile {lo:.4f}, {BAND_QUANTILES[1]:.1%} quantile {hi:.4f}; each bound "
              "shifts every intercept by the δ that scales the expected length over the training requests by "
              "that ratio")
    return _ratio_band(params, sub, k, round(float(lo), 4), round(float(hi), 4), source, exact_ratios=(lo, hi))


def _ratio_band(params: AcceptanceParams, stream: Streams, k: int, lo: float, hi: float, source: str,
                exact_ratios: tuple[float, float] | None = None) -> dict[str, Any]:
    """A band whose bounds shift every intercept of `params` by the δ (scipy brentq) that scales its
    expected mean acceptance length on `stream` at draft length k by the ratio lo (low) and hi (high);
    `exact_ratios`, when given, are the unrounded ratios solved for (the band records lo, hi)."""
    from scipy.optimize import brentq

    base = 1.0 + float(model_rates(stream, params, k).sum())
    out: dict[str, Any] = {"source": source, "ratio": [lo, hi]}
    for bound, ratio in zip(("low", "high"), exact_ratios or (lo, hi), strict=True):
        def gap(delta: float, target: float = base * ratio) -> float:
            return 1.0 + float(model_rates(stream, _shifted(params, delta), k).sum()) - target

        delta = 0.0 if abs(ratio - 1.0) < 1e-12 else brentq(gap, -4.0, 4.0, xtol=1e-6)
        out[bound] = {"positions": [round(a + delta, 6) for a in params.positions],
                      "coefficients": {f: round(params.coefficient(f), 6) for f in FEATURES},
                      "logit_shift": round(float(delta), 6)}
    return out


def calibrate_specdecode_bench(paths: Sequence[str | Path], *, method: str = "eagle3", model: str = "custom",
                               k: int | None = None, train: Sequence[str] | None = None, limit: int | None = None,
                               coefficients: Mapping[str, float] | None = None,
                               proposer: str | None = None, num_positions: int | None = POOLED_POSITIONS,
                               band: bool = True, band_requests: int = 100
                               ) -> tuple[FitResult, list[GroupRow], Streams]:
    """Fit from SpecDecode-Bench request files (`load_specdecode_bench`), one dataset (group) per file.

    Every request is its own call (its prompt and output ids; no tokenizer, so code = 0), its steps at
    their known output positions: the exact likelihood of the drafter's process. `train`: the datasets
    to fit on (default: all); the others are held out and only reported. `coefficients` fixes the
    feature coefficients (e.g. all zero: per-position intercepts only); None fits them too. Slots from
    `num_positions` − 1 on share one intercept. The report compares observed and expected (the walk over
    each request's own stream) per-position acceptance.

    `band`: the file's uncertainty band (`_band`): how far the mean acceptance length of `band_requests`
    requests of one kind of text falls from the fit's expectation for them."""
    proposer = proposer or SPECDECODE_BENCH_PROPOSERS.get(method, f"acc_{method}")
    observations: list[Observation] = []
    calls: list[Call] = []
    for path in paths:
        obs, cs = load_specdecode_bench(path, proposer=proposer, k=k, limit=limit)
        observations += obs
        calls += cs
    depth = k
    if depth is None:  # one k for every file: the largest any of them shows (no step accepted more in any)
        depth = max(int(o.drafted.max(initial=1)) for o in observations)
        observations = [replace(o, drafted=np.full_like(o.drafted, depth)) for o in observations]
    groups = sorted({o.group for o in observations})
    train_set = set(train) if train else set(groups)
    unknown = sorted(train_set - set(groups))
    if unknown:
        raise CalibrationError(f"unknown datasets {unknown} (in the files: {', '.join(groups)})")
    streams = build_streams(calls, tokenizer=None)
    fit_obs = [o for o in observations if o.group in train_set]
    names = ", ".join(Path(p).name for p in paths if specdecode_bench_group(p) in train_set)
    source = (f"fitted by agentspec_sim.drafters.model.calibrate (maximum likelihood, every step at its output "
              f"position) to SpecDecode-Bench {proposer} data: {names} ({len(fit_obs)} requests"
              + (f", first {limit} per file" if limit else "") + f"; k = {depth})")
    result = fit_steps(fit_obs, streams, depth, method=method, model=model, coefficients=coefficients,
                       source=source, num_positions=num_positions)
    held_out = [g for g in groups if g not in train_set]
    band_doc = _band(result.params, fit_obs, streams, depth, band_requests, seed=0) if band else {}
    sources = {"positions": source,
               "coefficients": source if coefficients is None else "held fixed at the given values"}
    result.params = AcceptanceParams(method, model, result.params.positions, result.params.coefficients,
                                     source=source, sources=sources,
                                     calibration={"k": depth, "train": sorted(train_set), "held_out": held_out,
                                                  "steps": result.num_steps, "streams": "each request's own call"},
                                     band=band_doc)
    rows = group_report(observations, streams, result.params, depth, train_set if held_out else None)
    return result, rows, streams
