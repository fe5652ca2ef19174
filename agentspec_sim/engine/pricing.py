"""Pricing the engine's steps: each logged step's drafting seconds (the proposal before it) plus its forward
time from the cost model, the token budget M(b) of its batch size, and — when the run ends — the t_A / t_V /
t_D reference of every step with drafts (the same batch priced without its drafts, paper §3.1)."""

from __future__ import annotations

import numpy as np

from agentspec_sim.cost.base import BatchShape, StepCostModel, step_times
from agentspec_sim.engine.result import StepLogBuilder
from agentspec_sim.engine.scheduler import SimulationError


class StepPricer:
    """Prices runs of steps as the event loop logs them (engine/simulator.py)."""

    def __init__(self, cost: StepCostModel, max_num_batched_tokens: int, check_budget: bool, *,
                 synchronous: bool = False) -> None:
        self.cost = cost
        # A synchronous engine (no async scheduling) waits for its host work every step (`sync_host_time`).
        self.synchronous = synchronous
        self.max_num_batched_tokens = max_num_batched_tokens
        self.check_budget = check_budget  # BUDGET (engine/invariants.py), with the run's invariant checks
        self._budget_memo: dict[int, int] = {}

    def price(self, log: StepLogBuilder, k0: int, k1: int, now: float, first_draft_s: float, *,
              moe_tokens: int = 0) -> float:
        """Times of steps k0 … k1 − 1, the last logged and not yet priced, the first starting at `now`; returns
        the end of the last one.

        Each step's duration is the drafting time spent before it (the first step's: `first_draft_s`, the event
        loop's last proposal; the others': the compiled loop's own, already logged) plus its forward time, and on
        a synchronous engine the host work the GPU waits for (`StepCostModel.sync_host_time`; not in `forward_s`).
        Step j starts when step j − 1 ends and takes its drafting then its forward time, accumulated in that order
        as one step per event would: end_j = (end_{j−1} + draft_j) + forward_j. A run of one step (every step of a
        drafter the event loop drives) is priced with Python scalars: the same sums, without the arrays.
        `moe_tokens` (one step only): the tokens a data-parallel MoE model's experts see over all ranks
        (`BatchShape.moe_tokens`; 0: this rank's × the data-parallel size).
        """
        m = k1 - k0
        buf = log.buf
        r1 = log.num_rows
        if m == 1:
            col = buf.steps
            n = int(col.batch_size[k0])
            rows = buf.rows[r1 - n:r1]
            shape = BatchShape(rows["scheduled"].astype(np.int64), rows["context_len"].astype(np.int64),
                               rows["decode"] == 0, moe_tokens)
            forward = float(self.cost.step_time(shape).total_s)
            host = float(self.cost.sync_host_time(np.array([n]))[0]) if self.synchronous else 0.0
            col.time_s[k0], col.forward_s[k0], col.draft_s[k0], col.host_s[k0] = now, forward, first_draft_s, host
            col.budget[k0] = self._budget(n)
            self._check(int(col.scheduled_tokens[k0]))
            return now + first_draft_s + (forward + host)  # the order the run path sums in
        steps = buf.steps.window(k0, k1)
        sizes = steps.batch_size
        rows = buf.rows[r1 - int(sizes.sum()):r1]
        offsets = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        forward = step_times(self.cost, rows["scheduled"], rows["context_len"], rows["decode"] == 0, offsets)
        draft_s = steps.draft_s.copy()
        draft_s[0] = first_draft_s
        interleaved = np.empty(2 * m + 1)
        interleaved[0], interleaved[1::2], interleaved[2::2] = now, draft_s, forward
        host = 0.0  # an async engine's host work overlaps its steps
        if self.synchronous:
            host = self.cost.sync_host_time(sizes)
            interleaved[2::2] += host
        ends = np.cumsum(interleaved)[2::2]
        steps.time_s[0] = now
        steps.time_s[1:] = ends[:-1]
        steps.forward_s[:], steps.draft_s[:], steps.host_s[:] = forward, draft_s, host
        steps.budget[:] = self._budgets(sizes)
        self._check(int(steps.scheduled_tokens.max()))
        return float(ends[-1])

    def price_references(self, log: StepLogBuilder) -> None:
        """t_A, t_V and t_D of every step with drafts (NaN elsewhere), from its reference: the same batch priced
        without its drafts. One batched `step_times` over the whole log (bit-identical to pricing each step
        alone) instead of a second cost-model call per step in the hot loop."""
        b = log.buf
        steps = b.steps.head(log.num_steps)
        rows = b.rows[:log.num_rows]
        sizes, d = steps.batch_size, steps.D
        for column in (steps.t_A, steps.t_V, steps.t_D):
            column[:] = np.nan
        drafting = d.nonzero()[0]
        if drafting.shape[0] == 0:
            return
        sub = np.zeros(drafting.shape[0] + 1, dtype=np.int64)
        np.cumsum(sizes[drafting], out=sub[1:])
        picked = np.repeat(d > 0, sizes)  # the rows of those steps: four fields, not whole log rows
        base = step_times(self.cost, rows["scheduled"][picked] - rows["drafted"][picked], rows["context_len"][picked],
                          rows["decode"][picked] == 0, sub)
        n, dk = sizes[drafting], d[drafting]
        steps.t_A[drafting] = base / n
        steps.t_V[drafting] = (steps.forward_s[drafting] - base) / dk
        steps.t_D[drafting] = steps.draft_s[drafting] / dk

    def _check(self, scheduled_tokens: int) -> None:
        if self.check_budget and scheduled_tokens > self.max_num_batched_tokens:
            raise SimulationError(f"step scheduled {scheduled_tokens} tokens > max_num_batched_tokens (BUDGET)")

    def _budget(self, n: int) -> int:
        budget = self._budget_memo.get(n)
        if budget is None:
            budget = self._budget_memo[n] = self.cost.token_budget(n)
        return budget

    def _budgets(self, sizes: np.ndarray) -> np.ndarray:
        """M(b) of each step's batch size (memoised: few distinct sizes, all ≤ max_num_seqs, so a lookup
        table by size instead of sorting millions of steps' sizes)."""
        present = np.bincount(sizes)
        table = np.zeros(present.shape[0], dtype=np.int64)
        for n in present.nonzero()[0].tolist():
            table[n] = self._budget(n)
        return table[sizes]
