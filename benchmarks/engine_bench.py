"""Simulator speed: simulated output tokens per wall-clock second, normal vs ngram, by max_num_seqs.

Usage: python benchmarks/engine_bench.py [TRACE] [--queries N] [--seqs 1,32,256] [--hardware a100-80g]
TRACE defaults to the bundled default trace; --queries keeps the first N queries (all by default).
Every query arrives at t = 0 so that max_num_seqs, not the trace's pacing, sets the batch.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentspec_sim import EngineConfig, load_trace, simulate
from agentspec_sim.cost import build_cost_model
from agentspec_sim.metrics import summarize
from agentspec_sim.trace.bundled import default_trace_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, default=None)
    parser.add_argument("--queries", type=int, default=None, help="keep only the first N queries")
    parser.add_argument("--seqs", default="1,32,256", help="max_num_seqs values (comma-separated)")
    parser.add_argument("--drafters", default="normal,ngram")
    parser.add_argument("--hardware", default="a100-80g")
    args = parser.parse_args()

    path = args.trace or default_trace_path()
    workload = load_trace(path)
    if args.queries:
        workload = replace(workload, queries=workload.queries[:args.queries])
    cost = build_cost_model(args.hardware, "qwen3-8b")
    simulate(replace(workload, queries=workload.queries[:1]), "ngram", EngineConfig(hardware=args.hardware),
             cost)  # warm-up: numba compilation and imports are not the engine's speed

    table = Table(title=f"engine speed on {path.name}: {len(workload.queries)} queries, "
                        f"{workload.num_calls} calls, {workload.output_tokens:,} output tokens")
    for name in ("drafter", "max_num_seqs", "steps", "call-steps", "wall s", "sim tok / wall s",
                 "call-steps / wall s", "simulated s", "goodput tok/s"):
        table.add_column(name, justify="left" if name == "drafter" else "right")
    for seqs in (int(s) for s in args.seqs.split(",")):
        config = EngineConfig(max_num_seqs=seqs, hardware=args.hardware, arrival="zero")
        for drafter in args.drafters.split(","):
            t0 = time.perf_counter()
            result = simulate(workload, drafter, config, cost)
            wall = time.perf_counter() - t0
            s = summarize(result)
            table.add_row(drafter, str(seqs), f"{s.steps:,}", f"{result.steps.height:,}", f"{wall:.1f}",
                          f"{s.output_tokens / wall:,.0f}", f"{result.steps.height / wall:,.0f}",
                          f"{s.simulated_s:,.0f}", f"{s.goodput_tok_s:,.0f}")
            Console(stderr=True).print(f"done: {drafter} @ {seqs} in {wall:.1f}s")
    Console().print(table)


if __name__ == "__main__":
    main()
