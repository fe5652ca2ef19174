"""Options and helpers shared by commands that read a trace."""

from __future__ import annotations

from pathlib import Path

import typer

from agentspec_sim.trace.schema import Workload


def trace_argument():
    return typer.Argument(None, metavar="[TRACE]", help="Trace file (default: the bundled coding-agent trace).",
                          show_default=False)


def load_workload(trace: Path | None, skip_bad_lines: bool = False) -> tuple[Path, Workload]:
    """Load `trace` (or the bundled default); say how many lines were skipped, if any."""
    from rich.console import Console

    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    path = trace if trace is not None else default_trace_path()
    workload = load_trace(path, skip_bad_lines=skip_bad_lines)
    if workload.skipped:
        Console(stderr=True).print(f"skipped {len(workload.skipped)} bad line(s); first: {workload.skipped[0]}")
    return path, workload
