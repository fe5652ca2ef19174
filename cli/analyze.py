"""`agentspec-sim analyze …`: offline analyses of a trace (no simulation), one command per function.

Adding an analysis is one function decorated with `@analyze.command()` below; each parses its
options, calls one library function and renders (table, `--json`, optional PNG).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli.common import caption_below, load_workload, trace_argument
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app
from agentspec_sim.io.outputs import FIGURE_SUFFIXES, JSON_SUFFIXES, Output, check_outputs, json_paths

analyze = typer.Typer(name="analyze", help="Offline analyses of a trace (no engine run).", no_args_is_help=True)
app.add_typer(analyze, name="analyze")


def _token_bytes(workload):
    """The trace tokenizer's token→bytes map, or None for an ids-only trace."""
    from agentspec_sim.trace.tokenizer import load_tokenizer

    return load_tokenizer(workload.meta.tokenizer).token_bytes() if workload.meta.tokenizer else None


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{option}: expected integers ≥ 1, got {text!r}")
    return values


def _check_output(output: Output, trace: Path | None, inputs: dict | None = None) -> None:
    """The output policy (agentspec_sim/io/outputs.py): the output is none of the files the analysis reads."""
    from agentspec_sim.trace.bundled import default_trace_path

    check_outputs(output, inputs={"TRACE": trace or default_trace_path(), **(inputs or {})})


def _emit(doc: dict, as_json: bool, render) -> None:
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        render(doc)


@analyze.command()
def redundancy(
    trace: Path | None = trace_argument(),
    match_lens: str = typer.Option("2,4,8", "--match-lens", help="Context match lengths to compare (one line each)."),
    draft_len: int = typer.Option(0, "--draft-len", help="Draft the plurality path's first K tokens (0: draft CT*, "
                                  "the majority prefix)."),
    max_candidates: int = typer.Option(64, "--max-candidates", help="Newest matched continuations kept per position."),
    no_structure: bool = typer.Option(False, "--no-structure", help="Ignore semantic blocks (history per query only)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the figure here (.png, .svg or .pdf)."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip malformed lines (and count them)."),
) -> None:
    """Acceptance vs redundancy c/n for several match lengths (AgentSpec Figure 6), by replaying outputs."""
    from agentspec_sim.analysis.redundancy import plot_redundancy, redundancy_profile

    lens = _int_list(match_lens, "--match-lens")
    if max_candidates < 1 or draft_len < 0:
        raise UsageError("--max-candidates must be ≥ 1 and --draft-len ≥ 0")
    _check_output(Output("--output", output, FIGURE_SUFFIXES), trace)
    path, workload = load_workload(trace, skip_bad_lines)
    profile = redundancy_profile(workload, _token_bytes(workload), lens, max_candidates=max_candidates,
                                 draft_len=draft_len, structured=not no_structure)
    profile["trace"] = str(path)
    if output is not None:
        profile["figure"] = str(plot_redundancy(profile, output, title=f"Acceptance vs redundancy — {path.name}"))
    _emit(profile, as_json, _render_redundancy)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _render_redundancy(profile: dict) -> None:
    console = Console()
    lens = profile["match_lens"]
    table = Table(title=f"{profile['trace']}: acceptance ratio 1 − ρ by redundancy c/n (draft {profile['draft']}; "
                        "drafts in bin)")
    table.add_column("c/n", justify="right")
    for L in lens:
        table.add_column(f"match {L}", justify="right")
    for i, row in enumerate(profile["by_len"][lens[0]]["bins"]):
        cells = []
        for L in lens:
            r = profile["by_len"][L]["bins"][i]
            cells.append(f"{_pct(r['acceptance'])} ({r['positions']:,})")
        table.add_row(f"{row['lo']:.1f}–{row['hi']:.1f}", *cells)
    for key, label in (("overall", "all"),):
        table.add_row(label, *(f"{_pct(profile['by_len'][L][key]['acceptance'])} "
                               f"({profile['by_len'][L][key]['positions']:,})" for L in lens))
    console.print(caption_below(table))
    by_n = Table(title="by number of candidates n: acceptance ratio / drafts accepted in full")
    by_n.add_column("n", justify="right")
    for L in lens:
        by_n.add_column(f"match {L}", justify="right")
    for i, row in enumerate(profile["by_len"][lens[0]]["by_n"]):
        label = f"{row['lo']}" if row["lo"] == row["hi"] else f"{row['lo']}–{row['hi'] or ''}"
        by_n.add_row(label, *(f"{_pct(profile['by_len'][L]['by_n'][i]['acceptance'])} / "
                              f"{_pct(profile['by_len'][L]['by_n'][i]['full_accept'])}" for L in lens))
    console.print(by_n)
    console.print(f"{profile['positions']:,} output positions replayed"
                  + (f"; figure: {profile['figure']}" if "figure" in profile else ""))


@analyze.command()
def roles(
    trace: Path | None = trace_argument(),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the cap file (.json, atomically); the "
                                "agspec drafter reads it through its `role_caps` key.", show_default=False),
    drafter: str = typer.Option('{"method": "agspec"}', "--drafter", help="The agspec speculative config whose "
                                "retrieval is profiled (corpora, representations, controller)."),
    k_max: int | None = typer.Option(None, "--k-max", help="Longest draft profiled (default: the config's "
                                     "num_speculative_tokens)."),
    penalty: float | None = typer.Option(None, "--penalty", help="λ, the cost of verifying one draft token in decode "
                                         "steps (default: t_V/t_A from the cost model at --batch-size)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Batch size at which λ is taken from the cost model."),
    hardware: str = typer.Option("a100-80g", "--hardware", help="Hardware profile for λ."),
    model: str = typer.Option("qwen3-8b", "--model", help="Model profile for λ."),
    max_queries: int | None = typer.Option(None, "--max-queries", help="Profile only the first N queries."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole cap-file document instead of a table."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip malformed lines (and count them)."),
) -> None:
    """Per-role acceptance curves and draft caps for the agspec drafter (AgSpec: offline role profiling)."""
    from agentspec_sim.analysis.roles import analyze_roles
    from agentspec_sim.engine.drafting import SpecConfigError
    from agentspec_sim.host.resources import ResourceError

    if k_max is not None and k_max < 1:
        raise UsageError("--k-max must be ≥ 1")
    if batch_size < 1:
        raise UsageError("--batch-size must be ≥ 1")
    _check_output(Output("--output", output, JSON_SUFFIXES), trace, {"--model": model, "--hardware": hardware,
                                                                     "--drafter": json_paths([drafter])})
    path, workload = load_workload(trace, skip_bad_lines)
    try:
        doc = analyze_roles(workload, output, drafter=drafter, k_max=k_max, penalty=penalty, batch_size=batch_size,
                            hardware=hardware, model=model, max_queries=max_queries)
    except ResourceError:
        raise  # run_guarded writes its settings as options
    except (SpecConfigError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise UsageError(f"analyze roles: {exc}") from None
    doc["trace"] = str(path)
    _emit(doc, as_json, _render_roles)


def _render_roles(doc: dict) -> None:
    table = Table(title=f"per-role draft caps → {doc['output']}  (λ = {doc['penalty']:.4f}: {doc['penalty_source']})")
    for col in ("role", "calls", "positions", "drafted", "P(accept) pos 1", "pos 4", "pos 8", "pos 16", "cap"):
        table.add_column(col, justify="left" if col == "role" else "right")
    rows = [*doc["roles"].items(), ("(default: all calls)", doc["all"])]
    for role, r in rows:
        p = r["curve"]["p_accept"]
        at = [f"{p[i - 1]:.2f}" if i <= len(p) else "-" for i in (1, 4, 8, 16)]
        table.add_row(role, f"{r['calls']:,}", f"{r['positions']:,}", f"{r['curve']['drafted'][0]:.2f}", *at,
                      str(r["cap"]))
    Console().print(caption_below(table))
