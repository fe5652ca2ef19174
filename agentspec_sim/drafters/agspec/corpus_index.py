"""Token-level n-gram indexes for retrieval drafting (the `agspec` drafter's three corpora).

An index answers one question: *where, in this corpus, does the longest suffix of the context
(at least `n` tokens long) occur, and what follows it?* It is an LZ77-style hash chain over token
positions: a hash of the n tokens ending at position e maps to the latest such e, and `prev[e]`
links to the previous e with the same hash, so every occurrence of an n-gram is reachable from
the newest one. A lookup hashes the context's last n tokens, walks the chain newest first,
verifies each candidate token by token (a hash collision costs a comparison, never a wrong
draft), extends the match backwards up to `max_n` tokens, and keeps the longest; ties go to the
newest occurrence. The walk stops at the first match of `max_n` tokens, after `max_cand`
eligible candidates, or after 4·`max_cand` visited ones (the bound on work per lookup).

Two kinds of corpora share the compiled code:

- *owned*: the index holds its tokens, documents separated by `SEP` (−1), each position tagged
  with its document's owner (an int; lookups may exclude one owner). Only n-grams that lie inside
  one document and have a next token in the same document are indexed, so a match never spans
  two documents and a continuation stops at the document's end.
- *external* (a call's own history): the tokens live in the caller's buffer, which only grows;
  `sync(tokens)` indexes the n-grams ending at e ≤ len − 2 (those whose next token is known), so
  the context's own suffix never matches itself.

Everything per token lives in numpy arrays (int32 positions, uint64 hashes); the table grows by
doubling with a rehash from the chain heads. Building is O(tokens); a lookup is O(max_cand·max_n)
at worst, about 1 µs with its dispatch on an agent's session.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

SEP = np.int32(-1)  # document separator in owned corpora (token ids are ≥ 0)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SEED = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True, inline="always")
def _hash(tokens: np.ndarray, end: int, n: int) -> np.uint64:
    """64-bit hash of tokens[end − n + 1 .. end] (splitmix-style mixing per token)."""
    h = _SEED
    for i in range(end - n + 1, end + 1):
        h = (h ^ np.uint64(np.int64(tokens[i]) + 1)) * _M1
        h ^= h >> np.uint64(29)
    h *= _M2
    return h ^ (h >> np.uint64(32))


@njit(cache=True, nogil=True)
def _insert(tokens: np.ndarray, e: int, n: int, tkey: np.ndarray, tval: np.ndarray, prev: np.ndarray) -> int:
    """Make e the newest occurrence of the n-gram ending at e; returns 1 if its hash is new."""
    h = _hash(tokens, e, n)
    mask = tkey.shape[0] - 1
    s = np.int64(h & np.uint64(mask))
    while True:
        v = tval[s]
        if v < 0:
            tkey[s] = h
            tval[s] = e
            prev[e] = -1
            return 1
        if tkey[s] == h:
            prev[e] = v
            tval[s] = e
            return 0
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def index_range(tokens: np.ndarray, lo: int, hi: int, n: int, owned: bool, tkey: np.ndarray, tval: np.ndarray,
                prev: np.ndarray) -> int:
    """Index the n-grams ending at e ∈ [lo, hi); returns how many new hashes entered the table.

    owned: skip n-grams that contain SEP or whose next token is SEP or past the end."""
    added = 0
    length = tokens.shape[0]
    run = 0  # tokens since the last SEP, ending at e (owned corpora)
    if owned:
        j = lo
        while j > 0 and run < n and tokens[j - 1] >= 0:
            run += 1
            j -= 1
    for e in range(lo if owned else max(lo, n - 1), hi):
        if owned:
            if tokens[e] < 0:
                run = 0
                prev[e] = -1
                continue
            run += 1
            if run < n or e + 1 >= length or tokens[e + 1] < 0:
                prev[e] = -1
                continue
        added += _insert(tokens, e, n, tkey, tval, prev)
    return added


@njit(cache=True, nogil=True)
def rehash_into(tokens: np.ndarray, tkey: np.ndarray, tval: np.ndarray, new_key: np.ndarray,
                new_val: np.ndarray) -> None:
    """Move every (hash → newest position) entry into a larger, empty table (chains are untouched)."""
    mask = new_key.shape[0] - 1
    for s in range(tkey.shape[0]):
        v = tval[s]
        if v < 0:
            continue
        h = tkey[s]
        t = np.int64(h & np.uint64(mask))
        while new_val[t] >= 0:
            t = (t + 1) & mask
        new_key[t] = h
        new_val[t] = v


@njit(cache=True, nogil=True)
def lookup(ctx: np.ndarray, length: int, corpus: np.ndarray, corpus_end: int, tkey: np.ndarray, tval: np.ndarray,
           prev: np.ndarray, owner: np.ndarray, exclude: int, n: int, max_n: int, max_cand: int) -> tuple[int, int]:
    """(start of the continuation, match length) of the longest suffix of ctx[:length] (≥ n tokens) that
    occurs in `corpus` with at least one token after it before `corpus_end`; (-1, 0) when none.

    Candidates come newest first; an occurrence owned by `exclude` (when `owner` is non-empty) is skipped.
    """
    if length < n or tkey.shape[0] == 0:
        return -1, 0
    h = _hash(ctx, length - 1, n)
    mask = tkey.shape[0] - 1
    s = np.int64(h & np.uint64(mask))
    e = -1
    while True:
        v = tval[s]
        if v < 0:
            return -1, 0
        if tkey[s] == h:
            e = v
            break
        s = (s + 1) & mask
    has_owner = owner.shape[0] > 0
    best_n = 0
    best_e = -1
    eligible = 0
    visited = 0
    limit = 4 * max_cand
    while e >= 0 and eligible < max_cand and visited < limit:
        visited += 1
        if e + 1 < corpus_end and not (has_owner and owner[e] == exclude):
            m = 0
            while m < n and corpus[e - m] == ctx[length - 1 - m]:
                m += 1
            if m == n:  # a true occurrence (not a hash collision)
                eligible += 1
                while m < max_n and e - m >= 0 and m < length and corpus[e - m] == ctx[length - 1 - m]:
                    m += 1
                if m > best_n:
                    best_n = m
                    best_e = e
                    if m >= max_n:
                        break
        e = prev[e]
    if best_e < 0:
        return -1, 0
    return best_e + 1, best_n


@njit(cache=True, nogil=True)
def continuation_len(corpus: np.ndarray, start: int, corpus_end: int, cap: int) -> int:
    """Tokens from `start` up to `cap`, stopping at SEP or `corpus_end`."""
    m = 0
    while m < cap and start + m < corpus_end and corpus[start + m] >= 0:
        m += 1
    return m


def _table_size(keys: int) -> int:
    size = 16
    while size < 2 * keys + 2:
        size *= 2
    return size


class NGramIndex:
    """A hash-chain index over one token sequence (see the module docstring).

    `n`: the n-gram the table is keyed on = the shortest match a lookup returns. Owned indexes are
    built once by `from_docs`; external ones follow a growing buffer through `sync`.
    """

    __slots__ = ("count", "indexed", "n", "owned", "owner", "prev", "synced", "tkey", "tokens", "tval")

    def __init__(self, n: int, expected: int = 0, tokens: np.ndarray | None = None, owner: np.ndarray | None = None):
        if n < 1:
            raise ValueError(f"n-gram length must be ≥ 1, got {n}")
        self.n = int(n)
        self.owned = tokens is not None
        self.tokens = tokens if tokens is not None else _EMPTY_I32
        self.owner = owner if owner is not None else _EMPTY_I32
        size = _table_size(expected)
        self.tkey = np.zeros(size, dtype=np.uint64)
        self.tval = np.full(size, -1, dtype=np.int32)
        self.prev = np.empty(max(expected, 16), dtype=np.int32)
        self.count = 0  # distinct hashes in the table
        self.indexed = 0  # positions < indexed are indexed (external: n-grams ending at e < indexed)
        self.synced: np.ndarray = _EMPTY_I32  # external: the buffer prefix last synced (for reuse checks)

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_docs(cls, docs: Sequence[np.ndarray], n: int, owners: Sequence[int] | None = None) -> NGramIndex:
        """An owned index over `docs`, concatenated with SEP after each; `owners[i]` tags doc i."""
        total = sum(int(d.shape[0]) + 1 for d in docs)
        tokens = np.empty(total, dtype=np.int32)
        owner = np.empty(total if owners is not None else 0, dtype=np.int32)
        at = 0
        for i, d in enumerate(docs):
            m = int(d.shape[0])
            tokens[at:at + m] = d
            tokens[at + m] = SEP
            if owners is not None:
                owner[at:at + m + 1] = owners[i]
            at += m + 1
        index = cls(n, total, tokens, owner)
        index.prev = np.empty(max(total, 1), dtype=np.int32)
        index.count = index_range(tokens, 0, total, index.n, True, index.tkey, index.tval, index.prev)
        index.indexed = total
        index._resize_table(index.count)  # sized for every position while building; shrink to the keys
        return index

    def _grow_table(self, keys: int) -> None:
        if _table_size(keys) > self.tkey.shape[0]:
            self._resize_table(keys)

    def _resize_table(self, keys: int) -> None:
        size = _table_size(keys)
        if size == self.tkey.shape[0]:
            return
        tkey = np.zeros(size, dtype=np.uint64)
        tval = np.full(size, -1, dtype=np.int32)
        rehash_into(self.tokens, self.tkey, self.tval, tkey, tval)
        self.tkey, self.tval = tkey, tval

    def sync(self, tokens: np.ndarray) -> None:
        """External index: index the n-grams of `tokens` ending at e ≤ len − 2 not yet indexed.

        Pre: `tokens` extends the buffer given to earlier syncs (append-only)."""
        hi = tokens.shape[0] - 1
        if hi > self.indexed:
            if hi > self.prev.shape[0]:
                prev = np.empty(max(hi, 2 * self.prev.shape[0]), dtype=np.int32)
                prev[:self.indexed] = self.prev[:self.indexed]
                self.prev = prev
            if 2 * (self.count + hi - self.indexed) + 2 > self.tkey.shape[0]:
                self._grow_table(self.count + hi - self.indexed)
            self.count += index_range(tokens, self.indexed, hi, self.n, False, self.tkey, self.tval, self.prev)
            self.indexed = hi
        self.synced = tokens

    def extends(self, tokens: np.ndarray) -> bool:
        """External index: whether `tokens` starts with the buffer last synced (so `sync` may go on)."""
        m = self.synced.shape[0]
        return tokens.shape[0] >= m and np.array_equal(tokens[:m], self.synced)

    @property
    def nbytes(self) -> int:
        return int(self.tkey.nbytes + self.tval.nbytes + self.prev.nbytes + (self.tokens.nbytes if self.owned else 0)
                   + self.owner.nbytes)

    # -- lookups (tests and tools; the drafter calls the compiled functions directly) -----------
    def find(self, ctx: np.ndarray, max_n: int = 32, max_cand: int = 256, exclude: int = -1,
             cap: int = 1 << 30) -> tuple[np.ndarray, int]:
        """(continuation of the longest match, match length): empty and 0 when nothing matches."""
        ctx = np.ascontiguousarray(ctx, dtype=np.int32)
        corpus = self.tokens if self.owned else self.synced
        end = corpus.shape[0]
        start, m = lookup(ctx, ctx.shape[0], corpus, end, self.tkey, self.tval, self.prev, self.owner, exclude,
                          self.n, max(max_n, self.n), max_cand)
        if start < 0:
            return _EMPTY_I32, 0
        return corpus[start:start + continuation_len(corpus, start, end, cap)], int(m)
