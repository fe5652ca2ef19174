"""`convert otel-genai`: OTLP/JSON trace exports with gen_ai.* spans in the three shapes instrumentations emit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentspec_sim.trace.convert import ConvertError
from agentspec_sim.trace.convert_run import convert_records
from agentspec_sim.trace.io import load_trace

S = 1_000_000_000  # nanoseconds


def kv(key: str, value) -> dict:
    if isinstance(value, bool):
        v = {"boolValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}  # OTLP/JSON writes int64 as a string
    elif isinstance(value, float):
        v = {"doubleValue": value}
    elif isinstance(value, list):
        v = {"arrayValue": {"values": [kv("x", x)["value"] for x in value]}}
    elif isinstance(value, dict):
        v = {"kvlistValue": {"values": [kv(k, x) for k, x in value.items()]}}
    else:
        v = {"stringValue": value}
    return {"key": key, "value": v}


def span(span_id: str, trace: str, start: float, end: float, attrs: dict, parent: str | None = None,
         name: str = "chat m", events: list | None = None) -> dict:
    out = {"traceId": trace, "spanId": span_id, "name": name, "kind": 3,
           "startTimeUnixNano": str(int(start * S)), "endTimeUnixNano": str(int(end * S)),
           "attributes": [kv(k, v) for k, v in attrs.items()]}
    if parent:
        out["parentSpanId"] = parent
    if events:
        out["events"] = events
    return out


def export(spans: list[dict], service: str = "my-agents") -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [kv("service.name", service)]},
                               "scopeSpans": [{"scope": {"name": "x"}, "spans": spans}]}]}


SYSTEM = [{"type": "text", "content": "You are a coder."}]
TURN1_IN = [{"role": "user", "parts": [{"type": "text", "content": "Fix the bug."}]}]
TURN1_OUT = [{"role": "assistant", "finish_reason": "tool_call", "parts": [
    {"type": "text", "content": "Looking."},
    {"type": "tool_call", "id": "c1", "name": "run", "arguments": {"cmd": "ls"}}]}]
TURN2_IN = [*TURN1_IN, {"role": "assistant", "parts": TURN1_OUT[0]["parts"]},
            {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "a.py"}]}]
TURN2_OUT = [{"role": "assistant", "parts": [{"type": "text", "content": "Done."}]}]


def current_conventions() -> list[dict]:
    """One agent run (trace t1): an invoke_agent span, two chat spans (JSON-string messages, one structured), a
    tool span between them."""
    return [
        span("a0", "t1", 10.0, 20.0, {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "coder",
                                     "gen_ai.conversation.id": "conv-1"}, name="invoke_agent coder"),
        span("c1", "t1", 10.5, 11.0, {"gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen3-8b",
                                     "gen_ai.system_instructions": json.dumps(SYSTEM),
                                     "gen_ai.input.messages": json.dumps(TURN1_IN),
                                     "gen_ai.output.messages": json.dumps(TURN1_OUT),
                                     "gen_ai.usage.input_tokens": 30, "gen_ai.usage.output_tokens": 12},
             parent="a0"),
        span("x1", "t1", 11.0, 13.0, {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "run"},
             parent="a0", name="execute_tool run"),
        span("c2", "t1", 13.0, 14.0, {"gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen3-8b",
                                     "gen_ai.system_instructions": json.dumps(SYSTEM),
                                     "gen_ai.input.messages": TURN2_IN,  # the structured form
                                     "gen_ai.output.messages": json.dumps(TURN2_OUT)}, parent="a0"),
    ]


def test_current_conventions_one_query_in_delta_form(tmp_path):
    f = tmp_path / "spans.json"
    f.write_text(json.dumps(export(current_conventions())))
    records = convert_records("otel-genai", [f])
    meta, calls = records[0], records[1:]
    assert meta["model"] == "qwen3-8b" and meta["workload"] == "otel-genai"
    assert [(c["agent_id"], c["query_id"], c["seq"], c["role"]) for c in calls] == [
        ("my-agents", "conv-1", 0, "coder"), ("my-agents", "conv-1", 1, "coder")]
    first, second = calls
    assert first["messages"] == [{"role": "system", "content": "You are a coder."},
                                 {"role": "user", "content": "Fix the bug."}]
    assert first["output"] == ('Looking.\n<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'
                               "<|im_end|>")
    assert first["arrival_s"] == 0.0 and first["extra"] == {"usage": {"input_tokens": 30, "output_tokens": 12},
                                                             "model": "qwen3-8b"}
    # The second call re-sends the first's answer: the delta form, with the tool's 2 s as think time.
    assert second["prompt_extends"] == first["id"]
    assert second["messages_append"] == [{"role": "tool", "content": "a.py"}]
    assert second["think_s"] == pytest.approx(2.0)
    out = tmp_path / "t.jsonl"
    r = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "convert", "otel-genai", str(f), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    wl = load_trace(out, cache=False)
    assert wl.num_calls == 2 and wl.queries[0].calls[1].prompt_extends == first["id"]


def test_indexed_attributes_and_events_one_export_per_line(tmp_path):
    indexed = span("i1", "t2", 1.0, 2.0, {
        "gen_ai.operation.name": "chat", "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "Plan.",
        "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "Go", "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.content": "", "gen_ai.completion.0.tool_calls.0.name": "search",
        "gen_ai.completion.0.tool_calls.0.arguments": '{"q": "x"}'})
    events = span("e1", "t3", 5.0, 6.0, {"gen_ai.system": "openai"}, events=[
        {"name": "gen_ai.user.message", "attributes": [kv("content", "hello")]},
        {"name": "gen_ai.choice", "attributes": [kv("message", {"content": "hi there"})]}])
    other = span("z1", "t3", 0.0, 9.0, {"http.method": "GET"}, name="GET /")  # not a model call
    dark = span("d1", "t3", 7.0, 8.0, {"gen_ai.operation.name": "chat"})  # content capture was off
    f = tmp_path / "spans.jsonl"
    lines = [json.dumps(export([indexed])), "", json.dumps(export([events, other, dark], service="svc"))]
    f.write_text("\n".join(lines) + "\n")
    records = convert_records("otel-genai", [f])
    calls = records[1:]
    assert records[0]["extra"] == {"skipped_spans_without_content": 1}
    assert [(c["agent_id"], c["query_id"]) for c in calls] == [("my-agents", "t2"), ("svc", "t3")]
    assert calls[0]["messages"] == [{"role": "system", "content": "Plan."}, {"role": "user", "content": "Go"}]
    assert calls[0]["output"] == '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call><|im_end|>'
    assert calls[1]["messages"] == [{"role": "user", "content": "hello"}] and calls[1]["output"] == "hi there<|im_end|>"
    assert calls[1]["arrival_s"] == pytest.approx(4.0)


@pytest.mark.parametrize("content, message", [
    ('{"resourceSpans": "x"}', "not an OTLP trace export"),
    ('{"nope": 1}\n{"x": ', "line 2: not valid JSON"),
    (json.dumps(export([span("c", "t", 0, 1, {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"})])),
     "1 without content: turn the instrumentation's content capture on"),
    (json.dumps(export([span("c", "t", 0, 1, {"gen_ai.operation.name": "chat",
                                              "gen_ai.input.messages": "[{oops"})])), "not valid JSON"),
    (json.dumps(export([span("c", "t", 0, 1, {"gen_ai.operation.name": "embeddings"})])), "no gen_ai model-call"),
])
def test_bad_exports_name_the_file_and_line(tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ConvertError, match=re.escape(message)) as info:
        convert_records("otel-genai", [f])
    assert str(f) in str(info.value)


def test_spans_in_a_cycle_of_parents_end(tmp_path):
    spans = [span("a", "t", 0, 1, {"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(TURN1_IN),
                                    "gen_ai.output.messages": json.dumps(TURN2_OUT)}, parent="b"),
             span("b", "t", 0, 1, {"gen_ai.operation.name": "invoke_agent"}, parent="a")]
    f = tmp_path / "cycle.json"
    f.write_text(json.dumps(export(spans)))
    calls = convert_records("otel-genai", [Path(f)])[1:]
    assert len(calls) == 1 and calls[0]["query_id"] == "t" and "role" not in calls[0]


def test_every_indexed_tool_call_is_kept(tmp_path):
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "go"}
    for m in range(70):
        attrs[f"gen_ai.completion.0.tool_calls.{m}.name"] = f"tool{m}"
        attrs[f"gen_ai.completion.0.tool_calls.{m}.arguments"] = "{}"
    f = tmp_path / "many.json"
    f.write_text(json.dumps(export([span("s", "t", 0, 1, attrs)])))
    output = convert_records("otel-genai", [f])[1]["output"]
    assert output.count("<tool_call>") == 70 and '"name": "tool69"' in output
