"""The AgentSpec closing-note tables: run the replay grid, then turn its JSON into Markdown.

    python benchmarks/agentspec_tables.py run DIR [--traces reflexion,gaia] [--sets base,plus,ablate] [--dry-run]
    python benchmarks/agentspec_tables.py tables DIR > tables.md
    python benchmarks/agentspec_tables.py run DIR --sets as,switches   (issue 26's grid)
    python benchmarks/agentspec_tables.py as-tables DIR

`run` calls `agentspec-sim replay TRACE --drafter … --max-num-seqs B --replicate R --json -o
DIR/TRACE_bB_rR_SET.json` for every grid point whose file is missing (so an interrupted grid
resumes), under `nice -n 10`. The grid (`GRID`): each bundled agent trace at the max batch sizes
its concurrency can fill, with `--replicate R` = ⌈B / queries⌉ copies where one copy cannot fill B;
the big coding trace at 256 (`default`, the whole trace) and, on every 12th of its queries
(`default-12th`, written into DIR by `run`), at 1 and 32. Drafter sets: `base` = every
drafter and the AgentSpec ablations S/R/N, `plus` = `agentspec+`, `ablate` = `agentspec+` with each
part switched off (labelled by `ABLATIONS`). `tables` reads whatever files exist: rejection rates
beside the paper's Table 1, speedups per max batch size, and the two ablation tables.
A100-80G, Qwen3-8B, vLLM defaults otherwise (the replay command's defaults).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

from agentspec_sim.drafters.registry import parse_drafter

ROOT = Path(__file__).resolve().parents[1]
TRACES = {"reflexion": 965, "gaia": 8, "deep-research": 1, "swe-agent": 3, "default-12th": 21, "default": 252}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the small traces (gaia, swe-agent)
# Reflexion and deep-research cost more per point: every 4× (the machine is shared by many jobs).
COARSE = (1, 4, 16, 64, 256)
# The ablation: a middle and the largest batch each trace's engine limits let it reach (swe-agent and
# gaia are bound by the per-step token budget near a batch of 25–55, reached at max_num_seqs 64).
ABLATE_BATCHES = {"reflexion": (16, 256), "gaia": (16, 64), "swe-agent": (16, 64), "deep-research": (16,),
                  "default-12th": (32,), "default": ()}
# The coding trace (2.2 M output tokens) costs minutes per drafter: the whole trace at 256 only,
# every 12th query at 1 and 32. deep-research has one query: 256 copies would be 3 M tokens, so its
# grid stops at 16 copies to stay affordable on a shared 2-core machine.
ONLY_BATCHES = {"default": (256,), "default-12th": (1, 32), "reflexion": COARSE, "deep-research": COARSE}
MAX_BATCH = {"deep-research": 16}
SUBSETS = {"default-12th": ("default", 12)}  # name → (bundled trace, every n-th query)
BASE = ("ngram", "suffix", "eagle3", "agentspec", "agentspec-s", "agentspec-n", "agentspec-r", "agspec")
# The whole coding trace: the drafters of the main tables only (the S/R/N ablation runs on its subset).
BASE_FOR = {"default": ("ngram", "suffix", "eagle3", "agentspec", "agspec")}
ABLATIONS: dict[str, dict] = {
    "− structure": {"structure": False},
    "− workspace": {"corpora": ["session", "global"]},
    "− multi-repr.": {"forms": ["raw"]},
    "− global": {"corpora": ["session", "workspace"]},
    "− M(b) (α budget)": {"budget": "alpha"},
    "− allocation (fixed k)": {"budget": "none"},
    "− controller": {"controller": False},
    "− short matches (min 3)": {"min_match_len": 3},
    "− redundancy select": {"select": "priority"},
}
# Issue 26's grid: the batch-aware defaults beside the paper's preset and the model-free baselines at every
# batch size (set `as`), and the switches of docs/agentspec.md §4 at a small and a large batch (set `switches`).
AS_DRAFTERS = ("ngram", "suffix", "agspec", "agentspec", "agentspec-paper")
AS_SWITCHES: dict[str, dict] = {
    "− break-even depth": {"depth": "allocation"},
    "− M(b) (α budget)": {"budget": "alpha"},
    "− loose lookups (min 3)": {"min_match_len": 3},
    "single candidate: CT* only": {"single_candidate": "ct_only"},
    "outputs only (no prompt history)": {"prompt_history": False},
    "all matches of 3 tokens": {"match": "pattern", "min_match_len": 3},
}
SWITCH_BATCHES = {"reflexion": (16, 256), "gaia": (16, 128), "swe-agent": (2, 128), "deep-research": (16,),
                  "default-12th": (1, 32), "default": ()}
AS_BATCHES = {"default": (256,), "deep-research": (1, 2, 4, 8, 16)}
PAPER_TABLE1 = {"eagle3": 0.533, "ngram": 0.887, "suffix": 0.659, "agentspec": 0.264}


def grid(traces: list[str]) -> list[tuple[str, int, int]]:
    """(trace, max batch size, replicate) points."""
    points = []
    for trace in traces:
        queries = TRACES[trace]
        batches = ONLY_BATCHES.get(trace, BATCHES)
        for b in batches:
            if b > MAX_BATCH.get(trace, 256):
                continue
            # reflexion (965 queries) and default (252) fill 256 alone; replicate only what cannot.
            points.append((trace, b, 1 if queries >= 0.9 * b else math.ceil(b / queries)))
    return points


def as_grid(traces: list[str]) -> list[tuple[str, int, int]]:
    """Issue 26's points: every power of two to 256 (deep-research to 16, the whole coding trace at 256)."""
    return [(t, b, 1 if TRACES[t] >= 0.9 * b else math.ceil(b / TRACES[t]))
            for t in traces for b in AS_BATCHES.get(t, BATCHES)]


def trace_path(trace: str, out_dir: Path) -> Path:
    """The bundled trace, or the subset `SUBSETS` names (written into `out_dir` once)."""
    if trace not in SUBSETS:
        return ROOT / "traces" / f"{trace}.jsonl.zst"
    path = out_dir / f"{trace}.jsonl.zst"
    if not path.exists():
        from agentspec_sim.trace.io import load_trace, write_trace
        from agentspec_sim.trace.schema import Workload

        source, every = SUBSETS[trace]
        workload = load_trace(ROOT / "traces" / f"{source}.jsonl.zst")
        write_trace(Workload(workload.meta, workload.queries[::every]), path)
    return path


def replay_args(trace: str, b: int, r: int, which: str, out: Path) -> list[str]:
    cmd = ["nice", "-n", "10", "agentspec-sim", "replay", str(trace_path(trace, out.parent)),
           "--max-num-seqs", str(b), "--replicate", str(r), "--json", "-o", str(out)]
    if which == "base":
        return [*cmd, "--drafter", ",".join(BASE_FOR.get(trace, BASE))]
    if which == "plus":
        return [*cmd, "--drafter", "agentspec+"]
    if which == "as":
        return [*cmd, "--drafter", ",".join(AS_DRAFTERS)]
    if which == "switches":
        cmd += ["--drafter", "agentspec"]
        for opts in AS_SWITCHES.values():
            cmd += ["--speculative-config", json.dumps({"method": "agentspec", **opts})]
        return cmd
    if which == "ablate":
        cmd += ["--drafter", "agentspec+"]
        for opts in ABLATIONS.values():
            cmd += ["--speculative-config", json.dumps({"method": "agentspec+", **opts})]
        return cmd
    raise SystemExit(f"unknown set {which!r} (base, plus, ablate)")


def run(args: argparse.Namespace) -> None:
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for which in args.sets.split(","):
        points = as_grid(args.traces.split(",")) if which in ("as", "switches") else grid(args.traces.split(","))
        for trace, b, r in points:
            if which == "ablate" and b not in ABLATE_BATCHES[trace]:
                continue  # the coding trace's ablation runs on its subset
            if which == "switches" and b not in SWITCH_BATCHES[trace]:
                continue
            out = out_dir / f"{trace}_b{b}_r{r}_{which}.json"
            if out.exists():
                continue
            cmd = replay_args(trace, b, r, which, out)
            print(" ".join(cmd), flush=True)
            if not args.dry_run:
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


# --------------------------------------------------------------------------------------------
# Tables

_NAME = re.compile(r"(?P<trace>.+)_b(?P<b>\d+)_r(?P<r>\d+)_(?P<set>base|plus|ablate|as|switches)\.json$")


@functools.cache
def _agentspec_defaults() -> dict:
    """`agentspec`'s resolved options as a run's JSON config spells them (lists, not tuples)."""
    return json.loads(json.dumps(dict(parse_drafter("agentspec").options)))


def _label(run: dict) -> str:
    """The row name of a run: its shorthand, or the ablation whose switches its config carries."""
    cfg = run["speculative_config"]
    if cfg.get("method") == "agentspec" and len(run["drafter"]) > len("agentspec"):
        defaults = _agentspec_defaults()
        changed = {k for k, v in cfg.items() if k in defaults and defaults[k] != v} - {"max_match_len"}
        for name, opts in AS_SWITCHES.items():
            wanted = {k for k, v in opts.items() if defaults.get(k) != v}
            if changed == wanted and all(cfg[k] == opts[k] for k in changed):
                return f"agentspec {name}"
    if cfg.get("method") != "agentspec+":
        return run["drafter"]
    for name, opts in ABLATIONS.items():
        if all(cfg.get(k) == (list(v) if isinstance(v, tuple) else v) for k, v in opts.items()):
            return f"agentspec+ {name}"
    return "agentspec+"


def load(dir_: Path) -> dict[tuple[str, int, int], dict[str, dict]]:
    """(trace, b, r) → label → run summary, over every result file in `dir_`."""
    results: dict[tuple[str, int, int], dict[str, dict]] = {}
    for path in sorted(dir_.glob("*.json")):
        m = _NAME.match(path.name)
        if not m:
            continue
        key = (m["trace"], int(m["b"]), int(m["r"]))
        for run in json.loads(path.read_text())["runs"]:
            label = _label(run)
            if label == "normal" and "normal" in results.get(key, {}):
                continue
            results.setdefault(key, {})[label] = run
    return results


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _point(trace: str, b: int, r: int) -> str:
    return f"{b}" if r == 1 else f"{b} (×{r})"


ALL = ("ngram", "suffix", "eagle3", "agspec", "agentspec", "agentspec-s", "agentspec-n", "agentspec-r", "agentspec+")


def pick_batch(results, trace: str) -> int | None:
    """The batch size a trace's one-column tables use: 16 (or 32, or the largest run)."""
    bs = sorted({k[1] for k in results if k[0] == trace})
    return next((b for b in (16, 32) if b in bs), bs[-1] if bs else None)


def _at(results, trace: str, b: int | None) -> dict[str, dict]:
    key = next((k for k in results if k[0] == trace and k[1] == b), None)
    return results.get(key, {}) if key else {}


def rejection_table(results, traces: list[str]) -> str:
    """Per trace: at the one-column batch (`pick_batch`) and at the largest batch run."""
    cols = []
    for t in traces:
        bs = sorted({k[1] for k in results if k[0] == t})
        cols += [(t, b) for b in dict.fromkeys((pick_batch(results, t), bs[-1]))]
    head = "| drafter | paper Table 1 (Reflexion, Qwen3-8B) | " + " | ".join(f"{t} b={b}" for t, b in cols) + " |"
    out = [head, "|" + "---|" * (2 + len(cols))]
    for name in ALL:
        cells = [name, _fmt(PAPER_TABLE1.get(name), 3)]
        for t, b in cols:
            run = _at(results, t, b).get(name)
            cells.append(_fmt(run and run["rejection_rate"]))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def coverage_table(results, traces: list[str]) -> str:
    """Accepted draft tokens per output token, beside where the trace's repeated 4-token spans were
    seen first (`analysis.repetition`): what isolation by block and by query leaves to draft."""
    from agentspec_sim.analysis.repetition import repetition_profile
    from agentspec_sim.trace.io import load_trace
    from agentspec_sim.trace.tokenizer import load_tokenizer

    table = load_tokenizer("qwen3").token_bytes()
    names = ("suffix", "agspec", "agentspec", "agentspec-n", "agentspec-r", "agentspec+")
    out = ["| trace (b) | repeats: same block | same query, other block | other query | "
           + " | ".join(names) + " |", "|" + "---|" * (4 + len(names))]
    for t in traces:
        path = ROOT / "traces" / f"{t}.jsonl.zst"
        if t in SUBSETS:
            path = Path(_results_dir) / f"{t}.jsonl.zst"
        shares = repetition_profile(load_trace(path), table, ks=(4,))["by_k"][4]
        b = pick_batch(results, t)
        runs = _at(results, t, b)
        cells = [f"{t} ({b})", *(f"{shares[c]:.1%}" for c in ("same_block", "same_query_other_block", "other_query"))]
        for name in names:
            run = runs.get(name)
            cells.append("–" if run is None else f"{run['accepted_tokens'] / run['output_tokens']:.1%}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


_results_dir = "."


def _speedup_cell(run: dict) -> str:
    return f"{run['speedup']:.3f} / {run['rejection_rate'] or 0:.2f}"


def _speedup_token_cell(run: dict) -> str:
    return f"{_speedup_cell(run)} / {run['rejection_rate_tokens'] or 0:.2f}"


def speedup_table(results, trace: str, names: list[str], cell=_speedup_cell, keys=None) -> str:
    """Drafters × the trace's grid points (`keys`, default all), `cell(run)` in each, the batch reached last."""
    keys = sorted(keys if keys is not None else (k for k in results if k[0] == trace), key=lambda k: k[1])
    out = ["| drafter | " + " | ".join(_point(*k) for k in keys) + " |", "|" + "---|" * (1 + len(keys))]
    for name in names:
        cells = [name]
        for k in keys:
            run = results[k].get(name)
            cells.append("–" if run is None else cell(run))
        out.append("| " + " | ".join(cells) + " |")
    out.append("| mean batch (normal) | " + " | ".join(
        _fmt(results[k].get("normal", {}).get("batch_size_mean"), 1) for k in keys) + " |")
    return "\n".join(out)


def ablation_delta_table(results, base: str = "agentspec+", parts=ABLATIONS, with_rejection: bool = False) -> str:
    """Speedup change when each part of `base` is switched (`parts`: the run labels "<base> <name>"), at every
    point the ablation ran; `with_rejection`: the switched run's per-call rejection after an arrow."""
    points = sorted((k for k, runs in results.items() if any(n.startswith(f"{base} ") for n in runs)),
                    key=lambda k: (list(TRACES).index(k[0]), k[1]))
    head = "switch" if with_rejection else "part removed"
    out = [f"| {head} | " + " | ".join(f"{t} {_point(t, b, r)}" for t, b, r in points) + " |",
           "|" + "---|" * (1 + len(points))]
    if with_rejection:
        out.append(f"| none: {base} | " + " | ".join(_speedup_cell(results[k][base]) for k in points) + " |")
    else:
        out.append(f"| none: {base} speedup | " + " | ".join(f"{results[k][base]['speedup']:.3f}" for k in points)
                   + " |")
    for name in parts:
        cells = []
        for k in points:
            full, cut = results[k].get(base), results[k].get(f"{base} {name}")
            delta = "–" if not (full and cut) else f"{(cut['speedup'] / full['speedup'] - 1) * 100:+.1f}%"
            cells.append(f"{delta} → {cut['rejection_rate'] or 0:.2f}" if with_rejection and full and cut else delta)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def tables(args: argparse.Namespace) -> None:
    global _results_dir
    _results_dir = args.dir
    results = load(Path(args.dir))
    if not results:
        raise SystemExit(f"no result files in {args.dir}")
    traces = [t for t in TRACES if any(k[0] == t for k in results)]
    print("## Rejection rate (mean over calls of rejected / drafted tokens, the paper's Table 1 definition)\n")
    print(rejection_table(results, traces))
    print("\n## Accepted draft tokens per output token vs where 4-token repeats come from\n")
    print(coverage_table(results, traces))
    print("\n## agentspec+ ablation: speedup change with each part removed (negative: the part helps)\n")
    print(ablation_delta_table(results))
    main = ["ngram", "suffix", "eagle3", "agspec", "agentspec", "agentspec+"]
    for t in traces:
        print(f"\n## {t}: speedup / rejection by max_num_seqs (×R: --replicate R)\n")
        print(speedup_table(results, t, main))
        print(f"\n### {t}: AgentSpec ablations (S / R / N / full) and agentspec+ parts\n")
        print(speedup_table(results, t, ["agentspec", "agentspec-s", "agentspec-r", "agentspec-n", "agentspec+",
                                         *[f"agentspec+ {n}" for n in ABLATIONS]]))


BASELINES = ("ngram", "suffix")  # the paper's model-free baselines (vLLM's n-gram and SuffixDecoding)


def as_tables(args: argparse.Namespace) -> None:
    """Issue 26's tables: the grid per trace (speedup / per-call / per-token rejection), the acceptance
    checks against the model-free baselines and the previous defaults (= `agentspec-paper`), the switches."""
    results = load(Path(args.dir))
    traces = [t for t in TRACES if any(k[0] == t for k in results)]
    names = ["ngram", "suffix", "agspec", "agentspec-paper", "agentspec"]
    grid = {t: sorted((k for k in results if k[0] == t and "agentspec-paper" in results[k]), key=lambda k: k[1])
            for t in traces}
    for t in traces:
        print(f"\n#### {t}: speedup / rejection per call / per token\n")
        print(speedup_table(results, t, names, _speedup_token_cell, grid[t]))
    print("\n#### Acceptance checks (agentspec = the new defaults; before = agentspec-paper, the previous defaults)\n")
    print("| trace | b | agentspec | before | Δ vs before | best baseline | Δ vs best | checks |")
    print("|---|---|---|---|---|---|---|---|")
    for t in traces:
        for k in grid[t]:
            runs = results[k]
            new, old = runs["agentspec"]["speedup"], runs["agentspec-paper"]["speedup"]
            best = max(BASELINES, key=lambda n: runs[n]["speedup"])
            gap = new / runs[best]["speedup"] - 1
            checks = ["≥ 1.0 ✓" if new >= 1.0 else "≥ 1.0 ✗"]
            if k[1] >= 128:
                checks.append("within 1 % of best ✓" if gap >= -0.01 else "within 1 % of best ✗")
            elif new / old - 1 < -0.02:
                checks.append("small batch −2 % ✗")
            if t == "reflexion" and k[1] == 256:
                rej = runs["agentspec"]["rejection_rate"]
                checks.append(f"rejection {rej:.3f} {'✓' if rej <= 0.30 else '✗'}")
            print(f"| {t} | {_point(*k)} | {new:.3f} | {old:.3f} | {(new / old - 1) * 100:+.1f}% | {best} "
                  f"{runs[best]['speedup']:.3f} | {gap * 100:+.1f}% | {', '.join(checks)} |")
    print("\n#### Switches: speedup change from the defaults (rejection per call after the arrow)\n")
    print(ablation_delta_table(results, "agentspec", AS_SWITCHES, with_rejection=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the missing grid points")
    p.add_argument("dir")
    p.add_argument("--traces", default="swe-agent,gaia,deep-research,reflexion,default")
    p.add_argument("--sets", default="base,plus,ablate")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=run)
    p = sub.add_parser("tables", help="Markdown tables from the result files")
    p.add_argument("dir")
    p.set_defaults(func=tables)
    p = sub.add_parser("as-tables", help="issue 26's tables (sets as, switches): grid, acceptance checks, switches")
    p.add_argument("dir")
    p.set_defaults(func=as_tables)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
