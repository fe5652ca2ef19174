"""Regenerate the committed schedule samples in validation/schedules/ from the simulator.

    python -m agentspec_sim.validation.make_schedules            # all of them (about a minute)
    python -m agentspec_sim.validation.make_schedules --model qwen3-8b --max-num-seqs 32

Each sample is the bundled coding-agent trace's first `--queries` queries (default 2 × max_num_seqs,
so the largest batch fills) replayed with `ngram`
(k=5, so verify steps carry 1 + draft tokens) on an H200 profile at one max_num_seqs, and
`--steps` of its engine steps picked by `schedule.stratified_sample` (seed 0). The GPU check replays
these without polars or the simulator. Deterministic: the same code gives byte-identical files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentspec_sim.validation.schedule import SCHEDULE_DIR, StepShapes, shapes_from_columns, stratified_sample

MODELS = ("qwen3-8b", "gpt-oss-20b")
MAX_NUM_SEQS = (1, 32, 256)


def simulated_shapes(model: str, max_num_seqs: int, *, queries: int, hardware: str = "h200",
                     drafter: str = "ngram", trace: str | None = None) -> StepShapes:
    """Every engine step of a replay of the trace's first `queries` queries (all at t = 0)."""
    from dataclasses import replace

    from agentspec_sim.engine import EngineConfig
    from agentspec_sim.run.simulation import simulate
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    workload = load_trace(trace or default_trace_path())
    workload = replace(workload, queries=workload.queries[:queries])
    config = EngineConfig(max_num_seqs=max_num_seqs, hardware=hardware, model=model, arrival="zero")
    steps = simulate(workload, drafter, config).steps
    columns = {name: steps[name].to_numpy() for name in ("step", "phase", "context_len", "scheduled_tokens")}
    shapes = shapes_from_columns(columns, where=f"simulated {model} max_num_seqs={max_num_seqs}", time_columns=())
    shapes.meta = {"trace": Path(trace or default_trace_path()).name, "queries": queries, "model": model,
                   "hardware": hardware, "max_num_seqs": max_num_seqs, "drafter": drafter,
                   "steps_in_run": len(shapes)}
    return shapes


def make(model: str, max_num_seqs: int, *, steps: int, queries: int, out_dir: Path = SCHEDULE_DIR) -> Path:
    shapes = simulated_shapes(model, max_num_seqs, queries=queries)
    sample = stratified_sample(shapes, steps, seed=0)
    path = out_dir / f"{model}_seqs{max_num_seqs}.json.gz"
    sample.to_file(path, command="python -m agentspec_sim.validation.make_schedules", sample_seed=0)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=MODELS, help="default: all")
    parser.add_argument("--max-num-seqs", action="append", type=int, help="default: 1, 32, 256")
    parser.add_argument("--steps", type=int, default=48, help="steps per sample (default 48)")
    parser.add_argument("--queries", type=int, default=None,
                        help="trace queries replayed (default: 2 × max_num_seqs, at least 2; the trace has 252)")
    parser.add_argument("--out", type=Path, default=SCHEDULE_DIR)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.model or MODELS:
        for seqs in args.max_num_seqs or MAX_NUM_SEQS:
            queries = args.queries or max(2, 2 * seqs)
            print(make(model, seqs, steps=args.steps, queries=queries, out_dir=args.out))


if __name__ == "__main__":
    main()
