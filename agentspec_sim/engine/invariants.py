"""Whole-run invariants, checked once at the end of a run when `EngineConfig.check_invariants` is on.

The per-step checks (SEQS, BLOCKS, REFS, SLOTS, CALLS, BUDGET, STALL) live in the simulator, which
holds the state they read; the ones here need the whole step log and call table and cost one
vectorised pass over them (docs/invariants.md lists every invariant and the test that checks it):

- CLOCK: step times are finite, every step takes > 0 s, and step k + 1 starts no earlier than step
  k ends (one engine, steps never overlap, the clock never goes back).
- CAUSALITY: no call is scheduled before it arrives, emits its first token before it is scheduled,
  or finishes before its first token; the next call of a query arrives no earlier than its
  predecessor finished (or was refused).
- WORK: the engine never idles while a call waits: a step that leaves calls waiting is followed
  at once by the next step.
- DONE: at the end every call is finished, refused or skipped (never waiting or running), a
  finished call emitted exactly its target (its recording, capped at max_model_len) and has
  arrival, first-token and finish times; a skipped call never arrived.

Each check takes plain arrays (so tests can hand it a broken log) and raises SimulationError naming
the invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from agentspec_sim.engine.request import S_FINISHED, S_REFUSED, S_RUNNING, S_SKIPPED, S_WAITING
from agentspec_sim.engine.scheduler import SimulationError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from agentspec_sim.engine.request import CallState, CallTable
    from agentspec_sim.engine.result import StepLogBuilder
    from agentspec_sim.engine.scheduler import Scheduler

# Step times are sums of float64 durations computed in different orders (one step per event or a
# run of steps); they agree to far better than a nanosecond of simulated time.
TOLERANCE_S = 1e-9

__all__ = ["TOLERANCE_S", "check_causality", "check_clock", "check_completion", "check_run", "check_step",
           "check_work_conservation", "first_scheduled", "predecessors"]


def check_clock(start_s: np.ndarray, duration_s: np.ndarray) -> None:
    """CLOCK: finite start times, durations > 0, and no step starting before the previous one ends."""
    if not (np.isfinite(start_s).all() and np.isfinite(duration_s).all()):
        k = int(np.flatnonzero(~(np.isfinite(start_s) & np.isfinite(duration_s)))[0])
        raise SimulationError(f"step {k}: time {start_s[k]} s, duration {duration_s[k]} s is not finite (CLOCK)")
    if (duration_s <= 0).any():
        k = int(np.flatnonzero(duration_s <= 0)[0])
        raise SimulationError(f"step {k} takes {duration_s[k]} s; a step must take > 0 s or time stalls (CLOCK)")
    ends = start_s[:-1] + duration_s[:-1]
    early = start_s[1:] < ends - TOLERANCE_S
    if early.any():
        k = int(np.flatnonzero(early)[0])
        raise SimulationError(f"step {k + 1} starts at {start_s[k + 1]} s, before step {k} ends at {ends[k]} s "
                              "(CLOCK)")


def check_work_conservation(start_s: np.ndarray, duration_s: np.ndarray, waiting: np.ndarray) -> None:
    """WORK: a step after which calls still wait is followed by the next step the instant it ends."""
    n = start_s.shape[0]
    if n and waiting[-1] > 0:
        raise SimulationError(f"{int(waiting[-1])} call(s) still wait after the last step (WORK)")
    ends = start_s[:-1] + duration_s[:-1]
    idle = (waiting[:-1] > 0) & (np.abs(start_s[1:] - ends) > TOLERANCE_S)
    if idle.any():
        k = int(np.flatnonzero(idle)[0])
        raise SimulationError(f"the engine idled from {ends[k]} s to {start_s[k + 1]} s after step {k} while "
                              f"{int(waiting[k])} call(s) waited (WORK)")


def first_scheduled(row_calls: np.ndarray, row_steps: np.ndarray, start_s: np.ndarray, num_calls: int) -> np.ndarray:
    """Start time of the first step that scheduled each call (NaN: never scheduled); rows in step order."""
    out = np.full(num_calls, np.nan)
    calls, first = np.unique(row_calls, return_index=True)
    out[calls] = start_s[row_steps[first]]
    return out


def predecessors(queries: Iterable[Sequence[CallState]], num_calls: int) -> np.ndarray:
    """Each call's previous call in its query (its table row; −1 for a query's first)."""
    out = np.full(num_calls, -1, dtype=np.int64)
    for calls in queries:
        order = [s.index for s in calls]
        out[order[1:]] = order[:-1]
    return out


def check_causality(ids: list[str], arrival_s: np.ndarray, scheduled_s: np.ndarray, first_token_s: np.ndarray,
                    finish_s: np.ndarray, status: np.ndarray, predecessor: np.ndarray) -> None:
    """CAUSALITY over calls (one entry each; `predecessor`: the row of the previous call of its query, −1)."""
    tol = TOLERANCE_S
    with np.errstate(invalid="ignore"):
        checks = (
            (scheduled_s < arrival_s - tol, "is scheduled at {s} s, before it arrives at {a} s"),
            (first_token_s < scheduled_s - tol, "emits its first token at {f} s, before its first step at {s} s"),
            (finish_s < first_token_s - tol, "finishes at {e} s, before its first token at {f} s"),
        )
    for bad, what in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SimulationError(f"call {ids[i]!r} " + what.format(s=scheduled_s[i], a=arrival_s[i],
                                                                     f=first_token_s[i], e=finish_s[i])
                                  + " (CAUSALITY)")
    has_pred = (predecessor >= 0) & ~np.isnan(arrival_s)
    rows = np.flatnonzero(has_pred)
    pred = predecessor[rows]
    done = np.isin(status[pred], (S_FINISHED, S_REFUSED))
    early = ~done | (arrival_s[rows] < finish_s[pred] - tol)
    if early.any():
        i, p = int(rows[early.nonzero()[0][0]]), int(pred[early.nonzero()[0][0]])
        raise SimulationError(f"call {ids[i]!r} arrives at {arrival_s[i]} s, before the call before it, {ids[p]!r}, "
                              f"finished (at {finish_s[p]} s) (CAUSALITY)")


def check_completion(ids: list[str], status: np.ndarray, emitted: np.ndarray, target: np.ndarray,
                     arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray) -> None:
    """DONE: every call ended (finished, refused or skipped), each as its status says."""
    open_ = np.isin(status, (S_WAITING, S_RUNNING))
    if open_.any():
        i = int(np.flatnonzero(open_)[0])
        raise SimulationError(f"call {ids[i]!r} is still {'waiting' if status[i] == S_WAITING else 'running'} at "
                              "the end of the run (DONE)")
    finished = status == S_FINISHED
    short = finished & (emitted != target)
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise SimulationError(f"call {ids[i]!r} finished with {int(emitted[i])} tokens, its recording has "
                              f"{int(target[i])} (DONE)")
    untimed = finished & ~(np.isfinite(arrival_s) & np.isfinite(first_token_s) & np.isfinite(finish_s))
    if untimed.any():
        i = int(np.flatnonzero(untimed)[0])
        raise SimulationError(f"finished call {ids[i]!r} lacks an arrival, first-token or finish time (DONE)")
    ghost = (status == S_SKIPPED) & (~np.isnan(arrival_s) | (emitted > 0))
    if ghost.any():
        i = int(np.flatnonzero(ghost)[0])
        raise SimulationError(f"skipped call {ids[i]!r} arrived or emitted tokens (DONE)")


def check_run(log: StepLogBuilder, table: CallTable, states: Sequence[CallState],
              queries: Iterable[Sequence[CallState]]) -> None:
    """All whole-run invariants of a finished simulation (called by `Simulator.run`): its step log, its call
    table and states, and each query's calls in order."""
    buf = log.buf
    n_steps, n_rows = log.num_steps, log.num_rows
    steps = buf.steps.head(n_steps)
    start_s = steps.time_s
    duration_s = steps.duration_s
    check_clock(start_s, duration_s)
    check_work_conservation(start_s, duration_s, steps.waiting)

    n = table.rows
    col = table.cols
    ids = [s.call_id for s in states]
    status = col["status"][:n]
    rows = buf.rows[:n_rows]
    row_steps = np.repeat(np.arange(n_steps), steps.batch_size)
    scheduled_s = first_scheduled(np.ascontiguousarray(rows["call"]), row_steps, start_s, n)
    arrival_s, first_token_s, finish_s = col["arrival_s"][:n], col["first_token_s"][:n], col["finish_s"][:n]
    check_causality(ids, arrival_s, scheduled_s, first_token_s, finish_s, status, predecessors(queries, n))
    check_completion(ids, status, col["num_emitted"][:n], col["target_len"][:n], arrival_s, first_token_s,
                     finish_s)


def check_step(sched: Scheduler, pool: Any, t: CallTable, states: Sequence[CallState], max_num_seqs: int,
               block_size: int) -> None:
    """The runtime invariants after each run of steps (SEQS, BLOCKS, REFS, SLOTS, CALLS): the scheduler, the
    KV pool and the call table agree. BUDGET is checked where steps are priced (engine/pricing.py)."""
    if sched.num_running > max_num_seqs:
        raise SimulationError(f"{sched.num_running} running > max_num_seqs (SEQS)")
    held = int(np.count_nonzero(pool.ref[1:]))
    if held + pool.num_free != pool.usable:
        raise SimulationError(f"KV blocks: {held} held + {pool.num_free} free ≠ {pool.usable} usable (BLOCKS)")
    col, n = t.cols, t.rows
    running = sched.qu.running[:sched.num_running]
    slots = col["slot"][running]
    blocks = np.where(slots >= 0, t.slot_nblocks[np.maximum(slots, 0)], 0)
    if int(blocks.sum()) != int(pool.ref.sum()):
        raise SimulationError(f"KV references {int(pool.ref.sum())} ≠ blocks held by running calls "
                              f"{int(blocks.sum())} (REFS)")
    bad = (col["status"][running] != S_RUNNING) | (blocks * block_size < col["num_computed"][running])
    if bad.any():
        s = states[int(running[bad.nonzero()[0][0]])]
        raise SimulationError(f"call {s.call_id!r}: {s.num_computed} computed tokens in "
                              f"{len(s.block_ids)} blocks (SLOTS)")
    waiting = sched._waiting_rows()
    bad = (col["status"][waiting] != S_WAITING) | (col["slot"][waiting] >= 0)
    if bad.any():
        s = states[int(waiting[bad.nonzero()[0][0]])]
        raise SimulationError(f"waiting call {s.call_id!r} holds KV blocks (SLOTS)")
    arrived = int(np.count_nonzero(~np.isnan(col["arrival_s"][:n])))
    finished = int(np.count_nonzero(np.isin(col["status"][:n], (S_FINISHED, S_REFUSED))))
    if arrived != finished + sched.num_running + sched.num_waiting:
        raise SimulationError(f"CALLS: {arrived} arrived ≠ {finished} finished or refused + "
                              f"{sched.num_running} running + {sched.num_waiting} waiting")
