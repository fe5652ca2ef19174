"""Depth-limited suffix trees for the `suffix` drafter: a numba core over one shared array arena.

The rule (ArcticInference 0.3.0 `csrc/suffix_decoding/suffix_tree.cc`, which vLLM 0.33's `method:
"suffix"` drives): a tree indexes every suffix of its sequences, each cut to `depth` tokens. A node
is a path-compressed run of tokens with `count` = the number of (cut) suffixes that pass through or
end at it. Appending a token to a sequence extends the ≤ `depth` suffixes still open ("active");
a suffix always ends at a node boundary, so a node with one child of the same count is merged, and
a node where a suffix ends next to a child is split. The children of a node form a list ordered by
count, largest first; equal counts keep the order of these rules (what the greedy draft follows on
ties): a new child goes to the tail; an increment moves a node to the *head* of the next count's
run if it headed its own run, else to that run's *tail*; a decrement moves it to the head of the
lower count's run; splits, fusions and merges keep the position. `speculate` walks the tree with
the last 1, 2, … context tokens and follows the head child greedily (see `_speculate_tree`).

Layout (one arena per drafter; every tree — the global response tree and each call's prompt tree —
lives in it, so one compiled call serves a whole batch):
  `nd[node, F]`  int32 node fields (F below); `gp[group, G]` int32 runs of equal count among
  siblings (head, tail, size), so that moving a node is O(1); `ht` an open-addressing table
  (linear probing, backward-shift deletion) from (parent, first token) to child, holding only the
  children of nodes with two or more (a lookup reads an only child from its parent's HEAD, so its
  entry would be dead weight; and an only child's first token is the one that path compression keeps
  changing, which cost two table writes per change); `sq[seq, S]` int64
  per-sequence storage (offset and length in `pool`, capacity, the ring of active nodes in `act`).
A node's tokens are `pool[sq[ref_seq, OFF] + ref_idx : … + len]`. Unlike the C++ (which re-points
references when a sequence is removed), a removed sequence keeps its tokens in the pool, so no
reference ever changes; the tokens a node reads are the same either way.

The compiled code never grows the arena: pool space of each appended sequence is reserved by the Python
side (`SuffixForest`) before a batch, and when node or hash-table room runs short the batch stops
between two appends, the Python side grows the arrays, and the batch resumes where it stopped.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

# Node fields.
CNT, TOK, LEN, RSEQ, RIDX, PAR, HEAD, TAIL, NEXT, PREV, GRP, NCH = range(12)
NODE_FIELDS = 16  # 12 used; rows of 64 bytes, one cache line each
# Group fields (a run of equal-count siblings).
GHEAD, GTAIL, GSIZE = range(3)
# Sequence fields.
SOFF, SLEN, SCAP, SAST, SAN = range(5)
SEQ_FIELDS = 5
# meta: free-list heads, high-water marks, live counts.
M_NFREE, M_NHWM, M_NLIVE, M_GFREE, M_GHWM, M_HUSED, M_NFREECNT, M_RTOK = range(8)
META_FIELDS = 8
# Batch operations (rows of an int64 array, see `run_ops`).
OP_STEP, OP_APPEND, OP_REMOVE, OP_FREE, OP_TABLE_STEP = range(5)
OP_FIELDS = 10


class LocalTable(NamedTuple):
    """Prompt-tree drafts read from a table instead of a tree (`OP_TABLE_STEP`; drafters/suffix/tables.py):
    per position, the draft's float32 score, its length, and where its tokens start in `pool`."""

    score: np.ndarray  # float32 [positions]
    length: np.ndarray  # int32 [positions]
    path: np.ndarray  # int64 [positions]
    pool: np.ndarray  # int32

    @classmethod
    def empty(cls) -> LocalTable:
        return cls(np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int64),
                   np.zeros(1, dtype=np.int32))

# A free slot of the child table. Keys are never 0 (`_key` counts nodes from 1), so a new table is np.zeros: the
# kernel's zeroed pages, touched only as entries land, instead of a fill of the whole table at every doubling.
EMPTY = np.int64(0)
_MIX = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------------------------
# Hash table: (parent, token) → child.

@njit(inline="always")
def _key(node, tok):
    return ((np.int64(node) + 1) << 32) | (np.int64(tok) & 0xFFFFFFFF)


@njit(inline="always")
def _slot(key, mask):
    h = np.uint64(key) * _MIX
    h ^= h >> np.uint64(31)
    return np.int64(h & np.uint64(mask))


@njit(cache=True, nogil=True)
def _hget(ht, key):
    mask = ht.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = ht[i, 0]
        if k == key:
            return ht[i, 1]
        if k == EMPTY:
            return np.int64(-1)
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _hset(ht, meta, key, val):
    """Insert or overwrite."""
    mask = ht.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = ht[i, 0]
        if k == key:
            ht[i, 1] = val
            return
        if k == EMPTY:
            ht[i, 0] = key
            ht[i, 1] = val
            meta[M_HUSED] += 1
            return
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _hdel(ht, meta, key):
    mask = ht.shape[0] - 1
    i = _slot(key, mask)
    while ht[i, 0] != key:
        if ht[i, 0] == EMPTY:
            return
        i = (i + 1) & mask
    # Backward-shift deletion: pull later entries of the probe run into the hole.
    j = i
    while True:
        j = (j + 1) & mask
        k = ht[j, 0]
        if k == EMPTY:
            break
        ideal = _slot(k, mask)
        if (j > i and (ideal <= i or ideal > j)) or (j < i and ideal <= i and ideal > j):
            ht[i, 0] = k
            ht[i, 1] = ht[j, 1]
            i = j
    ht[i, 0] = EMPTY
    meta[M_HUSED] -= 1


@njit(cache=True, nogil=True)
def child_node(nd, ht, node, tok):
    """The child of node starting with tok, or -1 (no table probe for leaves and single children)."""
    n = nd[node, NCH]
    if n == 0:
        return np.int64(-1)
    if n == 1:
        c = nd[node, HEAD]
        return np.int64(c) if nd[c, TOK] == tok else np.int64(-1)
    return _hget(ht, _key(node, tok))


@njit(cache=True, nogil=True)
def move_entries(old, new):
    """Every entry of `old` into `new` (all EMPTY, a power-of-two multiple of old's size). Taken in old's
    slot order, an entry's new home slot is its old one plus a multiple of old's size, so the writes run
    through `new` in a few ordered streams instead of at random (as a rebuild from the nodes did)."""
    mask = new.shape[0] - 1
    for j in range(old.shape[0]):
        k = old[j, 0]
        if k == EMPTY:
            continue
        i = _slot(k, mask)
        while new[i, 0] != EMPTY:
            i = (i + 1) & mask
        new[i, 0] = k
        new[i, 1] = old[j, 1]


# ---------------------------------------------------------------------------------------------
# Allocation.

@njit(cache=True, nogil=True)
def _new_node(nd, meta):
    x = meta[M_NFREE]
    if x >= 0:
        meta[M_NFREE] = nd[x, NEXT]
        meta[M_NFREECNT] -= 1
    else:
        x = meta[M_NHWM]
        meta[M_NHWM] += 1
    meta[M_NLIVE] += 1
    for f in range(NODE_FIELDS):
        nd[x, f] = -1
    nd[x, CNT] = 0
    nd[x, LEN] = 0
    nd[x, NCH] = 0
    return x


@njit(cache=True, nogil=True)
def _free_node(nd, meta, x):
    nd[x, PAR] = -1
    nd[x, LEN] = 0
    nd[x, NEXT] = meta[M_NFREE]
    meta[M_NFREE] = x
    meta[M_NFREECNT] += 1
    meta[M_NLIVE] -= 1


@njit(cache=True, nogil=True)
def _new_group(gp, meta, x):
    g = meta[M_GFREE]
    if g >= 0:
        meta[M_GFREE] = gp[g, GHEAD]
    else:
        g = meta[M_GHWM]
        meta[M_GHWM] += 1
    gp[g, GHEAD] = x
    gp[g, GTAIL] = x
    gp[g, GSIZE] = 1
    return g


@njit(cache=True, nogil=True)
def _free_group(gp, meta, g):
    gp[g, GSIZE] = 0
    gp[g, GHEAD] = meta[M_GFREE]
    meta[M_GFREE] = g


@njit(cache=True, nogil=True)
def new_root(nd, meta):
    return _new_node(nd, meta)


# ---------------------------------------------------------------------------------------------
# Sibling list: ordered by count (largest first), equal counts in runs (groups).

@njit(cache=True, nogil=True)
def _unlink(nd, gp, meta, x):
    """Take x out of its parent's child list and out of its run."""
    p = nd[x, PAR]
    g = nd[x, GRP]
    gp[g, GSIZE] -= 1
    if gp[g, GSIZE] == 0:
        _free_group(gp, meta, g)
    else:
        if gp[g, GHEAD] == x:
            gp[g, GHEAD] = nd[x, NEXT]
        if gp[g, GTAIL] == x:
            gp[g, GTAIL] = nd[x, PREV]
    nd[x, GRP] = -1
    nx = nd[x, NEXT]
    pv = nd[x, PREV]
    if nx >= 0:
        nd[nx, PREV] = pv
    else:
        nd[p, TAIL] = pv
    if pv >= 0:
        nd[pv, NEXT] = nx
    else:
        nd[p, HEAD] = nx
    nd[x, NEXT] = -1
    nd[x, PREV] = -1


@njit(cache=True, nogil=True)
def _link_before(nd, gp, meta, p, x, before):
    """Put x into p's child list just before `before` (-1: at the tail); join an equal-count neighbour's run."""
    pv = nd[before, PREV] if before >= 0 else nd[p, TAIL]
    nx = before
    nd[x, PREV] = pv
    nd[x, NEXT] = nx
    if pv >= 0:
        nd[pv, NEXT] = x
    else:
        nd[p, HEAD] = x
    if nx >= 0:
        nd[nx, PREV] = x
    else:
        nd[p, TAIL] = x
    c = nd[x, CNT]
    if pv >= 0 and nd[pv, CNT] == c:
        g = nd[pv, GRP]
        nd[x, GRP] = g
        gp[g, GSIZE] += 1
        if gp[g, GTAIL] == pv:
            gp[g, GTAIL] = x
    elif nx >= 0 and nd[nx, CNT] == c:
        g = nd[nx, GRP]
        nd[x, GRP] = g
        gp[g, GSIZE] += 1
        if gp[g, GHEAD] == nx:
            gp[g, GHEAD] = x
    else:
        nd[x, GRP] = _new_group(gp, meta, x)


@njit(cache=True, nogil=True)
def _replace(nd, gp, old, new):
    """`new` (same count) takes `old`'s place in the child list and its run."""
    p = nd[old, PAR]
    pv = nd[old, PREV]
    nx = nd[old, NEXT]
    nd[new, PREV] = pv
    nd[new, NEXT] = nx
    if pv >= 0:
        nd[pv, NEXT] = new
    else:
        nd[p, HEAD] = new
    if nx >= 0:
        nd[nx, PREV] = new
    else:
        nd[p, TAIL] = new
    g = nd[old, GRP]
    nd[new, GRP] = g
    if gp[g, GHEAD] == old:
        gp[g, GHEAD] = new
    if gp[g, GTAIL] == old:
        gp[g, GTAIL] = new
    nd[old, GRP] = -1
    nd[old, PREV] = -1
    nd[old, NEXT] = -1


@njit(cache=True, nogil=True)
def _increment(nd, gp, meta, x):
    p = nd[x, PAR]
    c = nd[x, CNT]
    if p < 0 or nd[p, NCH] == 1:  # the root, or an only child (alone in its run): nothing moves
        nd[x, CNT] = c + 1
        return
    pv = nd[x, PREV]
    if pv < 0 or nd[pv, CNT] > c + 1:
        # Stays in place; if it shared its run (as its head), it leaves it.
        g = nd[x, GRP]
        if gp[g, GSIZE] > 1:
            gp[g, GHEAD] = nd[x, NEXT]
            gp[g, GSIZE] -= 1
            nd[x, GRP] = _new_group(gp, meta, x)
        nd[x, CNT] = c + 1
    else:
        # Head of its run → head of the (c+1) run; otherwise → just before its own run (tail of c+1).
        target = gp[nd[pv, GRP], GHEAD]
        _unlink(nd, gp, meta, x)
        nd[x, CNT] = c + 1
        _link_before(nd, gp, meta, p, x, target)


@njit(cache=True, nogil=True)
def _decrement(nd, gp, meta, x):
    p = nd[x, PAR]
    if p < 0:
        nd[x, CNT] -= 1
        return
    # → head of the (c−1) run: just after the last node of its current run.
    target = nd[gp[nd[x, GRP], GTAIL], NEXT]
    _unlink(nd, gp, meta, x)
    nd[x, CNT] -= 1
    _link_before(nd, gp, meta, p, x, target)


# ---------------------------------------------------------------------------------------------
# Append, remove, free.

@njit(cache=True, nogil=True)
def _append(nd, gp, sq, act, pool, ht, meta, root, s, tok):
    """Append one token to sequence s of the tree at `root` (pool space reserved by the caller)."""
    depth = act.shape[1]
    st = sq[s, SAST]
    n = sq[s, SAN]
    if n == depth:  # the oldest open suffix reached the depth limit: it is closed
        st = (st + 1) % depth
        n -= 1
    act[s, (st + n) % depth] = root
    n += 1
    sq[s, SAST] = st
    sq[s, SAN] = n
    nd[root, CNT] += 1
    off = sq[s, SOFF]
    L = sq[s, SLEN]
    pool[off + L] = tok
    L += 1
    sq[s, SLEN] = L
    a = st - 1
    for _ in range(n):
        a += 1
        if a == depth:
            a = 0
        node = np.int64(act[s, a])
        child = child_node(nd, ht, node, tok)
        if child < 0:
            if nd[node, CNT] == 1 and node != root:
                # The only suffix here is this one, at a leaf: lengthen the leaf.
                ln = nd[node, LEN] + 1
                nd[node, LEN] = ln
                nd[node, RSEQ] = s
                nd[node, RIDX] = L - ln
            else:
                # New leaf child, at the tail of the child list.
                c = _new_node(nd, meta)
                nd[c, CNT] = 1
                nd[c, TOK] = tok
                nd[c, LEN] = 1
                nd[c, RSEQ] = s
                nd[c, RIDX] = L - 1
                nd[c, PAR] = node
                k = nd[node, NCH]
                if k == 1:  # node starts branching: its first child enters the table too
                    h = nd[node, HEAD]
                    _hset(ht, meta, _key(node, nd[h, TOK]), h)
                if k >= 1:
                    _hset(ht, meta, _key(node, tok), c)
                nd[node, NCH] = k + 1
                _link_before(nd, gp, meta, node, c, -1)
                act[s, a] = c
        elif nd[node, CNT] == nd[child, CNT] + 1 and node != root:
            # This suffix ends at node; every other suffix through node goes on into child.
            if nd[child, LEN] == 1:
                # Fuse node and child: child takes node's place.
                p = nd[node, PAR]
                nd[child, CNT] += 1
                nd[child, TOK] = nd[node, TOK]
                nd[child, LEN] = nd[node, LEN] + 1
                nd[child, RSEQ] = s
                nd[child, RIDX] = L - nd[child, LEN]
                _free_group(gp, meta, nd[child, GRP])
                nd[child, GRP] = -1
                _replace(nd, gp, node, child)
                nd[child, PAR] = p
                if nd[p, NCH] > 1:
                    _hset(ht, meta, _key(p, nd[node, TOK]), child)
                _free_node(nd, meta, node)
                act[s, a] = child
            else:
                # Lengthen node by one token taken from the front of child.
                ln = nd[node, LEN] + 1
                nd[node, LEN] = ln
                nd[node, RSEQ] = s
                nd[node, RIDX] = L - ln
                nd[child, LEN] -= 1
                nd[child, RIDX] += 1
                nd[child, TOK] = pool[sq[nd[child, RSEQ], SOFF] + nd[child, RIDX]]
        else:
            if nd[child, LEN] == 1:
                _increment(nd, gp, meta, child)
                act[s, a] = child
            else:
                # Split child after its first token; the new node takes child's place.
                m = _new_node(nd, meta)
                nd[m, CNT] = nd[child, CNT]
                nd[m, TOK] = tok
                nd[m, LEN] = 1
                nd[m, RSEQ] = s
                nd[m, RIDX] = L - 1
                nd[m, PAR] = node
                _replace(nd, gp, child, m)
                if nd[node, NCH] > 1:
                    _hset(ht, meta, _key(node, tok), m)
                nd[child, LEN] -= 1
                nd[child, RIDX] += 1
                nd[child, TOK] = pool[sq[nd[child, RSEQ], SOFF] + nd[child, RIDX]]
                nd[child, PAR] = m
                nd[m, HEAD] = child
                nd[m, TAIL] = child
                nd[m, NCH] = 1
                nd[child, GRP] = _new_group(gp, meta, child)
                _increment(nd, gp, meta, m)
                act[s, a] = m


@njit(cache=True, nogil=True)
def _remove(nd, gp, sq, pool, ht, meta, root, s):
    """Remove every suffix of sequence s from the tree at `root` (its tokens stay in the pool)."""
    off = sq[s, SOFF]
    L = sq[s, SLEN]
    for start in range(L):
        node = np.int64(root)
        nd[root, CNT] -= 1
        idx = start
        while idx < L:
            t = pool[off + idx]
            child = child_node(nd, ht, node, t)
            if child < 0:
                break
            if nd[child, CNT] > 1:
                _decrement(nd, gp, meta, child)
            else:
                # Count 1: a leaf holding only this suffix.
                _unlink(nd, gp, meta, child)
                k = nd[node, NCH]
                if k > 1:
                    _hdel(ht, meta, _key(node, t))
                if k == 2:  # node stops branching: its last child leaves the table
                    h = nd[node, HEAD]
                    _hdel(ht, meta, _key(node, nd[h, TOK]))
                nd[node, NCH] = k - 1
                _free_node(nd, meta, child)
                break
            idx += nd[child, LEN]
            node = child
        if node != root and nd[node, NCH] == 1:
            c = nd[node, HEAD]
            if nd[node, CNT] == nd[c, CNT]:
                # No suffix ends at node any more: merge it into its only child.
                p = nd[node, PAR]
                nd[c, TOK] = nd[node, TOK]
                nd[c, LEN] += nd[node, LEN]
                nd[c, RIDX] -= nd[node, LEN]
                _free_group(gp, meta, nd[c, GRP])
                nd[c, GRP] = -1
                _replace(nd, gp, node, c)
                nd[c, PAR] = p
                if nd[p, NCH] > 1:
                    _hset(ht, meta, _key(p, nd[node, TOK]), c)
                _free_node(nd, meta, node)
    sq[s, SAN] = 0


@njit(cache=True, nogil=True)
def _free_tree(nd, gp, ht, meta, root):
    """Free every node of the tree at `root` (post-order, no stack)."""
    x = np.int64(root)
    while True:
        h = nd[x, HEAD]
        if h >= 0:
            x = h
            continue
        p = nd[x, PAR]
        if p < 0:
            _free_node(nd, meta, x)
            return
        nxt = nd[x, NEXT]
        nd[p, HEAD] = nxt
        if nxt >= 0:
            nd[nxt, PREV] = -1
        g = nd[x, GRP]
        gp[g, GSIZE] -= 1
        if gp[g, GSIZE] == 0:
            _free_group(gp, meta, g)
        else:
            gp[g, GHEAD] = nxt
        if nd[p, NCH] > 1:
            _hdel(ht, meta, _key(p, nd[x, TOK]))
        _free_node(nd, meta, x)
        x = p


# ---------------------------------------------------------------------------------------------
# Speculation.

@njit(cache=True, nogil=True)
def _match(nd, sq, pool, ht, root, ctx, lo, hi):
    """Walk ctx[lo:hi] from the root: (node, tokens of node matched), or (-1, 0)."""
    node = np.int64(root)
    idx = 0
    base = 0
    for j in range(lo, hi):
        t = ctx[j]
        if idx >= nd[node, LEN]:
            child = child_node(nd, ht, node, t)
            if child < 0:
                return np.int64(-1), 0
            node = child
            base = sq[nd[node, RSEQ], SOFF] + nd[node, RIDX]
            idx = 0
        if pool[base + idx] != t:
            return np.int64(-1), 0
        idx += 1
    return node, idx


@njit(cache=True, nogil=True)
def _walk(nd, sq, pool, node, idx, budget, min_prob, out):
    """Greedy path from (node, idx): head child each time; float32 probabilities as the C++ computes them."""
    prob = np.float32(1.0)
    score = np.float32(0.0)
    n = 0
    base = sq[nd[node, RSEQ], SOFF] + nd[node, RIDX]
    while n < budget and prob >= min_prob:
        if idx < nd[node, LEN]:
            out[n] = pool[base + idx]
            score += prob
            n += 1
            idx += 1
        else:
            child = nd[node, HEAD]
            if child < 0:
                break
            prob = prob * (np.float32(nd[child, CNT]) / np.float32(nd[node, CNT]))
            node = child
            base = sq[nd[node, RSEQ], SOFF] + nd[node, RIDX]
            idx = 0
    return n, score


@njit(cache=True, nogil=True)
def _tail_agrees(sq, pool, s, ctx, lo, hi):
    """How many of ctx[lo:hi]'s last tokens end sequence s, up to its open suffixes (0 for s < 0)."""
    if s < 0:
        return 0
    v = min(sq[s, SAN], hi - lo)
    end = sq[s, SOFF] + sq[s, SLEN] - 1
    for j in range(v):
        if pool[end - j] != ctx[hi - 1 - j]:
            return j
    return v


@njit(cache=True, nogil=True)
def _speculate_tree(nd, sq, act, pool, ht, root, s, ctx, lo, hi, max_spec, factor, offset, min_prob, tmp, best):
    """Best draft of one tree for context ctx[lo:hi] into `best`: (length, score).

    For match length m = 1, 2, … < len(ctx) (stop at the first that does not occur): budget
    min(max_spec, ⌊m·factor + offset + 1e-6⌋), greedy path, score = Σ probabilities; the best score
    wins, ties to the longer match.

    Two shortcuts leave the result as the C++ computes it. (1) When the context ends with the last
    tokens of the tree's sequence s (a call's own prompt tree; its response in the global tree), the
    match of its last m tokens, m ≤ that overlap, is where s's open suffix of length m ends, a node
    boundary (`act`), so no walk from the root is needed. (2) A path from a node m tokens deep holds
    at most depth − m more tokens (suffixes are cut to the depth) and each adds a probability ≤ 1,
    so once depth − m falls below the best score no longer match can win.
    """
    depth = act.shape[1]
    agree = _tail_agrees(sq, pool, s, ctx, lo, hi)
    st = sq[s, SAST] if s >= 0 else 0
    n_open = sq[s, SAN] if s >= 0 else 0
    best_n = 0
    best_score = np.float32(0.0)
    for m in range(1, hi - lo):
        if depth - m < best_score:
            break
        if m <= agree:
            node = np.int64(act[s, (st + n_open - m) % depth])
            idx = nd[node, LEN]
        else:
            node, idx = _match(nd, sq, pool, ht, root, ctx, hi - m, hi)
            if node < 0:
                break
        budget = int(np.float64(np.float32(m) * factor + offset) + 1e-6)
        budget = max(min(max_spec, budget), 0)
        n, score = _walk(nd, sq, pool, node, idx, budget, min_prob, tmp)
        if score >= best_score:
            best_score = score
            best_n = n
            for i in range(n):
                best[i] = tmp[i]
    return best_n, best_score


# ---------------------------------------------------------------------------------------------
# The batch entry point.

@njit(cache=True, nogil=True)
def room(nd, ht, meta, need):
    """Whether `need` more nodes fit (node slots, and hash slots at load ≤ 1/2)."""
    free = nd.shape[0] - meta[M_NHWM] + meta[M_NFREECNT]
    return free >= need and 2 * (meta[M_HUSED] + need) <= ht.shape[0]


@njit(cache=True, nogil=True)
def run_ops(nd, gp, sq, act, pool, ht, meta, global_root, ops, tb, factor, offset, min_prob, out, out_n,
            first_op, first_tok, lt, out_score):
    """Apply ops[first_op:] in order (the first from its token first_tok). Row layout (int64):

    OP_STEP   [kind, local_root, local_seq, global_seq|-1, tok_off, tok_len, ctx_off, ctx_len, max_spec, out_row|-1]:
              append tb[tok_off:+tok_len] to the local tree and (if global_seq ≥ 0) the global tree;
              then, if out_row ≥ 0, speculate on ctx = tb[ctx_off:+ctx_len] and write the draft to out[out_row]
              and its score to out_score[out_row]: the local tree's draft unless the global tree's scores higher.
    OP_TABLE_STEP [kind, position, -, global_seq|-1, …as OP_STEP]: OP_STEP for a call whose local tree's
              drafts are `lt`'s (`LocalTable`): its draft at `position` stands for the local tree's.
    OP_APPEND [kind, root, seq, -, tok_off, tok_len, …]: append tokens to one tree.
    OP_REMOVE [kind, root, seq, …]: remove a sequence.
    OP_FREE   [kind, root, …]: free a whole tree.

    Returns -1 when done, or the op to resume at when the arena is short of room (one append can
    create up to `depth` nodes): then meta[M_RTOK] is the token to resume from; nothing is half-done.
    """
    work = np.empty((3, max(out.shape[1], 1)), dtype=np.int32)
    return run_ops_into(nd, gp, sq, act, pool, ht, meta, global_root, ops, tb, factor, offset, min_prob, out, out_n,
                        first_op, first_tok, work, lt, out_score)


@njit(cache=True, nogil=True)
def run_ops_into(nd, gp, sq, act, pool, ht, meta, global_root, ops, tb, factor, offset, min_prob, out, out_n,
                 first_op, first_tok, work, lt, out_score):
    """`run_ops` with its work space given (int32 [3, ≥ out's width]): allocates nothing."""
    depth = act.shape[1]
    width = out.shape[1]
    tmp, best_l, best_g = work[0], work[1], work[2]
    for r in range(first_op, ops.shape[0]):
        kind = ops[r, 0]
        if kind == OP_APPEND:
            root = ops[r, 1]
            s = ops[r, 2]
            o = ops[r, 4]
            j0 = first_tok if r == first_op else 0
            for j in range(o + j0, o + ops[r, 5]):
                if not room(nd, ht, meta, depth + 1):
                    meta[M_RTOK] = j - o
                    return r
                _append(nd, gp, sq, act, pool, ht, meta, root, s, tb[j])
        elif kind in (OP_STEP, OP_TABLE_STEP):
            tabled = kind == OP_TABLE_STEP
            root = ops[r, 1]
            s = ops[r, 2]
            gs = ops[r, 3]
            o = ops[r, 4]
            n = ops[r, 5]
            if not room(nd, ht, meta, (depth if tabled else 2 * depth) * n + 1):
                meta[M_RTOK] = 0
                return r
            if not tabled:
                for j in range(o, o + n):
                    _append(nd, gp, sq, act, pool, ht, meta, root, s, tb[j])
            if gs >= 0:
                for j in range(o, o + n):
                    _append(nd, gp, sq, act, pool, ht, meta, global_root, gs, tb[j])
            row = ops[r, 9]
            if row < 0:
                continue
            c0 = ops[r, 6]
            c1 = c0 + ops[r, 7]
            k = min(ops[r, 8], width)
            if tabled:
                nl = lt.length[root]
                sl = lt.score[root]
                at = lt.path[root]
                for i in range(nl):
                    best_l[i] = lt.pool[at + i]
            else:
                nl, sl = _speculate_tree(nd, sq, act, pool, ht, root, s, tb, c0, c1, k, factor, offset, min_prob, tmp,
                                         best_l)
            ng, sg = _speculate_tree(nd, sq, act, pool, ht, global_root, gs, tb, c0, c1, k, factor, offset, min_prob,
                                     tmp, best_g)
            if sl >= sg:
                for i in range(nl):
                    out[row, i] = best_l[i]
                out_n[row] = nl
                out_score[row] = sl
            else:
                for i in range(ng):
                    out[row, i] = best_g[i]
                out_n[row] = ng
                out_score[row] = sg
        elif kind == OP_REMOVE:
            _remove(nd, gp, sq, pool, ht, meta, ops[r, 1], ops[r, 2])
        elif kind == OP_FREE:
            _free_tree(nd, gp, ht, meta, ops[r, 1])
    return -1


@njit(cache=True, nogil=True)
def speculate_one(nd, sq, act, pool, ht, root, seq, ctx, max_spec, factor, offset, min_prob, out):
    """One tree's best draft for ctx (all of it) into out: (length, float32 score)."""
    tmp = np.empty(out.shape[0], dtype=np.int32)
    return _speculate_tree(nd, sq, act, pool, ht, root, seq, ctx, 0, ctx.shape[0], min(max_spec, out.shape[0]),
                           factor, offset, min_prob, tmp, out)


@njit(cache=True, nogil=True)
def is_prefix(pool, off, n, tokens):
    """pool[off:off+n] == tokens[:n] (checked from the end: recent tokens differ first)."""
    if n > tokens.shape[0]:
        return False
    i = n - 1
    while i >= 0 and pool[off + i] == tokens[i]:
        i -= 1
    return i < 0


# ---------------------------------------------------------------------------------------------
# The Python side: capacity, sequences, trees.

class SuffixForest:
    """An arena of suffix trees of one depth (the compiled state above) and its allocator.

    Trees are named by their root node, sequences by a seq id. `reserve(seq, n)` must precede
    appending n tokens to seq in a batch; `run` applies a batch of operations, growing the node
    arrays and the hash table whenever the compiled code stops for room.
    """

    def __init__(self, depth: int, node_capacity: int = 1 << 12, pool_capacity: int = 1 << 16) -> None:
        if depth < 1:
            raise ValueError(f"suffix tree depth must be ≥ 1, got {depth}")
        self.depth = int(depth)
        self.meta = np.zeros(META_FIELDS, dtype=np.int64)
        self.meta[M_NFREE] = -1
        self.meta[M_GFREE] = -1
        self.nd = np.zeros((0, NODE_FIELDS), dtype=np.int32)
        self.gp = np.zeros((0, 3), dtype=np.int32)
        self.ht = np.zeros((0, 2), dtype=np.int64)
        self._grow_nodes(node_capacity)
        self._grow_hash(1 << max(4, (2 * node_capacity - 1).bit_length()))
        self.sq = np.zeros((0, SEQ_FIELDS), dtype=np.int64)
        self.act = np.zeros((0, self.depth), dtype=np.int32)
        self.free_seqs: list[int] = []
        self._grow_seqs(64)
        self.pool = np.zeros(pool_capacity, dtype=np.int32)
        self.pool_top = 0
        self.pool_garbage = 0
        # Mirrors of sq's length (with what a batch being built has reserved; an array, so that compiled
        # callers appending to a sequence keep it) and capacity (a list: reads from numpy scalars are slow).
        self.seq_len = np.zeros(self.sq.shape[0], dtype=np.int64)
        self.seq_cap: list[int] = [0] * self.sq.shape[0]
        self.seq_live: list[bool] = [False] * self.sq.shape[0]
        self.local_table = LocalTable.empty()  # the prompt-tree drafts `OP_TABLE_STEP` reads

    # -- nodes --------------------------------------------------------------------------------
    @property
    def live_nodes(self) -> int:
        return int(self.meta[M_NLIVE])

    def _grow_nodes(self, capacity: int) -> None:
        # Rows past the high-water mark are never read before `_new_node` initializes them.
        old = self.nd.shape[0]
        nd = np.empty((capacity, NODE_FIELDS), dtype=np.int32)
        nd[:old] = self.nd
        gp = np.empty((capacity, 3), dtype=np.int32)
        gp[:old] = self.gp
        self.nd, self.gp = nd, gp

    def _grow_hash(self, size: int) -> None:
        ht = np.zeros((size, 2), dtype=np.int64)  # all EMPTY
        move_entries(self.ht, ht)
        self.ht = ht

    def make_room(self, need: int) -> None:
        """Grow the arena (×2 at least) until `need` more nodes fit."""
        meta = self.meta
        free = self.nd.shape[0] - int(meta[M_NHWM]) + int(meta[M_NFREECNT])
        if free < need:
            self._grow_nodes(max(2 * self.nd.shape[0], self.nd.shape[0] + need - free))
        size = max(self.ht.shape[0], 16)
        while 2 * (int(meta[M_HUSED]) + need) > size:
            size *= 2
        if size != self.ht.shape[0]:
            self._grow_hash(size)

    def new_tree(self) -> int:
        self.make_room(1)
        return int(new_root(self.nd, self.meta))

    # -- sequences ----------------------------------------------------------------------------
    def _grow_seqs(self, capacity: int) -> None:
        old = self.sq.shape[0]
        sq = np.zeros((capacity, SEQ_FIELDS), dtype=np.int64)
        sq[:old] = self.sq
        act = np.zeros((capacity, self.depth), dtype=np.int32)
        act[:old] = self.act
        self.sq, self.act = sq, act
        self.free_seqs.extend(range(capacity - 1, old - 1, -1))
        if old:
            self.seq_len = np.concatenate([self.seq_len, np.zeros(capacity - old, dtype=np.int64)])
            self.seq_cap.extend([0] * (capacity - old))
            self.seq_live.extend([False] * (capacity - old))

    def new_seq(self, capacity: int = 0) -> int:
        if not self.free_seqs:
            self._grow_seqs(2 * self.sq.shape[0])
        s = self.free_seqs.pop()
        self.sq[s] = 0
        self.seq_len[s] = 0
        self.seq_cap[s] = 0
        self.seq_live[s] = True
        if capacity:
            self._relocate(s, capacity)
        return s

    def release_seq(self, s: int) -> None:
        """The sequence and every node that reads it are gone: its id and pool space are reusable."""
        self.pool_garbage += self.seq_cap[s]
        self.seq_cap[s] = self.seq_len[s] = 0
        self.seq_live[s] = False
        self.sq[s] = 0
        self.free_seqs.append(s)

    def seq_tokens(self, s: int) -> np.ndarray:
        off = int(self.sq[s, SOFF])
        return self.pool[off:off + int(self.seq_len[s])]

    def make_seq_room(self, s: int, n: int) -> None:
        """Pool space for n more tokens of sequence s, which a compiled caller appends (and counts) itself."""
        need = int(self.seq_len[s]) + n
        if need > self.seq_cap[s]:
            self._relocate(s, max(need + 64, 2 * self.seq_cap[s]))

    def reserve(self, s: int, n: int) -> None:
        """Pool space for n more tokens of sequence s (the batch will append them)."""
        self.make_seq_room(s, n)
        self.seq_len[s] += n

    def _relocate(self, s: int, capacity: int) -> None:
        if self.pool_top + capacity > self.pool.shape[0]:
            self._compact(capacity)
        off = int(self.sq[s, SOFF])
        n = int(self.sq[s, SLEN])
        top = self.pool_top
        self.pool[top:top + n] = self.pool[off:off + n]
        self.sq[s, SOFF] = top
        self.sq[s, SCAP] = capacity
        self.pool_garbage += self.seq_cap[s]
        self.seq_cap[s] = capacity
        self.pool_top = top + capacity

    def _compact(self, extra: int) -> None:
        """Copy the sequences still read (live or removed-but-referenced) into a fresh pool."""
        used = self.pool_top - self.pool_garbage
        size = max(self.pool.shape[0], 2 * (used + extra))
        pool = np.zeros(size, dtype=np.int32)
        top = 0
        for s in range(self.sq.shape[0]):
            cap = self.seq_cap[s]
            if not cap:
                continue
            off = int(self.sq[s, SOFF])
            n = int(self.sq[s, SLEN])
            pool[top:top + n] = self.pool[off:off + n]
            self.sq[s, SOFF] = top
            top += cap
        self.pool, self.pool_top, self.pool_garbage = pool, top, 0

    # -- batches ------------------------------------------------------------------------------
    def run(self, global_root: int, ops: np.ndarray, tb: np.ndarray, factor: float, offset: float,
            min_prob: float, out: np.ndarray, out_n: np.ndarray, out_score: np.ndarray | None = None) -> None:
        f32 = np.float32
        at, tok = 0, 0
        if out_score is None:
            out_score = np.zeros(out.shape[0], dtype=np.float32)
        while True:
            at = run_ops(self.nd, self.gp, self.sq, self.act, self.pool, self.ht, self.meta, global_root, ops,
                         tb, f32(factor), f32(offset), f32(min_prob), out, out_n, at, tok, self.local_table, out_score)
            if at < 0:
                return
            tok = int(self.meta[M_RTOK])
            n = int(ops[at, 5]) if ops[at, 0] in (OP_STEP, OP_TABLE_STEP) else 1
            self.make_room(2 * self.depth * n + self.depth + 1)

    def free_trees(self, trees: list[tuple[int, int]]) -> None:
        """Free whole trees, each (root, its sequence): their nodes, and the sequences for reuse."""
        ops = np.asarray([[OP_FREE, root, seq, 0, 0, 0, 0, 0, 0, -1] for root, seq in trees], dtype=np.int64)
        self.run(trees[0][0], ops, np.zeros(0, dtype=np.int32), 1.0, 0.0, 0.0, np.zeros((0, 1), dtype=np.int32),
                 np.zeros(0, dtype=np.int32))
        for _, seq in trees:
            self.release_seq(seq)

    # -- one tree at a time (tests, tools) ---------------------------------------------------
    def append(self, root: int, seq: int, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.reserve(seq, tokens.shape[0])
        ops = np.array([[OP_APPEND, root, seq, -1, 0, tokens.shape[0], 0, 0, 0, -1]], dtype=np.int64)
        self.run(root, ops, tokens, 1.0, 0.0, 0.0, np.zeros((0, 0), dtype=np.int32), np.zeros(0, dtype=np.int32))

    def remove(self, root: int, seq: int) -> None:
        """Remove seq's suffixes from the tree; its tokens stay (nodes may read them), its id is not reused."""
        ops = np.array([[OP_REMOVE, root, seq, -1, 0, 0, 0, 0, 0, -1]], dtype=np.int64)
        self.run(root, ops, np.zeros(0, dtype=np.int32), 1.0, 0.0, 0.0, np.zeros((0, 0), dtype=np.int32),
                 np.zeros(0, dtype=np.int32))

    def speculate(self, root: int, context: np.ndarray, max_spec: int, factor: float = 1.0, offset: float = 0.0,
                  min_prob: float = 0.1, seq: int = -1) -> tuple[np.ndarray, float]:
        """The tree's best greedy draft for `context` and its score (the C++ `SuffixTree.speculate`, path mode);
        `seq`: a sequence of the tree whose open suffixes may stand in for walks from the root."""
        out = np.zeros(max(max_spec, 0), dtype=np.int32)
        n, score = speculate_one(self.nd, self.sq, self.act, self.pool, self.ht, root, seq,
                                 np.ascontiguousarray(context, dtype=np.int32), max_spec, np.float32(factor),
                                 np.float32(offset), np.float32(min_prob), out)
        return out[:n], float(score)

    def check_table(self) -> None:
        """The child table holds exactly the children of nodes with two or more, under the right keys (tests only)."""
        nd, hwm = self.nd, int(self.meta[M_NHWM])
        par = nd[:hwm, PAR].astype(np.int64)
        child = np.flatnonzero((par >= 0) & (nd[:hwm, LEN] > 0))
        child = child[nd[par[child], NCH] > 1]
        keys = ((par[child] + 1) << 32) | (nd[child, TOK].astype(np.int64) & 0xFFFFFFFF)  # as `_key`
        want = dict(zip(keys.tolist(), child.tolist(), strict=True))
        used = self.ht[:, 0] != EMPTY
        have = dict(zip(self.ht[used, 0].tolist(), self.ht[used, 1].tolist(), strict=True))
        assert have == want and len(have) == self.meta[M_HUSED]

    def check(self, root: int) -> None:
        """Structural invariants of one tree (tests only; slow): counts, order, runs, hash entries."""
        nd, gp = self.nd, self.gp
        stack = [root]
        while stack:
            x = stack.pop()
            kids = []
            c = int(nd[x, HEAD])
            prev = -1
            while c >= 0:
                assert nd[c, PAR] == x and nd[c, PREV] == prev
                assert _hget(self.ht, _key(x, nd[c, TOK])) == (c if nd[x, NCH] > 1 else -1)
                assert nd[c, LEN] > 0 and nd[c, CNT] > 0
                if x != root:
                    assert nd[c, CNT] < nd[x, CNT]
                g = int(nd[c, GRP])
                if prev >= 0:
                    assert nd[c, CNT] <= nd[prev, CNT]
                    assert (nd[c, GRP] == nd[prev, GRP]) == (nd[c, CNT] == nd[prev, CNT])
                if prev < 0 or nd[prev, CNT] != nd[c, CNT]:
                    assert gp[g, GHEAD] == c
                nxt = int(nd[c, NEXT])
                if nxt < 0 or nd[nxt, CNT] != nd[c, CNT]:
                    assert gp[g, GTAIL] == c
                kids.append(c)
                prev = c
                c = nxt
            assert nd[x, TAIL] == prev and nd[x, NCH] == len(kids)
            assert sum(int(nd[k, CNT]) for k in kids) <= nd[x, CNT]
            stack.extend(kids)
