"""Watching a run as it goes, to end it once what it was run for is decided (a capacity probe whose failure is
already certain: agentspec_sim/capacity/steady.py `FailureWatch`).

The engine knows nothing of verdicts: it offers a `RunSoFar`, what the run has settled up to `known_s`, and
asks the watch after each engine run of steps whose end reaches the watch's `next_s`; the watch says whether to
stop there. A stopped run's result holds what happened up to that instant (calls still waiting or running keep
those statuses) and says when it stopped (`RunResult.stopped_s`).

What is settled at `known_s`: every call that reached the server by then has its arrival time, every first
token and finish of a step that ended by then its time, and every step that ended by then is in the log with its
emitted tokens. A step running across `known_s` may already have advanced the calls' counters (`num_emitted`),
so a watch reads times, never counters.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from agentspec_sim.engine.result import StepLogBuilder


class RunSoFar(Protocol):
    """What a run has settled up to `known_s` (module docstring)."""

    @property
    def known_s(self) -> float: ...

    @property
    def max_model_len(self) -> int:
        """Prompts of at least this many tokens are refused when they arrive (the rest of their query skipped)."""
        ...

    def column(self, name: str) -> np.ndarray:
        """A call-table column (engine/request.py `CALL_COLUMNS`), one entry per call in the result's order."""
        ...

    def query_sends(self) -> np.ndarray:
        """Each query instance's send time (NaN: not sent yet), by query index."""
        ...

    def call_queries(self) -> np.ndarray:
        """Each call's query index."""
        ...

    def emitted_between(self, start: float, end: float) -> int:
        """Output tokens of the steps that ended in [start, end] (each step's tokens at its end, as
        `RunResult.emissions` counts them); exact once `known_s` ≥ end."""
        ...


class RunWatch(Protocol):
    """Asked after an engine run of steps ends at or past `next_s`: `look` returns True to stop the run there
    (and moves `next_s` on otherwise)."""

    next_s: float

    def look(self, run: RunSoFar) -> bool: ...


def emitted_between(log: StepLogBuilder, start: float, end: float) -> int:
    """One engine's tokens emitted in [start, end] (each step's at its end: `StepLogBuilder.emissions_frame`'s
    arithmetic, so a watch and the finished run's emissions agree to the bit)."""
    b = log.buf
    ns, nr = log.num_steps, log.num_rows
    steps = b.steps.head(ns)
    ends = steps.time_s + steps.duration_s
    emitted = b.rows["emitted"][:nr]
    at = np.repeat(ends, steps.batch_size)
    inside = (at >= start) & (at <= end)
    return int(emitted[inside].sum())
