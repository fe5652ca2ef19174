"""Options and helpers shared by commands that read a trace."""

from __future__ import annotations

from pathlib import Path

import typer

from agentspec_sim.trace.schema import Workload


def trace_argument():
    return typer.Argument(None, metavar="[TRACE]", help="Trace file, or - to read it from standard input (gzip, "
                          "xz or zstd too); default: the bundled coding-agent trace.", show_default=False)


def load_workload(trace: Path | None, skip_bad_lines: bool = False) -> tuple[Path, Workload]:
    """Load `trace` (or the bundled default; `-`: standard input, then the path returned is `<stdin>`, the name
    its errors and reports use); say how many lines were skipped, if any."""
    from rich.console import Console

    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import STDIN_NAME, is_stdin, load_trace

    path = trace if trace is not None else default_trace_path()
    workload = load_trace(path, skip_bad_lines=skip_bad_lines)
    if is_stdin(path):
        path = Path(STDIN_NAME)
    if workload.skipped:
        Console(stderr=True).print(f"skipped {len(workload.skipped)} bad line(s); first: {workload.skipped[0]}")
    return path, workload


def say_if_compiling() -> None:
    """One line on stderr before the first run in an environment whose compiled kernels are not cached yet."""
    from agentspec_sim.run.simulation import kernels_compiled

    if not kernels_compiled():
        from rich.console import Console

        Console(stderr=True, highlight=False, soft_wrap=True).print(
            "compiling the simulator's kernels: once for these sources on this machine, under a minute (cached for "
            "later runs and installs)…",
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


# One unit per quantity across tables, JSON and flags: times are seconds everywhere (the SLO flags and the
# JSON documents are seconds), so a table column says "s" in its header and shows seconds, never ms.
def seconds(value: float | None) -> str:
    """Seconds with three significant digits and no exponent: 233,011 · 233 · 17.3 · 0.174 · 0.0113."""
    import math

    if value is None or not math.isfinite(value):
        return "—"
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    decimals = 2 - math.floor(math.log10(abs(value)))
    return f"{value:.{decimals}f}"


def percent(rate: float | None) -> str:
    """A rate in [0, 1] as a percentage with one decimal (`—` where undefined, e.g. for `normal`)."""
    return "—" if rate is None else f"{rate * 100:.1f}%"


# The two rejection rates, in the words every table that shows them uses (definitions: agentspec_sim/metrics.py).
REJECTION_LEGEND = ("rej.tok: rejected / drafted tokens = 1 − vLLM's draft acceptance rate "
                    "(vllm:spec_decode_num_accepted_tokens / num_draft_tokens) · rej.call: the paper's rejection "
                    "rate, the mean over calls of a call's rejected / drafted")


def burst_note(workload: Workload, config) -> str | None:
    """The line a latency table needs when every query arrives at once (the default trace records no
    arrival_s, and without --rate every query's first call then arrives at t = 0): TTFT and query latency
    are then mostly queueing behind the whole trace, not what a user of a loaded server sees. None otherwise."""
    if (config.arrival in ("poisson", "request-rate") or config.copies > 1 or config.max_concurrency is not None
            or (len(workload.queries) < 2 and config.replicate < 2)):
        return None
    recorded = config.arrival == "recorded"
    starts = {(q.calls[0].arrival_s or 0.0) if recorded else 0.0 for q in workload.queries}
    if len(starts) > 1:
        return None
    return ("note: every query arrives at once (the trace records no arrival_s), so TTFT and query latency are "
            "queueing behind the whole burst; --request-rate Q sends them as vllm bench serve does (Poisson, Q per "
            "second), --max-concurrency N as N agents in a closed loop")


def caption_below(table):
    """`table` with its caption printed below it at the console's width, not wrapped to the table's (a narrow
    table made its caption a ribbon of a few words a line, whatever COLUMNS said)."""
    from rich.console import Group
    from rich.text import Text

    caption = table.caption
    if not caption:
        return table
    table.caption = None
    return Group(table, Text(caption, style="table.caption") if isinstance(caption, str) else caption)
