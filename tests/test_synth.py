"""trace/synth.py and `agentspec-sim synth`: resampled traces keep per-query shapes, are deterministic,
share no text across copies of one query, and replay per query exactly like the real queries."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest
from simhelpers import ConstantCost
from typer.testing import CliRunner

from agentspec_sim import EngineConfig, simulate
from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace, write_trace
from agentspec_sim.trace.schema import Workload
from agentspec_sim.trace.synth import draw, relabelling, synthesize, vocabulary, vocabulary_for


@pytest.fixture(scope="module")
def reflexion() -> Workload:
    w = load_trace(bundled_trace("reflexion.jsonl.zst"))
    return replace(w, queries=w.queries[:12])


@pytest.fixture(scope="module")
def vocab(reflexion):
    return vocabulary_for(reflexion)


def by_origin(w: Workload, generation: int) -> Workload:
    """The queries of one generation, in the real trace's order (ids '<real>~<generation>')."""
    qs = [q for q in w.queries if q.calls[0].extra["synth"]["generation"] == generation]
    return replace(w, queries=tuple(sorted(qs, key=lambda q: q.calls[0].extra["synth"]["of"])))


def test_draw_counts_whole_queries_in_generations(reflexion):
    picks = draw(reflexion, queries=30, seed=4)
    assert len(picks) == 30
    assert [g for g, _ in picks] == [0] * 12 + [1] * 12 + [2] * 6
    assert sorted(i for g, i in picks if g == 1) == list(range(12))  # each real query once per generation
    sizes = [q.output_tokens for q in reflexion.queries]
    picks = draw(reflexion, output_tokens=5000, seed=4)
    total = sum(sizes[i] for _, i in picks)
    assert total >= 5000 > total - sizes[picks[-1][1]]
    assert draw(reflexion, queries=30, seed=4) == draw(reflexion, queries=30, seed=4)
    assert draw(reflexion, queries=30, seed=5) != draw(reflexion, queries=30, seed=4)
    with pytest.raises(ValueError, match="exactly one"):
        draw(reflexion, queries=3, output_tokens=3)


def test_copies_keep_shapes_and_relabel_by_a_bijection(reflexion, vocab):
    w = synthesize(reflexion, queries=36, seed=1, vocab=vocab)
    assert len({q.query_id for q in w.queries}) == 36
    assert len({c.id for q in w.queries for c in q.calls}) == w.num_calls
    real = {c.id: c for q in reflexion.queries for c in q.calls}
    for q in w.queries:
        for c in q.calls:
            src = real[c.extra["synth"]["of"]]
            assert (c.prompt_len, c.output_len, c.role, c.structure, c.seq) == (src.prompt_len, src.output_len,
                                                                                src.role, src.structure, src.seq)
            if c.extra["synth"]["generation"] == 0:
                assert np.array_equal(c.output_tokens, src.output_tokens)
    # Generation g relabels through one permutation that fixes special and delimiter tokens.
    for g in (1, 2):
        pairs = [(real[c.extra["synth"]["of"]], c) for q in by_origin(w, g).queries for c in q.calls]
        src = np.concatenate([np.concatenate([s.prompt_tokens, s.output_tokens]) for s, _ in pairs])
        dst = np.concatenate([np.concatenate([c.prompt_tokens, c.output_tokens]) for _, c in pairs])
        mapping = {}
        for a, b in zip(src.tolist(), dst.tolist(), strict=True):
            assert mapping.setdefault(a, b) == b
        assert len(set(mapping.values())) == len(mapping)  # injective
        assert all(mapping[a] == a for a in mapping if vocab.fixed[a])
        moved = [a for a in mapping if not vocab.fixed[a]]
        assert sum(mapping[a] != a for a in moved) > 0.95 * len(moved)


def test_copies_share_no_text_across_generations(reflexion, vocab):
    # A copy's 8-grams made of relabelled tokens never occur in the real query it copies.
    w = synthesize(reflexion, queries=24, seed=2, vocab=vocab)
    real = {q.query_id: q for q in reflexion.queries}
    for q in by_origin(w, 1).queries:
        src = real[q.query_id.rsplit("~", 1)[0]]
        grams = {tuple(c.output_tokens[i:i + 8].tolist()) for c in src.calls for i in range(c.output_len - 7)}
        shared = [i for c in q.calls for i in range(c.output_len - 7)
                  if tuple(c.output_tokens[i:i + 8].tolist()) in grams
                  and not vocab.fixed[c.output_tokens[i:i + 8]].all()]
        assert not shared


def test_same_seed_same_trace_and_file_round_trip(reflexion, vocab, tmp_path):
    a = synthesize(reflexion, output_tokens=8000, seed=7, vocab=vocab)
    b = synthesize(reflexion, output_tokens=8000, seed=7, vocab=vocab)
    assert a.queries == b.queries
    c = synthesize(reflexion, output_tokens=8000, seed=8, vocab=vocab)
    assert a.queries != c.queries
    write_trace(a, tmp_path / "a.jsonl.zst")
    write_trace(b, tmp_path / "b.jsonl.zst")
    assert (tmp_path / "a.jsonl.zst").read_bytes() == (tmp_path / "b.jsonl.zst").read_bytes()
    assert load_trace(tmp_path / "a.jsonl.zst", cache=False).queries == a.queries


def test_delta_form_chains_survive(vocab):
    coding = load_trace(bundled_trace("default.jsonl.zst"))
    small = replace(coding, queries=coding.queries[:2])
    w = synthesize(small, queries=4, seed=0, vocab=vocab)
    for q in w.queries:
        calls = {c.id: c for c in q.calls}
        extended = [c for c in q.calls if c.prompt_extends]
        assert extended
        for c in extended:
            parent = calls[c.prompt_extends]
            shared = parent.prompt_len + parent.output_len
            assert np.array_equal(c.prompt_tokens[:shared], np.concatenate([parent.prompt_tokens,
                                                                            parent.output_tokens]))


def test_relabelled_copies_replay_like_the_real_queries(reflexion, vocab):
    # agentspec keys its state per query and reads structure through token bytes: a relabelled copy
    # must draft and accept exactly as the real query does (same delimiters, same blocks, same n-grams).
    w = synthesize(reflexion, queries=24, seed=3, vocab=vocab)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=8192, num_kv_blocks=4096,
                          block_size=16, arrival="zero")
    cols = ["prompt_len", "output_len", "drafted", "accepted", "draft_steps"]
    runs = [simulate(by_origin(w, g), "agentspec", config, ConstantCost()).calls.select(cols) for g in (0, 1)]
    assert runs[0]["accepted"].sum() > 0
    assert runs[0].equals(runs[1])


def test_vocabulary_fixes_tokens_that_touch_delimiters():
    table = [b"```", b"``", b"python", b"py", b"thon", b"hello", b"on the", b"n", b"`x", b"x`", b"", b"<|im_end|>"]
    v = vocabulary(table, [11], [b"```python", b"```"], len(table))
    assert v.fixed.tolist() == [True, True, True, True, True, False, True, True, True, True, True, True]
    perm = relabelling(vocabulary(table, [], [], len(table)), np.random.default_rng(0))
    assert sorted(perm.tolist()) == list(range(len(table)))


def test_cli_writes_a_trace(tmp_path):
    out = tmp_path / "s.jsonl.zst"
    result = CliRunner().invoke(app, ["synth", "--like", str(bundled_trace("reflexion.jsonl.zst")), "--queries", "5",
                                      "--seed", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    w = load_trace(out, cache=False)
    assert len(w.queries) == 5 and all(q.query_id.endswith("~0") for q in w.queries)


@pytest.mark.parametrize(("args", "message"), [
    (["--queries", "0"], "--queries: must be ≥ 1"),
    (["--queries", "2", "--output-tokens", "5"], "give exactly one"),
    ([], "give exactly one"),
    (["--queries", "2", "--seed", "-1"], "--seed"),
])
def test_bad_options_are_one_error_line(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", "synth", *args, "-o", str(tmp_path / "x.jsonl")])
    assert run_guarded(app) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
