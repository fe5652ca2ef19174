"""A clock that counts engine steps: every step takes one unit of time, whatever it holds.

`validate vllm --clock steps` drives a real vLLM on this clock and the simulator prices steps with
`StepClockCost`, so both sides see the same times: a query's next call arrives `think_s` steps after
its previous call's last step, a recorded `arrival_s` is a step count. The schedule then depends only
on the tokens and the engine's rules, not on how fast the machine running vLLM is (a CPU wall clock
and a simulated GPU would put arrivals between different steps). Goodput on this clock is tokens per
step.

Float safety: a step is exactly 1.0 and drafting 2**-60 per call, far below the spacing of floats at
1.0, so the clock reads whole steps exactly (`now + draft + 1.0` rounds to `now + 1.0` once now ≥ 1)
and arrival times compare exactly with step boundaries.
"""

from __future__ import annotations

import numpy as np

from agentspec_sim.cost.base import BatchShape, StepCost

STEP = 1.0
_DRAFT_PER_CALL = 2.0**-60  # > 0 as the protocol asks; never moves the clock


class StepClockCost:
    """`StepCostModel` whose every engine step costs `STEP`: ties no timing to a machine."""

    def step_time(self, batch: BatchShape) -> StepCost:
        return StepCost(STEP, 0.0, 0.0, STEP, 0.0)

    def step_times(self, query_lens: np.ndarray, context_lens: np.ndarray, is_prefill: np.ndarray,
                   offsets: np.ndarray) -> np.ndarray:
        return np.full(max(0, offsets.shape[0] - 1), STEP, dtype=np.float64)

    def draft_model_time(self, num_calls: int, draft_len: int, context_lens: np.ndarray | None = None) -> float:
        return _DRAFT_PER_CALL * num_calls * draft_len

    def model_free_draft_time(self, num_calls: int) -> float:
        return _DRAFT_PER_CALL * num_calls

    def frontend_time(self, prompt_lens: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(prompt_lens))  # engine steps only: the harness has no front end

    def sync_host_time(self, batch_sizes: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(batch_sizes))  # a step is one tick, host work included

    @property
    def ridge_tokens(self) -> float:
        # Verifying more tokens costs nothing on this clock: no finite ridge, no finite budget.
        return float(2**31)

    def token_budget(self, batch_size: int) -> int:
        return max(0, 2**31 - batch_size)

    def per_token_decode_time(self, batch_size: int, context_len: int) -> float:
        return STEP / batch_size

    def describe(self) -> dict[str, float | int | str]:
        return {"cost_model": "step clock", "step_s": STEP}
