"""The KV-cache block pool and prefix cache, as vLLM 0.33's `BlockPool` / `KVCacheManager` keep them.

Facts followed (docs/ENGINE-FACTS.md §3):
- Block 0 is vLLM's null block: of `num_blocks`, blocks 1 … num_blocks−1 are usable.
- Only *full* blocks are hashed and cached; a block's hash chains its parent's hash and its tokens
  (here blake2b, 8 bytes: deterministic across processes, unlike Python's `hash` of bytes). The
  chain starts from a per-tenant salt, as vLLM's `cache_salt`: replicate copies of a query never
  hit each other's blocks, while different queries of one tenant share what they really share.
- A cache hit is the longest run of cached full blocks from the start, capped at num_tokens − 1
  tokens (a prompt always recomputes at least its last token).
- Free queue: allocation pops from the front, evicting the popped block's hash if it had one.
  Freeing a request walks its blocks tail first; blocks that were never cached go to the front
  (reused first), cached blocks to the back (LRU), each group in that reversed order. A hit block
  with no other user leaves the queue (`touch`).
- Blocks are cached when scheduled, up to min(computed + scheduled, num_tokens) tokens, so draft
  tokens are never cached; rejected drafts keep their slots (vLLM does not free them).
"""

from __future__ import annotations

import hashlib
from itertools import pairwise

from agentspec_sim.engine.request import CallState


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Blocks, reference counts, the hash → block map and the free queue (a doubly linked list)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, dict[int, None]] = {}  # hash → blocks holding it (insertion-ordered)
        # Linked list over block ids 1..n−1 with sentinels head = n, tail = n + 1.
        self._head, self._tail = num_blocks, num_blocks + 1
        self._next = [0] * (num_blocks + 2)
        self._prev = [0] * (num_blocks + 2)
        order = [self._head, *range(1, num_blocks), self._tail]
        for a, b in pairwise(order):
            self._next[a], self._prev[b] = b, a
        self._in_queue = [False] + [True] * (num_blocks - 1)
        self.num_free = num_blocks - 1

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    # -- free queue ----------------------------------------------------------------------------
    def _unlink(self, block: int) -> None:
        p, n = self._prev[block], self._next[block]
        self._next[p], self._prev[n] = n, p
        self._in_queue[block] = False
        self.num_free -= 1

    def _link_after(self, anchor: int, block: int) -> None:
        n = self._next[anchor]
        self._next[anchor], self._prev[block] = block, anchor
        self._next[block], self._prev[n] = n, block
        self._in_queue[block] = True
        self.num_free += 1

    def free_order(self) -> list[int]:
        """The free queue front to back (tests and invariant checks)."""
        out, b = [], self._next[self._head]
        while b != self._tail:
            out.append(b)
            b = self._next[b]
        return out

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the front (caller checked `num_free`), evicting their cached hashes."""
        out = []
        for _ in range(n):
            block = self._next[self._head]
            self._unlink(block)
            h = self.block_hash[block]
            if h is not None:
                holders = self.cached[h]
                del holders[block]
                if not holders:
                    del self.cached[h]
                self.block_hash[block] = None
            self.ref[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: list[int]) -> None:
        """A cache hit: one more user per block; a block nobody used leaves the free queue."""
        for block in blocks:
            if self.ref[block] == 0:
                self._unlink(block)
            self.ref[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Release one request's blocks (given head → tail); see the module docstring for the order."""
        uncached, cached = [], []
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (uncached if self.block_hash[block] is None else cached).append(block)
        anchor = self._head
        for block in uncached:  # front, keeping the tail-first order
            self._link_after(anchor, block)
            anchor = block
        for block in cached:  # back (LRU), tail first
            self._link_after(self._prev[self._tail], block)

    # -- prefix cache ------------------------------------------------------------------------------
    def get_cached(self, h: int) -> int | None:
        holders = self.cached.get(h)
        return next(iter(holders)) if holders else None

    def cache(self, block: int, h: int) -> None:
        self.block_hash[block] = h
        self.cached.setdefault(h, {})[block] = None

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the free queue (touching them uses free capacity)."""
        return sum(1 for b in blocks if self.ref[b] == 0)


class KVCacheManager:
    """Per-request block bookkeeping over a `BlockPool` (vLLM's `KVCacheManager`, full attention)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching

    def _salt(self, tenant: int) -> bytes:
        return hashlib.blake2b(f"tenant:{tenant}".encode(), digest_size=8).digest()

    def ensure_hashes(self, state: CallState, num_full_blocks: int) -> None:
        """Extend `state.block_hashes` to the first `num_full_blocks` full blocks of its tokens."""
        hashes = state.block_hashes
        bs = self.block_size
        parent = hashes[-1].to_bytes(8, "little") if hashes else self._salt(state.tenant)
        history = state.history
        for i in range(len(hashes), num_full_blocks):
            digest = hashlib.blake2b(parent + history[i * bs:(i + 1) * bs].tobytes(), digest_size=8).digest()
            hashes.append(int.from_bytes(digest, "little"))
            parent = digest

    def lookup(self, state: CallState) -> list[int]:
        """Cached blocks of the longest hit for a request with nothing computed (≤ num_tokens − 1 tokens)."""
        if not self.enable_caching:
            return []
        max_blocks = (state.num_tokens - 1) // self.block_size
        self.ensure_hashes(state, max_blocks)
        hit = []
        for h in state.block_hashes[:max_blocks]:
            block = self.pool.get_cached(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate_slots(self, state: CallState, num_new: int, hit_blocks: list[int] | None = None,
                       full_sequence_must_fit: bool = False) -> bool:
        """Give `state` slots for `num_new` more tokens (after `hit_blocks`, a fresh prefix-cache hit).

        Returns False, changing nothing, when the free blocks do not suffice; with
        `full_sequence_must_fit` (admission, vLLM's scheduler_reserve_full_isl) the whole of
        min(num_tokens, max_model_len) must fit, not just this step's chunk.
        """
        hit_blocks = hit_blocks or []
        bs = self.block_size
        held = len(state.block_ids) + len(hit_blocks)
        computed = state.num_computed + len(hit_blocks) * bs
        evictable_hits = self.pool.num_evictable(hit_blocks)
        if full_sequence_must_fit:
            full = cdiv(min(state.num_tokens, self.max_model_len), bs) - held
            if full + evictable_hits > self.pool.num_free:
                return False
        need = max(0, cdiv(min(computed + num_new, self.max_model_len), bs) - held)
        if need + evictable_hits > self.pool.num_free:
            return False
        if hit_blocks:
            self.pool.touch(hit_blocks)
            state.block_ids.extend(hit_blocks)
            state.num_cached_blocks = len(state.block_ids)
        if need:
            state.block_ids.extend(self.pool.allocate(need))
        if self.enable_caching:
            self._cache_full_blocks(state, min(computed + num_new, state.num_tokens) // bs)
        return True

    def _cache_full_blocks(self, state: CallState, num_full: int) -> None:
        if num_full <= state.num_cached_blocks:
            return
        self.ensure_hashes(state, num_full)
        for i in range(state.num_cached_blocks, num_full):
            self.pool.cache(state.block_ids[i], state.block_hashes[i])
        state.num_cached_blocks = num_full

    def free(self, state: CallState) -> None:
        self.pool.free(state.block_ids)
        state.block_ids = []
        state.num_cached_blocks = 0
