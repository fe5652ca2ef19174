"""Simulator speed: simulated output tokens per wall-clock second, per drafter, by max_num_seqs.

Usage: python benchmarks/engine_bench.py [TRACE] [--queries N] [--seqs 1,32,256] [--drafters normal,ngram]
                                         [--hardware a100-80g] [--out benchmarks/results.json]
TRACE defaults to the bundled default trace; --queries keeps the first N queries (all by default).
Every query arrives at t = 0 so that max_num_seqs, not the trace's pacing, sets the batch.

Each (drafter, max_num_seqs) run happens in a fresh child process (this script with --one), so its
peak RSS is its own and one run's garbage never slows the next. Reported per run: wall seconds of
`simulate` (trace loading and the warm-up excluded), simulated output tokens per wall second, engine
steps, engine overhead per step in µs (wall / engine steps), and the child's peak RSS. The table
is printed and written as JSON (default benchmarks/results.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(trace: str | None, queries: int | None):
    from agentspec_sim import load_trace
    from agentspec_sim.trace.bundled import default_trace_path

    path = Path(trace) if trace else default_trace_path()
    workload = load_trace(path)
    if queries:
        workload = replace(workload, queries=workload.queries[:queries])
    return path, workload


def run_one(args: argparse.Namespace) -> dict:
    """One simulation in this process; returns its measurements."""
    from agentspec_sim import EngineConfig, simulate
    from agentspec_sim.cost import build_cost_model
    from agentspec_sim.metrics import summarize

    _, workload = _load(args.trace, args.queries)
    cost = build_cost_model(args.hardware, "qwen3-8b")
    drafter, seqs = args.one.split("@")
    # Warm-up: numba compilation and imports are not the engine's speed.
    simulate(replace(workload, queries=workload.queries[:1]), drafter, EngineConfig(hardware=args.hardware), cost)
    config = EngineConfig(max_num_seqs=int(seqs), hardware=args.hardware, arrival="zero")
    t0 = time.perf_counter()
    result = simulate(workload, drafter, config, cost)
    wall = time.perf_counter() - t0
    s = summarize(result)
    return {
        "drafter": drafter, "max_num_seqs": int(seqs), "wall_s": wall, "output_tokens": s.output_tokens,
        "tokens_per_s": s.output_tokens / wall, "engine_steps": s.steps,
        "call_steps": int(result.engine_steps["batch_size"].sum()),
        "us_per_step": wall / s.steps * 1e6, "batch_size_mean": s.batch_size_mean,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "simulated_s": s.simulated_s, "goodput_tok_s": s.goodput_tok_s, "preemptions": s.preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default=None)
    parser.add_argument("--queries", type=int, default=None, help="keep only the first N queries")
    parser.add_argument("--seqs", default="1,32,256", help="max_num_seqs values (comma-separated)")
    parser.add_argument("--drafters", default="normal,ngram")
    parser.add_argument("--hardware", default="a100-80g")
    parser.add_argument("--out", type=Path, default=HERE / "results.json", help="JSON results file")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: DRAFTER@SEQS in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return

    from rich.console import Console
    from rich.table import Table

    path, workload = _load(args.trace, args.queries)
    rows = []
    err = Console(stderr=True)
    for seqs in (int(s) for s in args.seqs.split(",")):
        for drafter in args.drafters.split(","):
            cmd = [sys.executable, __file__, "--one", f"{drafter}@{seqs}", "--hardware", args.hardware]
            if args.trace:
                cmd.append(args.trace)
            if args.queries:
                cmd += ["--queries", str(args.queries)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            err.print(f"done: {drafter} @ {seqs} in {rows[-1]['wall_s']:.1f}s")

    table = Table(title=f"engine speed on {path.name}: {len(workload.queries)} queries, "
                        f"{workload.num_calls} calls, {workload.output_tokens:,} output tokens")
    for name in ("drafter", "max_num_seqs", "steps", "call-steps", "wall s", "sim tok / wall s", "µs / step",
                 "mean batch", "peak RSS MiB", "simulated s", "goodput tok/s"):
        table.add_column(name, justify="left" if name == "drafter" else "right")
    for r in rows:
        table.add_row(r["drafter"], str(r["max_num_seqs"]), f"{r['engine_steps']:,}", f"{r['call_steps']:,}",
                      f"{r['wall_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['us_per_step']:.1f}",
                      f"{r['batch_size_mean']:.1f}", f"{r['peak_rss_mib']:,.0f}", f"{r['simulated_s']:,.0f}",
                      f"{r['goodput_tok_s']:,.0f}")
    Console(width=200).print(table)
    document = {"trace": path.name, "queries": len(workload.queries), "calls": workload.num_calls,
                "output_tokens": workload.output_tokens, "hardware": args.hardware, "model": "qwen3-8b",
                "python": platform.python_version(), "machine": platform.machine(), "runs": rows}
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
