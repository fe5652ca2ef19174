"""Budget policies: how many tokens each drafting call may propose for the next engine step.

The engine asks once per step, after sampling, for the calls about to draft. vLLM's own policies:
a fixed k (`num_speculative_tokens`), and `num_speculative_tokens_per_batch_size`, where k is looked
up by the number of requests scheduled in the step that just ran (vLLM 0.33 `Scheduler.schedule()`
sets `num_spec_tokens_to_schedule = lookup[len(num_scheduled_tokens)]` and the V1 n-gram proposer
drafts with it). Later policies (AdaSpec-style, AgentSpec's redundancy-aware split of M(b)) register
here by name too, and a drafter picks one through its `budget_policy` class attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from agentspec_sim.drafters.base import SpeculativeConfig, drafter_class

if TYPE_CHECKING:
    from agentspec_sim.engine.request import CallState


@runtime_checkable
class BudgetPolicy(Protocol):
    def max_draft_lens(self, num_scheduled: int, rows: Sequence[CallState]) -> np.ndarray:
        """The most draft tokens each row may propose for the next step.

        Pre:  `rows` are the calls that sampled a token in the step just ended and go on (not in
              partial prefill, not finished); `num_scheduled` ≥ 1 is how many requests that step
              scheduled (prefill chunks included).
        Post: an int64 array of `len(rows)` values ≥ 0 (0: the call does not draft). The engine
              further clips each by max_model_len − num_tokens, as vLLM's proposer does.
        """
        ...


class FixedK:
    """vLLM's static `num_speculative_tokens`: every drafting call may propose k tokens."""

    def __init__(self, k: int) -> None:
        self.k = int(k)

    def max_draft_lens(self, num_scheduled: int, rows: Sequence[CallState]) -> np.ndarray:
        return np.full(len(rows), self.k, dtype=np.int64)


class BatchSizeSchedule:
    """vLLM's `num_speculative_tokens_per_batch_size`: k by the number of scheduled requests.

    Dense lookup as vLLM's `build_dynamic_sd_schedule_lookup`: the first range starts at 1; gaps
    and batch sizes past the last range carry the previous k forward; every k is clipped to
    `num_speculative_tokens`.
    """

    def __init__(self, schedule: Sequence[tuple[int, int, int]], k_max: int) -> None:
        last_end = max(end for _, end, _ in schedule)
        lookup = np.zeros(last_end + 1, dtype=np.int64)
        k_prev = 0
        position = 1
        for start, end, k in schedule:
            lookup[position:start] = k_prev  # a gap carries the previous k
            lookup[start:end + 1] = min(k, k_max)
            k_prev = min(k, k_max)
            position = end + 1
        self.lookup = lookup
        self.tail = k_prev

    def k_for(self, num_scheduled: int) -> int:
        return int(self.lookup[num_scheduled]) if num_scheduled < self.lookup.shape[0] else self.tail

    def max_draft_lens(self, num_scheduled: int, rows: Sequence[CallState]) -> np.ndarray:
        return np.full(len(rows), self.k_for(num_scheduled), dtype=np.int64)


BUDGET_POLICIES: dict[str, Callable[[SpeculativeConfig], BudgetPolicy]] = {
    "fixed": lambda spec: FixedK(spec.num_speculative_tokens),
    "batch-size-schedule": lambda spec: BatchSizeSchedule(spec.num_speculative_tokens_per_batch_size or (),
                                                          spec.num_speculative_tokens),
}


def register_budget_policy(name: str) -> Callable[[Callable[[SpeculativeConfig], BudgetPolicy]],
                                                  Callable[[SpeculativeConfig], BudgetPolicy]]:
    """Decorator: register a policy factory (config → policy) under `name`."""

    def decorate(factory: Callable[[SpeculativeConfig], BudgetPolicy]) -> Callable[[SpeculativeConfig], BudgetPolicy]:
        BUDGET_POLICIES[name] = factory
        return factory

    return decorate


def make_budget_policy(spec: SpeculativeConfig) -> BudgetPolicy:
    """The policy for `spec`: the drafter's own (`budget_policy` attribute), else vLLM's rule."""
    name = getattr(drafter_class(spec.method), "budget_policy", None)
    if name is None:
        name = "batch-size-schedule" if spec.num_speculative_tokens_per_batch_size else "fixed"
    return BUDGET_POLICIES[name](spec)
