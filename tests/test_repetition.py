"""The Figure 5 repetition profile (analysis/repetition.py) on hand-built workloads."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentspec_sim.analysis.repetition import repetition_profile
from agentspec_sim.drafters.common.structure import StructureAutomaton
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload

BYTES = [bytes([i]) for i in range(256)]  # token id i is the single byte i
ANGLE = ((("<", ">"),),)  # token "<" opens a block, ">" closes it


def call(query: int, seq: int, text: str, structure=()) -> Call:
    return Call(
        id=f"q{query}c{seq}", agent_id=0, query_id=query, seq=seq,
        prompt_tokens=np.zeros(0, dtype=np.int32),
        output_tokens=np.array([ord(ch) for ch in text], dtype=np.int32),
        structure=structure,
    )


def workload(*queries: list[Call]) -> Workload:
    return Workload(
        meta=TraceMeta(tokenizer=None),
        queries=tuple(Query(agent_id=0, query_id=cs[0].query_id, calls=tuple(cs)) for cs in queries),
    )


def counts(w: Workload, k: int) -> dict[str, int]:
    return repetition_profile(w, BYTES, ks=(k,))["tokens_by_k"][k]


def test_repeat_inside_one_call() -> None:
    w = workload([call(0, 0, "abcdXabcd")])
    prof = repetition_profile(w, BYTES, ks=(4, 8))
    assert prof["output_tokens"] == 9 and prof["calls"] == 1 and prof["queries"] == 1
    assert prof["tokens_by_k"][4] == {"same_block": 4, "same_query_other_block": 0, "other_query": 0, "total": 4}
    assert prof["by_k"][4]["same_block"] == pytest.approx(4 / 9)
    assert prof["by_k"][4]["total"] == pytest.approx(4 / 9)
    assert prof["tokens_by_k"][8]["total"] == 0


def test_overlapping_windows_merge() -> None:
    # windows at 1 and 2 repeat the one at 0 (overlapping earlier occurrences count): tokens 1..5
    assert counts(workload([call(0, 0, "aaaaaa")]), 4)["same_block"] == 5
    # two matched windows that overlap cover their union once
    assert counts(workload([call(0, 0, "abcde"), call(0, 1, "abcde")]), 4)["same_block"] == 5


def test_windows_never_cross_call_boundaries() -> None:
    # "abcd" exists only across the boundary of calls 0|1: the later "abcd" is not a repeat
    w = workload([call(0, 0, "12ab"), call(0, 1, "cd34"), call(0, 2, "abcd")])
    assert counts(w, 4)["total"] == 0
    # and an earlier "abcd" is not found by a later window spanning calls 1|2
    w = workload([call(0, 0, "abcd"), call(0, 1, "xxab"), call(0, 2, "cdyy")])
    assert counts(w, 4)["total"] == 0
    # same across queries
    w = workload([call(0, 0, "12ab")], [call(1, 0, "cd34")], [call(2, 0, "abcd")])
    assert counts(w, 4)["total"] == 0


def test_repeat_in_another_query() -> None:
    w = workload([call(0, 0, "abcdefgh")], [call(1, 0, "zzabcdefzz")])
    got = counts(w, 4)  # q1 windows abcd, bcde, cdef match query 0: tokens 2..7 of q1
    assert got == {"same_block": 0, "same_query_other_block": 0, "other_query": 6, "total": 6}
    assert repetition_profile(w, BYTES, ks=(4,))["by_k"][4]["other_query"] == pytest.approx(6 / 18)
    assert counts(w, 8)["total"] == 0  # "abcdefgh" does not occur in query 1


def test_repeat_in_same_query_other_block() -> None:
    # call 0: "abcd" inside <…> (block (0, 0)); call 1 repeats it outside every block
    w = workload([call(0, 0, "<abcd>", ANGLE), call(0, 1, "xabcdx", ANGLE)])
    assert counts(w, 4) == {"same_block": 0, "same_query_other_block": 4, "other_query": 0, "total": 4}
    # repeated inside a block again: same block ("<abc" at root both times, "abcd" and "bcd>" in <…>)
    w = workload([call(0, 0, "<abcd>", ANGLE), call(0, 1, "x<abcd>", ANGLE)])
    assert counts(w, 4) == {"same_block": 6, "same_query_other_block": 0, "other_query": 0, "total": 6}
    # a window's block is its first token's: "<abc" starts at root (the "<" token itself is outside)
    w = workload([call(0, 0, "<abc>", ANGLE), call(0, 1, "<abc", ANGLE)])
    assert counts(w, 4)["same_block"] == 4  # "<abc" both times, both starting at root
    # without a structure everything is one root block: the same repeat is same_block
    w = workload([call(0, 0, "<abcd>"), call(0, 1, "xabcdx")])
    assert counts(w, 4)["same_block"] == 4


def test_blocks_compare_by_delimiter_pair_across_structures() -> None:
    other = ((("[", "]"), ("<", ">")),)  # the same "<" ">" pair, now at (0, 1)
    w = workload([call(0, 0, "<abcd>", ANGLE), call(0, 1, "[x]<abcd>", other)])
    assert counts(w, 4)["same_block"] == 6
    w = workload([call(0, 0, "<abcd>", ANGLE), call(0, 1, "[abcd]", other)])
    assert counts(w, 4)["same_query_other_block"] == 4


def test_most_local_category_wins() -> None:
    # query 1: "abcd" repeats query 0 (other query); then "abcde" — its "abcd" repeats the
    # start of query 1 (same block) and its "bcde" only query 0 (other query).
    w = workload([call(0, 0, "abcde")], [call(1, 0, "abcdZabcde")])
    got = counts(w, 4)
    # q1 tokens 0..3 other_query; 5..8 same_block (also covered by "bcde"); 9 other_query
    assert got == {"same_block": 4, "same_query_other_block": 0, "other_query": 5, "total": 9}
    shares = repetition_profile(w, BYTES, ks=(4,))["by_k"][4]
    assert shares["same_block"] + shares["same_query_other_block"] + shares["other_query"] == pytest.approx(
        shares["total"]
    )


def test_trace_order_uses_seq_not_tuple_order() -> None:
    later, earlier = call(0, 1, "Xabcd"), call(0, 0, "abcdY")
    w = workload([later, earlier])  # tuple order is wrong on purpose; seq decides
    assert counts(w, 4)["same_block"] == 4
    prof = repetition_profile(w, BYTES, ks=(4,))
    assert prof["tokens_by_k"][4]["total"] == 4


def test_edge_cases() -> None:
    empty = Workload(meta=TraceMeta(tokenizer=None), queries=())
    prof = repetition_profile(empty, None)
    assert prof["output_tokens"] == 0 and prof["by_k"][4]["total"] == 0.0
    assert counts(workload([call(0, 0, "abc")]), 4)["total"] == 0  # shorter than k
    with pytest.raises(ValueError):
        repetition_profile(workload([call(0, 0, "abcd")]), BYTES, ks=(0,))
    with pytest.raises(ValueError, match="token_bytes"):
        repetition_profile(workload([call(0, 0, "<abcd>", ANGLE)]), None)
    assert repetition_profile(workload([call(0, 0, "abcdabcd")]), None, ks=(4,))["tokens_by_k"][4]["total"] == 4


def naive_profile(w: Workload, k: int) -> dict[str, int]:
    """Reference: windows in trace order against sets of earlier k-grams."""
    seen_any, seen_q, seen_qb = set(), set(), set()
    categories = {"same_block": [], "same_query_other_block": [], "other_query": []}
    offset = 0
    for qi, query in enumerate(w.queries):
        for c in sorted(query.calls, key=lambda c: c.seq):
            toks = c.output_tokens.tolist()
            pda = StructureAutomaton(c.structure)
            pairs = [None, *(p for g in c.structure for p in g)]
            blocks = []
            for t in toks:
                blocks.append(pairs[pda.block_index])
                pda.feed(BYTES[t])
            for p in range(len(toks) - k + 1):
                gram, b = tuple(toks[p : p + k]), blocks[p]
                if (qi, b, gram) in seen_qb:
                    categories["same_block"].append(offset + p)
                elif (qi, gram) in seen_q:
                    categories["same_query_other_block"].append(offset + p)
                elif gram in seen_any:
                    categories["other_query"].append(offset + p)
                seen_any.add(gram)
                seen_q.add((qi, gram))
                seen_qb.add((qi, b, gram))
            offset += len(toks)
    label: dict[int, int] = {}  # token -> most local category rank
    for rank, name in enumerate(categories):
        for s in categories[name]:
            for t in range(s, s + k):
                label[t] = min(label.get(t, rank), rank)
    out = {name: sum(1 for r in label.values() if r == rank) for rank, name in enumerate(categories)}
    out["total"] = len(label)
    return out


def test_matches_naive_reference_on_random_workloads() -> None:
    rng = random.Random(11)
    structures = [(), ANGLE, ((("[", "]"), ("<", ">")),)]
    for _ in range(40):
        queries = []
        for qi in range(rng.randrange(1, 4)):
            calls = []
            for seq in range(rng.randrange(1, 4)):
                text = "".join(rng.choice("ab<>[]") for _ in range(rng.randrange(0, 40)))
                calls.append(call(qi, seq, text, rng.choice(structures)))
            queries.append(calls)
        w = workload(*queries)
        prof = repetition_profile(w, BYTES, ks=(2, 3, 4, 8))
        for k in (2, 3, 4, 8):
            assert prof["tokens_by_k"][k] == naive_profile(w, k), k
