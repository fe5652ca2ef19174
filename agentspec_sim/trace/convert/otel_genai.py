"""OpenTelemetry GenAI spans (OTLP JSON exports) → trace records.

Input: `.json` / `.jsonl` files (or directories of them) holding OTLP/JSON trace exports — one
`ExportTraceServiceRequest` (`{"resourceSpans": [...]}`) per file, or one per line as the collector's file
exporter writes them. Instrumented agent frameworks emit one span per model call under the `gen_ai.*`
semantic conventions; this converter reads them in the three shapes found in the wild:

- current conventions (semconv ≥ 1.37): `gen_ai.input.messages`, `gen_ai.output.messages` and
  `gen_ai.system_instructions`, each a JSON string or a structured value of messages `{role, parts}` with
  parts `text`, `tool_call` (`name`, `arguments`), `tool_call_response` (`response`); other part types
  (reasoning, media) are dropped;
- indexed attributes (OpenLLMetry and others): `gen_ai.prompt.N.role` / `.content`,
  `gen_ai.completion.N.content` and `gen_ai.completion.0.tool_calls.M.name` / `.arguments`;
- span events (semconv ≤ 1.36): `gen_ai.system.message`, `gen_ai.user.message`, `gen_ai.assistant.message`,
  `gen_ai.tool.message` and `gen_ai.choice`, with the text in the event's `content` (or `message`) attribute.

A span is a model call when its `gen_ai.operation.name` is `chat`, `text_completion` or `generate_content`, or
when it has no operation name but carries messages; agent, tool and embedding spans are skipped, and so are model
calls recorded without their messages (content capture is off by default in most instrumentations), counted in
the meta's `extra.skipped_spans_without_content`.

Identity: a query is the span's `gen_ai.conversation.id` (its own or its nearest ancestor's), else its OTel
trace (one agent run); the agent is the resource's `service.name` (default `otel`); the call's `role` is the
nearest `gen_ai.agent.name` (the sub-agent of a multi-agent run). Calls of a query are ordered by start time;
the first gets `arrival_s` (relative to the earliest span), the others `think_s` (the gap since the previous
call ended). Tool calls are written into the text as the Qwen3 template renders them (openai-chat's rule), so a
call that re-sends the history extends the previous one (the delta form). Token usage and the model go to
`extra`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from agentspec_sim.io import strict_json
from agentspec_sim.trace.convert.base import (
    ChatCall,
    ConvertError,
    ConvertOptions,
    chat_call_records,
    expand_inputs,
    register,
)
from agentspec_sim.trace.convert.openai_chat import render_tool_calls

CALL_OPERATIONS = {"chat", "text_completion", "generate_content"}
DEFAULT_AGENT = "otel"
_EVENT_ROLES = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


def any_value(value: object) -> object:
    """An OTLP/JSON AnyValue as plain Python (intValue is a string in OTLP/JSON: int64's JSON mapping)."""
    if not isinstance(value, dict):
        return value
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        return attributes((value["kvlistValue"] or {}).get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes(items: object) -> dict:
    """OTLP KeyValue list → dict."""
    if not isinstance(items, list):
        raise TypeError("attributes: expected a list of {key, value}")
    out = {}
    for kv in items:
        if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
            raise TypeError("attributes: an entry without a string key")
        out[kv["key"]] = any_value(kv.get("value"))
    return out


def _structured(value: object) -> object:
    """A messages attribute: a JSON string or already structured."""
    if isinstance(value, str):
        try:
            return strict_json.loads(value)
        except ValueError:
            raise TypeError("not valid JSON") from None
    return value


def _part_text(parts: object, role: str) -> str:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise TypeError("parts: expected a list")
    text, calls = [], []
    for part in parts:
        if not isinstance(part, dict):
            raise TypeError("parts: expected objects")
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("content"), str):
            text.append(part["content"])
        elif kind == "tool_call" and isinstance(part.get("name"), str):
            calls.append({"name": part["name"], "arguments": part.get("arguments") or {}})
        elif kind == "tool_call_response":
            response = part.get("response")
            text.append(response if isinstance(response, str) else json.dumps(response, ensure_ascii=False))
    out = "".join(text)
    return render_tool_calls(out, calls) if calls and role == "assistant" else out


def _messages(value: object) -> list[dict]:
    msgs = _structured(value)
    if not isinstance(msgs, list):
        raise TypeError("expected a list of messages")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError("a message without a string role")
        parts = m.get("parts", m.get("content", ""))
        out.append({"role": m["role"], "content": _part_text(parts, m["role"])})
    return out


def _indexed(attrs: dict, prefix: str) -> list[dict]:
    """`prefix.N.role` / `prefix.N.content` (+ tool calls) → messages, by N."""
    found: dict[int, dict] = {}
    for key, value in attrs.items():
        if not key.startswith(prefix + "."):
            continue
        head, _, rest = key[len(prefix) + 1:].partition(".")
        if head.isdigit():
            found.setdefault(int(head), {})[rest] = value
    out = []
    for n in sorted(found):
        f = found[n]
        role = f.get("role") if isinstance(f.get("role"), str) else ("assistant" if prefix.endswith("completion")
                                                                      else "user")
        text = f.get("content") if isinstance(f.get("content"), str) else ""
        calls = []
        for m in itertools.count():
            name = f.get(f"tool_calls.{m}.name")
            if not isinstance(name, str):
                break
            calls.append({"name": name, "arguments": f.get(f"tool_calls.{m}.arguments") or {}})
        out.append({"role": role, "content": render_tool_calls(text, calls) if calls else text})
    return out


def _from_events(span: dict) -> tuple[list[dict], list[dict]]:
    inputs, outputs = [], []
    for event in span.get("events") or ():
        if not isinstance(event, dict):
            continue
        name = event.get("name")
        attrs = attributes(event.get("attributes") or [])
        if name in _EVENT_ROLES:
            content = attrs.get("content", attrs.get("gen_ai.event.content", ""))
            inputs.append({"role": _EVENT_ROLES[name], "content": content if isinstance(content, str)
                           else json.dumps(content, ensure_ascii=False)})
        elif name == "gen_ai.choice":
            message = _structured(attrs.get("message", attrs.get("content", "")))
            text = message.get("content", "") if isinstance(message, dict) else message
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            outputs.append({"role": "assistant",
                            "content": render_tool_calls(text if isinstance(text, str) else "", calls or [])})
    return inputs, outputs


def _span_call(attrs: dict, span: dict) -> tuple[list[dict], str] | None:
    """(messages, output text) of a model-call span, or None for any other span."""
    op = attrs.get("gen_ai.operation.name")
    if op is not None and op not in CALL_OPERATIONS:
        return None
    if "gen_ai.input.messages" in attrs or "gen_ai.output.messages" in attrs:
        system = attrs.get("gen_ai.system_instructions")
        inputs = ([{"role": "system", "content": _part_text(_structured(system), "system")}] if system else [])
        inputs += _messages(attrs.get("gen_ai.input.messages", "[]"))
        outputs = _messages(attrs.get("gen_ai.output.messages", "[]"))
    elif any(k.startswith("gen_ai.prompt.") for k in attrs):
        inputs, outputs = _indexed(attrs, "gen_ai.prompt"), _indexed(attrs, "gen_ai.completion")
    else:
        inputs, outputs = _from_events(span)
    if not inputs and op is None:
        return None
    if not inputs or not outputs or not outputs[0]["content"]:
        raise _NoContent
    return inputs, outputs[0]["content"]


class _NoContent(Exception):
    """A model-call span without its messages: the instrumentation's content capture was off."""


def _requests(path: Path, opts: ConvertOptions | None = None) -> Iterator[tuple[int, dict]]:
    """(line, ExportTraceServiceRequest) of a file: one JSON document, or one per line (a line that is not JSON
    refused, or skipped and recorded with `opts.skip_bad_lines`)."""
    try:
        text = path.read_text("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read as UTF-8 text ({exc})") from None
    try:
        doc = strict_json.loads(text)
        yield 1, doc
        return
    except ValueError:
        pass
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                doc = strict_json.loads(line)
            except ValueError as exc:
                error = ConvertError(path, f"line {n}: not valid JSON ({exc})")
                if opts is None:
                    raise error from None
                opts.skip_or_raise(error)
                continue
            yield n, doc


def _nano(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError("expected a time in nanoseconds")
    return int(value)


@register("otel-genai", "OpenTelemetry GenAI spans: OTLP JSON trace exports with gen_ai.* attributes")
def convert(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then every query's calls (queries in order of their first call)."""
    files = expand_inputs(paths, "*.json*")
    calls: list[dict] = []
    models: set[str] = set()
    no_content = [0]
    for path in files:
        for n, request in _requests(path, opts):
            if not isinstance(request, dict) or not isinstance(request.get("resourceSpans", []), list):
                raise ConvertError(path, f"line {n}: not an OTLP trace export (no resourceSpans list)")
            for resource in request.get("resourceSpans", []):
                try:
                    calls.extend(_resource_calls(resource, models, no_content))
                except (TypeError, ValueError, KeyError) as exc:
                    raise ConvertError(path, f"line {n}: {exc}") from None
    if not calls:
        raise ConvertError(files[0] if files else "input", "no gen_ai model-call spans with message content found"
                           + (f" ({no_content[0]} without content: turn the instrumentation's content capture on, "
                              "e.g. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)" if no_content[0] else ""))
    t0 = min(c["start"] for c in calls)
    meta = {"type": "meta", "version": 1, "tokenizer": opts.tokenizer,
            "model": ", ".join(sorted(models)) if models else None, "workload": "otel-genai",
            "source": "otel-genai spans: " + ", ".join(p.name for p in files)}
    if no_content[0]:
        meta["extra"] = {"skipped_spans_without_content": no_content[0]}
    yield meta
    queries: dict[tuple, list[dict]] = {}
    for c in sorted(calls, key=lambda c: (c["start"], c["span_id"])):
        queries.setdefault(c["key"], []).append(c)
    for (agent, query), group in queries.items():
        chat_calls, previous_end = [], None
        for c in group:
            timing = ({"arrival_s": round((c["start"] - t0) / 1e9, 6)} if previous_end is None
                      else {"think_s": round(max(0, c["start"] - previous_end) / 1e9, 6)})
            chat_calls.append(ChatCall(messages=c["messages"], response=c["output"], role=c["role"],
                                       extra=c["extra"] or None, **timing))
            previous_end = c["end"]
        yield from chat_call_records(agent, query, chat_calls, opts)


def _resource_calls(resource: dict, models: set[str], no_content: list[int]) -> list[dict]:
    res_attrs = attributes((resource.get("resource") or {}).get("attributes") or [])
    agent = str(res_attrs.get("service.name") or DEFAULT_AGENT)
    spans = [s for scope in resource.get("scopeSpans") or () for s in scope.get("spans") or ()]
    by_id = {s.get("spanId"): s for s in spans if isinstance(s, dict)}
    span_attrs = {sid: attributes(s.get("attributes") or []) for sid, s in by_id.items()}

    def inherited(span: dict, key: str) -> object:
        seen = 0
        while span is not None and seen < 1000:  # a cycle of parent ids must end
            value = span_attrs.get(span.get("spanId"), {}).get(key)
            if value is not None:
                return value
            span, seen = by_id.get(span.get("parentSpanId")), seen + 1
        return None

    out = []
    for sid, span in by_id.items():
        attrs = span_attrs[sid]
        try:
            call = _span_call(attrs, span)
        except _NoContent:
            no_content[0] += 1
            continue
        except TypeError as exc:
            raise TypeError(f"span {sid} ({span.get('name')}): {exc}") from None
        if call is None:
            continue
        conversation = inherited(span, "gen_ai.conversation.id")
        role = inherited(span, "gen_ai.agent.name")
        model = attrs.get("gen_ai.response.model") or attrs.get("gen_ai.request.model")
        extra = {k: attrs[a] for k, a in (("input_tokens", "gen_ai.usage.input_tokens"),
                                          ("output_tokens", "gen_ai.usage.output_tokens"))
                 if isinstance(attrs.get(a), int)}
        extra = {"usage": extra} if extra else {}
        if isinstance(model, str):
            models.add(model)
            extra["model"] = model
        out.append({"key": (agent, str(conversation if conversation is not None else span.get("traceId"))),
                    "messages": call[0], "output": call[1], "role": role if isinstance(role, str) else None,
                    "start": _nano(span.get("startTimeUnixNano")), "end": _nano(span.get("endTimeUnixNano")),
                    "span_id": str(sid), "extra": extra})
    return out
