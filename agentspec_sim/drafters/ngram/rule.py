"""`ngram`: vLLM's V1 CPU prompt-lookup proposer (`vllm/v1/spec_decode/ngram_proposer.py`, vLLM 0.33,
`VLLM_USE_V2_MODEL_RUNNER=0`), token for token.

Rule: history = prompt + every token emitted so far (never drafts). Find the longest n in
[prompt_lookup_min, prompt_lookup_max] such that the last n tokens occur earlier in the history,
the occurrence ending at or before index len−2 (overlapping the suffix is allowed); among the
occurrences of that n take the **earliest**. The draft is the tokens after it, at most
min(k, max_model_len − len, len − start) of them (the engine passes the first two as `max_len`):
variable length, ≥ 1 when something matches; no match → no draft. vLLM computes this with a KMP
scan over the reversed history; the forward scan below returns the same answer (checked against a
brute-force search in tests/test_ngram.py) and stops at the first occurrence of the longest n.

Config (vLLM `SpeculativeConfig`): `num_speculative_tokens` is required; `prompt_lookup_min/max`
are both 5 when neither is given, the other copies the one given, and 1 ≤ min ≤ max.
State: none across calls (the history is the call's own token buffer). The engine does not call
`propose`: it computes the same drafts for all rows at once from an incremental index of first
n-gram occurrences per history (drafters/ngram/index.py, ngram_fastpath.py), a cache of this rule that `propose` and
`ngram_match` remain the reference for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from numba import njit

from agentspec_sim.drafters.registry import register_drafter
from agentspec_sim.engine.drafting import BaseDrafter, SpecConfigError, SpeculativeConfig

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

_EMPTY = np.zeros(0, dtype=np.int32)


@njit(cache=True, nogil=True)
def ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(draft start, matched n) for the earliest occurrence of the longest matching suffix; (-1, 0) if none."""
    length = tokens.shape[0]
    if length < min_n:
        return -1, 0
    last = tokens[length - 1]
    best_n = 0
    best_end = -1
    # An occurrence ends at e ≤ len−2; its match length counts equal tokens backwards from e and
    # from the history's end, up to max_n and never past the start of the history.
    for e in range(length - 1):
        if tokens[e] != last:
            continue
        limit = min(max_n, e + 1)
        n = 1
        while n < limit and tokens[e - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n = n
            best_end = e
            if n == max_n:
                break  # the earliest occurrence of the longest possible n: nothing later can beat it
    if best_n < min_n:
        return -1, 0
    return best_end + 1, best_n


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, max_len: int) -> np.ndarray:
    """The draft for one history (int32, contiguous): at most `max_len` tokens, empty when nothing matches."""
    if max_len <= 0:
        return _EMPTY
    start, _ = ngram_match(tokens, min_n, max_n)
    if start < 0:
        return _EMPTY
    return tokens[start:start + min(max_len, tokens.shape[0] - start)]


@register_drafter("ngram")
class NgramDrafter(BaseDrafter):
    # Memory per token of the trace (its workload table, one tenant; its live state, per tenant).
    bytes_per_token = (36.0, 8.0)
    # `--drafter ngram`: the paper's settings (AgentSpec appendix A.1): k=5, prompt_lookup_max=4 (vLLM's rule
    # "if one is given the other copies it" makes min=4 too).
    shorthand: ClassVar[dict] = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}

    config_keys: ClassVar[frozenset[str]] = frozenset({"prompt_lookup_min", "prompt_lookup_max"})
    supports_batch_size_schedule: ClassVar[bool] = True

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        self.min_n = int(spec.prompt_lookup_min or 5)
        self.max_n = int(spec.prompt_lookup_max or 5)

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        return resolve_prompt_lookup(spec)

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        # Drafts are views into the call's buffer: safe, since tokens before `num_tokens` never change.
        lo, hi = self.min_n, self.max_n
        return [propose_ngram(row.tokens, lo, hi, int(m)) for row, m in zip(rows, max_lens, strict=True)]


def resolve_prompt_lookup(spec: SpeculativeConfig) -> SpeculativeConfig:
    """vLLM's n-gram rules: k required; min/max default 5/5, one given copies to the other; 1 ≤ min ≤ max."""
    from dataclasses import replace

    if spec.num_speculative_tokens < 0:
        raise SpecConfigError(f"method {spec.method!r} needs num_speculative_tokens (vLLM has no default for it)")
    lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
    for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpecConfigError(f"{key} must be an integer ≥ 1, got {value!r}")
    if lo is None and hi is None:
        lo = hi = 5
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    if lo > hi:
        raise SpecConfigError(f"prompt_lookup_min ({lo}) must be ≤ prompt_lookup_max ({hi})")
    return replace(spec, prompt_lookup_min=lo, prompt_lookup_max=hi)
