"""`ngram` and `ngram-v2`'s proposals for a whole workload, made once: the table the engine drafts
from instead of extending the prompt-lookup index in every run.

Why a table is exact: both proposers read only the call's own history — prompt + output so far — and
that history is a stretch of the engine's token arena fixed by the trace (drafters/ngram/index.py). So where
the draft of call i after t output tokens starts (after the earliest occurrence of the longest suffix
n-gram for `ngram`, the rightmost for `ngram-v2`, or nowhere) is the same in every run, whatever the
batch size, schedule or preemptions; only how many tokens the step takes from there (k, the batch's
draft length, max_model_len) depends on the run, and the run applies it as before. `build_ngram_table`
asks the incremental index (`NgramIndex`) at every position of every call, in arena order; the
engine reads the answers through the n-gram fast path (drafters/ngram/fastpath.py). The cells of
a sweep share one table through the disk cache (drafters/common/table_cache.py), keyed by the arena's
tokens, the calls' places in it, the n-gram range and this code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agentspec_sim.drafters.common import table_cache
from agentspec_sim.drafters.common.table_cache import Arrays, cached_arrays
from agentspec_sim.drafters.ngram import index as ngram_index
from agentspec_sim.drafters.ngram import rule as ngram
from agentspec_sim.drafters.ngram import v2 as ngram_v2
from agentspec_sim.drafters.ngram.index import NgramIndex

FORMAT = 1  # bump when the table's layout changes (the code's own bytes are in the key too)
_CODE = (__file__, ngram.__file__, ngram_v2.__file__, ngram_index.__file__)


@dataclass(frozen=True)
class NgramTable:
    """Call i's draft starts after t = 0 … target_len[i] output tokens: match[at[i] + t], the arena index
    of the draft's first token (it runs to the end of the history at most), −1 where there is none."""

    at: np.ndarray  # int64 [calls + 1]
    match: np.ndarray  # int64 [positions]

    def arrays(self) -> Arrays:
        return {"at": self.at, "match": self.match}

    @staticmethod
    def valid(arrays: Arrays) -> bool:
        at, match = arrays["at"], arrays["match"]
        return (at.dtype == np.int64 and match.dtype == np.int64 and at.ndim == 1 and at.shape[0] > 0
                and match.shape == (int(at[-1]),))


def build_ngram_table(tokens: np.ndarray, starts: np.ndarray, prompt_lens: np.ndarray, target_lens: np.ndarray,
                      min_n: int, max_n: int, rightmost: bool, chunk: int = 1 << 20) -> NgramTable:
    """The proposals of calls whose histories are tokens[starts[i]:starts[i] + prompt_lens[i] + t], t ≤
    target_lens[i] (≤ 0: no positions but t = 0), for n in [min_n, max_n] (≤ MAX_INDEXED_N); asked in
    batches of about `chunk` positions (the work arrays stay small on traces of many millions of tokens)."""
    counts = np.maximum(target_lens, 0).astype(np.int64) + 1
    at = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=at[1:])
    match = np.empty(int(at[-1]), dtype=np.int64)
    index = NgramIndex(tokens, min_n, max_n, rightmost)
    # In arena order — each region's calls by prompt length, a call's positions in order — so the index
    # only ever grows forward (an agent's next call extends the previous one's history at its offset).
    order = np.lexsort((prompt_lens, starts))
    bounds = np.searchsorted(np.cumsum(counts[order]), np.arange(chunk, int(at[-1]), chunk), side="right")
    for calls in np.split(order, np.unique(bounds)):
        if calls.shape[0] == 0:
            continue
        n = counts[calls]
        row = np.repeat(calls, n)
        first = np.repeat(np.cumsum(n) - n, n)
        t = np.arange(row.shape[0], dtype=np.int64) - first
        hist = starts.astype(np.int64)[row]
        lengths = prompt_lens.astype(np.int64)[row] + t
        found = np.empty(row.shape[0], dtype=np.int64)
        if rightmost:
            index.match_rightmost(tokens, hist, lengths, found)
        else:
            drafts = np.empty((2, row.shape[0]), dtype=np.int64)
            index.propose(tokens, hist, lengths, np.ones(row.shape[0], dtype=np.int64), drafts)
            found = np.where(drafts[1] > 0, drafts[0], -1)
        match[at[row] + t] = found
    return NgramTable(at, match)


def table_key(min_n: int, max_n: int, rightmost: bool, tokens: np.ndarray | bytes, starts: np.ndarray,
              prompt_lens: np.ndarray, target_lens: np.ndarray) -> str:
    """What the table depends on: the code (this module's, the proposers' and the index's), the n-gram
    range and rule, and each call's place in the arena and lengths (with the arena's tokens, or their
    digest as bytes)."""
    options = {"min_n": int(min_n), "max_n": int(max_n), "rightmost": bool(rightmost)}
    return table_cache.key_hash("ngram tables", FORMAT, _CODE, options, tokens, starts, prompt_lens,
                                target_lens).hexdigest()


def cached_ngram_table(key: str, build: Callable[[], NgramTable]) -> NgramTable:
    """The table under `key` in the disk cache, else `build()`'s, stored (drafters/common/table_cache.py)."""
    got = cached_arrays("ngram-tables", key, lambda: build().arrays(), NgramTable.valid)
    return NgramTable(got["at"], got["match"])


__all__ = ["NgramTable", "build_ngram_table", "cached_ngram_table", "table_key"]
