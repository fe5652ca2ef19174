"""The structure-isolated history of AgentSpec: one token stream per block, indexed by n-gram hash chains.

AgentSpec (paper §4.1, Algorithm 1) keeps a history cache H(agent, query, block) and drafts only
from the cache of the active block. Here every such cache is one *block* of a `BlockArena`: an
append-only token stream made of *segments* (each contiguous piece of text that the block
received: a run of one call's output, or of its prompt, whose tokens the structure automaton put in
that block). A segment is stored as `SEP, lead-in…, tokens…`:

- `SEP` (-1) separates segments, so no n-gram and no continuation crosses from one segment into
  another (text that was not contiguous is never drafted as if it were).
- The *lead-in* is the ≤ `max_n` tokens that preceded the segment in its call (an opener such as
  "```python\\n", the end of the previous block). Lookups match the call's own last tokens, whatever
  block they were in, so the lead-in lets a context that ends with an opener find the earlier
  blocks that began after the same opener; only the n-grams ending at the lead-in's *last* token
  are indexed, and continuations never contain lead-in tokens (they stop at the next SEP).

Index: for each match length n in `levels` (a sorted subset of [min_n, max_n], both ends
included), a hash table maps (block, the n tokens ending at position p) to the most recent such p,
and `pv[level, p]` chains each p to the previous position with the same key: the occurrences of an
n-gram, newest first. Keys are 64-bit splitmix hashes of (block id, tokens); every hit is checked
token by token, so a hash collision can cost time but never a wrong candidate.

Lookup (`run_ops`, LOOKUP): for the levels from the longest down, take the first level at which
the context's last n tokens occur with ≥ 1 continuation token; scan its chain (at most `max_scan`
occurrences, newest first), extend each occurrence's match backwards to its exact length below the
next level (exact longest match when the levels are consecutive), keep the occurrences with the
longest match — the `max_candidates` newest of them. Their continuations (the ≤ `Lc` tokens after
each occurrence, up to its segment's end) are the candidates; `consensus` reduces them (below).

Consensus (paper Algorithm 2, lines 10–11), on n candidate continuations, newest first:
- the *plurality path* P: at each depth d, among the candidates that agree with P[:d] and are
  longer than d, the most frequent token (ties: the newest candidate's token); stop when none is
  left or at Lc;
- CT* = P[:m], the longest prefix of P on which a strict majority of all n candidates agree
  (c_d > n/2 for every d < m), and at least `min_support` of them;
- c = the number of candidates that agree with all of CT* (if CT* is empty: with P's first
  token, the plurality count).

`suffix_path_counts` / `suffix_batch_meta` read the same summary (n, c, CT*) off a `suffix_tree`
tree for agentspec-r: n = the count of the node the context ends in, c_j = the counts along the
draft.

Layout: one arena per drafter (all blocks of all queries), grown by the Python side before a batch
(`BlockArena.run` reserves pool room and hash slots first, so the compiled code never grows
anything). Blocks live in regions of `pool` (tokens) and `pv` (chains), relocated on growth; hash
values are block-relative positions, so relocation and compaction never touch the table. A freed
block's hash entries go stale (its id is never reused) and disappear when the table is next rebuilt
from the live blocks (when dropping them keeps a growing table a size smaller; else it takes the old
table's entries).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from agentspec_sim.drafters.suffix import tree as suffix_tree
from agentspec_sim.drafters.suffix.tree import CNT, LEN, RIDX, RSEQ, SOFF
from agentspec_sim.drafters.suffix.tree import child_node as tree_child  # the tree's own child lookup
from agentspec_sim.host.kernel_cache import clear_if_changed

# The kernels below compile in suffix_tree.py's child_node: numba alone would not notice an edit there.
clear_if_changed(__file__, [suffix_tree.__file__])

SEP = -1
# Block fields (int64 rows of `bk`).
BOFF, BLEN, BCAP, BSEP, BLIVE = range(5)
BLOCK_FIELDS = 5
# Batch operations (int64 rows), run in order by `run_ops`:
#   APPEND [kind, block, tok_off, tok_n, lead_off, lead_n, -, -]: append tb[tok_off:+tok_n] to the block;
#          lead_n ≥ 0 starts a new segment with lead-in tb[lead_off:+lead_n]; lead_n = -1 continues the last one.
#   LOOKUP [kind, block, ctx_off, ctx_n, row, -, -, -]: candidates for context tb[ctx_off:+ctx_n]; the plurality
#          path goes to out[row], (n, c, |CT*|, |P|, match length) to meta[row].
OP_APPEND, OP_LOOKUP = 0, 1
OP_FIELDS = 8
META_N, META_C, META_CT, META_P, META_MATCH = range(5)
META_FIELDS = 5
NOT_INDEXED = -2  # pv value of a (level, position) that is not in the table

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


# ---------------------------------------------------------------------------------------------
# Hashing.

@njit(inline="always")
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(inline="always")
def _seed(block):
    return _mix(np.uint64(block) * _GOLD + _GOLD)


@njit(inline="always")
def _step(h, tok):
    return _mix(h ^ (np.uint64(tok) + _GOLD))


@njit(inline="always")
def _key(h):
    return h if h != np.uint64(0) else np.uint64(1)  # 0 marks an empty slot


@njit(cache=True, nogil=True)
def _probe(hk, key):
    """The slot holding `key`, or the empty slot where it would go."""
    mask = hk.shape[0] - 1
    i = np.int64(key & np.uint64(mask))
    while True:
        k = hk[i]
        if k == key or k == np.uint64(0):
            return i
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _index(pool, pv, hk, hv, used, levels, block, off, p, sep):
    """Insert the n-grams ending at block position p (n in levels; windows stay after `sep`)."""
    nlev = levels.shape[0]
    h = _seed(block)
    j = 0
    max_n = levels[nlev - 1]
    for i in range(max_n):
        q = p - i
        if q <= sep:
            break
        h = _step(h, pool[off + q])
        if i + 1 == levels[j]:
            key = _key(h)
            s = _probe(hk, key)
            if hk[s] == np.uint64(0):
                hk[s] = key
                pv[j, off + p] = -1
                used[0] += 1
            else:
                pv[j, off + p] = hv[s]
            hv[s] = p
            j += 1
            if j == nlev:
                break
    for jj in range(j, nlev):
        pv[jj, off + p] = NOT_INDEXED


@njit(cache=True, nogil=True)
def rebuild_table(pool, pv, bk, hk, hv, levels, num_blocks):
    """Fill an empty table from the live blocks' chains (heads: each key's newest position)."""
    nlev = levels.shape[0]
    max_n = levels[nlev - 1]
    used = 0
    for b in range(num_blocks):
        if bk[b, BLIVE] == 0:
            continue
        off = bk[b, BOFF]
        sep = np.int64(-1)
        for p in range(bk[b, BLEN]):
            if pool[off + p] == SEP:
                sep = p
                continue
            h = _seed(b)
            j = 0
            for i in range(max_n):
                q = p - i
                if q <= sep:
                    break
                h = _step(h, pool[off + q])
                if i + 1 == levels[j]:
                    if pv[j, off + p] != NOT_INDEXED:
                        key = _key(h)
                        s = _probe(hk, key)
                        if hk[s] == np.uint64(0):
                            hk[s] = key
                            used += 1
                        hv[s] = p
                    j += 1
                    if j == nlev:
                        break
    return used


@njit(cache=True, nogil=True)
def regrow_table(hk_old, hv_old, hk, hv):
    """Fill an empty (larger) table with the entries of the old one: no token is hashed again, and the
    writes follow the old table's order (a key's slot is its low bits), so they are near sequential."""
    used = 0
    for i in range(hk_old.shape[0]):
        key = hk_old[i]
        if key != np.uint64(0):
            s = _probe(hk, key)
            hk[s] = key
            hv[s] = hv_old[i]
            used += 1
    return used


# ---------------------------------------------------------------------------------------------
# Consensus over candidate continuations.

@njit(cache=True, nogil=True)
def _consensus(pool, off, cpos, clen, cnt, out, row, width, active, min_support):
    """Plurality path of the candidates into out[row]; returns (c, |CT*|, |P|) (module docstring)."""
    na = 0
    for i in range(cnt):
        active[na] = i
        na += 1
    m = 0
    c = 0
    c0 = 0
    d = 0
    while d < width:
        best_tok = -1
        best_cnt = 0
        for a in range(na):
            i = active[a]
            if clen[i] <= d:
                continue
            t = pool[off + cpos[i] + 1 + d]
            counted = False
            for a2 in range(a):  # a token is counted at its first (newest) occurrence
                i2 = active[a2]
                if clen[i2] > d and pool[off + cpos[i2] + 1 + d] == t:
                    counted = True
                    break
            if counted:
                continue
            k = 1
            for a2 in range(a + 1, na):
                i2 = active[a2]
                if clen[i2] > d and pool[off + cpos[i2] + 1 + d] == t:
                    k += 1
            if k > best_cnt:
                best_cnt = k
                best_tok = t
        if best_cnt == 0:
            break
        out[row, d] = best_tok
        keep = 0
        for a in range(na):
            i = active[a]
            if clen[i] > d and pool[off + cpos[i] + 1 + d] == best_tok:
                active[keep] = i
                keep += 1
        na = keep
        if d == 0:
            c0 = best_cnt
        if m == d and 2 * best_cnt > cnt and best_cnt >= min_support:
            m = d + 1
            c = best_cnt
        d += 1
    if m == 0:
        c = c0
    return c, m, d


@njit(cache=True, nogil=True)
def consensus_lists(tokens, offsets, width, min_support=1):
    """`consensus` of explicit candidates (tokens[offsets[i]:offsets[i+1]], newest first) — for tests
    and tools: returns (path int32 array, c, |CT*|)."""
    cnt = offsets.shape[0] - 1
    cpos = np.empty(max(cnt, 1), dtype=np.int64)
    clen = np.empty(max(cnt, 1), dtype=np.int64)
    for i in range(cnt):
        cpos[i] = offsets[i] - 1  # continuation = pool[cpos + 1 : cpos + 1 + clen]
        clen[i] = min(offsets[i + 1] - offsets[i], width)
    out = np.zeros((1, max(width, 1)), dtype=np.int32)
    active = np.empty(max(cnt, 1), dtype=np.int64)
    c, m, plen = _consensus(tokens, 0, cpos, clen, cnt, out, 0, width, active, min_support)
    return out[0, :plen].copy(), c, m


# ---------------------------------------------------------------------------------------------
# The batch entry point.

@njit(cache=True, nogil=True)
def _lookup(pool, pv, bk, hk, hv, levels, block, tb, co, cn, max_cand, max_scan, out, meta, row, cpos, clen,
            active, keys, min_support):
    width = out.shape[1]
    for f in range(META_FIELDS):
        meta[row, f] = 0
    if cn == 0 or width == 0:
        return
    off = bk[block, BOFF]
    blen = bk[block, BLEN]
    nlev = levels.shape[0]
    h = _seed(block)
    nk = 0
    for i in range(min(cn, levels[nlev - 1])):
        h = _step(h, tb[co + cn - 1 - i])
        if i + 1 == levels[nk]:
            keys[nk] = _key(h)
            nk += 1
            if nk == nlev:
                break
    for j in range(nk - 1, -1, -1):
        s = _probe(hk, keys[j])
        if hk[s] == np.uint64(0):
            continue
        n_j = levels[j]
        cap = levels[j + 1] - 1 if j + 1 < nlev else n_j
        cap = min(cap, cn)
        best = 0
        cnt = 0
        scanned = 0
        p = np.int64(hv[s])
        while p >= 0 and scanned < max_scan:
            scanned += 1
            ok = True
            for i in range(n_j):
                if pool[off + p - i] != tb[co + cn - 1 - i]:
                    ok = False
                    break
            if ok:
                ell = n_j
                while ell < cap and p - ell >= 0 and pool[off + p - ell] == tb[co + cn - 1 - ell]:
                    ell += 1  # SEP (-1) never equals a token
                q = p + 1
                lim = min(blen, p + 1 + width)
                while q < lim and pool[off + q] != SEP:
                    q += 1
                cl = q - p - 1
                if cl > 0:
                    if ell > best:
                        best = ell
                        cnt = 0
                    if ell == best and cnt < max_cand:
                        cpos[cnt] = p
                        clen[cnt] = cl
                        cnt += 1
            p = np.int64(pv[j, off + p])
        if cnt > 0:
            c, m, plen = _consensus(pool, off, cpos, clen, cnt, out, row, width, active, min_support)
            meta[row, META_N] = cnt
            meta[row, META_C] = c
            meta[row, META_CT] = m
            meta[row, META_P] = plen
            meta[row, META_MATCH] = best
            return


@njit(cache=True, nogil=True)
def run_ops(pool, pv, bk, hk, hv, used, levels, ops, tb, max_cand, max_scan, min_support, out, meta):
    """Apply `ops` in order (layout above). Pre: pool room and table slots reserved for every APPEND."""
    work = np.empty((3, max(max_cand, 1)), dtype=np.int64)
    keys = np.empty(levels.shape[0], dtype=np.uint64)
    run_ops_into(pool, pv, bk, hk, hv, used, levels, ops, tb, max_cand, max_scan, min_support, out, meta, work, keys)


@njit(cache=True, nogil=True)
def run_ops_into(pool, pv, bk, hk, hv, used, levels, ops, tb, max_cand, max_scan, min_support, out, meta, work,
                 keys):
    """`run_ops` with its work space given (int64 [3, ≥ max_cand], uint64 [levels]): allocates nothing."""
    nlev = levels.shape[0]
    cpos, clen, active = work[0], work[1], work[2]
    for r in range(ops.shape[0]):
        kind = ops[r, 0]
        b = ops[r, 1]
        if kind == OP_APPEND:
            off = bk[b, BOFF]
            L = bk[b, BLEN]
            sep = bk[b, BSEP]
            lead_n = ops[r, 5]
            if lead_n >= 0:
                pool[off + L] = SEP
                for j in range(nlev):
                    pv[j, off + L] = NOT_INDEXED
                sep = L
                L += 1
                lo = ops[r, 4]
                for i in range(lead_n):
                    pool[off + L] = tb[lo + i]
                    if i == lead_n - 1:
                        _index(pool, pv, hk, hv, used, levels, b, off, L, sep)
                    else:
                        for j in range(nlev):
                            pv[j, off + L] = NOT_INDEXED
                    L += 1
            o = ops[r, 2]
            for i in range(ops[r, 3]):
                pool[off + L] = tb[o + i]
                _index(pool, pv, hk, hv, used, levels, b, off, L, sep)
                L += 1
            bk[b, BLEN] = L
            bk[b, BSEP] = sep
        elif kind == OP_LOOKUP:
            _lookup(pool, pv, bk, hk, hv, levels, b, tb, ops[r, 2], ops[r, 3], max_cand, max_scan, out, meta,
                    ops[r, 4], cpos, clen, active, keys, min_support)


# ---------------------------------------------------------------------------------------------
# Counts along a path of a suffix tree (agentspec-r), read through `suffix_tree`'s node layout and child lookup.

@njit(cache=True, nogil=True)
def _tree_step(nd, sq, pool, ht, node, idx, tok):
    """One token down from (node, tokens of node matched): the new position, or (-1, 0)."""
    if idx >= nd[node, LEN]:
        child = tree_child(nd, ht, node, tok)
        if child < 0:
            return np.int64(-1), 0
        node = np.int64(child)
        idx = 0
    if pool[sq[nd[node, RSEQ], SOFF] + nd[node, RIDX] + idx] != tok:
        return np.int64(-1), 0
    return node, idx + 1


@njit(cache=True, nogil=True)
def _tree_walk(nd, sq, pool, ht, root, ctx, m, draft, counts, record):
    """Walk ctx[-m:] + draft from `root`: the count of the node the context ends in, or -1 when the
    path does not exist; with `record`, counts[j] = the count at draft token j."""
    node = np.int64(root)
    idx = 0
    L = ctx.shape[0]
    for j in range(L - m, L):
        node, idx = _tree_step(nd, sq, pool, ht, node, idx, ctx[j])
        if node < 0:
            return -1
    n_ctx = nd[node, CNT]
    for j in range(draft.shape[0]):
        node, idx = _tree_step(nd, sq, pool, ht, node, idx, draft[j])
        if node < 0:
            return -1
        if record:
            counts[j] = nd[node, CNT]
    return n_ctx


@njit(cache=True, nogil=True)
def suffix_path_counts(nd, sq, pool, ht, root, ctx, draft, counts):
    """The longest m ≥ 1 such that ctx[-m:] + draft is a path of the tree at `root`: returns (m, count
    of the node the context ends in) and sets counts[j] = the count of the node draft token j ends
    in (suffixes through it). (0, 0) when no m works. Node counts are suffix counts (suffix_tree).
    Paths are closed under dropping a first token, so the property is monotone in m: binary search."""
    lo = 0
    hi = ctx.shape[0]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _tree_walk(nd, sq, pool, ht, root, ctx, mid, draft, counts, False) >= 0:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return 0, 0
    return lo, _tree_walk(nd, sq, pool, ht, root, ctx, lo, draft, counts, True)


@njit(cache=True, nogil=True)
def suffix_batch_meta(nd, sq, pool, ht, roots, ctx, ctx_off, drafts, draft_off, meta):
    """agentspec-r's candidate summary of every row: `suffix_path_counts` on each of the row's trees
    (roots[row, :], -1 = none; the best is the longest m, then the larger count, then the first
    tree), then CT* (longest prefix with 2·c_j > n) and c; meta[row] = (n, c, |CT*|, |draft|, m)."""
    rows = roots.shape[0]
    width = 1
    for r in range(rows):
        width = max(width, draft_off[r + 1] - draft_off[r])
    counts = np.empty(width, dtype=np.int64)
    best_counts = np.empty(width, dtype=np.int64)
    for r in range(rows):
        for f in range(META_FIELDS):
            meta[r, f] = 0
        d = drafts[draft_off[r]:draft_off[r + 1]]
        if d.shape[0] == 0:
            continue
        c_ctx = ctx[ctx_off[r]:ctx_off[r + 1]]
        best_m = 0
        best_n = 0
        for t in range(roots.shape[1]):
            root = roots[r, t]
            if root < 0:
                continue
            m, n = suffix_path_counts(nd, sq, pool, ht, root, c_ctx, d, counts)
            if m > best_m or (m == best_m and n > best_n):
                best_m = m
                best_n = n
                for j in range(d.shape[0]):
                    best_counts[j] = counts[j]
        if best_m == 0:
            continue
        ct = 0
        while ct < d.shape[0] and 2 * best_counts[ct] > best_n:
            ct += 1
        meta[r, META_N] = best_n
        meta[r, META_C] = best_counts[ct - 1] if ct > 0 else best_counts[0]
        meta[r, META_CT] = ct
        meta[r, META_P] = d.shape[0]
        meta[r, META_MATCH] = best_m


# ---------------------------------------------------------------------------------------------
# The Python side.

def match_levels(min_n: int, max_n: int) -> tuple[int, ...]:
    """The indexed match lengths for [min_n, max_n]: every n when the range is short (≤ 4 lengths),
    else min_n, the powers of two between, and max_n (memory grows with the number of levels)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
    if max_n - min_n < 4:
        return tuple(range(min_n, max_n + 1))
    inner = [1 << k for k in range(1, max_n.bit_length()) if min_n < (1 << k) < max_n]
    return (min_n, *inner, max_n)


class BlockArena:
    """Blocks (token streams with segments) and their n-gram index, in one set of arrays.

    `new_block()` → a block id; `run(ops, tb, …)` appends and looks up in one compiled call;
    `free_block(b)` drops a block (its space is reclaimed at the next compaction).
    """

    def __init__(self, levels: Sequence[int], pool_capacity: int = 1 << 14, table_size: int = 1 << 12) -> None:
        lv = sorted({int(n) for n in levels})
        if not lv or lv[0] < 1:
            raise ValueError(f"match levels must be ≥ 1, got {levels}")
        self.levels = np.asarray(lv, dtype=np.int64)
        self.max_n = lv[-1]
        self.pool = np.zeros(pool_capacity, dtype=np.int32)
        self.pv = np.zeros((len(lv), pool_capacity), dtype=np.int32)
        self.pool_top = 0
        self.bk = np.zeros((16, BLOCK_FIELDS), dtype=np.int64)
        self.num_blocks = 0
        self.hk = np.zeros(table_size, dtype=np.uint64)
        self.hv = np.zeros(table_size, dtype=np.int32)
        self.used = np.zeros(1, dtype=np.int64)
        # Tokens (SEPs and lead-ins included) held by live blocks: [0] counts what `run` reserved and
        # `free_block` dropped, [1] what compiled callers appended after checking the room themselves
        # (drafters/agentspec/fastpath.py, its compiled step).
        self.live = np.zeros(2, dtype=np.int64)
        self._stale = 0  # keys of freed blocks still in the table, at most (a position per level)

    @property
    def live_tokens(self) -> int:
        return int(self.live[0] + self.live[1])

    # -- blocks ---------------------------------------------------------------------------------
    def new_block(self) -> int:
        b = self.num_blocks
        if b == self.bk.shape[0]:
            bk = np.zeros((2 * b, BLOCK_FIELDS), dtype=np.int64)
            bk[:b] = self.bk
            self.bk = bk
        self.bk[b] = (0, 0, 0, -1, 1)
        self.num_blocks += 1
        return b

    def free_block(self, b: int) -> None:
        if self.bk[b, BLIVE]:
            self.bk[b, BLIVE] = 0
            self.live[0] -= self.bk[b, BLEN]
            self.bk[b, BCAP] = 0
            self._stale += int(self.bk[b, BLEN]) * self.levels.shape[0]

    def block_len(self, b: int) -> int:
        return int(self.bk[b, BLEN])

    def block_tokens(self, b: int) -> np.ndarray:
        """The block's stream (a view): SEP (-1) before each segment, then its lead-in and tokens."""
        off = int(self.bk[b, BOFF])
        return self.pool[off:off + int(self.bk[b, BLEN])]

    # -- room -----------------------------------------------------------------------------------
    def _reserve(self, b: int, n: int, pending: dict[int, int]) -> None:
        """Room for n more tokens in block b, after the `pending` ones this batch already reserved."""
        length = int(self.bk[b, BLEN])
        need = length + pending.get(b, 0) + n
        self._grow(b, need)
        pending[b] = need - length
        self.live[0] += n

    def ensure_room(self, b: int, n: int) -> None:
        """Capacity for n more tokens in block b, for a compiled caller that appends them later and checks
        the room itself (drafters/agentspec/fastpath.py, its compiled step); nothing is counted as live."""
        if self.bk[b, BLIVE]:
            self._grow(b, int(self.bk[b, BLEN]) + n)

    def _grow(self, b: int, need: int) -> None:
        """Move block b to a stretch of the pool with room for `need` tokens, if it has less (doubling)."""
        cap = int(self.bk[b, BCAP])
        if need <= cap:
            return
        length = int(self.bk[b, BLEN])
        cap = max(need + 64, 2 * cap)
        if self.pool_top + cap > self.pool.shape[0]:
            self._compact(cap)
        off = int(self.bk[b, BOFF])
        top = self.pool_top
        self.pool[top:top + length] = self.pool[off:off + length]
        self.pv[:, top:top + length] = self.pv[:, off:off + length]
        self.bk[b, BOFF] = top
        self.bk[b, BCAP] = cap
        self.pool_top = top + cap

    def _compact(self, extra: int) -> None:
        """Move the live blocks to the front of the pool, in place while they and `extra` fill at most half
        of it, else into fresh arrays twice that size. (Freed blocks stay in `bk`: only live ones are
        visited, in pool order, so that a move never overwrites a block not yet moved.)"""
        nb = self.num_blocks
        bk = self.bk[:nb]
        live = np.flatnonzero((bk[:, BLIVE] != 0) & (bk[:, BCAP] != 0))
        live = live[np.argsort(bk[live, BOFF], kind="stable")]
        need = int(bk[live, BCAP].sum())
        if 2 * (need + extra) <= self.pool.shape[0]:
            pool, pv = self.pool, self.pv
        else:
            size = 2 * (need + extra)
            pool = np.zeros(size, dtype=np.int32)
            pv = np.zeros((self.pv.shape[0], size), dtype=np.int32)
        top = 0
        for b in live.tolist():
            off, length = int(bk[b, BOFF]), int(bk[b, BLEN])
            if off != top or pool is not self.pool:
                pool[top:top + length] = self.pool[off:off + length]
                pv[:, top:top + length] = self.pv[:, off:off + length]
                bk[b, BOFF] = top
            top += int(bk[b, BCAP])
        self.pool, self.pv, self.pool_top = pool, pv, top

    def _reserve_slots(self, extra: int) -> None:
        """Make room in the table for `extra` more keys at load ≤ 1/2. A new table is a pass over every
        key, so it is sized for a load of ≤ 1/3 (the next one comes once the keys have grown by half; a
        plain doubling lands at ≤ 1/4). It is rebuilt from the live blocks, dropping freed blocks' keys,
        when that keeps it a size smaller; else it takes the old table's entries (nothing hashed again)."""
        used = int(self.used[0])
        if 2 * (used + extra) <= self.hk.shape[0]:
            return

        def size_for(keys: int) -> int:
            size = self.hk.shape[0]
            while 3 * (keys + extra) > size:
                size *= 2
            return size

        size, live_size = size_for(used), size_for(max(used - self._stale, 0))
        rebuild = live_size < size  # (only when freed blocks' keys are in the table)
        if rebuild:
            size = live_size
        while True:
            hk = np.zeros(size, dtype=np.uint64)
            hv = np.zeros(size, dtype=np.int32)
            if rebuild:
                used = rebuild_table(self.pool, self.pv, self.bk, hk, hv, self.levels, self.num_blocks)
            else:
                used = regrow_table(self.hk, self.hv, hk, hv)
            if 2 * (used + extra) <= size:
                break
            size *= 2
        self.hk, self.hv = hk, hv
        self.used[0] = used
        if rebuild:
            self._stale = 0

    # -- batches --------------------------------------------------------------------------------
    def run(self, ops: np.ndarray, tb: np.ndarray, out: np.ndarray, meta: np.ndarray, max_candidates: int,
            max_scan: int, min_support: int = 1, grow: list[tuple[int, int]] | None = None) -> None:
        """Run `ops` (int64 [k, OP_FIELDS]) over the token buffer `tb`; lookups write out/meta rows.

        `grow`: (block, tokens it receives) for every APPEND, SEPs and lead-ins included, if the
        caller knows them (else they are read from `ops`); room is reserved before the run."""
        if ops.shape[0] == 0:
            return
        if grow is None:
            appends = ops[ops[:, 0] == OP_APPEND]
            grow = [(b, n + (lead + 1 if lead >= 0 else 0)) for b, n, lead in
                    zip(appends[:, 1].tolist(), appends[:, 3].tolist(), appends[:, 5].tolist(), strict=True)]
        if grow:
            extra = 0
            pending: dict[int, int] = {}
            for b, n in grow:
                self._reserve(b, n, pending)
                extra += n
            self._reserve_slots(extra * self.levels.shape[0])
        run_ops(self.pool, self.pv, self.bk, self.hk, self.hv, self.used, self.levels, ops, tb,
                int(max_candidates), int(max_scan), int(min_support), out, meta)

__all__ = [
    "META_C", "META_CT", "META_FIELDS", "META_MATCH", "META_N", "META_P", "OP_APPEND", "OP_FIELDS", "OP_LOOKUP",
    "SEP", "BlockArena", "consensus_lists", "match_levels", "run_ops", "suffix_batch_meta", "suffix_path_counts",
]
