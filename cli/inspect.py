"""`agentspec-sim inspect [TRACE]`: what a trace holds, and how repetitive its outputs are."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli.common import load_workload, trace_argument
from agentspec_sim.cli.root import app


@app.command()
def inspect(
    trace: Path | None = trace_argument(),
    max_model_len: int = typer.Option(40960, "--max-model-len", help="Context limit to check calls against "
                                      "(Qwen3-8B: 40,960)."),
    repetition: bool = typer.Option(True, "--repetition/--no-repetition",
                                    help="Run the repeated-span analysis (paper Figure 5)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip malformed lines (and count them)."),
) -> None:
    """Calls, queries, token totals and distributions, context-limit violations, repetition profile."""
    from agentspec_sim.cli.errors import UsageError
    from agentspec_sim.trace.stats import trace_stats

    if max_model_len < 1:
        raise UsageError(f"--max-model-len: must be ≥ 1, got {max_model_len}")
    path, workload = load_workload(trace, skip_bad_lines)
    stats = trace_stats(workload, max_model_len)
    stats["trace"] = str(path)
    if repetition:
        from agentspec_sim.analysis.repetition import isolation_premise, workload_repetition

        stats["repetition"] = workload_repetition(workload)
        stats["isolation_premise"] = isolation_premise(stats["repetition"])
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    _render(stats)


def _render(stats: dict) -> None:
    console = Console()
    head = Table(title=f"{stats['trace']}", show_header=False)
    for key in ("queries", "calls", "agents", "prompt_tokens", "unique_prompt_tokens", "output_tokens",
                "calls_in_delta_form", "calls_with_structure", "calls_with_workspace", "skipped_lines"):
        head.add_row(key.replace("_", " "), f"{stats[key]:,}")
    head.add_row("roles", ", ".join(f"{k}: {v}" for k, v in stats["roles"].items()))
    if "max_model_len" in stats:
        head.add_row(f"calls over {stats['max_model_len']:,} context",
                     f"{stats['calls_total_over_context']:,} (prompt alone: {stats['calls_prompt_over_context']:,})")
    console.print(head)
    dist = Table(title="per-call distributions")
    for col in ("", "mean", "min", "p50", "p90", "p99", "max"):
        dist.add_column(col, justify="right")
    for key in ("prompt_len", "output_len", "calls_per_query"):
        d = stats[key]
        dist.add_row(key.replace("_", " "), f"{d['mean']:,.1f}", f"{d['min']:,}", f"{d['p50']:,.0f}",
                     f"{d['p90']:,.0f}", f"{d['p99']:,.0f}", f"{d['max']:,}")
    console.print(dist)
    rep = stats.get("repetition")
    if rep:
        t = Table(title="repeated output tokens (share of all output tokens, spans ≥ k tokens seen earlier)")
        for col in ("k", "same block", "same query, other block", "other query", "total"):
            t.add_column(col, justify="right")
        for k, row in rep["by_k"].items():
            t.add_row(str(k), *(f"{100 * row[c]:.1f}%" for c in
                                ("same_block", "same_query_other_block", "other_query", "total")))
        console.print(t)
        from agentspec_sim.analysis.repetition import premise_sentence

        console.print(f"AgentSpec's premise (paper Figure 5) {premise_sentence(stats['isolation_premise'])}")
