"""Drafters whose proposals the engine computes for all rows in one compiled call per step.

A drafter's `propose` takes a list of `CallState`s and returns a list of arrays: per row, a Python
call into the drafter and back. For a stateless drafter whose rule is a compiled function of the
call's token history, the engine can instead run that same function over every row in one compiled
loop, reading the histories where they lie (the token arena) and writing the drafts where the
scheduler keeps them. `BATCHED` maps such a drafter class to its batch form; each entry must return
exactly what the drafter's `propose` returns (tests/test_engine_batched.py checks it row by row).

`ngram`: `NgramDrafter.propose` is `propose_ngram(row.tokens, min_n, max_n, max_len)` per row:
`ngram_match` on the history, then the tokens after the match, at most max_len of them, none when
nothing matches or max_len ≤ 0. The loop below is that, row after row, with `ngram_match` itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit

from agentspec_sim.drafters import ngram
from agentspec_sim.drafters.base import BaseDrafter
from agentspec_sim.engine.kernel_cache import clear_if_changed

clear_if_changed(__file__, [ngram.__file__])  # the kernel below compiles in ngram.py's ngram_match


@njit(cache=True, nogil=True)
def _ngram_rows(tokens, starts, lengths, max_lens, min_n, max_n, draft_start, draft_len):
    """Row i's history is tokens[starts[i]:starts[i] + lengths[i]]; its draft goes to
    tokens[draft_start[i]:draft_start[i] + draft_len[i]] (`propose_ngram`)."""
    for i in range(starts.shape[0]):
        draft_start[i] = starts[i]
        draft_len[i] = 0
        if max_lens[i] <= 0:
            continue
        start, _ = ngram.ngram_match(tokens[starts[i]:starts[i] + lengths[i]], min_n, max_n)
        if start >= 0:
            draft_start[i] = starts[i] + start
            draft_len[i] = min(max_lens[i], lengths[i] - start)


def propose_ngram_rows(drafter: ngram.NgramDrafter, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       max_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(draft start, draft length) in `tokens` of each row's `NgramDrafter.propose` draft."""
    draft_start = np.empty(starts.shape[0], dtype=np.int64)
    draft_len = np.empty(starts.shape[0], dtype=np.int64)
    _ngram_rows(tokens, starts, lengths, max_lens.astype(np.int64, copy=False), drafter.min_n, drafter.max_n,
                draft_start, draft_len)
    return draft_start, draft_len


# drafter class → (drafter, token arena, history starts, history lengths, max draft lengths) → (starts, lengths)
BATCHED: dict[type[BaseDrafter], Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    ngram.NgramDrafter: propose_ngram_rows,
}
