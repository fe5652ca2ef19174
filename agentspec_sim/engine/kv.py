"""The KV-cache block pool and prefix cache, as vLLM 0.33's `BlockPool` / `KVCacheManager` keep them.

Facts followed (docs/vllm-engine-facts.md §3):
- Block 0 is vLLM's null block: of `num_blocks`, blocks 1 … num_blocks−1 are usable.
- Only *full* blocks are hashed and cached; a block's hash chains its parent's hash and its tokens.
  The chain starts from a per-tenant salt, as vLLM's `cache_salt`: replicate copies of a query never
  hit each other's blocks, while different queries of one tenant share what they really share.
  (Here a 64-bit splitmix64 chain, deterministic across processes; only hash equality matters.)
- A cache hit is the longest run of cached full blocks from the start, capped at num_tokens − 1
  tokens (a prompt always recomputes at least its last token).
- Free queue: allocation pops from the front, evicting the popped block's hash if it had one.
  Freeing a request walks its blocks tail first; blocks that were never cached go to the front
  (reused first), cached blocks to the back (LRU), each group in that reversed order. A hit block
  with no other user leaves the queue (`touch`).
- Blocks are cached when scheduled, up to min(computed + scheduled, num_tokens) tokens, so draft
  tokens are never cached; rejected drafts keep their slots (vLLM does not free them).

The state is numpy arrays (`Pool`) and the operations are compiled functions (`allocate_slots`,
`lookup`, `free_call`, …) that the compiled scheduler step calls; `BlockPool` and
`KVCacheManager` are the same operations for Python callers (tests, tools). Each distinct block
hash is numbered once, as a *node* (an insert-only open-addressing table maps hash → node), and
block hashes and nodes are computed once per token prefix and tenant (`CallTable` hash regions:
an agent's next call re-sends the previous one's tokens and shares their hashes). Caching a block
or evicting one is then an update of a few arrays: a cached block points at its node, and a node
lists the blocks holding it in the order they were cached, so the first holder is what a lookup
finds, as vLLM's insertion-ordered dict gives.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from agentspec_sim.engine.counters import CT_FREE_SLOTS, KV_FREE, KV_NODES
from agentspec_sim.engine.request import CallState, CallTable, zeros


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The compiled engine functions hand each other tuples of arrays. Compiled without numba's runtime
# (NRT), they do no reference counting on those arrays: with it, every call between them paid two
# atomic operations per array, which dominated the time of a step. None of them allocates.
# No cfunc wrapper either: nothing takes a kernel's address (numba builds one per compiled function unless told).
kernel = njit(cache=True, _nrt=False, no_cfunc_wrapper=True)
# A compiled function is compiled once per distinct argument types, and a constant argument at a call site
# (`f(x, 0)`, `f(x, True)`) is its own literal type, with the branches it decides folded away. That costs
# compile time and did not pay at run time (`allocate_slots`' running and admission paths as one version: the
# whole default trace at max_num_seqs 1, 32, 256 within noise), so call sites pass typed values
# (`np.int64(...)`, `np.bool_(...)`), and tiny helpers called with constants are inlined.
inline_kernel = njit(cache=True, _nrt=False, inline="always")
# Kernels only compiled code calls: no Python entry point to build (with the engine's named tuples of arrays
# as arguments, building it is a good part of a kernel's compile time).
internal_kernel = njit(cache=True, _nrt=False, no_cpython_wrapper=True, no_cfunc_wrapper=True)


# Records of the pool's arrays (numba reads a field of record array `a` as `a.field[i]`).
# (32-bit block and node ids keep the arrays small: they are accessed at random, once per block cached.)
BLOCK = np.dtype([("ref", np.int32), ("node", np.int32), ("nxt", np.int32), ("prv", np.int32),
                  ("same_next", np.int32), ("same_prev", np.int32)], align=True)
NODE = np.dtype([("hash", np.int64), ("head", np.int32), ("tail", np.int32)], align=True)
ENTRY = np.dtype([("key", np.int64), ("node", np.int64)], align=True)


class Pool(NamedTuple):
    """The block pool's arrays (see the module docstring).

    A *node* is one distinct block hash (one token prefix of one tenant), numbered in the order
    first seen; the hash table maps hashes to nodes and never forgets one. A cached block points
    at its node, and a node lists the blocks holding it in the order they were cached.
    """

    # [blocks + 2] BLOCK: ref (users), node (the node a cached block holds, −1 = not cached), nxt / prv
    # (free queue links; head sentinel = blocks, tail = blocks + 1), same_next / same_prev (the other
    # blocks holding the same node, in insertion order, −1 none)
    blocks: np.ndarray
    nodes: np.ndarray  # [nodes] NODE: head / tail (first / last block holding it, −1 none), hash
    table: np.ndarray  # [2^k] ENTRY: open-addressing hash → node (key 0 = empty)
    scratch: np.ndarray  # int64 [blocks]: work space for `free_blocks`
    ctr: np.ndarray  # int64: [num_free, nodes]
    params: np.ndarray  # int64: [block_size, max_model_len, enable_caching, num_blocks]


_K_TOKEN = np.uint64(0x9E3779B97F4A7C15)


@internal_kernel
def _mix64(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@internal_kernel
def tenant_salt(tenant):
    return np.int64(_mix64(np.uint64(tenant) + np.uint64(0x632BE59BD9B4E019)))


@internal_kernel
def block_hash(parent, tokens, start, size):
    """The chained hash of tokens[start:start + size] after `parent` (never 0)."""
    h = np.uint64(parent)
    for i in range(size):
        h = _mix64(h ^ (np.uint64(np.int64(tokens[start + i]) & 0xFFFFFFFF) + _K_TOKEN))
    out = np.int64(h)
    return out if out != 0 else np.int64(1)


# -- nodes ---------------------------------------------------------------------------------------
@internal_kernel
def _slot_of(keys, h):
    """Hash-table slot of key `h`, or of the empty slot where it would go (linear probing)."""
    mask = keys.shape[0] - 1
    i = h & mask
    while keys[i] != 0 and keys[i] != h:
        i = (i + 1) & mask
    return i


@kernel
def find_node(p, h):
    """The node of hash `h`, or −1 if it was never seen."""
    i = _slot_of(p.table.key, h)
    return p.table.node[i] if p.table.key[i] == h else -1


@internal_kernel
def node_of(p, h):
    """The node of hash `h`, numbering a new one if it was never seen."""
    i = _slot_of(p.table.key, h)
    if p.table.key[i] == h:
        return p.table.node[i]
    node = p.ctr[KV_NODES]
    if node == p.nodes.shape[0]:
        raise ValueError("block pool: out of node capacity")
    p.ctr[KV_NODES] = node + 1
    p.table.key[i] = h
    p.table.node[i] = node
    p.nodes.head[node] = -1
    p.nodes.tail[node] = -1
    p.nodes.hash[node] = h
    return node


@internal_kernel
def first_holder(p, node):
    """The first block holding `node` (cached first, still cached), or −1."""
    block = p.nodes.head[node]
    return block if block >= 0 and p.blocks.node[block] == node else -1


@internal_kernel
def cache_block(p, block, node):
    """Record that `block` holds `node` (after the node's other holders)."""
    last = p.nodes.tail[node]
    if last >= 0 and p.blocks.node[last] != node:
        last = -1  # the node's only holder was evicted since (see `_evict`)
    p.blocks.node[block] = node
    p.blocks.same_next[block] = -1
    p.blocks.same_prev[block] = last
    if last >= 0:
        p.blocks.same_next[last] = block
    else:
        p.nodes.head[node] = block
    p.nodes.tail[node] = block


@internal_kernel
def _evict(p, block):
    """Drop `block`'s cached node (the block is being reused).

    A block that was its node's only holder leaves the node's head and tail pointing at it: they
    are recognised as stale (the block no longer holds the node) by `first_holder` and
    `cache_block`, which spares a visit to the node record on most evictions.
    """
    node = p.blocks.node[block]
    before, after = p.blocks.same_prev[block], p.blocks.same_next[block]
    if before >= 0:
        p.blocks.same_next[before] = after
    elif after >= 0:
        p.nodes.head[node] = after
    if after >= 0:
        p.blocks.same_prev[after] = before
    elif before >= 0:
        p.nodes.tail[node] = before
    p.blocks.node[block] = -1


# -- free queue ----------------------------------------------------------------------------------
@internal_kernel
def _unlink(p, block):
    a, b = p.blocks.prv[block], p.blocks.nxt[block]
    p.blocks.nxt[a] = b
    p.blocks.prv[b] = a
    p.ctr[KV_FREE] -= 1


@internal_kernel
def _link_after(p, anchor, block):
    b = p.blocks.nxt[anchor]
    p.blocks.nxt[anchor] = block
    p.blocks.prv[block] = anchor
    p.blocks.nxt[block] = b
    p.blocks.prv[b] = block
    p.ctr[KV_FREE] += 1


@kernel
def pop_free(p):
    """The front block of the free queue, taken (its cached node evicted), with one user."""
    block = p.blocks.nxt[p.params[3]]
    _unlink(p, block)
    if p.blocks.node[block] >= 0:
        _evict(p, block)
    p.blocks.ref[block] = 1
    return block


@internal_kernel
def pop_free_into(p, out, start, n):
    """`pop_free` n times into out[start:start + n]: the first n blocks of the free queue, unlinked at once."""
    blocks = p.blocks
    head = p.params[3]
    block = blocks.nxt[head]
    for k in range(n):
        out[start + k] = block
        if blocks.node[block] >= 0:
            _evict(p, block)
        blocks.ref[block] = 1
        block = blocks.nxt[block]
    blocks.nxt[head] = block
    blocks.prv[block] = head
    p.ctr[KV_FREE] -= n


@internal_kernel
def touch_blocks(p, blocks, n):
    """A cache hit on blocks[:n]: one more user each; a block nobody used leaves the free queue."""
    for k in range(n):
        block = blocks[k]
        if p.blocks.ref[block] == 0:
            _unlink(p, block)
        p.blocks.ref[block] += 1


@internal_kernel
def free_blocks(p, blocks, n):
    """Release one request's blocks[:n] (head → tail): uncached ones to the front, cached to the back."""
    tmp = p.scratch
    head = p.params[3]
    tail = head + 1
    m = 0
    for k in range(n - 1, -1, -1):  # tail first
        block = blocks[k]
        p.blocks.ref[block] -= 1
        if p.blocks.ref[block] == 0:
            tmp[m] = block
            m += 1
    anchor = head
    for k in range(m):  # never-cached blocks: to the front, keeping the tail-first order
        if p.blocks.node[tmp[k]] < 0:
            _link_after(p, anchor, tmp[k])
            anchor = tmp[k]
    for k in range(m):  # cached blocks: to the back (LRU), tail first
        if p.blocks.node[tmp[k]] >= 0:
            _link_after(p, np.int64(p.blocks.prv[tail]), tmp[k])  # int64 as above: one compiled version


# -- per-request operations (vLLM's KVCacheManager) ------------------------------------------------
@internal_kernel
def ensure_hashes(p, c, r, num_full_blocks):
    """Hashes (and nodes) of call r's first `num_full_blocks` full blocks exist in its hash region."""
    region = c.calls.hreg[r]
    have = c.regions.n[region]
    if num_full_blocks <= have:
        return
    if num_full_blocks > c.regions.cap[region]:
        raise ValueError("block hash region too small")
    bs = p.params[0]
    off = c.regions.off[region]
    start = c.calls.hist_off[r]
    parent = c.hashes[off + have - 1] if have else tenant_salt(c.calls.tenant[r])
    for i in range(have, num_full_blocks):
        parent = block_hash(parent, c.tokens, start + i * bs, bs)
        c.hashes[off + i] = parent
        c.nodes[off + i] = node_of(p, parent)
    c.regions.n[region] = num_full_blocks


@internal_kernel
def lookup(p, c, r, hits):
    """Longest prefix-cache hit of call r (nothing computed): its blocks in hits[:n]; returns n."""
    if not p.params[2]:
        return 0
    bs = p.params[0]
    max_blocks = (c.calls.prompt_len[r] + c.calls.num_emitted[r] - 1) // bs
    ensure_hashes(p, c, r, max_blocks)
    off = c.regions.off[c.calls.hreg[r]]
    n = 0
    while n < max_blocks:
        block = first_holder(p, c.nodes[off + n])
        if block < 0:
            break
        hits[n] = block
        n += 1
    return n


@internal_kernel
def _cache_full_blocks(p, c, r, num_full):
    cached = c.calls.num_cached_blocks[r]
    if num_full <= cached:
        return
    ensure_hashes(p, c, r, num_full)
    off = c.regions.off[c.calls.hreg[r]]
    row = c.slot_blocks[c.calls.slot[r]]
    for i in range(cached, num_full):
        cache_block(p, row[i], c.nodes[off + i])
    c.calls.num_cached_blocks[r] = num_full


@internal_kernel
def allocate_slots(p, c, r, num_new, hits, nhits, full_sequence_must_fit):
    """Give call r slots for `num_new` more tokens after hits[:nhits] (a fresh prefix-cache hit).

    Returns False, changing nothing, when the free blocks do not suffice; with
    `full_sequence_must_fit` (admission, vLLM's scheduler_reserve_full_isl) the whole of
    min(num_tokens, max_model_len) must fit, not just this step's chunk.
    """
    bs, max_len = p.params[0], p.params[1]
    slot = c.calls.slot[r]
    held = (c.slots.nblocks[slot] if slot >= 0 else 0) + nhits
    computed = c.calls.num_computed[r] + nhits * bs
    num_tokens = c.calls.prompt_len[r] + c.calls.num_emitted[r]
    evictable = 0
    for k in range(nhits):
        if p.blocks.ref[hits[k]] == 0:
            evictable += 1
    if full_sequence_must_fit:
        full = -(-min(num_tokens, max_len) // bs) - held
        if full + evictable > p.ctr[KV_FREE]:
            return False
    need = max(0, -(-min(computed + num_new, max_len) // bs) - held)
    if need + evictable > p.ctr[KV_FREE]:
        return False
    if slot < 0:
        if nhits + need == 0:
            return True  # holds nothing and needs nothing (so no block can have become full)
        c.ctr[CT_FREE_SLOTS] -= 1
        slot = c.slots.free[c.ctr[CT_FREE_SLOTS]]
        c.calls.slot[r] = slot
        c.slots.nblocks[slot] = 0
    row = c.slot_blocks[slot]
    nb = c.slots.nblocks[slot]
    if nhits:
        touch_blocks(p, hits, nhits)
        for k in range(nhits):
            row[nb] = hits[k]
            nb += 1
        c.calls.num_cached_blocks[r] = nb
    pop_free_into(p, row, nb, need)
    nb += need
    c.slots.nblocks[slot] = nb
    if p.params[2]:
        _cache_full_blocks(p, c, r, min(computed + num_new, num_tokens) // bs)
    return True


@internal_kernel
def free_call(p, c, r):
    """Release call r's blocks (its full blocks stay cached) and its block-table slot."""
    slot = c.calls.slot[r]
    if slot >= 0:
        free_blocks(p, c.slot_blocks[slot], c.slots.nblocks[slot])
        c.slots.nblocks[slot] = 0
        c.slots.free[c.ctr[CT_FREE_SLOTS]] = slot
        c.ctr[CT_FREE_SLOTS] += 1
        c.calls.slot[r] = -1
    c.calls.num_cached_blocks[r] = 0


# -- Python API ----------------------------------------------------------------------------------------
# Python's way into the kernels above that the compiled loop calls: those are internal (a run that never calls
# them from Python builds no Python wrapper for them — with the engine's tuples of arrays as arguments, about a
# tenth of a cold run's compiling); the pool and manager below, and the event loop, call these.
@kernel
def touch_blocks_from_python(p, blocks, n):
    touch_blocks(p, blocks, n)


@kernel
def free_blocks_from_python(p, blocks, n):
    free_blocks(p, blocks, n)


@kernel
def first_holder_from_python(p, node):
    return first_holder(p, node)


@kernel
def cache_hash_from_python(p, block, h):
    cache_block(p, block, node_of(p, h))


@kernel
def ensure_hashes_from_python(p, c, r, num_full_blocks):
    ensure_hashes(p, c, r, num_full_blocks)


@kernel
def lookup_from_python(p, c, r, hits):
    return lookup(p, c, r, hits)


@kernel
def allocate_slots_from_python(p, c, r, num_new, hits, nhits, full_sequence_must_fit):
    return allocate_slots(p, c, r, num_new, hits, nhits, full_sequence_must_fit)


@kernel
def free_call_from_python(p, c, r):
    free_call(p, c, r)


@kernel
def _rehash(table, nodes, count):
    for node in range(count):
        i = _slot_of(table.key, nodes.hash[node])
        table.key[i] = nodes.hash[node]
        table.node[i] = node


def _table_size(nodes: int) -> int:
    """Hash-table entries for `nodes` nodes: a power of two, at most 3/4 full."""
    size = 16
    while 3 * size < 4 * nodes:
        size *= 2
    return size


def _records(dtype: np.dtype, n: int, **fill: int) -> np.ndarray:
    out = zeros(n, dtype=dtype)
    for name, value in fill.items():
        out[name] = value
    return out


class BlockPool:
    """Blocks, reference counts, the hash → block map and the free queue (a doubly linked list)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, block_size: int = 16,
                 max_model_len: int = 1 << 30, nodes: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        blocks = _records(BLOCK, num_blocks + 2, node=-1, same_next=-1, same_prev=-1)
        order = np.array([num_blocks, *range(1, num_blocks), num_blocks + 1], dtype=np.int64)
        blocks["nxt"][order[:-1]] = order[1:]
        blocks["prv"][order[1:]] = order[:-1]
        nodes = max(nodes, 64)
        self.p = Pool(blocks=blocks, nodes=_records(NODE, nodes, head=-1, tail=-1),
                      table=_records(ENTRY, _table_size(nodes)), scratch=zeros(num_blocks, dtype=np.int64),
                      ctr=np.array([num_blocks - 1, 0], dtype=np.int64),
                      params=np.array([block_size, max_model_len, int(enable_caching), num_blocks], dtype=np.int64))

    def reserve_nodes(self, nodes: int) -> None:
        """Room for at least `nodes` distinct block hashes (the compiled code cannot grow the arrays)."""
        p = self.p
        have = p.nodes.shape[0]
        if nodes <= have:
            return
        grown = _records(NODE, max(nodes, 2 * have), head=-1, tail=-1)
        count = int(p.ctr[KV_NODES])
        grown[:count] = p.nodes[:count]
        table = _records(ENTRY, _table_size(grown.shape[0]))
        _rehash(table, grown, count)
        self.p = p._replace(nodes=grown, table=table)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return int(self.p.ctr[KV_FREE])

    @property
    def ref(self) -> np.ndarray:
        """Users of each block (block 0 included, always 0)."""
        return self.p.blocks["ref"][:self.num_blocks]

    def free_order(self) -> list[int]:
        """The free queue front to back (tests and invariant checks)."""
        nxt = self.p.blocks["nxt"]
        out, b, tail = [], int(nxt[self.num_blocks]), self.num_blocks + 1
        while b != tail:
            out.append(b)
            b = int(nxt[b])
        return out

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the front (caller checked `num_free`), evicting their cached hashes."""
        return [int(pop_free(self.p)) for _ in range(n)]

    def touch(self, blocks: list[int]) -> None:
        """A cache hit: one more user per block; a block nobody used leaves the free queue."""
        touch_blocks_from_python(self.p, np.asarray(blocks, dtype=np.int64), len(blocks))

    def free(self, blocks: list[int]) -> None:
        """Release one request's blocks (given head → tail); see the module docstring for the order."""
        free_blocks_from_python(self.p, np.asarray(blocks, dtype=np.int64), len(blocks))

    def get_cached(self, h: int) -> int | None:
        """The first block cached with hash `h`, or None."""
        node = int(find_node(self.p, np.int64(h)))
        block = int(first_holder_from_python(self.p, node)) if node >= 0 else -1
        return None if block < 0 else block

    def cache(self, block: int, h: int) -> None:
        """Record that `block` holds hash `h`."""
        self.reserve_nodes(int(self.p.ctr[KV_NODES]) + 1)
        cache_hash_from_python(self.p, block, np.int64(h))

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the free queue (touching them uses free capacity)."""
        return int(np.count_nonzero(self.ref[np.asarray(blocks, dtype=np.int64)] == 0)) if blocks else 0


class KVCacheManager:
    """Per-request block bookkeeping over a `BlockPool` (vLLM's `KVCacheManager`, full attention).

    Requests are rows of `table` (a `CallTable`); a `CallState` from elsewhere is adopted into it
    the first time it is handled here.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True,
                 table: CallTable | None = None) -> None:
        self.pool = BlockPool(num_blocks, enable_caching, block_size, max_model_len)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.blocks_per_call = cdiv(max_model_len, block_size) + 1
        self.table = table if table is not None else CallTable(4)
        self.table.reserve_slots(1, self.blocks_per_call)
        self._reserve_nodes()
        self._hits = zeros(self.blocks_per_call, dtype=np.int64)

    def _reserve_nodes(self) -> None:
        # Every hash a region can hold may become a node (plus hashes cached through the pool API).
        self.pool.reserve_nodes(self.table.hashes.shape[0] + 64)

    def _row(self, state: CallState) -> int:
        if state._t is not self.table:
            self.table.adopt(state)
            self._reserve_nodes()
        return state._r

    def _one_free_slot(self) -> None:
        if self.table.ctr[CT_FREE_SLOTS] == 0:
            self.table.reserve_slots(2 * self.table.slot_blocks.shape[0], self.blocks_per_call)

    def ensure_hashes(self, state: CallState, num_full_blocks: int) -> None:
        """Hashes of the first `num_full_blocks` full blocks of `state`'s tokens (`state.block_hashes`)."""
        row = self._row(state)
        ensure_hashes_from_python(self.pool.p, self.table.nt, row, num_full_blocks)

    def lookup(self, state: CallState) -> list[int]:
        """Cached blocks of the longest hit for a request with nothing computed (≤ num_tokens − 1 tokens)."""
        row = self._row(state)
        n = lookup_from_python(self.pool.p, self.table.nt, row, self._hits)
        return self._hits[:n].tolist()

    def allocate_slots(self, state: CallState, num_new: int, hit_blocks: list[int] | None = None,
                       full_sequence_must_fit: bool = False) -> bool:
        """Give `state` slots for `num_new` more tokens (after `hit_blocks`, a fresh prefix-cache hit);
        False, changing nothing, when the free blocks do not suffice (see `allocate_slots`)."""
        row = self._row(state)
        self._one_free_slot()
        hits = np.asarray(hit_blocks or [], dtype=np.int64)
        return bool(allocate_slots_from_python(self.pool.p, self.table.nt, row, num_new, hits, hits.shape[0],
                                               full_sequence_must_fit))

    def free(self, state: CallState) -> None:
        row = self._row(state)
        free_call_from_python(self.pool.p, self.table.nt, row)
