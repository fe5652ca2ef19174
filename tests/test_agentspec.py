"""The AgentSpec drafter family (drafters/agentspec/rule.py, drafters/agentspec/block_index.py).

Hand-computed budget numbers (equations 1–3), CT*/c on hand-made candidate sets, the index against
a brute-force search, block and query isolation on real Qwen3 tokens, the four variants through
the engine (lossless check on), determinism, and the config surface.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim import simulate
from agentspec_sim.drafters.agentspec.allocation import Candidates, allocate, batch_budget, redundancy_score, saturation
from agentspec_sim.drafters.agentspec.block_index import (
    OP_APPEND,
    OP_LOOKUP,
    BlockArena,
    consensus_lists,
    match_levels,
)
from agentspec_sim.drafters.agentspec.rule import DEFAULT_K, PAPER_PRESET, bind_engine_context
from agentspec_sim.drafters.registry import make_drafter, parse_drafter
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.engine.request import CallState
from agentspec_sim.trace.schema import Call
from agentspec_sim.trace.tokenizer import load_tokenizer

VARIANTS = ("agentspec", "agentspec-s", "agentspec-n", "agentspec-r")

# --------------------------------------------------------------------------------------------
# Equations 1–3 against hand-computed values.


@pytest.mark.parametrize(("n", "g_min", "expected"), [
    (1, 0.3, 0.3),  # p(1) = g_min (equation 1; Algorithm 2's e^{-n} would give 0.7425)
    (2, 0.3, 0.3 + 0.7 * (1 - math.exp(-1))),  # 0.742487
    (3, 0.5, 0.5 + 0.5 * (1 - math.exp(-2))),  # 0.932332
    (10, 0.1, 0.1 + 0.9 * (1 - math.exp(-9))),
])
def test_saturation_is_equation_1(n, g_min, expected):
    assert saturation(n, g_min) == pytest.approx(expected, rel=1e-12)


def test_redundancy_score_hand_values():
    # g = (c/n)·p(n): (c, n, g_min) → value
    assert redundancy_score(1, 1, 0.3) == pytest.approx(0.3)
    assert redundancy_score(2, 3, 0.3) == pytest.approx(2 / 3 * (0.3 + 0.7 * (1 - math.exp(-2))))  # 0.603510
    assert redundancy_score(2, 3, 0.3) == pytest.approx(0.603510, abs=1e-6)
    assert redundancy_score(4, 4, 0.0) == pytest.approx(1 - math.exp(-3))  # 0.950213
    assert redundancy_score(0, 0, 0.5) == 0.0  # no candidates
    np.testing.assert_allclose(redundancy_score([1, 1, 0], [1, 2, 0], 1.0), [1.0, 0.5, 0.0])


@pytest.mark.parametrize(("alpha", "bz", "expected"), [(100, 7, 14), (5, 8, 0), (2048, 1, 2048), (2048, 3, 682),
                                                       (0, 4, 0), (10, 0, 0)])
def test_batch_budget_is_floor_alpha_over_bz(alpha, bz, expected):
    assert batch_budget(alpha, bz) == expected


def test_allocate_hand_example():
    # rows (n, c, |CT*|) with g_min 0.5:
    #   r0 (1, 1, 0): g = 1·0.5 = 0.5
    #   r1 (4, 4, 3): g = 0.5 + 0.5(1 − e^{-3}) = 0.975106
    #   r2 (0, 0, 0): g = 0 → L = 0
    #   r3 (2, 1, 0): g = ½(0.5 + 0.5(1 − e^{-1})) = 0.408030
    #   r4 (3, 3, 9): g = 0.5 + 0.5(1 − e^{-2}) = 0.932332; |CT*| 9 exceeds its share
    # Σg = 2.815468; B = 10 → exact shares 1.7759, 3.4634, 0, 1.4492, 3.3115: floors 1, 3, 0, 1, 3 (8),
    # the two largest fractions (r0 .7759, r1 .4634) get +1 → 2, 4, 0, 1, 3.
    cands = Candidates.of(n=[1, 4, 0, 2, 3], c=[1, 4, 0, 1, 3], ct_len=[0, 3, 0, 0, 9])
    assert allocate(cands, 10, 0.5).tolist() == [2, 4, 0, 1, 9]
    # budget 0 (α < bz): only the CT* floors
    assert allocate(cands, 0, 0.5).tolist() == [0, 3, 0, 0, 9]
    # n = 0 everywhere: nothing, whatever B
    assert allocate(Candidates.of([0, 0], [0, 0], [0, 0]), 50, 0.3).tolist() == [0, 0]


def test_allocate_shares_add_up_to_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 20))
        n = rng.integers(0, 6, k)
        c = np.minimum(rng.integers(1, 6, k), np.maximum(n, 1)) * (n > 0)
        cands = Candidates.of(n, c, np.zeros(k, dtype=np.int64))
        budget = int(rng.integers(0, 100))
        lengths = allocate(cands, budget, float(rng.uniform(0, 1)))
        assert (lengths >= 0).all() and (lengths[n == 0] == 0).all()
        g = redundancy_score(c, n, 0.5)
        assert lengths.sum() == (budget if g.sum() > 0 else 0)


# --------------------------------------------------------------------------------------------
# CT* and c on hand-made candidate sets (newest first).


def consensus(cands, width=8, min_support=1):
    toks = np.concatenate([np.asarray(c, dtype=np.int32) for c in cands]) if cands else np.zeros(0, np.int32)
    offs = np.cumsum([0] + [len(c) for c in cands]).astype(np.int64)
    path, c, m = consensus_lists(toks, offs, width, min_support)
    return path.tolist(), m, c


def test_ct_star_hand_cases():
    # path, |CT*|, c
    assert consensus([[1, 2, 3], [1, 2, 4], [1, 5]]) == ([1, 2, 3], 2, 2)  # 3/3 then 2/3 agree; then 1/3
    assert consensus([[1, 2, 3], [2, 2, 4], [3, 5]]) == ([1, 2, 3], 0, 1)  # no majority: c = plurality of token 1
    assert consensus([[7, 8], [7, 8], [7, 8], [9]]) == ([7, 8], 2, 3)  # 3 of 4
    assert consensus([[5, 6], [9, 9], [5, 7], [9, 9]]) == ([5, 6], 0, 2)  # 2-2 tie at depth 0: the newest (5)
    assert consensus([[4, 4, 4, 4]]) == ([4, 4, 4, 4], 4, 1)  # one candidate: all of it (without a support floor)
    assert consensus([[1, 2], [1]]) == ([1, 2], 1, 2)  # the shorter candidate stops agreeing at depth 1
    assert consensus([[1, 2, 3, 4, 5]], width=3) == ([1, 2, 3], 3, 1)  # candidate length capped by width


def test_ct_star_needs_support_two():
    # min_support 2 (the drafter's rule): a prefix seen once is not "frequent"
    assert consensus([[4, 4, 4, 4]], min_support=2) == ([4, 4, 4, 4], 0, 1)
    assert consensus([[1, 2, 3], [1, 2, 4], [1, 5]], min_support=2) == ([1, 2, 3], 2, 2)
    assert consensus([[1, 2], [3, 4]], min_support=2) == ([1, 2], 0, 1)


# --------------------------------------------------------------------------------------------
# The index against a brute-force search.


def brute(segments, ctx, levels, k, width):
    """Candidates (newest first) of the longest match in [min, max] over (lead-in, tokens) segments."""
    flat, indexed = [], []
    for lead, toks in segments:
        flat.append(-1)
        for i, t in enumerate(lead):
            flat.append(t)
            if i == len(lead) - 1:
                indexed.append(len(flat) - 1)
        for t in toks:
            flat.append(t)
            indexed.append(len(flat) - 1)
    lo, hi = levels[0], levels[-1]
    best, cands = 0, []
    for p in reversed(indexed):
        ell = 0
        while ell < hi and ell < len(ctx) and p - ell >= 0 and flat[p - ell] == ctx[-1 - ell]:
            ell += 1
        if ell < lo:
            continue
        q = p + 1
        while q < len(flat) and q - p - 1 < width and flat[q] != -1:
            q += 1
        if q == p + 1:
            continue
        if ell > best:
            best, cands = ell, []
        if ell == best and len(cands) < k:
            cands.append(flat[p + 1:q])
    return best, cands


@pytest.mark.parametrize("levels", [(1,), (2, 3), (1, 2, 3, 4), (1, 2, 4), (2, 4, 8)])
def test_lookup_matches_brute_force(levels):
    rng = np.random.default_rng(len(levels) * 7 + levels[-1])
    for _ in range(60):
        arena = BlockArena(levels, pool_capacity=8, table_size=16)
        blk, other = arena.new_block(), arena.new_block()
        segments = []
        vocab = int(rng.integers(2, 5))
        for _ in range(int(rng.integers(1, 6))):
            toks = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
            if segments and rng.random() < 0.3:  # continue the last segment
                segments[-1] = (segments[-1][0], segments[-1][1] + toks)
                ops = [[OP_APPEND, blk, 0, len(toks), 0, -1, 0, 0]]
                tb = toks
            else:
                lead = rng.integers(0, vocab, int(rng.integers(0, 4))).tolist()
                segments.append((lead, toks))
                ops = [[OP_APPEND, blk, 0, len(toks), len(toks), len(lead), 0, 0]]
                tb = toks + lead
            ops.append([OP_APPEND, other, 0, len(toks), 0, 0, 0, 0])  # another block: never a candidate
            arena.run(np.asarray(ops, dtype=np.int64), np.asarray(tb, dtype=np.int32), np.zeros((0, 1), np.int32),
                      np.zeros((0, 5), np.int64), 8, 10**6)
        k, width = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        for _ in range(8):
            ctx = rng.integers(0, vocab, int(rng.integers(0, 10))).tolist()
            out = np.zeros((1, width), np.int32)
            meta = np.zeros((1, 5), np.int64)
            arena.run(np.asarray([[OP_LOOKUP, blk, 0, len(ctx), 0, 0, 0, 0]], dtype=np.int64),
                      np.asarray(ctx, dtype=np.int32), out, meta, k, 10**6)
            best, cands = brute(segments, ctx, levels, k, width)
            assert meta[0, 0] == len(cands)
            if cands:
                path, m, c = consensus(cands, width)
                assert meta[0, 4] == best and out[0, :meta[0, 3]].tolist() == path
                assert (meta[0, 1], meta[0, 2]) == (c, m)


def test_match_levels():
    assert match_levels(2, 5) == (2, 3, 4, 5)
    assert match_levels(3, 16) == (3, 4, 8, 16)
    assert match_levels(1, 32) == (1, 2, 4, 8, 16, 32)
    with pytest.raises(ValueError):
        match_levels(4, 2)


def test_arena_growth_and_freeing_keep_lookups_right():
    arena = BlockArena((2,), pool_capacity=4, table_size=4)
    blocks = [arena.new_block() for _ in range(6)]
    for rep in range(30):
        for b in blocks:
            toks = np.asarray([b, b + 1, 100 + rep], dtype=np.int32)
            arena.run(np.asarray([[OP_APPEND, b, 0, 3, 0, 0, 0, 0]], dtype=np.int64), toks,
                      np.zeros((0, 1), np.int32), np.zeros((0, 5), np.int64), 4, 100)
        if rep == 10:
            arena.free_block(blocks.pop(0))
    for b in blocks:
        out, meta = np.zeros((1, 4), np.int32), np.zeros((1, 5), np.int64)
        arena.run(np.asarray([[OP_LOOKUP, b, 0, 2, 0, 0, 0, 0]], dtype=np.int64), np.asarray([b, b + 1], np.int32),
                  out, meta, 4, 100)
        # the 4 newest occurrences of (b, b+1), each followed by its repetition number
        assert meta[0, 0] == 4 and sorted(out[0, :1].tolist()) == [129]


def test_compaction_and_room_keep_every_live_blocks_tokens():
    """Random appends, frees and reservations (`ensure_room`, a compiled caller's room) over a small pool:
    compaction moves live blocks down in place while they fill at most half the pool, else into new
    arrays; every live block keeps its tokens either way, and both kinds happen."""
    arena = BlockArena((2,), pool_capacity=64, table_size=16)
    rng = np.random.default_rng(3)
    kept: dict[int, list[int]] = {}
    pools = set()
    in_place = 0
    compact = arena._compact

    def counting(extra):
        nonlocal in_place
        before = arena.pool
        compact(extra)
        in_place += arena.pool is before

    arena._compact = counting
    for _ in range(600):
        r = rng.random()
        if r < 0.15 or not kept:
            kept[arena.new_block()] = []
        elif r < 0.3 and len(kept) > 1:
            b = int(rng.choice(list(kept)))
            del kept[b]
            arena.free_block(b)
        elif r < 0.4:
            arena.ensure_room(int(rng.choice(list(kept))), int(rng.integers(1, 40)))
        else:
            b = int(rng.choice(list(kept)))
            toks = rng.integers(0, 50, size=int(rng.integers(1, 12))).astype(np.int32)
            arena.run(np.asarray([[OP_APPEND, b, 0, toks.shape[0], 0, -1, 0, 0]], dtype=np.int64), toks,
                      np.zeros((0, 1), np.int32), np.zeros((0, 5), np.int64), 4, 100)
            kept[b] += toks.tolist()
        pools.add(id(arena.pool))
        for b, toks in kept.items():
            stream = arena.block_tokens(b).tolist()
            assert [t for t in stream if t != -1] == toks
    assert in_place > 0 and len(pools) > 1


# --------------------------------------------------------------------------------------------
# Block and query isolation on real tokens.

PY = ((("```python", "```"),),)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def _call(tok, cid, query, seq, prompt, output, structure=PY):
    enc = tok.encode_batch([prompt, output])
    return Call(id=cid, agent_id="agent", query_id=query, seq=seq, prompt_tokens=enc[0], output_tokens=enc[1],
                structure=structure)


PAPER_RULES = {"budget": "alpha", "depth": "allocation", "ct_min_match": 2}  # no cost model: the drafter alone


def drafter_of(method, **options):
    """A drafter that matches from 2 tokens on (a short match is the harder test of isolation), with the
    paper's budget ⌊α/bz⌋ and no cost bound where the variant has a budget (these tests need no engine)."""
    rules = PAPER_RULES if method != "agentspec-s" else {}
    return make_drafter(parse_drafter({"method": method, "min_match_len": 2, **rules, **options}))


def drive(drafter, calls, k=16, last=()):
    """Run calls one after another, one token per step; the draft proposed before each output token.
    `last`: ids of calls that end their query."""
    drafts = {}
    for i, call in enumerate(calls):
        st = CallState(i, call, call.id, 0, i, call.output_len)
        st.last_in_query = call.id in last
        out = call.output_tokens
        seen = []
        for t in range(call.output_len):
            if t:
                seen.append(drafter.propose([st], np.array([k]))[0].tolist())
            st.history[st.prompt_len + t] = out[t]
            st.num_emitted = t + 1
            if t == 0:
                drafter.start_call(st)
            drafter.observe(st, st.history[st.prompt_len + t:st.prompt_len + t + 1])
        drafter.finish_call(st)
        drafts[call.id] = seen
    return drafts


def draft_after(tok, call, drafts, text):
    """The draft proposed right after the output's tokens spell `text` (a prefix of the output)."""
    ids = call.output_tokens.tolist()
    for t in range(1, len(ids)):
        if tok.decode(ids[:t]) == text:
            return tok.decode(drafts[call.id][t - 1])
    raise AssertionError(f"{text!r} is not a token-aligned prefix of the output")


@pytest.mark.parametrize("method", ["agentspec", "agentspec-s"])
def test_the_same_span_in_the_same_block_is_drafted(tok, method):
    first = _call(tok, "a0", "q", 0, "Task one.", "```python\ntotal = compute_total(items)\nprint(total)\n```")
    second = _call(tok, "a1", "q", 1, "Task two.", "```python\ntotal = compute_total(items)\nprint(total)\n```")
    drafts = drive(drafter_of(method), [first, second])
    assert draft_after(tok, second, drafts, "```python\ntotal = compute").startswith("_total(items)\nprint")


@pytest.mark.parametrize("method", ["agentspec", "agentspec-s"])
def test_a_span_from_another_block_is_not_drafted(tok, method):
    # The span lives in a python block of call 0; call 1 writes it in prose (ROOT).
    first = _call(tok, "b0", "q", 0, "Task one.", "```python\nvalue = scale_all(data_points)\n```")
    second = _call(tok, "b1", "q", 1, "Task two.", "Now value = scale_all(data_points) holds.")
    drafts = drive(drafter_of(method), [first, second])
    assert draft_after(tok, second, drafts, "Now value = scale") == ""
    # agentspec-n (no structure input) does draft it: the history is the whole query.
    drafts = drive(drafter_of("agentspec-n"), [first, second])
    assert draft_after(tok, second, drafts, "Now value = scale").startswith("_all(data_points)")


@pytest.mark.parametrize("method", ["agentspec", "agentspec-s", "agentspec-n"])
def test_a_span_from_another_query_is_not_drafted(tok, method):
    first = _call(tok, "c0", "q1", 0, "Task one.", "```python\nresult = merge_sorted(left, right)\n```")
    other = _call(tok, "c1", "q2", 0, "Task two.", "```python\nresult = merge_sorted(left, right)\n```")
    drafts = drive(drafter_of(method), [first, other])
    assert draft_after(tok, other, drafts, "```python\nresult = merge") == ""


def test_the_prompt_is_indexed_by_block(tok):
    # The implementation in the prompt's python fence is drafted inside the output's fence, not in prose.
    prompt = "Fix this:\n```python\ndef area(radius):\n    return 3.14 * radius * radius\n```\n"
    call = _call(tok, "d0", "q", 0, prompt, "```python\ndef area(radius):\n    return 3.14 * radius ** 2\n```")
    drafts = drive(make_drafter(parse_drafter("agentspec-s")), [call])
    assert draft_after(tok, call, drafts, "```python\ndef area").startswith("(radius):\n    return")
    prose = _call(tok, "d1", "q", 0, prompt, "I would define area(radius): return a product.", structure=PY)
    drafts = drive(make_drafter(parse_drafter("agentspec-s")), [prose])
    assert draft_after(tok, prose, drafts, "I would define area") == ""


def test_outputs_only_history_drafts_nothing_from_the_prompt(tok):
    # The paper's open rule as a switch: with "prompt_history": false only emitted tokens are history, so
    # the implementation shown in the prompt is not drafted; an earlier call's output still is.
    prompt = "Fix this:\n```python\ndef area(radius):\n    return 3.14 * radius * radius\n```\n"
    call = _call(tok, "o0", "q", 0, prompt, "```python\ndef area(radius):\n    return 3.14 * radius ** 2\n```")
    spec = {"method": "agentspec-s", "prompt_history": False}
    drafts = drive(make_drafter(parse_drafter(spec)), [call])
    assert draft_after(tok, call, drafts, "```python\ndef area") == ""
    again = _call(tok, "o1", "q", 1, "Once more.", "```python\ndef area(radius):\n    return 3.14 * radius ** 2\n```")
    drafts = drive(make_drafter(parse_drafter(spec)), [call, again])
    assert draft_after(tok, again, drafts, "```python\ndef area").startswith("(radius):\n    return")


def test_an_extending_prompt_is_not_indexed_twice(tok):
    drafter = make_drafter(parse_drafter({"method": "agentspec", **PAPER_RULES}))
    c0 = _call(tok, "e0", "q", 0, "Start.", "```python\nx = 1\n```")
    drive(drafter, [c0])
    held = drafter.history.arena.live_tokens
    doc = np.concatenate([c0.prompt_tokens, c0.output_tokens])
    append = tok.encode_batch(["\nObservation: ok."])[0]
    c1 = Call(id="e1", agent_id="agent", query_id="q", seq=1, prompt_tokens=np.concatenate([doc, append]),
              output_tokens=tok.encode_batch(["Done."])[0], structure=PY)
    drive(drafter, [c1])
    new = drafter.history.arena.live_tokens - held
    # only the appended prompt part and the output (each segment adds a SEP and ≤ max_n lead-in tokens)
    assert new <= len(append) + c1.output_len + 2 * (1 + 8)


def test_a_finished_querys_history_is_dropped(tok):
    # When the last call of a query finishes nothing reads its history again: its blocks are freed, with
    # the appends still queued for them; a query with calls to come keeps its history.
    drafter = make_drafter(parse_drafter({"method": "agentspec", **PAPER_RULES}))
    c0 = _call(tok, "f0", "q1", 0, "Start.", "```python\nx = 1\n```")
    other = _call(tok, "g0", "q2", 0, "Other.", "```python\ny = 2\n```")
    drive(drafter, [c0, other], last={"g0"})
    history = drafter.history
    assert {key[1] for key in history.stores} == {"q1"} and history.arena.live_tokens > 0
    c1 = Call(id="f1", agent_id="agent", query_id="q1", seq=1,
              prompt_tokens=np.concatenate([c0.prompt_tokens, c0.output_tokens, tok.encode_batch(["Ok."])[0]]),
              output_tokens=tok.encode_batch(["Done."])[0], structure=PY)
    drive(drafter, [c1], last={"f1"})
    assert not history.stores and not history.queue and history.arena.live_tokens == 0


def test_table_rebuilds_stay_logarithmic_when_blocks_are_freed(monkeypatch):
    # Each new table passes over every key; sized for a load of ≤ 1/3, freeing blocks along the way does
    # not make them come back-to-back.
    from agentspec_sim.drafters.agentspec import block_index

    rebuilds = []
    for name in ("rebuild_table", "regrow_table"):  # from the live blocks, from the old table
        real = getattr(block_index, name)
        monkeypatch.setattr(block_index, name, lambda *a, real=real: rebuilds.append(a[0].shape[0]) or real(*a))
    arena = BlockArena((2,), pool_capacity=4, table_size=4)
    rng = np.random.default_rng(0)
    blocks = []
    for rep in range(400):
        blocks.append(arena.new_block())
        toks = rng.integers(0, 1 << 20, size=64).astype(np.int32)
        arena.run(np.asarray([[OP_APPEND, blocks[-1], 0, 64, 0, 0, 0, 0]], dtype=np.int64), toks,
                  np.zeros((0, 1), np.int32), np.zeros((0, 5), np.int64), 4, 100)
        if rep % 3 == 2:
            arena.free_block(blocks.pop(int(rng.integers(0, len(blocks)))))
    assert len(rebuilds) <= 10


def test_offline_replay_sees_what_the_drafter_sees(tok):
    from agentspec_sim.drafters.agentspec.history import History

    table = tok.token_bytes()
    c0 = _call(tok, "g0", "q", 0, "Write it.", "Plan.\n```python\ntotal = compute_total(items)\n```\nok")
    c1 = _call(tok, "g1", "q", 1, "Again.", "Plan.\n```python\ntotal = compute_total(items)\nprint(total)\n```")
    live, offline = History(2, 6, 8, 16, table), History(2, 6, 8, 16, table)
    for call in (c0, c1):
        prompt, out = call.prompt_tokens, call.output_tokens
        stream = np.concatenate([prompt, out]).astype(np.int32)
        cursor = live.start(call, prompt)
        rows = []
        for t in range(out.shape[0]):
            end = prompt.shape[0] + t
            rows.append(live.lookup([(live.block_of(cursor), stream[max(0, end - 6):end])]))
            live.emit(cursor, stream, end, 1)
        live.finish(cursor, stream)
        cursor = offline.start(call, prompt)
        paths, meta = offline.replay(cursor, prompt, out)
        offline.finish(cursor, stream)
        assert meta.tolist() == [m[1][0].tolist() for m in rows]
        for t, (p, m) in enumerate(rows):
            assert paths[t, :m[0, 3]].tolist() == p[0, :m[0, 3]].tolist()
    assert meta[:, 0].any()  # the second call found candidates


# --------------------------------------------------------------------------------------------
# agentspec-r: candidates from the suffix tree's counts.


def test_agentspec_r_reads_n_and_c_from_the_tree():
    drafter = make_drafter(parse_drafter({"method": "agentspec-r", "alpha": 0}))
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    call = Call(id="r", agent_id="a", query_id="q", seq=0, prompt_tokens=np.asarray(prompt, np.int32),
                output_tokens=np.asarray([4, 5, 6, 7], np.int32))
    st = CallState(0, call, "r", 0, 0, 4)
    st.history[9] = 4
    st.num_emitted = 1
    drafter.start_call(st)
    drafter.observe(st, st.history[9:10])
    draft = drafter.propose([st], np.array([8]))[0]
    meta, lengths = drafter.last
    # context …1 2 3 4 seen once before: its node counts the earlier occurrence and its own → n = 2,
    # the continuation "5 6" has count 1 → c/n = 1/2, no majority → CT* = ∅ and, with α = 0, no draft.
    assert meta[0, 0] == 2 and meta[0, 1] == 1 and meta[0, 2] == 0
    assert draft.shape[0] == 0 and lengths[0] == 0
    drafter = make_drafter(parse_drafter({"method": "agentspec-r", "alpha": 64}))
    st = CallState(0, call, "r", 0, 0, 4)
    st.history[9] = 4
    st.num_emitted = 1
    drafter.start_call(st)
    drafter.observe(st, st.history[9:10])
    assert drafter.propose([st], np.array([8]))[0].tolist()[:2] == [5, 6]  # the budget share drafts it


# --------------------------------------------------------------------------------------------
# Through the engine.


def small_workload(seed=1):
    rng = np.random.default_rng(seed)
    return workload(*[agent_query(rng, f"q{i}", 3, vocab=8, out_len=30) for i in range(4)])


@pytest.mark.parametrize("method", VARIANTS)
def test_variants_draft_losslessly_through_the_engine(method):
    result = simulate(small_workload(), method, config(), ConstantCost())  # the engine checks every output
    assert (result.calls["status"] == "finished").all()
    drafted = int(result.calls["drafted"].sum())
    assert drafted > 0 and int(result.calls["accepted"].sum()) > 0


@pytest.mark.parametrize("method", VARIANTS)
def test_deterministic(method):
    wl = small_workload(2)
    a = simulate(wl, method, config(seed=3), ConstantCost())
    b = simulate(wl, method, config(seed=3), ConstantCost())
    assert a.steps.equals(b.steps) and a.calls.equals(b.calls)


def test_drafts_respect_the_caps():
    spec = parse_drafter({"method": "agentspec", "num_speculative_tokens": 3, "alpha": 10_000})
    result = simulate(small_workload(3), spec, config(), ConstantCost())
    per_step = result.steps.filter(result.steps["phase"] == "decode")
    assert int(per_step["drafted"].max()) <= 3


# --------------------------------------------------------------------------------------------
# Config, budget modes, engine context.


def test_config_defaults_and_validation():
    spec = parse_drafter("agentspec")
    assert spec.num_speculative_tokens == DEFAULT_K
    opts = dict(spec.options)
    assert opts["budget"] == "token_budget" and opts["depth"] == "break_even" and opts["min_match_len"] == 1
    assert opts["ct_min_match"] == 3 and opts["single_candidate"] == "share" and opts["prompt_history"] is True
    paper = dict(parse_drafter("agentspec-paper").options)
    assert {key: paper[key] for key in PAPER_PRESET} == PAPER_PRESET and paper["budget"] == "alpha"
    assert dict(parse_drafter({"method": "agentspec", "match": "pattern", "min_match_len": 4}).options)[
        "max_match_len"] == 4  # every occurrence of the last 4 tokens
    assert parse_drafter({"method": "agentspec-r"}).num_speculative_tokens == DEFAULT_K
    assert dict(parse_drafter("agentspec-r").options)["suffix_decoding_max_tree_depth"] == 24
    for bad in ({"g_min": 1.5}, {"alpha": -1}, {"budget": "nope"}, {"min_match_len": 5, "max_match_len": 3},
                {"max_candidates": 0}, {"prompt_lookup_min": 2}, {"ct_min_match": 0}, {"depth": "deep"},
                {"single_candidate": "all"}, {"prompt_history": 1}, {"match": "some"}):
        with pytest.raises(SpecConfigError):
            parse_drafter({"method": "agentspec", **bad})
    with pytest.raises(SpecConfigError):
        parse_drafter({"method": "agentspec-r", "min_match_len": 2})  # suffix keys, not match keys


def test_token_budget_mode_uses_m_of_b():
    drafter = make_drafter(parse_drafter({"method": "agentspec", "budget": "token_budget"}))
    with pytest.raises(SpecConfigError, match="cost model"):
        drafter.step_budget(4)
    drafter.bind_cost_model(ConstantCost(ridge=100.0))
    assert drafter.step_budget(4) == 96 and drafter.step_budget(150) == 0
    bound = bind_engine_context(parse_drafter({"method": "agentspec", "budget": "token_budget"}),
                                hardware="a100-80g", model="qwen3-8b")
    drafter = make_drafter(bound)
    from agentspec_sim.cost import build_cost_model

    assert drafter.step_budget(10) == build_cost_model("a100-80g", "qwen3-8b").token_budget(10)
    assert make_drafter(parse_drafter({"method": "agentspec", "alpha": 100, "budget": "alpha"})).step_budget(8) == 12


def test_batch_share_with_the_engine_step_size():
    drafter = make_drafter(parse_drafter({"method": "agentspec", "alpha": 120, **PAPER_RULES}))
    assert drafter.batch_share(4) == (30, 4)  # ⌊120 / 4⌋: this drafter's rows are the whole batch
    drafter.begin_step(12)  # replicate: 12 calls draft in the step, 4 of them this tenant's
    assert drafter.batch_share(4) == (10 * 4 // 12, 12)  # B_t = ⌊120 / 12⌋ = 10, this tenant's share 3
    assert drafter.batch_share(4) == (30, 4)  # the count applies to one propose only


def test_bind_engine_context():
    spec = bind_engine_context(parse_drafter("agentspec"), hardware="h100-80g", model="qwen3-8b", tokenizer=None)
    opts = dict(spec.options)
    assert opts["hardware"] == "h100-80g" and opts["tokenizer"] is None
    kept = bind_engine_context(parse_drafter({"method": "agentspec", "tokenizer": "qwen3"}), tokenizer=None)
    assert dict(kept.options)["tokenizer"] == "qwen3"  # the user's choice wins
    ngram = parse_drafter("ngram")
    assert bind_engine_context(ngram, hardware="a100-80g") is ngram


def test_without_a_token_map_structure_is_not_read(tok):
    first = _call(tok, "f0", "q", 0, "Task one.", "```python\nvalue = scale_all(data_points)\n```")
    second = _call(tok, "f1", "q", 1, "Task two.", "Now value = scale_all(data_points) holds.")
    drafter = drafter_of("agentspec-s", tokenizer=None)
    drafts = drive(drafter, [first, second])
    assert draft_after(tok, second, drafts, "Now value = scale").startswith("_all(data_points)")


@pytest.mark.parametrize("method", ["agentspec", "agentspec-s"])
def test_precomputed_output_labels_draft_as_the_fed_automaton(monkeypatch, method):
    """Engine calls label their output from one `segment` pass at start (their recording is known);
    the drafts equal those of an automaton fed token by token, also across calls of one query, whose
    prompts continue from the automaton the last output left."""
    from dataclasses import replace

    from agentspec_sim.drafters.agentspec.history import History
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    w = load_trace(default_trace_path())
    calls = [c for q in w.queries[:2] for c in q.calls[:4]]
    calls = [replace(c, output_tokens=c.output_tokens[:150]) for c in calls]
    precomputed = drive(drafter_of(method), calls, k=8)
    start = History.start
    monkeypatch.setattr(History, "start", lambda self, call, prompt, output=None: start(self, call, prompt))
    fed = drive(drafter_of(method), calls, k=8)
    assert precomputed == fed
    assert sum(len(d) for drafts in fed.values() for d in drafts) > 200
