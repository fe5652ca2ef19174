"""EAGLE-3 acceptance, simulated vs real, on SpecDecode-Bench's per-step vLLM data (Llama-3.1-8B-Instruct, H100).

    python reports/specdecode_bench_acceptance.py DATA_DIR [--first 100] [--k 20] [--params FILE] [--json OUT]

DATA_DIR holds SpecDecode-Bench/simulator's data/llama3.1-8B/combined_{gsm8k,sharegpt,instructcoder,cnn}.jsonl
(public; not bundled: the repository states no licence). Each file's first requests are replayed through the
engine at max_num_seqs 1 with `eagle3` (k = 20, --model llama-3.1-8b, the bundled parameters or --params),
and with the file's band bounds; "real" is SpecDecode-Bench's own walk over the recorded per-position accepted
lengths (calibrate_acceptance.walk_positions), i.e. what vLLM reports for that run: mean acceptance length
= 1 + accepted / drafts, and the cumulative per-position acceptance P(≥ i+1 accepted) per draft.
gsm8k and sharegpt are the fit's training data; instructcoder and cnn are held out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from agentspec_sim.drafters.model.calibrate import load_specdecode_bench
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.run.simulation import simulate
from agentspec_sim.trace.schema import Query, TraceMeta, Workload

DATASETS = ("gsm8k", "sharegpt", "instructcoder", "cnn")
DEPTHS = 8


def real_rates(observations, k: int) -> tuple[float, np.ndarray]:
    acc = np.concatenate([o.accepted for o in observations])
    rates = np.array([(acc >= i + 1).mean() for i in range(k)])
    return 1.0 + float(rates.sum()), rates


def simulated(calls, k: int, params: str | None, bound: str | None) -> tuple[float, np.ndarray]:
    workload = Workload(TraceMeta(tokenizer=None, model="llama-3.1-8b"),
                        tuple(Query("specdecode-bench", c.id, (c,)) for c in calls))
    spec = {"method": "eagle3", "num_speculative_tokens": k, "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}
    if params:
        spec["acceptance_params"] = params
    if bound:
        spec["acceptance_bound"] = bound
    result = simulate(workload, spec, EngineConfig(max_num_seqs=1, model="llama-3.1-8b", hardware="h100-80g"))
    steps = result.steps.filter(result.steps["drafted"] > 0)
    acc = steps["accepted"].to_numpy()
    rates = np.array([(acc >= i + 1).mean() for i in range(k)])
    return 1.0 + float(rates.sum()), rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--first", type=int, default=100)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--params", default=None, help="an acceptance parameter file (default: the bundled one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = {}
    for name in DATASETS:
        path = args.data_dir / f"combined_{name}.jsonl"
        observations, calls = load_specdecode_bench(path, k=args.k, limit=args.first)
        real_len, real = real_rates(observations, args.k)
        row = {"real_length": real_len, "real_cumulative": real[:DEPTHS].round(4).tolist()}
        for bound in (None, "low", "high"):
            try:
                length, rates = simulated(calls, args.k, args.params, bound)
            except ValueError as exc:  # no band in that file
                print(f"{name}: {bound}: {exc}", file=sys.stderr)
                continue
            key = bound or "sim"
            row[f"{key}_length"] = length
            row[f"{key}_cumulative"] = rates[:DEPTHS].round(4).tolist()
        err = row["sim_length"] / real_len - 1
        worst = float(np.max(np.abs(np.subtract(row["sim_cumulative"], row["real_cumulative"]))))
        covered = ("low_length" in row and min(row["low_length"], row["high_length"]) <= real_len
                   <= max(row["low_length"], row["high_length"]))
        row.update(length_error=err, max_cumulative_error=worst, band_covers=covered)
        out[name] = row
        band = (f" band [{row['low_length']:.3f}, {row['high_length']:.3f}] covers: {covered}"
                if "low_length" in row else "")
        print(f"{name:14s} real {real_len:.3f} sim {row['sim_length']:.3f} ({100 * err:+.1f}%) "
              f"max |cum err| ≤ depth {DEPTHS}: {worst:.3f}{band}")
        print(f"{'':14s} real cum {row['real_cumulative']}\n{'':14s} sim  cum {row['sim_cumulative']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
