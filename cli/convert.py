"""`agentspec-sim convert FORMAT INPUT... -o TRACE`: raw agent logs to the trace format."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app
from agentspec_sim.trace.convert_run import convert_to_trace


@app.command()
def convert(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="Source format (see the list below)."),
    inputs: list[Path] = typer.Argument(..., metavar="INPUT...", help="Files or directories to convert."),
    output: Path = typer.Option(..., "-o", "--output", help="Trace to write (.jsonl, .jsonl.gz/.xz/.zst)."),
    tokens: bool = typer.Option(False, "--tokens", help="Write token ids instead of text (faster to load)."),
    tokenizer: str = typer.Option("qwen3", help="Tokenizer named in the trace's meta line."),
    max_queries: int | None = typer.Option(None, "--max-queries", help="Keep only the first N queries."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip input lines that cannot be read (a "
                                        "truncated last line…) and say how many; line-oriented formats "
                                        "(openai-chat, otel-genai)."),
) -> None:
    """Convert raw agent logs into an agentspec-sim trace (validated by loading it back)."""
    from agentspec_sim.trace.convert import CONVERTERS

    if fmt not in CONVERTERS:
        raise UsageError(f"FORMAT: unknown format {fmt!r}; choose one of {', '.join(sorted(CONVERTERS))}")
    if max_queries is not None and max_queries < 1:
        raise UsageError(f"--max-queries: must be ≥ 1, got {max_queries}")
    from agentspec_sim.io.outputs import TRACE_SUFFIXES, Output, check_outputs

    # An existing output inside an INPUT folder counts as an input: the converter reads that folder.
    check_outputs(Output("--output", output, TRACE_SUFFIXES), inputs={"INPUT": inputs, "--tokenizer": tokenizer})
    summary = convert_to_trace(fmt, inputs, output, tokens=tokens, tokenizer=tokenizer, max_queries=max_queries,
                               skip_bad_lines=skip_bad_lines)
    for note in summary["notes"]:
        Console(stderr=True, highlight=False).print(f"note: {note}", markup=False)
    if summary["skipped"]:
        first = summary["skipped"][0]
        Console(stderr=True, highlight=False).print(
            f"skipped {len(summary['skipped']):,} bad input line(s); the first: {first}", markup=False)
    Console(stderr=True).print(
        f"wrote {output}: {summary['queries']} queries, {summary['calls']} calls, "
        f"{summary['prompt_tokens']:,} prompt / {summary['output_tokens']:,} output tokens"
        + ("" if summary["bytes"] is None else f", {summary['bytes']:,} bytes")
    )


def _format_help() -> str:
    from agentspec_sim.trace.convert import CONVERTERS

    return "\n".join(f"  {c.name:<16} {c.summary}" for c in CONVERTERS.values())


convert.__doc__ = (convert.__doc__ or "") + "\n\nFormats:\n\n" + _format_help()
