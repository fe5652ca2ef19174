"""The `suffix` drafter against ArcticInference 0.3.0 driven as vLLM 0.33 drives it, on a whole trace.

Every call of the trace is replayed (tests/suffix_reference.py::replay: `--concurrency` queries in
flight, calls of a query in sequence, each step's tokens = the recording verified greedily against
the previous draft). Both proposers see the same steps; every proposal is compared. Times are the
proposers' own (our hooks + propose; vLLM's propose loop over the real cache), per call-step (a
call that emitted tokens in a step) and per call start (prompt-tree build: the library's
`start_request`, measured directly; ours, the extra time of steps in which a call started, which
is exact at --concurrency 1).

With `--engine`, the engine itself runs the trace (`--max-num-seqs`, vLLM's other defaults for the
GPU) and its own step log is replayed into the library as vLLM's runner drives it
(tests/suffix_reference.py::engine_replay): every proposal the engine made is compared, and the
driving is checked (propose exactly after the steps vLLM runs the proposer in, budgets, token-0
drafts after skipped steps).

Needs arctic-inference (see docs/suffix-decoding.md for the CPU build).
Usage: python benchmarks/suffix_vs_arctic.py [--trace PATH] [--concurrency 1,32] [--queries N]
       [--config '{"method": "suffix", "num_speculative_tokens": 32}'] [--json out.json]
       python benchmarks/suffix_vs_arctic.py --engine [--max-num-seqs 32] [--queries N] [--config ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from suffix_reference import engine_replay, replay

from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.trace.bundled import default_trace_path
from agentspec_sim.trace.io import load_trace


def run(queries: list, spec, concurrency: int, max_model_len: int) -> dict:
    t0 = time.perf_counter()
    r = replay(queries, spec, concurrency=concurrency, max_model_len=max_model_len, max_mismatches=50)
    wall = time.perf_counter() - t0
    other_steps = max(r.steps - r.start_steps, 1)
    ours_step = (r.ours_s - r.ours_start_step_s) / other_steps  # a step without a start
    ours_start = (r.ours_start_step_s - r.start_steps * ours_step) / max(r.calls, 1)
    return {
        "concurrency": concurrency, "calls": r.calls, "steps": r.steps, "call_steps": r.call_steps,
        "tokens": r.tokens, "compared": r.compared, "mismatches": r.mismatch_count,
        "first_mismatches": r.mismatches[:5],
        "mean_accepted_per_draft_step": round(r.accepted / max(r.compared, 1), 3),
        "ours_s": round(r.ours_s, 2), "arctic_s": round(r.ref_s, 2),
        "ours_us_per_call_step": round(r.ours_s / r.call_steps * 1e6, 2),
        "arctic_us_per_call_step": round(r.ref_s / r.call_steps * 1e6, 2),
        "ours_start_ms_per_call": round(ours_start * 1e3, 3),
        "arctic_start_ms_per_call": round(r.ref_start_s / max(r.starts, 1) * 1e3, 3),
        "arctic_us_per_call_step_without_starts": round((r.ref_s - r.ref_start_s) / r.call_steps * 1e6, 2),
        "ours_us_per_call_step_without_starts": round(ours_step * r.steps / r.call_steps * 1e6, 2),
        "wall_s": round(wall, 1),
    }


def run_engine(workload, spec, max_num_seqs: int) -> dict:
    r = engine_replay(workload, spec, EngineConfig(max_num_seqs=max_num_seqs))
    return {
        "mode": "engine", "max_num_seqs": max_num_seqs, "steps": r.steps, "proposer_steps": r.proposer_steps,
        "skipped_steps": r.skipped_steps, "zero_drafts": r.zero_drafts, "compared": r.compared,
        "nonempty": r.nonempty, "absent_active": r.absent_active, "preemptions": r.preemptions,
        "problems": len(r.problems), "first_problems": r.problems[:5],
        "engine_s": round(r.wall_engine_s, 1), "reference_s": round(r.wall_reference_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--concurrency", default="1,32", help="comma-separated list of queries in flight")
    parser.add_argument("--queries", type=int, default=None, help="only the first N queries")
    parser.add_argument("--config", default='{"method": "suffix"}', help="speculative config JSON")
    parser.add_argument("--max-model-len", type=int, default=1 << 30)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--engine", action="store_true", help="replay the engine's own run (module docstring)")
    parser.add_argument("--max-num-seqs", default="32", help="--engine: comma-separated max_num_seqs values")
    args = parser.parse_args()
    workload = load_trace(args.trace or default_trace_path())
    spec = parse_drafter(args.config)
    if args.engine:
        from agentspec_sim.trace.schema import Workload

        workload = Workload(workload.meta, workload.queries[:args.queries])
        results = []
        for n in (int(x) for x in args.max_num_seqs.split(",")):
            result = {"config": spec.to_json(), **run_engine(workload, spec, n)}
            results.append(result)
            print(json.dumps(result), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    queries = [list(q.calls) for q in workload.queries[:args.queries]]
    replay(queries[:1], spec, concurrency=1, max_steps=50)  # compile (numba cache) outside the timings
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        result = {"config": spec.to_json(), **run(queries, spec, c, args.max_model_len)}
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
