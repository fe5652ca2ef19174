"""The `suffix` drafter (vLLM 0.33 `method: "suffix"` = ArcticInference 0.3.0 `SuffixDecodingCache`).

Hand-computed cases pin the rule (docs/suffix-decoding.md works them out); each is also run
through the real library when it is installed. The differential tests drive our code and the real
library through the same operations — a randomized tree-level test with removals and tiny
vocabularies, and a replay of default-trace trajectories driven as vLLM drives it — and require
identical drafts at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from suffix_reference import VllmSuffixProposer, replay

from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.drafters.suffix.tree import SuffixForest
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.engine.request import CallState
from agentspec_sim.trace.bundled import default_trace_path
from agentspec_sim.trace.io import load_trace
from agentspec_sim.trace.schema import Call


def _has_arctic() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


ARCTIC = _has_arctic()

# --------------------------------------------------------------------------------------------
# A tiny scripted driver: steps of (call, tokens emitted) rows, in row order.

Script = list[list[tuple[str, int]]]


def _spec(**options):
    return parse_drafter({"method": "suffix", **options})


def run_ours(calls: dict[str, tuple[Sequence[int], Sequence[int]]], steps: Script, spec) -> dict:
    """Drive our drafter as the engine does; drafts by (step, call) for rows that go on."""
    from agentspec_sim.drafters.registry import make_drafter

    drafter = make_drafter(spec)
    states: dict[str, CallState] = {}
    for i, (name, (prompt, output)) in enumerate(calls.items()):
        c = Call(id=name, agent_id="a", query_id=name, seq=0, prompt_tokens=np.asarray(prompt, dtype=np.int32),
                 output_tokens=np.asarray(output, dtype=np.int32))
        states[name] = CallState(i, c, name, 0, i, len(output))
    drafts = {}
    for t, rows in enumerate(steps):
        go_on = []
        for name, e in rows:
            s = states[name]
            end = s.num_tokens
            s.history[end:end + e] = s.call.output_tokens[s.num_emitted:s.num_emitted + e]
            s.num_emitted += e
        for name, e in rows:
            s = states[name]
            if s.drafter_state is None:
                drafter.start_call(s)
            drafter.observe(s, s.history[s.num_tokens - e:s.num_tokens])
            if s.num_emitted == s.target_len:
                drafter.finish_call(s)
            else:
                go_on.append(name)
        out = drafter.propose([states[n] for n in go_on], np.full(len(go_on), spec.num_speculative_tokens))
        for name, d in zip(go_on, out, strict=True):
            drafts[(t, name)] = d.tolist()
    return drafts


def run_reference(calls: dict[str, tuple[Sequence[int], Sequence[int]]], steps: Script, spec) -> dict:
    from suffix_reference import reference_from_spec

    ref = reference_from_spec(spec)
    emitted = dict.fromkeys(calls, 0)
    drafts = {}
    for t, rows in enumerate(steps):
        ids, prompts, toks, sampled = [], [], [], []
        for name, e in rows:
            prompt, output = calls[name]
            n = emitted[name]
            emitted[name] = n + e
            ids.append(name)
            prompts.append(np.asarray(prompt, dtype=np.int32))
            toks.append(np.asarray(list(prompt) + list(output[:n + e]), dtype=np.int32))
            sampled.append(list(output[n:n + e]))
        out = ref.propose(ids, prompts, toks, sampled)
        for (name, _), d in zip(rows, out, strict=True):
            if emitted[name] < len(calls[name][1]):
                drafts[(t, name)] = d
    return drafts


def check(calls, steps, spec, expected: dict) -> None:
    ours = run_ours(calls, steps, spec)
    assert {key: ours[key] for key in expected} == expected
    if ARCTIC:
        theirs = run_reference(calls, steps, spec)
        assert theirs == ours


# --------------------------------------------------------------------------------------------
# Config


def test_config_defaults_and_validation():
    spec = _spec()
    assert spec.num_speculative_tokens == 24  # vLLM: defaults to the tree depth
    assert dict(spec.options) == {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                                  "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
    assert _spec(suffix_decoding_max_tree_depth=16).num_speculative_tokens == 16
    assert _spec(num_speculative_tokens=32).num_speculative_tokens == 32
    assert parse_drafter(_spec(num_speculative_tokens=32).to_json()) == _spec(num_speculative_tokens=32)
    for bad in ({"suffix_decoding_max_tree_depth": 0}, {"suffix_decoding_max_cached_requests": -1},
                {"suffix_decoding_max_spec_factor": -0.5}, {"suffix_decoding_min_token_prob": 1.5},
                {"num_speculative_tokens_per_batch_size": [[1, 8, 4]]}, {"prompt_lookup_max": 3}):
        with pytest.raises(SpecConfigError):
            _spec(**bad)


# --------------------------------------------------------------------------------------------
# Hand-computed cases (one call unless said; P = prompt, the first output token comes with the start)


def test_context_seen_once_drafts_with_probability_half():
    # P+out = 5 6 7 8 5 6 | 7. "7" occurs twice (the second is the context's own end), so its child
    # "8 5 6 7" has count 1 of 2: p = 1/2 for every token. m=3 ("5 6 7") drafts 3 tokens, score 1.5.
    forest = SuffixForest(24)
    root, seq = forest.new_tree(), forest.new_seq()
    forest.append(root, seq, np.array([5, 6, 7, 8, 5, 6, 7]))
    tokens, score = forest.speculate(root, np.array([5, 6, 7, 8, 5, 6, 7]), 24)
    assert tokens.tolist() == [8, 5, 6] and score == 1.5
    assert forest.speculate(root, np.array([5, 6, 7, 8, 5, 6, 7]), 24, min_prob=0.5)[0].tolist() == [8, 5, 6]
    assert forest.speculate(root, np.array([5, 6, 7, 8, 5, 6, 7]), 24, min_prob=0.51)[0].tolist() == []
    calls = {"a": ([5, 6, 7, 8, 5, 6], [7, 8, 5, 6])}
    check(calls, [[("a", 1)]], _spec(), {(0, "a"): [8, 5, 6]})
    check(calls, [[("a", 1)]], _spec(suffix_decoding_min_token_prob=0.51), {(0, "a"): []})


def test_budget_is_applied_inside_the_search():
    # P+out = 1 2 3 1 2 3 1 2 3 4 2 5 6 7 4 | 2. m=1 "2": children "3" (3) and "5…" (1) of 5 → [3] at 0.6.
    # m=2 "4 2": child "5 6 7 4 2" count 1 of 2 → [5, 6] at 0.5 each, score 1.0 (wins with k ≥ 2).
    # With k = 1 the m=2 draft is [5] (0.5) and m=1's [3] (0.6) wins: truncating [5, 6] would be wrong.
    calls = {"a": ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 2, 5, 6, 7, 4], [2, 9, 9])}
    check(calls, [[("a", 1)]], _spec(), {(0, "a"): [5, 6]})
    check(calls, [[("a", 1)]], _spec(num_speculative_tokens=1), {(0, "a"): [3]})
    # The factor: budget ⌊m·factor + 1e-6⌋; at factor 0.5, m=1 gets 0 and m=2 gets 1 token → [5].
    check(calls, [[("a", 1)]], _spec(suffix_decoding_max_spec_factor=0.5), {(0, "a"): [5]})
    # At factor 3, m=2 may draft 6 but the stored continuation ends after 5 tokens (score 2.5 beats m=1's
    # [3, 1, 2] at 0.6 + 0.4 + 0.4).
    check(calls, [[("a", 1)]], _spec(suffix_decoding_max_spec_factor=3.0), {(0, "a"): [5, 6, 7, 4, 2]})


def test_suffixes_are_stored_to_the_tree_depth():
    # P+out = 1 2 3 4 5 6 1 2 3 | 4. Depth 24: m=4 "1 2 3 4" → [5, 6, 1, 2]. Depth 4: the context is the last
    # 4 tokens (m ≤ 3) and each suffix keeps 4 tokens, so "2 3 4" continues only by "5" and "3 4" by "5 6".
    calls = {"a": ([1, 2, 3, 4, 5, 6, 1, 2, 3], [4, 9, 9])}
    check(calls, [[("a", 1)]], _spec(), {(0, "a"): [5, 6, 1, 2]})
    check(calls, [[("a", 1)]], _spec(suffix_decoding_max_tree_depth=4), {(0, "a"): [5, 6]})


def test_prompt_tree_wins_ties_with_the_global_tree():
    # Call x responds 8 12 60 (then finishes); call y's prompt holds "8 9". For y's context "… 71 8" both
    # trees score 0.5 (local: "8" → "9", global: "8" → "12", the "8" of y's own response counting too):
    # the prompt tree wins. When x's response holds "8 12" twice, the global tree scores 2/3 and wins.
    y = ([70, 8, 9, 71], [8, 5, 5])
    steps = [[("x", 1)], [("x", 2)], [("y", 1)]]
    check({"x": ([50, 51], [8, 12, 60]), "y": y}, steps, _spec(), {(2, "y"): [9]})
    steps = [[("x", 1)], [("x", 4)], [("y", 1)]]
    check({"x": ([50, 51], [8, 12, 8, 12, 60]), "y": y}, steps, _spec(), {(2, "y"): [12]})


def test_sibling_ties_follow_the_linked_list_rules():
    # Children of "0", counts after P: "1" 1, "2" 2, "3" 2. Creation order 1, 2, 3 (new → tail); "3"
    # reached 2 first, then "2": an increment of a node that does not head its run goes to the tail of
    # the next run, so the list is 3, 2, 1 and the draft is [3] (p = 2/6).
    check({"a": ([0, 1, 0, 2, 0, 3, 0, 3, 0, 2, 9], [0, 9])}, [[("a", 1)]], _spec(), {(0, "a"): [3]})
    # One more "0 1": "1" headed its run (count 1), so it goes to the head of the count-2 run: [1] (2/7).
    check({"a": ([0, 1, 0, 2, 0, 3, 0, 3, 0, 2, 0, 1, 9], [0, 9])}, [[("a", 1)]], _spec(), {(0, "a"): [1]})


def test_rows_see_tokens_of_earlier_rows_in_the_same_step():
    # Step 2: x appends 30 31 32, y appends 30. In row order x, y, y's draft sees x's new "30 31" in the
    # global tree; in row order y, x it does not.
    calls = {"x": ([1], [40, 30, 31, 32, 7, 7]), "y": ([2], [41, 30, 31, 7, 7])}
    check(calls, [[("x", 1), ("y", 1)], [("x", 3), ("y", 1)]], _spec(), {(1, "y"): [31]})
    check(calls, [[("x", 1), ("y", 1)], [("y", 1), ("x", 3)]], _spec(), {(1, "y"): []})


def test_a_call_absent_from_a_step_is_restarted():
    # vLLM stops a request missing from a step's batch; when it comes back its prompt tree is rebuilt from
    # the prompt alone and its cached response is dropped, so its earlier output "5 6" is forgotten.
    calls = {"a": ([1, 2, 3], [5, 6, 4, 5, 6, 9])}
    steps = [[("a", 1)], [("a", 1)], [("a", 1)], [("a", 1)]]
    check(calls, steps, _spec(), {(3, "a"): [6]})
    check(calls, [*steps[:3], [], steps[3]], _spec(), {(4, "a"): []})


def test_fifo_eviction_of_cached_responses():
    # Responses of x then y are cached; with max_cached_requests=1, starting y evicts x's response.
    calls = {"x": ([1], [7, 8, 9]), "y": ([2], [3, 3, 3]), "z": ([4], [7, 5, 5])}
    steps = [[("x", 1)], [("x", 2)], [("y", 1)], [("y", 2)], [("z", 1)]]
    check(calls, steps, _spec(), {(4, "z"): [8]})
    check(calls, steps, _spec(suffix_decoding_max_cached_requests=2), {(4, "z"): []})  # z's start evicts x
    check(calls, steps, _spec(suffix_decoding_max_cached_requests=0), {(4, "z"): []})


# --------------------------------------------------------------------------------------------
# Differential tests against the real library


@pytest.mark.extra("arctic-inference")
@pytest.mark.skipif(not ARCTIC, reason="arctic_inference not installed")
def test_tree_matches_the_cpp_tree_with_removals():
    pytest.importorskip("arctic_inference.suffix_decoding")
    from arctic_inference.suffix_decoding._C import SuffixTree

    rng = np.random.default_rng(7)
    compared = 0
    for _ in range(60):
        depth, vocab = int(rng.integers(1, 9)), int(rng.integers(2, 6))
        forest, ref = SuffixForest(depth, node_capacity=16, pool_capacity=16), SuffixTree(depth)
        root = forest.new_tree()
        seqs: dict[int, int] = {}
        tokens: dict[int, list[int]] = {}
        for _ in range(60):
            r = rng.random()
            if r < 0.5 or not seqs:
                sid = int(rng.integers(0, 6))
                if sid not in seqs:
                    seqs[sid], tokens[sid] = forest.new_seq(), []
                new = rng.integers(0, vocab, size=int(rng.integers(1, 6))).astype(np.int32)
                ref.extend(sid, new.tolist())
                forest.append(root, seqs[sid], new)
                tokens[sid] += new.tolist()
            elif r < 0.62:
                sid = int(rng.choice(list(seqs)))
                ref.remove(sid)
                forest.remove(root, seqs.pop(sid))
                del tokens[sid]
            else:
                if rng.random() < 0.5 and tokens:
                    src = tokens[int(rng.choice(list(tokens)))]
                    ctx = np.asarray([*src[-int(rng.integers(1, depth + 3)):], int(rng.integers(0, vocab))],
                                     dtype=np.int32)
                else:
                    ctx = rng.integers(0, vocab, size=int(rng.integers(1, depth + 3))).astype(np.int32)
                k = int(rng.integers(0, 10))
                factor, offset = float(rng.choice([0.5, 1.0, 1.7, 3.0])), float(rng.choice([0.0, 0.3, 1.0]))
                min_prob = float(rng.choice([0.0, 0.1, 0.3, 0.5]))
                d = ref.speculate(ctx.tolist(), k, factor, offset, min_prob, False)
                mine, score = forest.speculate(root, ctx, k, factor, offset, min_prob)
                assert mine.tolist() == list(d.token_ids)
                assert np.float32(score) == np.float32(d.score)
                compared += 1
            forest.check(root)
    assert compared > 1000



def test_child_table_follows_branching_through_appends_removals_frees_and_growth():
    # Only children of nodes with two or more children have table entries (an only child is read from
    # its parent's HEAD): nodes start and stop branching as suffixes are added and removed, trees are
    # freed, and the arena regrows (rehash) — the table must hold exactly those entries throughout.
    rng = np.random.default_rng(5)
    for _ in range(30):
        depth, vocab = int(rng.integers(1, 7)), int(rng.integers(2, 5))
        forest = SuffixForest(depth, node_capacity=4, pool_capacity=8)
        trees: dict[int, list[int]] = {}  # root → its live sequences
        for _ in range(80):
            r = rng.random()
            if r < 0.1 or not trees:
                trees[forest.new_tree()] = []
            elif r < 0.7:
                root = int(rng.choice(list(trees)))
                seqs = trees[root]
                if not seqs or rng.random() < 0.3:
                    seqs.append(forest.new_seq())
                forest.append(root, int(rng.choice(seqs)), rng.integers(0, vocab, size=int(rng.integers(1, 7))))
            elif r < 0.9:
                root = int(rng.choice(list(trees)))
                if trees[root]:
                    forest.remove(root, trees[root].pop(int(rng.integers(0, len(trees[root])))))
            else:
                root = int(rng.choice(list(trees)))
                seqs = trees.pop(root) or [forest.new_seq()]
                forest.free_trees([(root, seqs[0])])  # one entry per tree; its other sequences are let go
                for seq in seqs[1:]:
                    forest.release_seq(seq)
            forest.check_table()
            for root in trees:
                forest.check(root)


def _speculate_by_root_walks(forest: SuffixForest, root: int, ctx: np.ndarray, max_spec: int, factor: float,
                             min_prob: float) -> tuple[list[int], np.float32]:
    """The speculation rule read straight off the arrays: every match length walked from the root, no shortcut."""
    from agentspec_sim.drafters.suffix.tree import CNT, HEAD, LEN, RIDX, RSEQ, SOFF, child_node

    nd, pool = forest.nd, forest.pool

    def token(node: int, i: int) -> int:
        return int(pool[forest.sq[nd[node, RSEQ], SOFF] + nd[node, RIDX] + i])

    best, best_score = [], np.float32(0.0)
    for m in range(1, len(ctx)):
        node, idx = root, 0
        for t in ctx[len(ctx) - m:]:
            if idx == nd[node, LEN]:
                node, idx = int(child_node(nd, forest.ht, node, int(t))), 0
                if node < 0:
                    break
            if token(node, idx) != t:
                node = -1
                break
            idx += 1
        if node < 0:
            break
        budget = max(min(max_spec, int(np.float64(np.float32(m) * np.float32(factor)) + 1e-6)), 0)
        draft, prob, score = [], np.float32(1.0), np.float32(0.0)
        while len(draft) < budget and prob >= np.float32(min_prob):
            if idx < nd[node, LEN]:
                draft.append(token(node, idx))
                score += prob
                idx += 1
            elif nd[node, HEAD] >= 0:
                child = int(nd[node, HEAD])
                prob = prob * (np.float32(nd[child, CNT]) / np.float32(nd[node, CNT]))
                node, idx = child, 0
            else:
                break
        if score >= best_score:
            best, best_score = draft, score
    return best, best_score


def test_open_suffixes_and_the_depth_bound_leave_speculation_as_root_walks():
    # `_speculate_tree` reads the match of a context's last m tokens off a sequence's open suffixes when
    # the context ends with that sequence, and stops once depth − m is below the best score; both must
    # give what walking every match length from the root gives (contexts that agree with the sequence's
    # end, in part, or not at all; longer than the depth; sequences removed).
    rng = np.random.default_rng(11)
    compared = agreeing = 0
    for _ in range(80):
        depth, vocab = int(rng.integers(2, 10)), int(rng.integers(2, 5))
        forest = SuffixForest(depth, node_capacity=16, pool_capacity=16)
        root = forest.new_tree()
        tokens: dict[int, list[int]] = {}
        for _ in range(40):
            if rng.random() < 0.1 and len(tokens) > 1:
                seq = int(rng.choice(list(tokens)))
                forest.remove(root, seq)
                del tokens[seq]
                continue
            seq = int(rng.choice(list(tokens))) if tokens and rng.random() < 0.8 else forest.new_seq()
            new = rng.integers(0, vocab, size=int(rng.integers(1, 8))).astype(np.int32)
            forest.append(root, seq, new)
            tokens[seq] = tokens.get(seq, []) + new.tolist()
            for _ in range(3):
                ctx = np.asarray(tokens[seq][-int(rng.integers(1, depth + 4)):], dtype=np.int32)
                if rng.random() < 0.4:
                    ctx[int(rng.integers(0, len(ctx)))] = int(rng.integers(0, vocab + 1))
                k, factor = int(rng.integers(1, 12)), float(rng.choice([0.5, 1.0, 2.0]))
                min_prob = float(rng.choice([0.0, 0.1, 0.4]))
                want, want_score = _speculate_by_root_walks(forest, root, ctx, k, factor, min_prob)
                for via in (seq, -1):
                    got, score = forest.speculate(root, ctx, k, factor, 0.0, min_prob, seq=via)
                    assert (got.tolist(), np.float32(score)) == (want, want_score)
                compared += 1
                agreeing += int(np.array_equal(ctx[-2:], tokens[seq][-2:]))
    assert compared > 5000 and agreeing > 2000


TRACE_CASES = [
    # (speculative config, replay options)
    ({}, {}),
    ({"suffix_decoding_max_cached_requests": 3, "num_speculative_tokens": 32},
     {"p_skip": 0.03, "max_prefill_steps": 3, "max_think_steps": 3}),
    ({"suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_tree_depth": 8,
      "suffix_decoding_max_spec_factor": 2.5, "suffix_decoding_min_token_prob": 0.3, "num_speculative_tokens": 5},
     {"p_skip": 0.02, "max_model_len": 16_000}),
]


@pytest.fixture(scope="module")
def trace_queries():
    pytest.importorskip("arctic_inference.suffix_decoding")
    w = load_trace(default_trace_path())
    return [q.calls[:4] for q in w.queries[:5]]


@pytest.mark.extra("arctic-inference")
@pytest.mark.parametrize(("options", "replay_options"), TRACE_CASES)
def test_replay_matches_vllm_driving_the_real_library(trace_queries, options, replay_options):
    res = replay(trace_queries, _spec(**options), concurrency=3, seed=3, **replay_options)
    assert res.compared > 1000
    assert res.mismatches == []
    assert res.accepted > 0


def test_reference_helper_is_importable_without_the_library():
    assert VllmSuffixProposer.__doc__


# --------------------------------------------------------------------------------------------
# The engine drives the drafter as vLLM's V1 runner does (tests/suffix_reference.py::engine_replay)

# Queries of the default trace whose calls grow to a 4200-token max_model_len (truncated calls, steps
# where vLLM skips the proposer, a refused prompt), their first five calls each.
ENGINE_QUERIES = (18, 19, 25, 35, 37)
# max_num_seqs 3 with a small token budget and KV cache: chunked prefills, preemptions, running
# calls left out of a step (vLLM stops them in the suffix cache and restarts them later).
TIGHT = {"max_num_seqs": 3, "max_num_batched_tokens": 512, "max_model_len": 4200, "num_kv_blocks": 600,
         "arrival": "zero"}
ENGINE_CASES = [
    ({}, TIGHT),
    ({}, {"max_num_seqs": 2, "max_num_batched_tokens": 1024, "arrival": "zero"}),
    ({"suffix_decoding_max_cached_requests": 2, "suffix_decoding_max_tree_depth": 8,
      "suffix_decoding_max_spec_factor": 2.5, "num_speculative_tokens": 5}, {**TIGHT, "max_num_seqs": 4}),
]


@pytest.fixture(scope="module")
def engine_workload():
    from agentspec_sim.trace.schema import Query, Workload

    w = load_trace(default_trace_path())
    return Workload(w.meta, tuple(Query(q.agent_id, q.query_id, q.calls[:5])
                                  for q in (w.queries[i] for i in ENGINE_QUERIES)))


def _engine_replay(workload, options, engine, reference):
    from suffix_reference import engine_replay

    from agentspec_sim.engine.config import EngineConfig

    return engine_replay(workload, _spec(**options), EngineConfig(**engine), reference=reference)


def test_engine_proposes_every_step_vllm_runs_the_proposer(engine_workload):
    res = _engine_replay(engine_workload, {}, TIGHT, reference=False)
    assert res.problems == []
    assert res.proposer_steps + res.skipped_steps == res.steps
    # The case exercises what the driving is about: stops, skipped steps and their token-0 drafts.
    assert res.skipped_steps > 0 and res.zero_drafts > 0
    assert res.absent_active > 0 and res.preemptions > 0
    assert res.compared > 1000


def test_engine_replay_catches_the_generic_driving(engine_workload, monkeypatch):
    from agentspec_sim.drafters.suffix.rule import SuffixDrafter

    # Driven like the other drafters (propose only after steps that sampled, n-gram budget): wrong.
    # (The generic path does model the V1 runner's proposer skip near max_model_len; what it lacks
    # is the propose after every step.)
    monkeypatch.setattr(SuffixDrafter, "driven_per_step", False)
    res = _engine_replay(engine_workload, {}, TIGHT, reference=False)
    assert any("not once" in p for p in res.problems)  # steps with no propose


@pytest.mark.extra("arctic-inference")
@pytest.mark.parametrize(("options", "engine"), ENGINE_CASES)
def test_engine_run_matches_vllm_driving_the_real_library(engine_workload, options, engine):
    pytest.importorskip("arctic_inference.suffix_decoding")
    res = _engine_replay(engine_workload, options, engine, reference=True)
    assert res.problems == []
    assert res.compared > 1000 and res.nonempty > 500


def test_prompt_trees_are_kept_only_for_a_later_call_of_their_query(monkeypatch):
    # A finished call's prompt tree is kept while a later call of its query may extend it; the last call's
    # is freed. Three agent queries of three calls each, one at a time: every later call extends its
    # predecessor's tree, and at the end no tree is kept.
    from simhelpers import agent_query, config, workload

    from agentspec_sim.cost import build_cost_model
    from agentspec_sim.engine.config import resolve
    from agentspec_sim.engine.simulator import Simulator

    rng = np.random.default_rng(3)
    wl = workload(*(agent_query(rng, f"q{i}", 3) for i in range(3)))
    cfg = config(max_num_seqs=1)
    monkeypatch.setattr(Simulator, "draft_tables", False)  # the prompt trees themselves, not their table
    sim = Simulator(wl, parse_drafter("suffix"), cfg, resolve(cfg), build_cost_model("a100-80g", "qwen3-8b"))
    drafter = sim.drafters[0]
    taken = []
    take = drafter._take_tree
    drafter._take_tree = lambda *args: taken.append(take(*args)) or taken[-1]
    sim.run()
    assert sum(root >= 0 for root, _ in taken) == 6  # calls 2 and 3 of each query extend a kept tree
    assert not drafter.reuse and drafter.reuse_tokens == 0
