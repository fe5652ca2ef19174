"""One vLLM V1 step: token budget, admission, chunked prefill, prefix cache, preemption, max_num_seqs."""

from __future__ import annotations

import numpy as np
import polars as pl
from simhelpers import ConstantCost, agent_query, call, config, workload

from agentspec_sim import simulate
from agentspec_sim.engine.kv import KVCacheManager
from agentspec_sim.engine.request import CallState
from agentspec_sim.engine.scheduler import Scheduler
from agentspec_sim.metrics import summarize


def make(scheduler_tokens=64, seqs=8, blocks=256, bs=4, max_len=4096):
    kv = KVCacheManager(blocks, bs, max_len)
    return Scheduler(kv, seqs, scheduler_tokens, max_len)


def req(i, prompt_len=8, out_len=20):
    c = call(f"c{i}", list(range(100 * i, 100 * i + prompt_len)), list(range(out_len)), query=f"q{i}")
    return CallState(i, c, c.id, 0, i, c.output_len)


def test_budget_truncates_drafts_of_later_running_requests():
    s = make(scheduler_tokens=64)
    rs = [req(i) for i in range(3)]
    for r in rs:
        s.add_request(r)
    s.update_from_output(s.schedule())  # all three prefill (24 tokens) and sample a token
    assert all(r.num_emitted == 1 for r in rs)
    s.max_num_batched_tokens = 10
    for r in rs:
        r.drafts = np.arange(5, dtype=np.int32) + 1000
    batch = s.schedule()
    assert batch.rows == rs[:2]  # the third gets nothing: the budget is spent
    assert batch.num_new == [6, 4]
    assert [d.shape[0] for d in batch.drafts] == [5, 3]  # the tail of the second draft is dropped
    assert batch.bound is None
    assert rs[2].drafts.shape[0] == 5  # untouched: it was not scheduled


def test_admission_is_fcfs_and_stops_at_the_first_that_does_not_fit():
    s = make(blocks=9, bs=4)  # 8 usable blocks = 32 tokens
    big, small = req(0, prompt_len=40), req(1, prompt_len=4)
    s.add_request(big)  # cannot fit: head of line blocks the small one behind it
    s.add_request(small)
    batch = s.schedule()
    assert batch.rows == [] and batch.bound == "kv"
    s2 = make(blocks=64)
    a, b = req(0), req(1)
    s2.add_request(a)
    s2.add_request(b)
    assert s2.schedule().rows == [a, b] and s2.running == [a, b]


def test_chunked_prefill_uses_the_leftover_budget():
    s = make(scheduler_tokens=32)
    r = req(0, prompt_len=100)
    s.add_request(r)
    chunks = []
    for _ in range(4):
        batch = s.schedule()
        chunks.append(batch.num_new[0])
        out = s.update_from_output(batch)
        assert batch.decode == [False]
        assert int(out.emitted[0]) == (1 if len(chunks) == 4 else 0)
    assert chunks == [32, 32, 32, 4]
    assert r.num_emitted == 1 and r.num_computed == 100


def test_max_num_seqs_caps_running():
    s = make(seqs=2)
    rs = [req(i) for i in range(4)]
    for r in rs:
        s.add_request(r)
    batch = s.schedule()
    assert batch.rows == rs[:2] and batch.bound == "seqs" and len(s.waiting) == 2


def test_prefix_cache_hit_across_an_agents_calls():
    first = call("c0", list(range(40)), list(range(100, 110)), query="q", seq=0)
    second_prompt = [*range(40), *range(100, 110), 7, 7, 7]
    second = call("c1", second_prompt, [1, 2, 3], query="q", seq=1)
    wl = workload([first, second])
    result = simulate(wl, "normal", config(block_size=4), ConstantCost())
    calls = result.calls
    # prompt + output of call 0 = 50 tokens; its last output token is never computed → 49 cached
    # tokens → 12 full blocks = 48 tokens hit; the second call prefills only 53 − 48 = 5 tokens.
    assert calls["prefix_hit_tokens"].to_list() == [0, 48]
    prefill = result.steps.filter((pl.col("call_id") == "c1") & (pl.col("phase") == "prefill"))
    assert prefill["scheduled_tokens"].to_list() == [5]
    assert prefill["context_len"].to_list() == [48]


def test_no_prefix_caching_prefills_everything():
    first = call("c0", list(range(40)), list(range(100, 110)), query="q", seq=0)
    second = call("c1", [*range(40), *range(100, 110), 7], [1, 2], query="q", seq=1)
    result = simulate(workload([first, second]), "normal", config(enable_prefix_caching=False), ConstantCost())
    assert result.calls["prefix_hit_tokens"].to_list() == [0, 0]


def test_preemption_under_a_tiny_kv_cache_recovers_and_stays_lossless():
    rng = np.random.default_rng(3)
    wl = workload(*[agent_query(rng, f"q{i}", 2, prompt_len=24, out_len=40, vocab=6) for i in range(4)])
    # 24 usable blocks × 4 = 96 tokens: four calls of up to ~100 tokens cannot all keep growing.
    cfg = config(num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    for drafter in ("normal", "ngram"):
        result = simulate(wl, drafter, cfg, ConstantCost())
        summary = summarize(result)
        assert summary.preemptions > 0
        assert (result.calls["status"] == "finished").all()
        assert result.calls["output_len"].to_list() == result.calls["recorded_output_len"].to_list()
        assert summary.bound_fractions["kv_cache"] > 0


def test_preempted_request_goes_to_the_front_and_recomputes_its_outputs():
    s = make(scheduler_tokens=64, blocks=14, bs=4)  # 13 usable blocks: one call (42 tokens, 11 blocks) fits alone
    a, b = req(0, prompt_len=12, out_len=30), req(1, prompt_len=12, out_len=30)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule())  # both admitted (3 + 3 blocks); growing both needs 22 > 13
    steps = 0
    while b.preemptions == 0:
        s.update_from_output(s.schedule())
        steps += 1
        assert steps < 50
    assert s.waiting[0] is b and b.num_computed == 0 and b.block_ids == []
    emitted_before = b.num_emitted
    assert emitted_before > 0  # progress on output tokens is kept
    # while a runs, b waits; once readmitted it re-prefills prompt + emitted tokens
    while True:
        batch = s.schedule()
        if b in batch.rows:
            break
        s.update_from_output(batch)
        steps += 1
        assert steps < 200
    i = batch.rows.index(b)
    assert not batch.decode[i]
    assert batch.context[i] + batch.num_new[i] == 12 + emitted_before  # prefix-cache hit + recomputed tail
    assert batch.context[i] % 4 == 0
    out = s.update_from_output(batch)
    assert int(out.emitted[i]) == 1 and b.num_emitted == emitted_before + 1
