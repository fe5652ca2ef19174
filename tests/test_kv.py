"""KV block pool and prefix cache: vLLM 0.33's hashing, hit rule and free-queue order."""

from __future__ import annotations

import numpy as np
from simhelpers import call

from agentspec_sim.engine.kv import BlockPool, KVCacheManager
from agentspec_sim.engine.request import CallState


def state(prompt, output=(1,), tenant=0, index=0):
    c = call(f"c{index}", prompt, output)
    return CallState(index, c, c.id, tenant, 0, c.output_len)


def test_hashes_chain_full_blocks_only_and_are_salted_by_tenant():
    kv = KVCacheManager(64, 4, 1000)
    a, b = state(range(10)), state(range(10))
    kv.ensure_hashes(a, 2)
    kv.ensure_hashes(b, 2)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    c = state([99, *range(1, 10)])  # first block differs → every later hash differs (chained)
    kv.ensure_hashes(c, 2)
    assert c.block_hashes[0] != a.block_hashes[0] and c.block_hashes[1] != a.block_hashes[1]
    other_tenant = state(range(10), tenant=1)
    kv.ensure_hashes(other_tenant, 2)
    assert other_tenant.block_hashes[0] != a.block_hashes[0]
    # lookup never covers the partial third block nor the last token
    assert kv.lookup(state(range(10))) == []  # nothing cached yet


def test_hit_is_capped_at_num_tokens_minus_one():
    kv = KVCacheManager(64, 4, 1000)
    first = state(range(8))
    assert kv.allocate_slots(first, 8)  # caches both full blocks
    assert first.num_cached_blocks == 2
    again = state(range(8), index=1)
    hit = kv.lookup(again)
    assert hit == first.block_ids[:1]  # 8 tokens fully cached, but the last token is recomputed: 1 block
    longer = state(range(9), index=2)
    assert kv.lookup(longer) == first.block_ids


def test_free_order_uncached_front_cached_back_tail_first():
    pool_size = 10
    kv = KVCacheManager(pool_size, 4, 1000)
    pool = kv.pool
    assert pool.free_order() == list(range(1, pool_size))  # block 0 is the null block
    req = state(range(10))
    assert kv.allocate_slots(req, 10)  # blocks 1, 2 full (cached), 3 partial (uncached)
    assert req.block_ids == [1, 2, 3]
    kv.free(req)
    # uncached block 3 to the front; cached 2 (tail) then 1 at the back
    assert pool.free_order() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    # allocation pops from the front: cached blocks are evicted last, deepest first
    got = pool.allocate(8)
    assert got == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.get_cached(req.block_hashes[1]) is None  # block 2 evicted with its hash
    assert pool.get_cached(req.block_hashes[0]) == 1


def test_touch_takes_hit_blocks_out_of_the_free_queue_and_refree_goes_to_lru_tail():
    kv = KVCacheManager(10, 4, 1000)
    a = state(range(9))
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    b = state(range(9), index=1)
    hit = kv.lookup(b)
    assert hit == [1, 2]
    assert kv.allocate_slots(b, 1, hit)
    assert 1 not in kv.pool.free_order() and 2 not in kv.pool.free_order()
    assert kv.pool.ref[1] == 1
    kv.free(b)
    order = kv.pool.free_order()
    assert order[-2:] == [2, 1]


def test_full_sequence_must_fit_on_admission():
    kv = KVCacheManager(5, 4, 1000)  # 4 usable blocks = 16 tokens
    big = state(range(20))
    assert not kv.allocate_slots(big, 4, full_sequence_must_fit=True)  # the chunk fits, the prompt does not
    assert kv.pool.num_free == 4 and big.block_ids == []
    assert kv.allocate_slots(state(range(16)), 4, full_sequence_must_fit=True)


def test_shared_blocks_are_reference_counted():
    pool = BlockPool(6)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 123)
    pool.touch([blocks[0]])
    assert pool.ref[blocks[0]] == 2
    pool.free(blocks)
    assert pool.ref[blocks[0]] == 1 and blocks[0] not in pool.free_order()
    pool.free([blocks[0]])
    assert pool.free_order()[-1] == blocks[0]
    assert np.sum(pool.ref) == 0
