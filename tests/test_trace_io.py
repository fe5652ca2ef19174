"""Loading, the delta form, chat rendering, round trips, compression and the load cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agentspec_sim.trace.io import load_trace, parse_records, parse_structure, write_records, write_trace
from agentspec_sim.trace.tokenizer import load_tokenizer

TOKEN_META = {"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 1000}


def records_of(*records):
    return list(enumerate(records, start=1))


def test_delta_form_expands_to_full_prompt_and_shares_storage():
    w = parse_records(records_of(
        TOKEN_META,
        {"type": "call", "id": "a", "agent_id": 1, "query_id": 1, "seq": 0, "prompt_tokens": [1, 2, 3],
         "output_tokens": [4, 5]},
        {"type": "call", "id": "b", "agent_id": 1, "query_id": 1, "seq": 1, "prompt_extends": "a",
         "prompt_append_tokens": [6], "output_tokens": [7]},
        {"type": "call", "id": "c", "agent_id": 1, "query_id": 1, "seq": 2, "prompt_extends": "a",
         "prompt_append_tokens": [8, 9], "output_tokens": [10]},  # branches off a, not b
    ))
    a, b, c = w.calls
    assert b.prompt_tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert c.prompt_tokens.tolist() == [1, 2, 3, 4, 5, 8, 9]
    assert b.output_tokens.dtype == np.int32
    assert np.shares_memory(a.prompt_tokens, b.prompt_tokens)  # chain stored once
    assert w.prompt_tokens == 3 + 6 + 7 and w.output_tokens == 4


def test_calls_ordered_by_seq_and_queries_by_first_appearance():
    w = parse_records(records_of(
        TOKEN_META,
        {"type": "call", "id": "q2-0", "agent_id": "x", "query_id": "q2", "seq": 0, "prompt_tokens": [1],
         "output_tokens": [2]},
        {"type": "call", "id": "q1-1", "agent_id": "x", "query_id": "q1", "seq": 1, "prompt_tokens": [1],
         "output_tokens": [2]},
        {"type": "call", "id": "q1-0", "agent_id": "x", "query_id": "q1", "seq": 0, "prompt_tokens": [1],
         "output_tokens": [2]},
    ))
    assert [q.query_id for q in w.queries] == ["q2", "q1"]
    assert [c.id for c in w.queries[1].calls] == ["q1-0", "q1-1"]


def test_messages_append_equals_rendering_the_whole_conversation():
    tok = load_tokenizer("qwen3")
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."}]
    reply = "THOUGHT: look\n```bash\nls\n```"
    observation = [{"role": "user", "content": "<returncode>0</returncode>\nsetup.py"}]
    w = parse_records(records_of(
        {"type": "meta", "version": 1, "tokenizer": "qwen3"},
        {"type": "call", "id": "a", "agent_id": 1, "query_id": 1, "seq": 0, "messages": msgs,
         "output": reply + "<|im_end|>"},
        {"type": "call", "id": "b", "agent_id": 1, "query_id": 1, "seq": 1, "prompt_extends": "a",
         "messages_append": observation, "output": "done<|im_end|>"},
    ))
    full = tok.render_chat([*msgs, {"role": "assistant", "content": reply}, *observation])
    assert w.calls[1].prompt_tokens.tolist() == tok.encode_batch([full])[0].tolist()
    assert w.calls[1].prompt_extends == "a"
    assert w.calls[0].output_tokens[-1] == tok.eot_id


def test_workspace_is_cumulative_on_calls():
    w = parse_records(records_of(
        TOKEN_META,
        {"type": "call", "id": "a", "agent_id": 1, "query_id": 1, "seq": 0, "prompt_tokens": [1],
         "output_tokens": [2], "workspace": [{"path": "x.py", "content": "1"}]},
        {"type": "call", "id": "b", "agent_id": 1, "query_id": 1, "seq": 1, "prompt_tokens": [1],
         "output_tokens": [2], "workspace": [{"path": "y.py", "content": "2"}, {"path": "x.py", "content": "3"}]},
    ))
    assert [(f.path, f.content) for f in w.calls[1].workspace] == [("y.py", "2"), ("x.py", "3")]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.zst"])
def test_round_trip_is_identical(tmp_path, suffix):
    src = tmp_path / "src.jsonl"
    write_records([
        {"type": "meta", "version": 1, "tokenizer": "qwen3", "model": "m", "workload": "w"},
        {"type": "call", "id": "a", "agent_id": 1, "query_id": "q", "seq": 0, "role": "coder",
         "messages": [{"role": "user", "content": "hi"}], "output": "```python\nx = 1\n```<|im_end|>",
         "structure": "[[('```python', '```')], [('$', '$')]]", "emission": "raw", "arrival_s": 1.5,
         "workspace": [{"path": "a.py", "content": "x = 0\n"}], "extra": {"k": [1, 2]}},
        {"type": "call", "id": "b", "agent_id": 1, "query_id": "q", "seq": 1, "prompt_extends": "a",
         "prompt_append": "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", "output": "ok<|im_end|>",
         "think_s": 0.25},
    ], src)
    first = load_trace(src, cache=False)
    out = tmp_path / f"out{suffix}"
    write_trace(first, out)
    second = load_trace(out, cache=False)
    assert second == first
    assert second.calls[1].prompt_extends == "a"
    again = tmp_path / f"again{suffix}"
    write_trace(second, again)
    assert out.read_bytes() == again.read_bytes()  # deterministic bytes, compressed or not


def test_structure_forms():
    grouped = [[["```python", "```"], ["<tool_call>", "</tool_call>"]], [["$$", "$$"]]]
    assert parse_structure(grouped) == ((("```python", "```"), ("<tool_call>", "</tool_call>")), (("$$", "$$"),))
    assert parse_structure([["```", "```"]]) == ((("```", "```"),),)
    paper = '[[("```python", "```"), ("<tool_call>", "</tool_call>")], [("\\\\[", "\\\\]"), ("$$", "$$")]]'
    assert parse_structure(paper)[1][0] == ("\\[", "\\]")


def test_load_cache_hit_is_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"type": "meta", "version": 1, "tokenizer": "qwen3"},
        {"type": "call", "id": "a", "agent_id": 1, "query_id": 1, "seq": 0, "prompt": "hello",
         "output": "world<|im_end|>", "workspace": [{"path": "p", "content": "c"}]},
        {"type": "call", "id": "b", "agent_id": 1, "query_id": 1, "seq": 1, "prompt_extends": "a",
         "prompt_append": " more", "output": "x<|im_end|>"},
    ]) + "\n")
    cold = load_trace(src)
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    warm = load_trace(src)
    assert warm == cold and warm.calls[1].prompt_extends == "a"
    src.write_text(src.read_text().replace("hello", "hullo"))  # new content, new key
    assert load_trace(src).calls[0].prompt_tokens.tolist() != cold.calls[0].prompt_tokens.tolist()
