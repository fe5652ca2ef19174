"""agentspec+ (drafters/agentspec_plus/rule.py): corpora order and isolation, workspace representations,
the M(b) allocation and its replicate batch, the cap controller, every ablation switch through the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from simhelpers import ConstantCost, agent_query, config, workload

from agentspec_sim import simulate
from agentspec_sim.drafters.agentspec.allocation import batch_budget
from agentspec_sim.drafters.agentspec.rule import BatchBudget
from agentspec_sim.drafters.agentspec_plus.rule import AgentSpecPlusDrafter
from agentspec_sim.drafters.registry import make_drafter, parse_drafter
from agentspec_sim.engine.drafting import SpecConfigError
from agentspec_sim.engine.request import CallState
from agentspec_sim.engine.simulator import Simulator
from agentspec_sim.trace.schema import Call, WorkspaceFile
from agentspec_sim.trace.tokenizer import load_tokenizer

PY = ((("```python", "```"),),)
SWITCHES = [{"structure": False}, {"corpora": ["session", "global"]}, {"forms": ["raw"]},
            {"corpora": ["session", "workspace"]}, {"budget": "alpha"}, {"budget": "none"}, {"controller": False}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def plus(**options) -> AgentSpecPlusDrafter:
    """An agentspec+ that matches from 2 tokens, without budget or controller unless asked (retrieval tests)."""
    drafter = make_drafter(parse_drafter({"method": "agentspec+", "min_match_len": 2, "budget": "none",
                                          "controller": False, **options}))
    drafter.bind_cost_model(ConstantCost(ridge=100.0))
    return drafter


def mkcall(tok, cid, query, seq, prompt, output, structure=PY, **kw) -> Call:
    enc = tok.encode_batch([prompt, output])
    return Call(id=cid, agent_id="agent", query_id=query, seq=seq, prompt_tokens=enc[0], output_tokens=enc[1],
                structure=structure, **kw)


def drive(drafter, calls, k=16):
    """Run calls one after another, one token per step; the draft proposed before each output token."""
    drafts = {}
    for i, call in enumerate(calls):
        st = CallState(i, call, call.id, 0, i, call.output_len)
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
    ids = call.output_tokens.tolist()
    for t in range(1, len(ids)):
        if tok.decode(ids[:t]) == text:
            return tok.decode(drafts[call.id][t - 1])
    raise AssertionError(f"{text!r} is not a token-aligned prefix of the output")


# --------------------------------------------------------------------------------------------
# Config


def test_shorthand_and_defaults():
    spec = parse_drafter("agentspec+")
    opts = dict(spec.options)
    assert spec.num_speculative_tokens == 32 and spec.label == "agentspec+"
    assert opts["budget"] == "token_budget" and opts["structure"] is True and opts["controller"] is True
    assert opts["corpora"] == ("session", "workspace", "global") and opts["forms"] == "emission"
    assert json.loads(json.dumps(spec.to_json()))["corpora"] == ["session", "workspace", "global"]


@pytest.mark.parametrize("bad", [{"structure": "no"}, {"corpora": []}, {"corpora": ["session", "session"]},
                                 {"corpora": ["web"]}, {"forms": ["diff"]}, {"budget": "nope"}, {"controller": 1},
                                 {"min_match_len": 4, "max_match_len": 2}, {"g_min": 2}, {"role_caps": "/no/such"},
                                 {"prompt_lookup_min": 2}])
def test_bad_switches_are_refused(bad):
    with pytest.raises(SpecConfigError):
        parse_drafter({"method": "agentspec+", **bad})


# --------------------------------------------------------------------------------------------
# Corpora


def test_session_first_then_global_from_finished_calls_of_other_queries(tok):
    code = "```python\nresult = merge_sorted(left, right)\n```"
    first = mkcall(tok, "c0", "q1", 0, "Task one.", code)
    other = mkcall(tok, "c1", "q2", 0, "Task two.", code)
    drafter = plus()
    drafts = drive(drafter, [first, other])
    assert draft_after(tok, other, drafts, "```python\nresult = merge").startswith("_sorted(left, right)")
    assert drafter.source_counts[2] > 0  # the global history drafted it (q2's session had nothing)
    # without the global corpus, AgentSpec's query isolation holds
    drafts = drive(plus(corpora=["session", "workspace"]), [first, other])
    assert draft_after(tok, other, drafts, "```python\nresult = merge") == ""


def test_global_history_is_structure_isolated(tok):
    first = mkcall(tok, "b0", "q1", 0, "Task one.", "```python\nvalue = scale_all(data_points)\n```")
    prose = mkcall(tok, "b1", "q2", 0, "Task two.", "Now value = scale_all(data_points) holds.")
    drafts = drive(plus(), [first, prose])
    assert draft_after(tok, prose, drafts, "Now value = scale") == ""  # python block text, drafted in prose: no
    drafts = drive(plus(structure=False), [first, prose])
    assert draft_after(tok, prose, drafts, "Now value = scale").startswith("_all(data_points)")


def test_the_running_call_is_not_in_the_global_history(tok):
    # Two calls of different queries at once: neither finished, so neither drafts from the other.
    code = "```python\nanswer = combine_parts(alpha, beta)\n```"
    a, b = mkcall(tok, "a", "q1", 0, "One.", code), mkcall(tok, "b", "q2", 0, "Two.", code)
    drafter = plus()
    states = [CallState(i, c, c.id, 0, i, c.output_len) for i, c in enumerate((a, b))]
    proposals = []
    for t in range(a.output_len):
        if t:
            proposals.extend(d.tolist() for d in drafter.propose(states, np.array([16, 16])))
        for st, c in zip(states, (a, b), strict=True):
            st.history[st.prompt_len + t] = c.output_tokens[t]
            st.num_emitted = t + 1
            if t == 0:
                drafter.start_call(st)
            drafter.observe(st, st.history[st.prompt_len + t:st.prompt_len + t + 1])
    assert drafter.source_counts[2] == 0


SOURCE = ("def calculate_total(items):\n    total = 0\n    for item in items:\n"
          "        total += item.price * item.quantity\n    return round(total, 2)\n")
DIFF = ("--- a/cart.py\n+++ b/cart.py\n@@ -1,5 +1,5 @@\n def calculate_total(items):\n     total = 0\n"
        "     for item in items:\n         total += item.price * item.quantity\n-    return round(total, 2)\n"
        "+    return round(total, 4)\n")


def test_workspace_diff_forms_draft_only_with_multi_representation(tok):
    call = mkcall(tok, "w", "q", 0, "Fix the rounding bug in cart.py; answer with a unified diff.\n", DIFF,
                  structure=(), workspace=(WorkspaceFile("cart.py", SOURCE),), emission="diff")
    drafter = plus()
    drafts = drive(drafter, [call])
    assert draft_after(tok, call, drafts, DIFF.split(" def calculate")[0] + " def calculate").startswith(
        "_total(items):\n     total = 0")
    assert drafter.source_counts[1] > 0
    raw = plus(forms=["raw"])
    drafts = drive(raw, [call])
    assert draft_after(tok, call, drafts, DIFF.split(" def calculate")[0] + " def calculate") == ""
    assert raw.source_counts[1] < drafter.source_counts[1]
    off = plus(corpora=["session", "global"])
    drive(off, [call])
    assert off.source_counts[1] == 0


# --------------------------------------------------------------------------------------------
# Budget and caps


def _rows(tok, drafter, n):
    """n calls of one query each, every one having seen the same python line twice (session candidates)."""
    code = "```python\nx = alpha_beta(gamma)\nx = alpha_beta(gamma)\nx = alpha_"
    states = []
    for i in range(n):
        call = mkcall(tok, f"r{i}", f"q{i}", 0, "Go.", code + "beta(gamma)\n```")
        st = CallState(i, call, call.id, 0, i, call.output_len)
        cut = len(tok.encode_batch([code])[0])
        st.history[st.prompt_len:st.prompt_len + cut] = call.output_tokens[:cut]
        st.num_emitted = 1
        drafter.start_call(st)
        drafter.observe(st, st.history[st.prompt_len:st.prompt_len + 1])
        st.num_emitted = cut
        drafter.observe(st, st.history[st.prompt_len + 1:st.prompt_len + cut])
        states.append(st)
    return states


def test_token_budget_allocates_m_of_b_over_the_whole_step(tok):
    drafter = plus(budget="token_budget", controller=True, max_match_len=3)  # both earlier lines match: n = 2
    drafter.bind_cost_model(ConstantCost(ridge=13.0))
    rows = _rows(tok, drafter, 3)
    drafter.propose(rows, np.full(3, 32))
    meta, lengths, source = drafter.last
    assert (source == 0).all() and (meta[:, 0] == 2).all() and (meta[:, 2] > 0).all()
    # M(3) = 10 split over three equal rows: 4, 3, 3 (largest remainder, ties to the earlier row); CT* ≥ that
    expected = np.maximum(meta[:, 2], [4, 3, 3])
    assert lengths.tolist() == np.minimum(expected, meta[:, 3]).tolist()
    drafter.begin_step(9)  # replicate: 9 rows draft in the step, 3 of them this tenant's → ⌊M(9)·3/9⌋ = 1
    drafter.propose(rows, np.full(3, 32))
    assert drafter.last[1].tolist() == np.minimum(np.maximum(meta[:, 2], [1, 0, 0]), meta[:, 3]).tolist()


def test_fixed_k_drafts_the_plurality_path_and_caps_bind(tok):
    drafter = plus(budget="none", max_match_len=3)
    rows = _rows(tok, drafter, 2)
    drafts = drafter.propose(rows, np.array([32, 2]))
    meta, lengths, _ = drafter.last
    assert lengths[0] == meta[0, 3] and lengths[1] == 2 and drafts[1].shape[0] == 2


def test_role_caps_and_the_controller(tok, tmp_path):
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({"version": 1, "caps": {"coder": 2}, "default": 0}))
    drafter = plus(role_caps=str(caps), controller=True)
    call = mkcall(tok, "z", "q", 0, "x = alpha_beta(gamma)\n", "x = alpha_beta(gamma)\n", structure=(), role="coder")
    drafts = drive(drafter, [call])["z"]
    assert max(len(d) for d in drafts) == 2  # the role's cap
    other = mkcall(tok, "y", "q", 0, "x = alpha_beta(gamma)\n", "x = alpha_beta(gamma)\n", structure=())
    assert not any(drive(plus(role_caps=str(caps)), [other])["y"])  # no role → default cap 0: no drafts


# --------------------------------------------------------------------------------------------
# Through the engine


def small_workload(seed=1):
    rng = np.random.default_rng(seed)
    return workload(*[agent_query(rng, f"q{i}", 3, vocab=8, out_len=30) for i in range(4)])


@pytest.mark.parametrize("switch", [{}, *SWITCHES], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "full")
def test_every_switch_drafts_losslessly_and_deterministically(switch):
    spec = parse_drafter({"method": "agentspec+", **switch})
    wl = small_workload()
    a = simulate(wl, spec, config(seed=3), ConstantCost())  # the engine checks every output
    b = simulate(wl, spec, config(seed=3), ConstantCost())
    assert (a.calls["status"] == "finished").all()
    assert int(a.calls["accepted"].sum()) > 0
    assert a.steps.equals(b.steps) and a.calls.equals(b.calls)


@pytest.mark.parametrize("method", ["agentspec", "agentspec+"])
def test_replicate_budget_uses_the_whole_steps_drafting_batch(method, monkeypatch):
    """With --replicate each tenant's drafter proposes its own rows; B_t must be sized by all rows
    drafting in the step (begin_step), each tenant taking its rows' share."""
    calls = []
    original = BatchBudget.batch_share

    def spy(self, rows):
        step = self._step_rows
        share = original(self, rows)
        calls.append((id(self), step, rows, share))
        return share

    monkeypatch.setattr(BatchBudget, "batch_share", spy)
    # The drafters' own propose (tests/test_draft_tables.py holds the compiled table path, which splits the budget
    # the same way, to it).
    monkeypatch.setattr(Simulator, "draft_tables", False)
    spec = parse_drafter({"method": method, "budget": "alpha", "alpha": 240})
    result = simulate(small_workload(4), spec, config(replicate=3, max_num_seqs=12), ConstantCost())
    assert (result.calls["status"] == "finished").all()
    assert calls and all(step is not None and step >= rows for _, step, rows, _ in calls)
    # Consecutive proposes of one step: their rows add up to the step's count, one per tenant.
    i, multi = 0, 0
    while i < len(calls):
        step, total, tenants = calls[i][1], 0, set()
        while total < step:
            assert calls[i][1] == step and calls[i][0] not in tenants
            tenants.add(calls[i][0])
            total += calls[i][2]
            i += 1
        assert total == step
        multi += len(tenants) > 1
    assert multi > 0
    for _, step, rows, share in calls:
        assert share == (batch_budget(240, step) * rows // step, step)  # (B_t share, the step's bz)


def test_select_by_redundancy_prefers_the_corpus_with_more_agreeing_candidates(tok):
    shared = "```python\nfoo = bar_baz(qux)\n```"
    done = [mkcall(tok, f"g{i}", f"q{i}", 0, "Task.", shared) for i in range(3)]  # global: 3 agreeing
    mine = mkcall(tok, "m", "q9", 0, "Task.", "```python\nfoo = bar_zzz(1)\nfoo = bar_baz(qux)\n```")  # session: 1
    drafts = drive(plus(), [*done, mine])
    assert draft_after(tok, mine, drafts, "```python\nfoo = bar_zzz(1)\nfoo = bar").startswith("_baz(qux)")
    drafts = drive(plus(select="priority"), [*done, mine])
    assert draft_after(tok, mine, drafts, "```python\nfoo = bar_zzz(1)\nfoo = bar").startswith("_zzz(1)")


def test_short_matches_draft_only_from_the_budget_share(tok):
    # Matches of 2 tokens (max_match_len 2) with 2 agreeing candidates: CT* exists, but with
    # ct_min_match 3 it is not drafted beyond the budget, and M(1) = 0 here.
    for ct_min, drafts_ct in ((3, False), (2, True)):
        drafter = plus(budget="token_budget", max_match_len=2, ct_min_match=ct_min)
        drafter.bind_cost_model(ConstantCost(ridge=1.0))
        rows = _rows(tok, drafter, 1)
        drafter.propose(rows, np.array([32]))
        meta, lengths, _ = drafter.last
        assert meta[0, 0] == 2 and meta[0, 2] > 0 and meta[0, 4] == 2
        assert (lengths[0] > 0) == drafts_ct
