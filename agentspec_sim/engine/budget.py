"""Budget policies: how many tokens each drafting call may propose for the next engine step.

The engine asks once per step, after sampling, for the calls about to draft. vLLM's own policies:
a fixed k (`num_speculative_tokens`), and `num_speculative_tokens_per_batch_size`, where k is looked
up by the number of requests scheduled in the step that just ran (vLLM 0.33 `Scheduler.schedule()`
sets `num_spec_tokens_to_schedule = lookup[len(num_scheduled_tokens)]` and the V1 n-gram proposer
drafts with it). `adaspec` (`AdaSpecPolicy`) sets each call's length from its running acceptance
rate, as the AgentSpec paper's Figure 3 uses AdaSpec (Huang et al., 2026). AgentSpec's own
redundancy-aware split (of ⌊α/bz⌋ or M(b)) needs the drafter's candidates, so it lives in the drafter
(`drafters/agentspec/rule.py`, `allocate`) and runs inside its `propose`, under the caps a policy gives.

Which policy a run uses: the speculative config's `budget_policy` (any drafter), else the drafter
class's `budget_policy` attribute, else vLLM's rule (`batch-size-schedule` when
`num_speculative_tokens_per_batch_size` is set, `fixed` otherwise). Policies register by name
(`register_budget_policy`), each a `BudgetPolicy`: what the engine asks is declared there with defaults.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from agentspec_sim.cost.base import BatchShape
from agentspec_sim.engine.drafting import SpecConfigError, SpeculativeConfig

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.engine.request import CallState


class BudgetPolicy(ABC):
    """What the engine asks a policy, once per step: a policy subclasses this and defines `max_draft_lens`; the
    other answers default to a policy that decides per call."""

    # The same k for every call at every step (vLLM's static `num_speculative_tokens`).
    fixed: bool = False

    @abstractmethod
    def max_draft_lens(self, num_scheduled: int, rows: Sequence[CallState]) -> np.ndarray:
        """The most draft tokens each row may propose for the next step.

        Pre:  `rows` are the calls that sampled a token in the step just ended and go on (not in
              partial prefill, not finished); `num_scheduled` ≥ 1 is how many requests that step
              scheduled (prefill chunks included).
        Post: an int64 array of `len(rows)` values ≥ 0 (0: the call does not draft). The engine
              further clips each by max_model_len − num_tokens, as vLLM's proposer does.
        """

    def k_of_batch(self, max_num_seqs: int) -> np.ndarray | None:
        """The draft length at 0…max_num_seqs scheduled calls when that alone decides it (the compiled loop
        then drafts without asking), else None."""
        return None

    def longest_draft(self, max_num_seqs: int) -> int | None:
        """The longest draft the policy lets a call propose (the event loop's horizon), None where unstated."""
        return None

    def bind_cost_model(self, cost: StepCostModel) -> None:  # noqa: B027 (a hook: no-op unless a policy prices)
        """Before the run: the engine's cost model (policies that price their choice)."""


class FixedK(BudgetPolicy):
    """vLLM's static `num_speculative_tokens`: every drafting call may propose k tokens."""

    fixed = True

    def __init__(self, k: int) -> None:
        self.k = int(k)

    def max_draft_lens(self, num_scheduled: int, rows: Sequence[CallState]) -> np.ndarray:
        return np.full(len(rows), self.k, dtype=np.int64)

    def k_of_batch(self, max_num_seqs: int) -> np.ndarray:
        return np.full(max_num_seqs + 1, self.k, dtype=np.int64)

    def longest_draft(self, max_num_seqs: int) -> int:
        return self.k


class BatchSizeSchedule(BudgetPolicy):
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

    def k_of_batch(self, max_num_seqs: int) -> np.ndarray:
        return np.array([self.k_for(n) for n in range(max_num_seqs + 1)], dtype=np.int64)

    def longest_draft(self, max_num_seqs: int) -> int:
        return int(self.k_of_batch(max_num_seqs).max())


class AdaSpecPolicy(BudgetPolicy):
    """AdaSpec-style allocation (Huang et al., 2026, "AdaSpec: Adaptive Speculative Decoding for Fast,
    SLO-Aware LLM Serving", SoCC'25), as the AgentSpec paper uses it for its Figure 3: each call's draft
    length from its own running acceptance rate. AdaSpec's SLO machinery is not modelled; the rule is
    the goodput argument AdaSpec and SmartSpec build on, per call:

    - acceptance: under the usual i.i.d. model a draft token is accepted with probability a, so
      the j-th token of a draft is accepted with probability a^j. Each call's a is estimated from
      its verified steps as A / (A + F) — A accepted draft tokens, F steps that ended at a
      rejected token (a step accepted in full adds no failure: the geometric MLE with censoring)
      — shrunk toward the run's pooled estimate with `prior_weight` pseudo-tokens, so a new call
      starts from what the run has seen (0.5 before anything is seen);
    - length: draft the j-th token while a^j ≥ τ, i.e. k = ⌊log τ / log a⌋ clipped to [0, k_max]:
      a token is worth drafting while its expected saving a^j·t_A exceeds its verification cost
      t_V, so τ = t_V(b) / t_A(b) at the step's batch size b from the engine's cost model (`bind_cost_model`;
      the paper's §3.1 terms), or the fixed `threshold` when no cost model is bound;
    - a call whose estimate gives k = 0 is offered one token every `probe_every` steps, so its
      estimate can recover (otherwise it would never draft again).

    Pre/post as `BudgetPolicy`. Deterministic: state is per call (keyed by the CallState) and pooled
    counts; nothing random.
    """

    def __init__(self, k_max: int, threshold: float = 0.3, prior_weight: float = 4.0, probe_every: int = 8,
                 cost: StepCostModel | None = None) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.k_max = int(k_max)
        self.threshold = float(threshold)
        self.prior_weight = float(prior_weight)
        self.probe_every = int(probe_every)
        self.cost = cost
        self.stats: dict[CallState, list[int]] = {}  # call → [drafted seen, accepted seen, A, F, idle steps]
        self.accepted = 0  # pooled over calls
        self.failures = 0
        self._tau_memo: dict[tuple[int, int], float] = {}

    def bind_cost_model(self, cost: StepCostModel) -> None:
        self.cost = cost

    def longest_draft(self, max_num_seqs: int) -> int:
        return self.k_max

    def acceptance(self, state: CallState) -> float:
        """The call's acceptance estimate a (see the class docstring)."""
        st = self.stats.get(state)
        pooled = (self.accepted + 1.0) / (self.accepted + self.failures + 2.0)
        if st is None:
            return pooled
        w = self.prior_weight
        return (st[2] + w * pooled) / (st[2] + st[3] + w)

    def tau(self, batch_size: int, context_len: int) -> float:
        """Break-even acceptance probability of one more draft token: t_V(b) / t_A(b), clipped to (0, 1)."""
        if self.cost is None:
            return self.threshold
        key = (batch_size, context_len.bit_length())  # context bucketed by powers of two
        tau = self._tau_memo.get(key)
        if tau is None:
            ctx = 1 << max(key[1] - 1, 0)
            one = self.cost.step_time(BatchShape.decode(batch_size, ctx, 1)).total_s
            two = self.cost.step_time(BatchShape.decode(batch_size, ctx, 2)).total_s
            tau = min(max((two - one) / one, 1e-3), 1.0 - 1e-3)  # (t_V·b) / (t_A·b)
            self._tau_memo[key] = tau
        return tau

    def length(self, a: float, tau: float) -> int:
        """k = ⌊log τ / log a⌋ in [0, k_max] (a^k ≥ τ)."""
        if a <= 0.0:
            return 0
        if a >= 1.0:
            return self.k_max
        return max(0, min(self.k_max, math.floor(math.log(tau) / math.log(a) + 1e-9)))

    def max_draft_lens(self, num_scheduled: int, rows: Sequence[CallState]) -> np.ndarray:
        out = np.zeros(len(rows), dtype=np.int64)
        if not rows:
            return out
        ctx = int(sum(r.num_tokens for r in rows) // len(rows))
        tau = self.tau(max(int(num_scheduled), 1), ctx)
        for i, row in enumerate(rows):
            st = self.stats.get(row)
            if st is None:
                st = self.stats[row] = [0, 0, 0, 0, 0]
            drafted, accepted = int(row.drafted), int(row.accepted)
            dd, da = drafted - st[0], accepted - st[1]
            if dd > 0:  # one verified step since we last saw the call
                st[2] += da
                self.accepted += da
                if da < dd:
                    st[3] += 1
                    self.failures += 1
            st[0], st[1] = drafted, accepted
            k = self.length(self.acceptance(row), tau)
            if k == 0:
                st[4] += 1
                if st[4] >= self.probe_every:
                    k, st[4] = 1, 0
            else:
                st[4] = 0
            out[i] = k
        return out


BUDGET_POLICIES: dict[str, Callable[[SpeculativeConfig], BudgetPolicy]] = {
    "fixed": lambda spec: FixedK(spec.num_speculative_tokens),
    "batch-size-schedule": lambda spec: BatchSizeSchedule(spec.num_speculative_tokens_per_batch_size or (),
                                                          spec.num_speculative_tokens),
    "adaspec": lambda spec: AdaSpecPolicy(spec.num_speculative_tokens),
}


def register_budget_policy(name: str) -> Callable[[Callable[[SpeculativeConfig], BudgetPolicy]],
                                                  Callable[[SpeculativeConfig], BudgetPolicy]]:
    """Decorator: register a policy factory (config → a `BudgetPolicy` subclass's instance) under `name`."""

    def decorate(factory: Callable[[SpeculativeConfig], BudgetPolicy]) -> Callable[[SpeculativeConfig], BudgetPolicy]:
        BUDGET_POLICIES[name] = factory
        return factory

    return decorate


def budget_policy_name(spec: SpeculativeConfig, drafter_default: str | None = None) -> str:
    """The policy `spec` selects: its `budget_policy` key, else the drafter's (`BaseDrafter.budget_policy`, given
    as `drafter_default`), else vLLM's rule."""
    name = spec.option("budget_policy") or spec.raw.get("budget_policy")
    if name is None:
        name = drafter_default
    if name is None:
        name = "batch-size-schedule" if spec.num_speculative_tokens_per_batch_size else "fixed"
    if name not in BUDGET_POLICIES:
        raise SpecConfigError(f"unknown budget_policy {name!r} (known: {', '.join(sorted(BUDGET_POLICIES))})")
    return name


def make_budget_policy(spec: SpeculativeConfig, cost: StepCostModel | None = None,
                       drafter_default: str | None = None) -> BudgetPolicy:
    """The policy for `spec` (`budget_policy_name`); `cost` (the engine's cost model) is bound into
    policies that use one."""
    policy = BUDGET_POLICIES[budget_policy_name(spec, drafter_default)](spec)
    if cost is not None:
        policy.bind_cost_model(cost)
    return policy
