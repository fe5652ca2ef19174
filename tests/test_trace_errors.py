"""Malformed traces: every case fails with `file:line: field: what is wrong` (table-driven)."""

from __future__ import annotations

import gzip
import json

import pytest

from agentspec_sim.trace.io import load_trace
from agentspec_sim.trace.schema import TraceError

META = {"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100}
TEXT_META = {"type": "meta", "version": 1, "tokenizer": "qwen3"}


def call(i: int = 0, **fields) -> dict:
    rec = {"type": "call", "id": f"c{i}", "agent_id": 1, "query_id": 1, "seq": i,
           "prompt_tokens": [1, 2, 3], "output_tokens": [4, 5]}
    rec.update(fields)
    return {k: v for k, v in rec.items() if v is not ...}


def lines(*records) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in records]


# (case, trace lines, expected line, field, message fragment)
CASES = [
    ("bad json", lines(META, '{"type": "call", "id": '), 2, "line", "invalid JSON"),
    ("not an object", lines(META, "[1, 2]"), 2, "line", "expected a JSON object"),
    ("no meta", lines(call(0)), 1, "type", "first line must be the meta line"),
    ("bad version", lines({**META, "version": 7}), 1, "version", "unsupported trace version 7"),
    ("unknown tokenizer", lines({**META, "tokenizer": "nope-tok"}, call(0)), 1, "tokenizer", "unknown tokenizer"),
    ("unknown record type", lines(META, {"type": "step"}), 2, "type", "unknown record type"),
    ("missing id", lines(META, call(0, id=...)), 2, "id", "missing"),
    ("id not a string", lines(META, call(0, id=5)), 2, "id", "expected a string, got an integer"),
    ("missing agent_id", lines(META, call(0, agent_id=...)), 2, "agent_id", "missing"),
    ("query_id as list", lines(META, call(0, query_id=[1])), 2, "query_id", "expected an integer or a string"),
    ("seq as string", lines(META, call(0, seq="0")), 2, "seq", "expected an integer, got a string"),
    ("seq bool", lines(META, call(0, seq=True)), 2, "seq", "expected an integer, got a boolean"),
    ("negative seq", lines(META, call(0, seq=-1)), 2, "seq", "must be ≥ 0"),
    ("negative token", lines(META, call(0, prompt_tokens=[1, -3])), 2, "prompt_tokens", "negative token id -3"),
    ("token out of vocab", lines(META, call(0, output_tokens=[4, 100])), 2, "output_tokens",
     "token id 100 is out of the vocabulary (size 100)"),
    ("token not int", lines(META, call(0, prompt_tokens=[1, 2.5])), 2, "prompt_tokens", "integer token ids"),
    ("empty output", lines(META, call(0, output_tokens=[])), 2, "output_tokens", "empty output"),
    ("empty prompt", lines(META, call(0, prompt_tokens=[])), 2, "prompt_tokens", "empty prompt"),
    ("no prompt", lines(META, call(0, prompt_tokens=...)), 2, "prompt", "missing"),
    ("two prompts", lines(META, call(0, prompt="hi")), 2, "prompt", "give only one of"),
    ("no output", lines(META, call(0, output_tokens=...)), 2, "output", "missing"),
    ("unknown field", lines(META, call(0, promt="x")), 2, "promt", "unknown field"),
    ("negative think", lines(META, call(0, think_s=-1)), 2, "think_s", "finite number ≥ 0"),
    ("bad emission", lines(META, call(0, emission="patch")), 2, "emission", "must be one of raw, diff, json"),
    ("unbalanced structure", lines(META, call(0, structure=[["```python"]])), 2, "structure",
     "unbalanced or empty delimiter pair"),
    ("empty delimiter", lines(META, call(0, structure=[["", "```"]])), 2, "structure", "unbalanced or empty"),
    ("bad structure string", lines(META, call(0, structure="[(")), 2, "structure", "string form"),
    ("bad workspace", lines(META, call(0, workspace=[{"path": "a"}])), 2, "workspace", "entry 0"),
    ("duplicate id", lines(META, call(0), call(1, id="c0")), 3, "id", "duplicate call id 'c0' (first on line 2)"),
    ("seq gap", lines(META, call(0), call(2)), 3, "seq", "expected seq 1, got 2"),
    ("duplicate seq", lines(META, call(0), call(1, seq=0)), 3, "seq", "duplicate seq 0"),
    ("extends unknown", lines(META, call(0), call(1, prompt_tokens=..., prompt_extends="zz",
                                                 prompt_append_tokens=[1])), 3, "prompt_extends",
     "names unknown call 'zz'"),
    ("extends later", lines(META, call(0, prompt_tokens=..., prompt_extends="c1", prompt_append_tokens=[1]),
                            call(1)), 2, "prompt_extends", "not earlier"),
    ("extends other query", lines(META, call(0), call(0, id="d0", query_id=2, prompt_tokens=...,
                                                      prompt_extends="c0", prompt_append_tokens=[1])),
     3, "prompt_extends", "another query"),
    ("append without extends", lines(META, call(0, prompt_tokens=..., prompt_append_tokens=[1])), 2,
     "prompt_append_tokens", "needs prompt_extends"),
    ("text without tokenizer", lines(META, call(0, prompt_tokens=..., prompt="hi")), 2, "prompt",
     "needs a tokenizer"),
    ("messages not a list", lines(TEXT_META, call(0, prompt_tokens=..., messages="hi")), 2, "messages",
     "non-empty list of chat messages"),
    ("message without role", lines(TEXT_META, call(0, prompt_tokens=..., messages=[{"content": "x"}])), 2,
     "messages", "message 0"),
]


@pytest.mark.parametrize(("case", "content", "line", "field", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_malformed_line_is_named(tmp_path, case, content, line, field, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(content) + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path, cache=False)
    err = info.value
    assert (err.line, err.field) == (line, field), str(err)
    assert fragment in err.message
    assert str(err).startswith(f"{path}:{line}: {field}: ")


def test_file_level_errors(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"type": "meta", "version": 1}\n' * 50)[:-20])
    with pytest.raises(TraceError, match="cannot decompress"):
        load_trace(truncated, cache=False)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceError, match=r"b\.jsonl:1: line: "):
        load_trace(binary, cache=False)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty trace"):
        load_trace(empty, cache=False)


def test_skip_bad_lines_counts_and_cascades(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines(
        META, call(0), "{oops", call(1, output_tokens=[]), call(2),  # call 1 bad → call 2 (gap) skipped too
        call(0, id="q2", query_id=2),
    )) + "\n")
    with pytest.raises(TraceError):
        load_trace(path, cache=False)
    workload = load_trace(path, skip_bad_lines=True, cache=False)
    assert [c.id for c in workload.calls] == ["c0", "q2"]
    assert len(workload.skipped) == 3
    assert workload.skipped[0].startswith(f"{path}:3: line: invalid JSON")
