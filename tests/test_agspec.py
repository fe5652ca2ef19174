"""The `agspec` drafter: representations, the n-gram index, corpus order, the online controller, config,
and an end-to-end replay of the bundled coding-agent trace (lossless, deterministic)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from agentspec_sim.drafters.agspec.corpus_index import NGramIndex
from agentspec_sim.drafters.agspec.rule import (
    ALL_FORMS,
    AgSpecDrafter,
    AgSpecSettings,
    CapController,
    Retriever,
    addition_form,
    build_global_corpus,
    context_form,
    deletion_form,
    forms_for,
    json_form,
    prefix_lines,
    raw_form,
    represent,
)
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload, WorkspaceFile


def arr(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


class FakeState:
    """What the Drafter protocol lets a drafter read of a CallState (no engine involved)."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.call_id = call.id
        self.history = np.concatenate([call.prompt_tokens, call.output_tokens]).astype(np.int32)
        self.prompt_len = call.prompt_len
        self.num_emitted = 1
        self.drafter_state = None

    @property
    def tokens(self) -> np.ndarray:
        return self.history[:self.prompt_len + self.num_emitted]

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_emitted


def replay(drafter: AgSpecDrafter, call: Call, k: int = 64, caps: list | None = None) -> list[tuple[int, int]]:
    """Drive one call through the drafter as the engine does (greedy verification against the recording);
    returns (drafted, accepted) per decode step; `caps` collects the controller's cap after each step."""
    state = FakeState(call)
    drafter.start_call(state)
    drafter.observe(state, state.history[state.prompt_len:state.prompt_len + 1])
    steps = []
    n = call.output_len
    while state.num_emitted < n:
        (draft,) = drafter.propose([state], np.asarray([k]))
        assert draft.shape[0] <= k
        truth = state.history[state.num_tokens:state.prompt_len + n]
        a = 0
        while a < draft.shape[0] and a < truth.shape[0] and draft[a] == truth[a]:
            a += 1
        e = min(a + 1, n - state.num_emitted)
        steps.append((int(draft.shape[0]), a))
        state.num_emitted += e
        drafter.observe(state, state.history[state.num_tokens - e:state.num_tokens])
        if caps is not None:
            caps.append(state.drafter_state.ctl.cap)
    drafter.finish_call(state)
    return steps


def mkcall(prompt, output, *, query="q", seq=0, role=None, workspace=(), emission=None, agent="a") -> Call:
    return Call(id=f"{agent}/{query}/{seq}", agent_id=agent, query_id=query, seq=seq,
                prompt_tokens=np.asarray(prompt, dtype=np.int32), output_tokens=np.asarray(output, dtype=np.int32),
                role=role, workspace=tuple(workspace), emission=emission)


def agspec(**options) -> AgSpecDrafter:
    return AgSpecDrafter(parse_drafter({"method": "agspec", **options}))


# --------------------------------------------------------------------------------------------
# Representations


def test_line_prefix_forms_on_concrete_text():
    text = "def f(x):\n\n    return x\n"
    assert raw_form(text) == text
    assert context_form(text) == " def f(x):\n \n     return x\n"
    assert deletion_form(text) == "-def f(x):\n-\n-    return x\n"
    assert addition_form(text) == "+def f(x):\n+\n+    return x\n"
    # No final newline: none added; '\r' stays inside its line; '' stays ''.
    assert context_form("a\nb") == " a\n b"
    assert deletion_form("a\r\nb\r\n") == "-a\r\n-b\r\n"
    assert prefix_lines("", "-") == ""
    assert prefix_lines("\n", " ") == " \n"


def test_json_form_escapes_as_a_json_string_body():
    text = 'print("a\\tb")\n\tpath = "C:\\\\x" # café ✓\x01'
    escaped = json_form(text)
    assert escaped == json.dumps(text, ensure_ascii=False)[1:-1]
    assert escaped == 'print(\\"a\\\\tb\\")\\n\\tpath = \\"C:\\\\\\\\x\\" # café ✓\\u0001'
    assert json.loads(f'"{escaped}"') == text  # the body of a JSON string, exactly
    assert json_form("é", ensure_ascii=True) == "\\u00e9"
    assert represent(text, "json") == escaped
    with pytest.raises(ValueError, match="unknown representation"):
        represent(text, "yaml")


def test_forms_follow_the_emission():
    assert forms_for("raw") == ("raw",)
    assert forms_for("diff") == ("raw", "context", "deletion")
    assert forms_for("json") == ("raw", "json")
    assert forms_for(None) == ALL_FORMS == ("raw", "context", "deletion", "json")
    assert forms_for(None, when_absent="raw") == ("raw",)
    assert forms_for("raw", forms=("json",)) == ("json",)


# --------------------------------------------------------------------------------------------
# The n-gram index


def _brute_longest(ctx, docs, n, max_n, exclude=None, owners=None):
    """Longest suffix match (≥ n, ≤ max_n) with a next token in the same doc; ties → latest position."""
    best = (0, None)
    for di, d in enumerate(docs):
        if owners is not None and owners[di] == exclude:
            continue
        for e in range(len(d) - 1):
            m = 0
            while m < max_n and m <= e and m < len(ctx) and d[e - m] == ctx[-1 - m]:
                m += 1
            if m >= n and m >= best[0]:
                best = (m, tuple(d[e + 1:]))
    return best


def test_owned_index_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(200):
        docs = [rng.integers(0, 4, rng.integers(1, 30)).astype(np.int32) for _ in range(rng.integers(1, 4))]
        owners = list(range(len(docs)))
        ctx = rng.integers(0, 4, rng.integers(1, 12)).astype(np.int32)
        exclude = int(rng.integers(-1, len(docs)))
        index = NGramIndex.from_docs(docs, 2, owners)
        got, m = index.find(ctx, max_n=6, max_cand=10_000, exclude=exclude)
        want_m, want_cont = _brute_longest(ctx, docs, 2, 6, exclude, owners)
        assert m == want_m, trial
        if m:
            assert tuple(got) == want_cont, trial


def test_index_prefers_longest_then_newest_and_stops_at_documents():
    index = NGramIndex.from_docs([arr(1, 2, 3, 4, 5, 6, 7), arr(9, 2, 3, 4, 8)], 3, owners=[0, 1])
    cont, m = index.find(arr(0, 2, 3, 4))
    assert m == 3 and cont.tolist() == [8]  # a tie → the newest occurrence
    cont, m = index.find(arr(1, 2, 3, 4))
    assert m == 4 and cont.tolist() == [5, 6, 7]  # the longer match wins
    cont, m = index.find(arr(9, 2, 3, 4), exclude=1)
    assert m == 3 and cont.tolist() == [5, 6, 7]  # owner 1 excluded
    assert index.find(arr(5, 6, 7))[1] == 0  # the end of a document has no continuation
    assert index.find(arr(7, 9, 2))[1] == 0  # no match across two documents


def test_session_index_never_matches_the_context_itself():
    index = NGramIndex(2)
    tokens = arr(1, 2, 3, 1, 2)
    index.sync(tokens)
    cont, m = index.find(tokens)
    assert m == 2 and cont.tolist() == [3, 1, 2]
    index.sync(arr(5, 6))  # (a different buffer only to check no self-match: (5, 6) is the suffix)
    fresh = NGramIndex(2)
    fresh.sync(arr(5, 6))
    assert fresh.find(arr(5, 6))[1] == 0


# --------------------------------------------------------------------------------------------
# Workspace representations and corpus order (Qwen3 tokenizer, bundled)

SOURCE = ("def calculate_total(items):\n    total = 0\n    for item in items:\n"
          "        total += item.price * item.quantity\n    return round(total, 2)\n")
DIFF = ("--- a/cart.py\n+++ b/cart.py\n@@ -1,5 +1,5 @@\n def calculate_total(items):\n     total = 0\n"
        "     for item in items:\n         total += item.price * item.quantity\n-    return round(total, 2)\n"
        "+    return round(total, 4)\n")


@pytest.fixture(scope="module")
def tok():
    from agentspec_sim.trace.tokenizer import load_tokenizer

    return load_tokenizer("qwen3")


def _cut_after(tok, ids: np.ndarray, text: str) -> int:
    """The number of leading tokens of `ids` whose text ends with `text` (first such place)."""
    for i in range(1, ids.shape[0] + 1):
        if tok.decode(ids[:i]).endswith(text):
            return i
    raise AssertionError(f"{text!r} not found")


def test_diff_continuation_is_drafted_from_the_workspace_only_when_the_emission_is_diff(tok):
    prompt = tok.encode_batch(["Fix the rounding bug in cart.py; answer with a unified diff.\n"])[0]
    output = tok.encode_batch([DIFF])[0]
    cut = _cut_after(tok, output, " def calculate")
    context = np.concatenate([prompt, output[:cut]]).astype(np.int32)
    drafts = {}
    for emission in ("diff", "raw", None):
        call = mkcall(prompt, output, workspace=[WorkspaceFile("cart.py", SOURCE)], emission=emission)
        retriever = Retriever(AgSpecSettings())
        corpora = retriever.begin(call, context[:prompt.shape[0] + 1])
        drafts[emission] = retriever.draft(corpora, context, 16)
    draft, source = drafts["diff"]
    assert source == 1  # the workspace corpus
    assert draft.shape[0] == 16 and np.array_equal(draft, output[cut:cut + 16])
    assert tok.decode(draft).startswith("_total(items):\n     total = 0\n     for")
    assert drafts["raw"][0].shape[0] == 0  # the raw file never has ' def' at a line start
    assert np.array_equal(drafts[None][0], draft)  # no emission: every form is indexed


def test_diff_representations_save_steps_on_a_diff(tok):
    prompt = tok.encode_batch(["Fix the rounding bug in cart.py; answer with a unified diff.\n"])[0]
    output = tok.encode_batch([DIFF])[0]
    accepted, steps = {}, {}
    for emission in ("diff", "raw"):
        drafter = agspec(controller=False)
        call = mkcall(prompt, output, workspace=[WorkspaceFile("cart.py", SOURCE)], emission=emission)
        run = replay(drafter, call, k=16)
        accepted[emission], steps[emission] = sum(a for _, a in run), len(run)
    # Raw drafts break at every line start and pick up again mid-line; the diff forms run across lines.
    assert accepted["diff"] > accepted["raw"] > 0
    assert steps["diff"] < steps["raw"]


def test_corpora_are_queried_session_then_workspace_then_global(tok):
    def ids(text):
        return tok.encode_batch([text])[0]

    stem = "the quick brown fox jumps over"
    other = mkcall(ids("x"), ids(f"{stem} the global dog"), query="other")
    mine = mkcall(ids("x"), ids(f"{stem} my own future text"), query="mine")
    glob = build_global_corpus(Workload(TraceMeta(), (Query("a", "other", (other,)), Query("a", "mine", (mine,)))), 2)
    ctx_text = f"Remember: {stem}"

    def draft(prompt_text, files, corpora=("session", "workspace", "global"), select="first"):
        prompt = ids(prompt_text + "\n" + ctx_text)
        call = mkcall(prompt, ids(" z"), query="mine", workspace=[WorkspaceFile("f.txt", t) for t in files])
        retriever = Retriever(replace(AgSpecSettings(), corpora=corpora, select=select), glob)
        corpora_ = retriever.begin(call, prompt)
        d, src = retriever.draft(corpora_, prompt, 3)
        return tok.decode(d), src

    assert draft(f"{stem} the session cat", [f"{stem} the workspace bird"]) == (" the session cat", 0)
    assert draft("nothing here", [f"{stem} the workspace bird"]) == (" the workspace bird", 1)
    # The global corpus: another query's output, never this query's own ("my own future text").
    assert draft("nothing here", []) == (" the global dog", 2)
    assert draft(f"{stem} the session cat", [f"{stem} the workspace bird"],
                 corpora=("global", "workspace", "session")) == (" the global dog", 2)
    # select "longest": the workspace match is longer than the session's here.
    longer = f"Remember: {stem} the workspace bird"
    assert draft(f"{stem} the session cat", [longer], select="longest") == (" the workspace bird", 1)
    assert draft(f"{stem} the session cat", [longer], select="first") == (" the session cat", 0)


def test_representations_are_tokenized_once_per_distinct_content(tok, monkeypatch):
    calls = []
    real = type(tok).encode_batch

    def counting(self, texts):
        calls.append(len(texts))
        return real(self, texts)

    monkeypatch.setattr(type(tok), "encode_batch", counting)
    retriever = Retriever(AgSpecSettings())
    prompt = tok.encode_batch(["hello"])[0]
    calls.clear()
    files = [WorkspaceFile("a.py", SOURCE), WorkspaceFile("b.py", "x = 1\n")]
    retriever.begin(mkcall(prompt, prompt, workspace=files, emission="diff"), prompt)
    assert calls == [6]  # 2 files × (raw, context, deletion), in one batch
    retriever.begin(mkcall(prompt, prompt, workspace=files[::-1], emission="raw"), prompt)
    retriever.begin(mkcall(prompt, prompt, workspace=[WorkspaceFile("c.py", SOURCE)], emission="json"), prompt)
    assert calls == [6, 1]  # only SOURCE's JSON form is new (same content under another path is cached)


# --------------------------------------------------------------------------------------------
# Global corpus and drafter wiring


def test_workload_other_queries_needs_bind_workload_and_excludes_the_own_query():
    a = mkcall([1, 2, 5, 6, 7], [8, 0, 0], query="A")
    b = mkcall([9, 7], [8, 5, 6, 7, 8, 40, 41, 42], query="B")
    workload = Workload(TraceMeta(tokenizer=None), (Query("a", "A", (a,)), Query("a", "B", (b,))))
    drafter = agspec(global_corpus="workload-other-queries", tokenizer=None)
    with pytest.raises(SpecConfigError, match="bind_workload"):
        drafter.start_call(FakeState(a))
    drafter.bind_workload(workload)
    state_a, state_b = FakeState(a), FakeState(b)  # histories so far: 1 2 5 6 7 8 and 9 7 8
    for state in (state_a, state_b):
        drafter.start_call(state)
    draft_a, draft_b = drafter.propose([state_a, state_b], np.asarray([8, 8]))
    assert draft_a.tolist() == [40, 41, 42]  # from query B's output
    assert draft_b.shape[0] == 0  # B's own output (… 7 8 40 …) is not in B's global corpus


def test_configure_fills_defaults_and_rejects_bad_keys(tmp_path):
    spec = parse_drafter({"method": "agspec"})
    assert spec.num_speculative_tokens == 16
    opts = dict(spec.options)
    assert opts["min_match"] == 2 and opts["corpora"] == ("session", "workspace", "global")
    assert opts["global_corpus"] == "none" and opts["role_caps"] is None and opts["reject_streak"] == 2
    assert parse_drafter({"method": "agspec", "num_speculative_tokens": 32}).num_speculative_tokens == 32
    bad = [({"min_match": 0}, "min_match"), ({"max_match": 1, "min_match": 3}, "max_match"),
           ({"corpora": ["session", "disk"]}, "corpora"), ({"select": "best"}, "select"),
           ({"forms": ["raw", "yaml"]}, "forms"), ({"shrink_factor": 1.0}, "shrink_factor"),
           ({"global_corpus": str(tmp_path / "missing.jsonl")}, "no such trace"),
           ({"role_caps": str(tmp_path / "missing.json")}, "role_caps"), ({"rejection": "some"}, "rejection"),
           ({"num_speculative_tokens_per_batch_size": [[1, 8, 4]]}, "not supported"), ({"bogus": 1}, "unknown")]
    for options, message in bad:
        with pytest.raises(SpecConfigError, match=message):
            parse_drafter({"method": "agspec", **options})
    assert AgSpecDrafter.supports_batch_size_schedule is False


def test_session_index_reuse_across_calls_gives_the_drafts_of_a_fresh_index():
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 12, 300).astype(np.int32)
    calls = []
    for seq in range(3):
        out = np.concatenate([prompt[rng.integers(0, 250):][:30], rng.integers(0, 12, 10)]).astype(np.int32)
        calls.append(mkcall(prompt, out, seq=seq))
        prompt = np.concatenate([prompt, out, rng.integers(0, 12, 20)]).astype(np.int32)
    shared = agspec(tokenizer=None)
    reused = [replay(shared, c) for c in calls]
    fresh = [replay(agspec(tokenizer=None), c) for c in calls]
    assert reused == fresh
    assert len(shared.retriever.sessions) == 1  # one query, its latest session index kept


# --------------------------------------------------------------------------------------------
# The online controller


def test_controller_shrinks_after_repeated_rejections_and_grows_back():
    ctl = CapController(16, AgSpecSettings())
    trace = []
    # (drafted, accepted) verifications, scripted
    script = [(16, 0), (16, 0),  # two rejections in a row → halve to 8
              (8, 0), (8, 3), (8, 0),  # a partial acceptance breaks the streak: stays 8
              (8, 0),  # second consecutive rejection → 4
              (4, 4), (5, 5),  # fully accepted → +1 each: 5, 6
              (6, 0), (6, 0), (3, 0), (3, 0), (1, 0), (1, 0), (1, 0)]  # → 3 → 1 → floor 1
    for drafted, accepted in script:
        ctl.update(drafted, accepted)
        trace.append(ctl.allowance())
    assert trace == [16, 8, 8, 8, 8, 4, 5, 6, 6, 3, 3, 1, 1, 1, 1]
    for _ in range(30):
        ctl.update(1, 1)
    assert ctl.allowance() == 16  # grows back to the role cap, never above it


def test_controller_variants():
    settings = AgSpecSettings()
    any_token = CapController(8, replace(settings, rejection="any-token"))
    for step in [(8, 7), (8, 7)]:
        any_token.update(*step)
    assert any_token.allowance() == 4  # partly accepted drafts count as rejections
    probe = CapController(4, replace(settings, min_cap=0, probe_interval=3, reject_streak=1))
    for drafted in (4, 2, 1):
        probe.update(drafted, 0)
    assert [probe.allowance() for _ in range(6)] == [0, 0, 1, 0, 0, 1]  # cap 0: a 1-token probe every 3 steps
    probe.update(1, 1)
    assert probe.allowance() == 1  # an accepted probe grows the cap back
    off = CapController(8, replace(settings, controller=False))
    for _ in range(5):
        off.update(8, 0)
    assert off.allowance() == 8


def test_drafter_applies_the_controller_to_its_drafts():
    # The prompt holds a 10-token phrase; the output starts it three times and leaves it, then copies it.
    phrase = list(range(100, 110))
    prompt = [*phrase, 1, 2]
    output = [100, 101, 3, 100, 101, 4, 100, 101, 5, 100, 101, *range(102, 110), 7]
    caps: list[int] = []
    steps = replay(agspec(tokenizer=None, num_speculative_tokens=8), mkcall(prompt, output), k=8, caps=caps)
    drafted = [(d, a) for d, a in steps if d]
    # (100 101) → the prompt's 102…109 1 2 (8 tokens, rejected), then the newest occurrence's continuation
    # (3 100 101, rejected): two rejections halve the cap to 4; (4 100 101), (5 100 101) rejected → 2;
    # then the phrase is copied, each draft fully accepted (+1 each time); the last one (after 109) fails
    # once, which is not yet a streak.
    assert drafted == [(8, 0), (3, 0), (3, 0), (3, 0), (2, 2), (3, 3), (4, 0)]
    assert caps[-3:] == [3, 4, 4]
    assert max(caps) == 8 and min(caps) == 2


# --------------------------------------------------------------------------------------------
# End to end on the bundled coding-agent trace


@pytest.fixture(scope="module")
def default_subset():
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    workload = load_trace(default_trace_path())
    assert any(c.workspace for c in workload.calls) and any(c.emission for c in workload.calls)
    return replace(workload, queries=workload.queries[:2])


def test_simulate_default_trace_subset_is_lossless_and_deterministic(default_subset):
    import agentspec_sim
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.metrics import summarize

    config = EngineConfig(arrival="zero")
    runs = [agentspec_sim.simulate(default_subset, "agspec", config) for _ in range(2)]  # the engine checks lossless
    first, second = (summarize(r) for r in runs)
    assert first.accepted_tokens > 0 and first.rejection_rate is not None
    assert replace(first, wall_s=0.0) == replace(second, wall_s=0.0)
    assert runs[0].steps.equals(runs[1].steps)


def test_simulate_with_a_global_corpus_from_the_trace_itself(default_subset):
    """The bundled trace as global corpus: each query drafts from the other 251 queries' outputs only."""
    import agentspec_sim
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.metrics import summarize
    from agentspec_sim.trace.bundled import default_trace_path

    config = EngineConfig(arrival="zero")
    spec = {"method": "agspec", "global_corpus": str(default_trace_path())}
    with_global = summarize(agentspec_sim.simulate(default_subset, spec, config))
    without = summarize(agentspec_sim.simulate(default_subset, "agspec", config))
    assert with_global.drafted_tokens > without.drafted_tokens  # more positions find a match
