"""Sweeps over drafter configurations and engine settings, run in worker processes and resumable;
capacity planning from their results.

`run_sweep(...)` runs a grid and returns its results (one row per cell, schema in `results` and
docs/sweep-and-plan.md); `read_results(path)` reads a results file back; `plan(frame, slo)` picks the
batch size and drafter (module `plan`).
"""

from agentspec_sim.sweep.cells import Cell, SweepError
from agentspec_sim.sweep.results import KEY_COLUMNS, read_results
from agentspec_sim.sweep.run import run_cell, run_sweep

__all__ = ["KEY_COLUMNS", "Cell", "SweepError", "read_results", "run_cell", "run_sweep"]
