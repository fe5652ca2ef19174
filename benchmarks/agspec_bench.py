"""AgSpec vs the other model-free drafters on a trace subset: acceptance metrics and drafting time.

For each drafter, one `simulate` run (every query arrives at t = 0, so `--seqs` sets the batch) with
the drafter class's hooks wrapped in timers: `propose` (per row it drafts for), `observe` (per call-
step that emitted tokens), `start_call` and `finish_call` (per call). Drafting µs per call-step =
(propose + observe time) / propose rows — the time one call adds to one engine step's drafting; the
article's budget is 2 ms per step. Call starts (session-index build or reuse, workspace tokenizing and
indexing) are reported separately, per call.

Quality columns come from `agentspec_sim.metrics.summarize` against a `normal` run on the same
subset and engine: rejection rate (mean over calls, and token-weighted), vLLM's mean acceptance
length, accepted tokens per decode call-step, speedup.

Usage: python benchmarks/agspec_bench.py [TRACE] [--queries 0:16] [--seqs 256]
       [--drafters 'ngram;suffix;{"method": "agspec"}'] [--hardware a100-80g] [--json out.json]
Drafters are separated by ';' (JSON configs contain commas). TRACE defaults to the bundled trace.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentspec_sim import EngineConfig, load_trace, simulate
from agentspec_sim.cost import build_cost_model
from agentspec_sim.drafters.registry import describe, drafter_class, parse_drafter, with_label
from agentspec_sim.metrics import summarize
from agentspec_sim.trace.bundled import default_trace_path

HOOKS = ("start_call", "propose", "observe", "finish_call")


class HookTimer:
    """Wraps a drafter class's hooks with perf_counter timers for the duration of a `with` block."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.seconds: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.saved: dict[str, object] = {}

    def __enter__(self) -> HookTimer:
        for name in HOOKS:
            original = self.cls.__dict__.get(name)
            self.saved[name] = original
            bound = getattr(self.cls, name)

            def timed(drafter, *args, _f=bound, _name=name):
                t0 = time.perf_counter()
                out = _f(drafter, *args)
                self.seconds[_name] += time.perf_counter() - t0
                self.count[_name] += len(args[0]) if _name == "propose" else 1
                return out

            setattr(self.cls, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            if original is None:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, default=None)
    parser.add_argument("--queries", default="0:16", help="START:COUNT of the trace's queries (default 0:16)")
    parser.add_argument("--seqs", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--drafters", default='ngram;suffix;{"method": "agspec"}')
    parser.add_argument("--hardware", default="a100-80g")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()

    path = args.trace or default_trace_path()
    workload = load_trace(path)
    start, count = (int(x) for x in args.queries.split(":"))
    workload = replace(workload, queries=workload.queries[start:start + count])
    cost = build_cost_model(args.hardware, "qwen3-8b")
    config = EngineConfig(max_num_seqs=args.seqs, hardware=args.hardware, arrival="zero")
    # Label each config by what was typed (a resolved agspec config lists every key).
    specs = [with_label(parse_drafter(d), d.strip()) for d in args.drafters.split(";") if d.strip()]
    warm = replace(workload, queries=workload.queries[:1])
    for spec in specs:  # warm-up: numba compilation, global corpora, imports
        simulate(warm, spec, config, cost)
    base = simulate(workload, "normal", config, cost)

    rows = []
    for spec in specs:
        with HookTimer(drafter_class(spec.method)) as timer:
            t0 = time.perf_counter()
            result = simulate(workload, spec, config, cost)
            wall = time.perf_counter() - t0
        s = summarize(result, base)
        sec, cnt = timer.seconds, timer.count
        per_step = (sec["propose"] + sec["observe"]) / max(cnt["propose"], 1)
        rows.append({
            "drafter": describe(spec), "speedup": s.speedup, "rejection_rate": s.rejection_rate,
            "rejection_rate_tokens": s.rejection_rate_tokens, "mean_acceptance_length": s.mean_acceptance_length,
            "accepted_per_decode_step": s.accepted_per_decode_step, "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens, "batch_size_mean": s.batch_size_mean,
            "draft_us_per_call_step": 1e6 * per_step,
            "propose_us_per_row": 1e6 * sec["propose"] / max(cnt["propose"], 1),
            "observe_us_per_call_step": 1e6 * sec["observe"] / max(cnt["observe"], 1),
            "start_call_us": 1e6 * sec["start_call"] / max(cnt["start_call"], 1),
            "propose_rows": cnt["propose"], "wall_s": wall,
        })
        Console(stderr=True).print(f"done: {describe(spec)} in {wall:.1f}s")

    table = Table(title=f"{path.name}: queries {start}..{start + count - 1} ({workload.num_calls} calls, "
                        f"{workload.output_tokens:,} output tokens), max_num_seqs {args.seqs}, {args.hardware}")
    columns = [("drafter", "drafter", "{}"), ("speedup", "speedup", "{:.3f}"),
               ("rej (calls)", "rejection_rate", "{:.3f}"), ("rej (tokens)", "rejection_rate_tokens", "{:.3f}"),
               ("mean acc len", "mean_acceptance_length", "{:.3f}"),
               ("acc / decode step", "accepted_per_decode_step", "{:.3f}"), ("drafted", "drafted_tokens", "{:,}"),
               ("accepted", "accepted_tokens", "{:,}"), ("µs / call-step", "draft_us_per_call_step", "{:.1f}"),
               ("µs / call start", "start_call_us", "{:.0f}")]
    for title, _, _ in columns:
        table.add_column(title, justify="left" if title == "drafter" else "right")
    for row in rows:
        table.add_row(*(fmt.format(row[key]) if row[key] is not None else "-" for _, key, fmt in columns))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
