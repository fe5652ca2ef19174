"""`ngram-v2`: vLLM 0.33's default n-gram speculator, the Model Runner V2 GPU kernel
(`vllm/v1/worker/gpu/spec_decode/ngram/speculator.py`, `NgramGPUSpeculator`), token for token.

Who gets which: vLLM 0.33 runs Model Runner V2 unless `VLLM_USE_V2_MODEL_RUNNER=0`, so a plain
`{"method": "ngram", ...}` (or `"ngram_gpu"`) gets *this* rule; with the variable set to 0 the V1
CPU proposer runs instead (the `ngram` drafter here). Same config, different drafts.

Rule (`_ngram_scan_kernel` + `_ngram_finalize_kernel`): history = prompt + every token emitted
so far (never drafts), length L. For each n in [prompt_lookup_min, prompt_lookup_max], a candidate
is a start position 0 ≤ pos ≤ L − n − 1 whose n tokens equal the last n tokens; the kernel keeps
the maximum of the score n·(max_model_len + 1) + pos + 1, so the **longest n** wins and, among
its occurrences, the **rightmost** one (V1 takes the earliest). Then exactly k draft slots: slot i
is `history[pos + n + i]` while pos + n + i < L, and the **last sampled token** otherwise; a row
with no match (or L < prompt_lookup_min) gets k copies of the last token. Filler slots are
ordinary drafts: verified, almost always rejected, and counted in vLLM's `num_draft_tokens`.
The kernel itself does not clip by max_model_len (the scheduler does; the engine passes the clipped
length as `max_len`), and a per-batch-size k takes the first k_dyn of the K slots, which is what
computing with k = k_dyn gives.

The compiled scan below walks occurrence ends e = L−2, …, 0 (right to left), measures how far each
matches the history's suffix (capped at max_n), and keeps the first e that reaches a new best
length: that is the rightmost occurrence of the longest n (checked against a literal
transcription of the kernel's score in tests/test_ngram_v2.py). It stops at the first e that
reaches max_n.

Config (vLLM `SpeculativeConfig`, shared with `ngram`): `num_speculative_tokens` is required;
`prompt_lookup_min/max` are both 5 when neither is given, the other copies the one given, and
1 ≤ min ≤ max; `num_speculative_tokens_per_batch_size` is supported.
State: none across calls (the history is the call's own token buffer). Cost: in vLLM this is two
small Triton kernels on the GPU (no CPU proposer pass); their tens of microseconds are approximated
by the cost model's model-free drafting time, as for `ngram`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from numba import njit

from agentspec_sim.drafters.ngram.rule import NgramDrafter
from agentspec_sim.drafters.registry import register_drafter

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

_EMPTY = np.zeros(0, dtype=np.int32)


@njit(cache=True, nogil=True)
def ngram_v2_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(draft start, matched n) for the rightmost occurrence of the longest matching suffix n-gram,
    n in [min_n, max_n]; (-1, 0) when nothing matches (or the history is shorter than min_n)."""
    length = tokens.shape[0]
    if length < min_n or length < 2:
        return -1, 0
    last = tokens[length - 1]
    best_n = 0
    best_end = -1
    # An occurrence ends at e ≤ len−2 (start pos = e − n + 1 ≤ len − n − 1, as the kernel requires).
    for e in range(length - 2, -1, -1):
        if tokens[e] != last:
            continue
        limit = min(max_n, e + 1)
        n = 1
        while n < limit and tokens[e - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:  # strict: a later (further left) e of the same length never replaces it
            best_n = n
            best_end = e
            if n == max_n:
                break
    if best_n < min_n:
        return -1, 0
    return best_end + 1, best_n


@njit(cache=True, nogil=True)
def _fill_draft(tokens: np.ndarray, start: int, k: int, out: np.ndarray) -> None:
    length = tokens.shape[0]
    last = tokens[length - 1]
    for i in range(k):
        p = start + i
        out[i] = tokens[p] if start >= 0 and p < length else last


def propose_ngram_v2(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The k draft slots for one history (int32, contiguous, ≥ 1 token): the continuation of the
    rightmost occurrence of the longest matching n-gram, padded (or wholly filled when nothing
    matches) with the last token. k ≤ 0 gives an empty draft."""
    if k <= 0:
        return _EMPTY
    start, _ = ngram_v2_match(tokens, min_n, max_n)
    out = np.empty(k, dtype=np.int32)
    _fill_draft(tokens, start, k, out)
    return out


@register_drafter("ngram-v2")
class NgramV2Drafter(NgramDrafter):
    """vLLM 0.33 MRV2 GPU n-gram: rightmost occurrence of the longest n-gram, always k slots.

    Same config keys, defaults and validation as `ngram` (V1); only the proposal rule differs.
    """

    # `--drafter ngram-v2` (vLLM 0.33's default runner): the same paper settings as ngram.
    shorthand: ClassVar[dict] = {"method": "ngram-v2", "num_speculative_tokens": 5, "prompt_lookup_max": 4}

    # Model Runner V2, not V1: the V1 runner's proposer skip near max_model_len (engine/simulator.py
    # `_propose`) does not apply; what MRV2 does there is not modelled.
    v1_runner = False
    async_scheduling = True

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Exactly `max_lens[i]` tokens for row i (the kernel always writes every slot)."""
        lo, hi = self.min_n, self.max_n
        return [propose_ngram_v2(row.tokens, lo, hi, int(m)) for row, m in zip(rows, max_lens, strict=True)]


__all__ = ["NgramV2Drafter", "ngram_v2_match", "propose_ngram_v2"]
