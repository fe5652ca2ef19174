"""Helpers for engine tests: a step-cost double with hand-checkable numbers, and tiny workloads."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from agentspec_sim.cost.base import BatchShape, StepCost
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload


class ConstantCost:
    """Every step costs `step_s` + `per_token_s` × scheduled tokens; drafting costs `draft_s` per proposer pass."""

    def __init__(self, step_s: float = 0.01, per_token_s: float = 0.0, draft_s: float = 0.0,
                 ridge: float = 64.0) -> None:
        self.step_s, self.per_token_s, self.draft_s, self.ridge = step_s, per_token_s, draft_s, ridge
        self.batches: list[BatchShape] = []

    def step_time(self, batch: BatchShape) -> StepCost:
        batch.validate()
        self.batches.append(batch)
        linear = self.per_token_s * batch.num_tokens
        return StepCost(self.step_s + linear, linear, 0.0, self.step_s, 0.0)

    def model_free_draft_time(self, num_calls: int) -> float:
        return self.draft_s if num_calls else 0.0

    def frontend_time(self, prompt_lens: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(prompt_lens))

    def sync_host_time(self, batch_sizes: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(batch_sizes))

    def draft_model_time(self, num_calls: int, draft_len: int, context_lens: np.ndarray) -> float:
        return 0.0

    @property
    def ridge_tokens(self) -> float:
        return self.ridge

    def token_budget(self, batch_size: int) -> int:
        return max(0, int(self.ridge - batch_size))

    def per_token_decode_time(self, batch_size: int, context_len: int) -> float:
        return (self.step_s + self.per_token_s * batch_size) / batch_size


def arr(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def call(cid: str, prompt: Sequence[int], output: Sequence[int], query: str = "q0", seq: int = 0,
         think_s: float = 0.0, arrival_s: float | None = None) -> Call:
    return Call(id=cid, agent_id="a", query_id=query, seq=seq, prompt_tokens=arr(prompt), output_tokens=arr(output),
                think_s=think_s, arrival_s=arrival_s)


def workload(*queries: Sequence[Call]) -> Workload:
    qs = tuple(Query("a", q[0].query_id, tuple(q)) for q in queries)
    return Workload(TraceMeta(tokenizer=None, vocab_size=1000), qs)


def config(**kw) -> EngineConfig:
    """A small engine with everything explicit (no cost profiles needed)."""
    base = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 4096, "num_kv_blocks": 512,
            "block_size": 4, "check_invariants": True}
    base.update(kw)
    return EngineConfig(**base)


def agent_query(rng: np.random.Generator, qid: str, calls: int, prompt_len: int = 40, out_len: int = 20,
                append: int = 8, vocab: int = 50, think_s: float = 0.0) -> list[Call]:
    """An agent session: each call's prompt is the previous prompt + output + a few new tokens."""
    prompt = rng.integers(0, vocab, prompt_len)
    out = []
    for k in range(calls):
        output = rng.integers(0, vocab, out_len)
        out.append(call(f"{qid}-{k}", prompt, output, query=qid, seq=k, think_s=think_s if k else 0.0))
        prompt = np.concatenate([prompt, output, rng.integers(0, vocab, append)])
    return out


# -- test drafters ------------------------------------------------------------------------------
from agentspec_sim.drafters.registry import register_drafter  # noqa: E402
from agentspec_sim.engine.drafting import BaseDrafter, SpeculativeConfig  # noqa: E402


@register_drafter("test-oracle")
class OracleDrafter(BaseDrafter):
    """Cheats on purpose: drafts the recorded continuation (and `overshoot` tokens past its end)."""

    supports_batch_size_schedule = True

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        return spec

    def propose(self, rows, max_lens):
        overshoot = int(self.spec.option("overshoot", 0) or 0)
        out = []
        for row, m in zip(rows, max_lens, strict=True):
            cont = row.call.output_tokens[row.num_emitted:row.num_emitted + int(m)]
            pad = min(int(m) - cont.shape[0], overshoot)
            out.append(np.concatenate([cont, np.full(pad, 7, dtype=np.int32)]).astype(np.int32))
        return out


OracleDrafter.config_keys = frozenset({"overshoot"})


@register_drafter("test-wrong")
class WrongDrafter(BaseDrafter):
    """Always drafts k copies of a token no trace uses: every draft is rejected."""

    def propose(self, rows, max_lens):
        return [np.full(int(m), 999, dtype=np.int32) for m in max_lens]


@register_drafter("test-counting")
class CountingDrafter(BaseDrafter):
    """Records which calls it saw (to check tenants never share a drafter)."""

    instances: ClassVar[list] = []

    def __init__(self, spec):
        super().__init__(spec)
        self.seen: set[int] = set()
        CountingDrafter.instances.append(self)

    def start_call(self, state):
        self.seen.add(state.tenant)

    def propose(self, rows, max_lens):
        return [np.zeros(0, dtype=np.int32) for _ in rows]


# What a command prints on stderr while it works (cli/common.py: PlainProgress when stderr is no terminal, the
# compile notice, replay's "finished …" lines), as opposed to what it says when it fails or is interrupted.
PROGRESS_LINE = re.compile(r"^(finished .*|compiling the simulator's kernels.*"
                           r"|.*: [\d,]+(/[\d,]+)? (calls|cells) \(\d+ s\))$")


def not_progress(err: str) -> list[str]:
    """The non-blank lines of `err` that are not progress."""
    return [line for line in err.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
