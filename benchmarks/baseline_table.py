"""Issue 4's baseline table: speedup, rejection rate and acceptance length of the baseline drafters
over max batch sizes, from `agentspec-sim replay --json -o FILE` documents (or runs of its own).

Render: `python benchmarks/baseline_table.py render A.json B.json …` prints one markdown row per
(document, drafter): model, max_num_seqs, queries, drafter, speedup over `normal`, rejection rate
(mean over calls that drafted, as `replay` reports it), mean acceptance length (1 + accepted /
draft steps, vLLM's), accepted tokens per decode step, engine steps.

Run: `python benchmarks/baseline_table.py run --max-num-seqs 1 --queries 40 -o out.json
[--drafter normal,ngram,…] [--model qwen3-8b]` simulates the first N queries of the default trace
exactly as `replay` would (same `compare`, same engine defaults) and writes the same document with
a `queries` field — for configurations too slow to replay whole on a shared box (suffix drives
the engine one step per event; at max_num_seqs 1 that is one event per output step).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

DEFAULT_DRAFTERS = "normal,ngram,ngram-v2,suffix,eagle3"


def run(args: argparse.Namespace) -> None:
    from agentspec_sim import EngineConfig, load_trace
    from agentspec_sim.drafters.registry import parse_drafter_list
    from agentspec_sim.io.atomic import atomic_text
    from agentspec_sim.run.simulation import compare
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.schema import Workload

    path = args.trace or default_trace_path()
    workload = load_trace(path)
    if args.queries is not None:
        workload = Workload(workload.meta, workload.queries[:args.queries])
    config = EngineConfig(max_num_seqs=args.max_num_seqs, model=args.model, hardware=args.hardware)
    runs = compare(workload, parse_drafter_list(args.drafter), config)
    document = {"trace": str(path), "queries": len(workload.queries), "config": asdict(config),
                "runs": [summary.to_dict() for _, summary in runs]}
    with atomic_text(args.output) as out:
        out.write(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render(paths: list[Path]) -> None:
    print("| model | max_num_seqs | queries | drafter | speedup | rejection rate | acceptance length "
          "| accepted / decode step | steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        doc = json.loads(path.read_text())
        cfg = doc["config"]
        queries = doc.get("queries", "all")
        for r in doc["runs"]:
            print(f"| {cfg['model']} | {cfg['max_num_seqs']} | {queries} | {r['drafter']} "
                  f"| {_fmt(r['speedup'], '.3f')} | {_fmt(r['rejection_rate'], '.3f')} "
                  f"| {_fmt(r['mean_acceptance_length'], '.3f')} | {_fmt(r['accepted_per_decode_step'], '.3f')} "
                  f"| {r['steps']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="simulate and write a replay-style JSON document")
    p_run.add_argument("--trace", type=Path, default=None)
    p_run.add_argument("--queries", type=int, default=None, help="only the first N queries of the trace")
    p_run.add_argument("--max-num-seqs", type=int, required=True)
    p_run.add_argument("--drafter", default=DEFAULT_DRAFTERS)
    p_run.add_argument("--model", default="qwen3-8b")
    p_run.add_argument("--hardware", default="a100-80g")
    p_run.add_argument("-o", "--output", type=Path, required=True)
    p_render = sub.add_parser("render", help="print the markdown table of replay JSON documents")
    p_render.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        render(args.files)


if __name__ == "__main__":
    main()
