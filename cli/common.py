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


def say_if_compiling() -> None:
    """One line on stderr before the first run in an environment whose compiled kernels are not cached yet."""
    from agentspec_sim.engine.run import kernels_compiled

    if not kernels_compiled():
        from rich.console import Console

        Console(stderr=True, highlight=False, soft_wrap=True).print(
            "compiling the simulator's kernels: once per install, about a minute (cached for later runs)…",
            markup=False)


class PlainProgress:
    """Progress as plain lines on stderr, for logs and pipes where a live bar cannot redraw.

    `update(name, done, total)` prints `name: done/total unit (elapsed s)` when a task starts and then at
    most once every `every_s` seconds per task; the end is the caller's own line ("finished …")."""

    def __init__(self, unit: str, every_s: float = 10.0) -> None:
        import time

        from rich.console import Console

        self._clock = time.monotonic
        self._console = Console(stderr=True, highlight=False, soft_wrap=True)
        self._unit, self._every_s = unit, every_s
        self._start = self._clock()
        self._last: dict[str, float] = {}

    def update(self, name: str, done: int, total: int | None) -> None:
        now = self._clock()
        last = self._last.get(name)
        if last is not None and (now - last < self._every_s or (total is not None and done >= total)):
            return
        self._last[name] = now
        of = "" if total is None else f"/{total:,}"
        self._console.print(f"{name}: {done:,}{of} {self._unit} ({now - self._start:.0f} s)", markup=False)
