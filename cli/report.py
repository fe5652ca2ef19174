"""`agentspec-sim report RESULTS…`: a Markdown report with PNG plots from a sweep's results."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app

REPORT_FILES = ("report.md", "*.png")  # what agentspec_sim/report/build.py writes into the folder


@app.command()
def report(
    results: list[Path] = typer.Argument(..., metavar="RESULTS...", help="Sweep results (.parquet or .jsonl), one "
                                         "or more; cells from several files are combined."),
    output: Path = typer.Option(Path("report"), "--output", "-o", help="Folder for report.md and its PNGs."),
    steps: list[Path] = typer.Option([], "--steps", help="A `replay --steps` log (parquet) for the per-step "
                                     "draft-token plot (repeatable)."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Max batch size of the latency CDF, the time "
                                          "breakdown and the goodput table (default: each trace's largest)."),
    title: str = typer.Option("agentspec-sim report", "--title", help="The report's heading."),
) -> None:
    """Write a Markdown report with plots: speedup vs batch size, drafts vs budget, latency CDF, time breakdown."""
    from agentspec_sim.report.build import write_report
    from agentspec_sim.report.results import ResultsError, load_results

    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be ≥ 1, got {batch_size}")
    from agentspec_sim.io.outputs import Output, check_outputs

    # The folder may hold the results; refused only where a file the report writes would replace an input.
    check_outputs(Output("--output", output, folder=True, names=REPORT_FILES),
                  inputs={"RESULTS": results, "--steps": steps})
    try:
        frame = load_results(results)
        written = write_report(frame, output, batch=batch_size, step_logs=steps, title=title,
                               sources=[f"agentspec-sim report {' '.join(str(p) for p in results)}"])
    except ResultsError as exc:
        message = str(exc)
        named = any(message.startswith(str(p)) for p in (*results, *(steps or ())))
        # A check over the results as a whole names what is wrong; with one file it names the file too.
        raise UsageError(message if named or len(results) > 1 else f"{results[0]}: {message}") from None
    console = Console()
    console.print(f"wrote {written.markdown} and {len(written.figures)} plot(s) to {output}")
