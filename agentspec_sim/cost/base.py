"""The step-cost interface the engine codes against: a batch shape in, seconds out.

The engine describes one forward pass as a `BatchShape` (per call: tokens computed this step,
tokens already cached, prefill or not) and asks a `StepCostModel` what it costs. The cost model
never sees token ids or drafts: a drafter decides *what* is accepted, the cost model *how long* a
step takes (DESIGN.md, "Rules of thumb").

Terms used by every cost model (the AgentSpec paper, §3.1, ΔT(b) = D(b)[(1 − ρ(b))·t_A − t_V(b)]):

- t_A(b): the per-token time saved by accepting one draft token. A plain decode step of b calls
  emits b tokens in T_step(b), so each emitted token costs T_step(b) / b of batch time, and an
  accepted draft token saves exactly that (`per_token_decode_time`).
- t_V(b): the per-token cost of verifying one more draft token: the marginal step time
  (T_step(b calls with 1 + 1 tokens) − T_step(b calls with 1 token)) / b (`per_token_verify_time`).
  Memory-bound small batches make t_V ≪ t_A; once the linear layers turn compute-bound
  (b ≳ AI, the ridge) t_V → t_A and a rejected token is pure loss.
- AI: the hardware's arithmetic intensity expressed in tokens (`ridge_tokens`); the paper's
  token budget is M(b) = AI − b (`token_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True, slots=True)
class BatchShape:
    """One engine step's batch: one row per scheduled call.

    query_lens:   int64 [n], tokens each call computes this step (a prefill chunk, or
                  1 + the draft tokens scheduled for verification).
    context_lens: int64 [n], tokens already in that call's KV cache before this step.
    is_prefill:   bool [n], True for a prefill chunk (its logits are computed for one row only).
    moe_tokens:   with data parallelism, the tokens a MoE model's routed experts see this step over all
                  ranks (they step in lockstep, every expert GPU serving every rank); 0: this batch's
                  tokens × the data-parallel size (ranks in balance, as AIConfigurator prices them).

    Construction does not copy or check (it runs once per simulated step); `validate()` checks.
    """

    query_lens: np.ndarray
    context_lens: np.ndarray
    is_prefill: np.ndarray
    moe_tokens: int = 0

    @classmethod
    def decode(cls, batch_size: int, context_len: int, query_len: int = 1) -> BatchShape:
        """`batch_size` decode calls, each with `context_len` cached tokens and `query_len` new ones."""
        return cls(
            np.full(batch_size, query_len, dtype=np.int64),
            np.full(batch_size, context_len, dtype=np.int64),
            np.zeros(batch_size, dtype=bool),
        )

    @classmethod
    def of(cls, query_lens, context_lens, is_prefill=None) -> BatchShape:
        """A batch from any sequences (converted to the documented dtypes)."""
        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(context_lens, dtype=np.int64)
        p = np.zeros(q.shape, dtype=bool) if is_prefill is None else np.asarray(is_prefill, dtype=bool)
        return cls(q, c, p)

    @property
    def num_calls(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    def validate(self) -> None:
        """Raise ValueError unless the shape meets `StepCostModel.step_time`'s preconditions."""
        q, c, p = self.query_lens, self.context_lens, self.is_prefill
        for name, arr, kind in (("query_lens", q, "i"), ("context_lens", c, "i"), ("is_prefill", p, "b")):
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind != kind:
                raise ValueError(f"BatchShape.{name}: expected a 1-D {'integer' if kind == 'i' else 'bool'} array")
        if not (q.shape == c.shape == p.shape):
            raise ValueError(f"BatchShape: lengths differ ({q.shape[0]}, {c.shape[0]}, {p.shape[0]})")
        if q.shape[0] == 0:
            raise ValueError("BatchShape: empty batch (an engine step schedules at least one call)")
        if int(q.min()) < 1:
            raise ValueError("BatchShape.query_lens: every call computes at least one token")
        if int(c.min()) < 0:
            raise ValueError("BatchShape.context_lens: negative context length")


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one forward pass costs, in seconds, and where the time goes.

    total_s = linear_s + attention_s + overhead_s + communication_s + moe_s, and total_s > 0.
    linear_s holds the dense layers' GEMMs (the weights streamed for every token: attention projections,
    dense MLP, router, LM head); moe_s the routed experts where the model prices them on their own
    (`Calibration.moe_memory_efficiency`), else 0 and the experts are part of linear_s; overhead_s the
    GPU's small kernels (norms, activations) and the host's per-step and per-call work.
    """

    total_s: float
    linear_s: float
    attention_s: float
    overhead_s: float
    communication_s: float
    moe_s: float = 0.0


@runtime_checkable
class StepCostModel(Protocol):
    """Prices engine steps. Implementations are immutable and cheap to call (once per step).

    Invariants every implementation keeps (checked in tests/test_cost.py):
      CLOCK     step_time(...).total_s > 0: a zero-length step would stall the simulation clock.
      MONOTONE  adding a token to any call (query or context) never makes the step cheaper.
    """

    def step_time(self, batch: BatchShape) -> StepCost:
        """Seconds for one forward pass over `batch`.

        Pre:  batch has ≥ 1 call; every call has query_len ≥ 1 and context_len ≥ 0
              (`batch.validate()` checks; implementations may skip the check for speed).
        Post: result.total_s > 0 and equals the sum of its parts.
              Monotone: adding a token to any call never lowers total_s.
        """
        ...

    def draft_model_time(self, num_calls: int, draft_len: int, context_lens: np.ndarray) -> float:
        """Seconds the draft model (EAGLE-3 head / MTP layer) spends proposing `draft_len` tokens
        for each of `num_calls` rows: `draft_len` sequential small forward passes.

        Pre:  num_calls ≥ 0, draft_len ≥ 0, context_lens holds the rows' context lengths.
        Post: 0.0 when num_calls == 0 or draft_len == 0, else > 0; non-decreasing in every argument.
        """
        ...

    def frontend_time(self, prompt_lens: np.ndarray) -> np.ndarray:
        """Seconds each request of `prompt_lens` tokens spends outside the engine core on the way to the client's
        first token (the API server's tokenization and hand-off, the first chunk's way back), added to its first
        token and finish times as a client measures them (`vllm bench serve`'s TTFT and E2EL).

        Post: ≥ 0, one per request, non-decreasing in the prompt length.
        """
        ...

    def sync_host_time(self, batch_sizes: np.ndarray) -> np.ndarray:
        """Seconds of the engine core's host work a synchronous step waits for, one per step of `batch_sizes`
        calls: the scheduler, the model runner's input preparation and bookkeeping, `update_from_output`. vLLM's
        async scheduling runs it during the previous step's forward; without it (`--no-async-scheduling`, the V1
        runner's CPU proposers) the GPU idles through it every step.

        Post: ≥ 0, one per step, non-decreasing in the batch size.
        """
        ...

    def model_free_draft_time(self, num_calls: int) -> float:
        """Seconds of CPU drafting (ngram / suffix / agentspec) per step for `num_calls` rows.

        Post: 0.0 when num_calls == 0, else > 0; non-decreasing in num_calls.
        """
        ...

    @property
    def ridge_tokens(self) -> float:
        """AI: the hardware's arithmetic intensity in tokens for this model: the number of tokens
        in one step at which the linear layers turn from memory-bound to compute-bound. > 0."""
        ...

    def token_budget(self, batch_size: int) -> int:
        """The paper's draft-token budget M(b) = max(0, ⌊AI − b⌋). Post: ≥ 0, non-increasing in b."""
        ...

    def per_token_decode_time(self, batch_size: int, context_len: int) -> float:
        """t_A(b): a plain decode step of `batch_size` calls at `context_len`, divided by batch_size.

        Pre:  batch_size ≥ 1, context_len ≥ 0.  Post: > 0.
        """
        ...


def step_times(cost: StepCostModel, query_lens: np.ndarray, context_lens: np.ndarray, is_prefill: np.ndarray,
               offsets: np.ndarray) -> np.ndarray:
    """`cost.step_time(...).total_s` for each step of a run: step k is rows offsets[k]:offsets[k + 1].

    Uses the model's own batched `step_times` when it has one (`RooflineCostModel` does, bit-for-bit
    equal to its `step_time`); otherwise calls `step_time` once per step.
    """
    batched = getattr(cost, "step_times", None)
    if batched is not None:
        return np.asarray(batched(query_lens, context_lens, is_prefill, offsets), dtype=np.float64)
    q, c, pf = query_lens, context_lens, is_prefill
    return np.array([float(cost.step_time(BatchShape(q[a:b], c[a:b], pf[a:b])).total_s)
                     for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)], dtype=np.float64)

