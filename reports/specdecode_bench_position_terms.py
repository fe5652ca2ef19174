"""Why the EAGLE-3 acceptance model has no context or position term: each candidate, fitted on the training
files, against the held-out ones (SpecDecode-Bench, Llama-3.1-8B-Instruct, H100, vLLM).

    python reports/specdecode_bench_position_terms.py DATA_DIR [--first 100]

A term is a hinge past 2,048 tokens (the EAGLE-3 head's training length) of log2(context at the step's start),
log2(output position) or log2(prompt length), clamped at 2^13 (the longest context in the data), with one
coefficient per slot group (slot 0, slots 1–3, slots ≥ 4): logit of slot i = a_i + c_g(i)·hinge. Fitted by
maximum likelihood on every step of gsm8k and sharegpt (the slots each real step reached), intercepts with it.
Reported per file, on its first requests: mean acceptance length (1 + Σ cumulative, k = 20) and the largest
|error| of the cumulative per-position acceptance P(≥ i accepted), i ≤ 8, each real step predicted at its
own start (the replay's error is close to this; reports/specdecode_bench_acceptance.py replays the bundled
model). instructcoder and cnn are held out: nothing here is tuned on them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from agentspec_sim.drafters.model.calibrate import load_specdecode_bench

TRAIN = ("gsm8k", "sharegpt")
HELD_OUT = ("instructcoder", "cnn")
SLOTS = 12  # as the bundled fit: slots ≥ 11 share one intercept
GROUPS = ((0, 0), (1, 3), (4, SLOTS))
TERMS = ("none", "context", "output position", "prompt length")
DEPTHS = 8
K = 20


def steps_of(path: Path, limit: int | None) -> dict[str, np.ndarray]:
    """Per real step: accepted, drafts possible, and the three lengths a term reads."""
    observations, calls = load_specdecode_bench(path, k=K, limit=limit)
    cols: dict[str, list[np.ndarray]] = {"accepted": [], "room": [], "context": [], "output position": [],
                                         "prompt length": []}
    for obs, call in zip(observations, calls, strict=True):
        starts = obs.positions(call.output_len)
        assert starts is not None, call.id  # the loader's walk tiles the (cut) output
        cols["accepted"].append(obs.accepted)
        cols["room"].append(np.minimum(K, call.output_len - starts))
        cols["context"].append(call.prompt_len + starts)
        cols["output position"].append(starts)
        cols["prompt length"].append(np.full(starts.shape, max(call.prompt_len, 1)))
    return {name: np.concatenate(v) for name, v in cols.items()}


def hinge(steps: dict[str, np.ndarray], term: str) -> np.ndarray:
    if term == "none":
        return np.zeros(steps["accepted"].shape)
    return np.maximum(np.minimum(np.log2(steps[term]), 13.0) - 11.0, 0.0)


def slot_group(slot: np.ndarray) -> np.ndarray:
    return np.searchsorted([hi for _, hi in GROUPS[:-1]], slot)  # slot 0 → 0, 1–3 → 1, ≥ 4 → 2


def fit(steps: dict[str, np.ndarray], term: str) -> np.ndarray:
    """Intercepts (SLOTS) then one coefficient per slot group, by maximum likelihood."""
    acc, room, h = steps["accepted"], steps["room"], hinge(steps, term)
    reached = np.minimum(acc + 1, room)  # slots each step tried: all accepted, then the first rejected
    step = np.repeat(np.arange(acc.shape[0]), reached)
    slot = np.arange(step.shape[0]) - np.repeat(np.cumsum(reached) - reached, reached)
    won = (slot < acc[step]).astype(np.float64)
    cap = np.minimum(slot, SLOTS - 1)
    group = slot_group(slot)
    x = h[step]
    groups = 0 if term == "none" else len(GROUPS)

    def nll(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = theta[cap] + (theta[SLOTS + group] * x if groups else 0.0)
        g = 1.0 / (1.0 + np.exp(-z)) - won
        value = float(np.sum(np.logaddexp(0.0, -z) * won + np.logaddexp(0.0, z) * (1.0 - won)))
        grad = np.concatenate([np.bincount(cap, g, SLOTS),
                               np.bincount(group, g * x, len(GROUPS))[:groups]])
        return value, grad

    return minimize(nll, np.zeros(SLOTS + groups), jac=True, method="L-BFGS-B").x


def cumulative(steps: dict[str, np.ndarray], term: str, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Observed and predicted P(≥ d accepted), d = 1..K."""
    acc, room, h = steps["accepted"], steps["room"], hinge(steps, term)
    observed = np.array([(acc >= d).mean() for d in range(1, K + 1)])
    alive = np.ones(acc.shape)
    predicted = np.empty(K)
    for d in range(1, K + 1):
        s = d - 1
        z = theta[min(s, SLOTS - 1)] + (theta[SLOTS + slot_group(np.array([s]))[0]] * h if term != "none" else 0.0)
        alive = alive * (room >= d) / (1.0 + np.exp(-z))
        predicted[d - 1] = alive.mean()
    return observed, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--first", type=int, default=100)
    args = parser.parse_args()
    path = {name: args.data_dir / f"combined_{name}.jsonl" for name in TRAIN + HELD_OUT}
    train = [steps_of(path[name], None) for name in TRAIN]
    pooled = {col: np.concatenate([s[col] for s in train]) for col in train[0]}
    first = {name: steps_of(path[name], args.first) for name in TRAIN + HELD_OUT}
    print(f"{'term':16s} " + "  ".join(f"{n + (' (held out)' if n in HELD_OUT else ''):>26s}" for n in first))
    for term in TERMS:
        theta = fit(pooled, term)
        cells = []
        for name in first:
            obs, pred = cumulative(first[name], term, theta)
            err = np.abs(obs - pred)[:DEPTHS].max()
            cells.append(f"{1 + obs.sum():.2f} vs {1 + pred.sum():.2f}, |err| {err:.3f}")
        coef = "" if term == "none" else "  c = " + " ".join(f"{c:+.2f}" for c in theta[SLOTS:])
        print(f"{term:16s} " + "  ".join(f"{c:>26s}" for c in cells) + coef)


if __name__ == "__main__":
    main()
