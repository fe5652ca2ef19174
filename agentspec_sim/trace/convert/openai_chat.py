"""Generic OpenAI-style chat logs (JSONL, one LLM call per line) → trace records.

Input: `.jsonl` files (or directories of them). Every non-blank line is one JSON object:

    {"messages": [{"role": ..., "content": ...}, ...],      # the request (required, non-empty)
     "response": "text" | <chat completion> | <message>,    # what the model returned (required)
     "agent_id": ..., "query_id": ..., "role": ...,         # optional identifiers
     "structure": [...], "workspace": [...], "emission": "raw",  # optional, passed through
     "timestamp": 1712345678.5 | "2024-04-05T12:00:00Z",   # optional: when the call was sent
     "arrival_s": 1.5, "think_s": 0.2, "model": "..."}       # optional

A line may instead be a whole transcript in OpenAI's chat fine-tuning form, `{"messages": [..., {"role":
"assistant", ...}]}` with no `response`: each assistant turn is a call (its messages before it the prompt, the turn
its output), the line's calls one query.

Rules:

- `response` is a string, an OpenAI chat completion (`choices[0].message`, or `choices[0].text` for
  legacy completions; its `usage` goes to the record's `extra.usage`) or a bare assistant message.
- Message `content` may be a string, `null`, or a list of parts (OpenAI multimodal form): text parts
  are joined, other parts dropped. An assistant message's `tool_calls` are written into its text the
  way the Qwen3 chat template renders them (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`),
  both in prompts and in the recorded output, so a call that re-sends the history still extends
  the previous call.
- Calls with the same (`agent_id`, `query_id`) form one query, ordered by file order (files in the
  order given), and are chained with the delta form where a call re-sends the previous history.
  A call without `query_id` joins the query of an earlier call without one whose whole conversation —
  its messages, then its response as the assistant's turn — it re-sends and goes on from (an agent that
  re-sends its history, as the recording proxy chains it); otherwise it is a query of its own (query id
  `<file name>:<line>`). One `query_id` in several files is one query, in file order, and the converter
  says so. The default `agent_id` is `"openai-chat"`.
- `arrival_s` is taken as given; otherwise `timestamp` (epoch seconds or ISO 8601) becomes an
  arrival relative to the earliest timestamp in the input.
- Any line of the wrong shape is rejected with `ConvertError(file, "line N: ...")`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from datetime import datetime
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

DEFAULT_AGENT_ID = "openai-chat"
_TEXT_PART_TYPES = {"text", "input_text", "output_text"}
_PASS_THROUGH = ("structure", "workspace", "emission", "think_s")


def content_text(content: object) -> str:
    """The text of a chat message's `content`: a string, None (→ ""), or a list of parts.

    Parts are strings or `{"type": "text", "text": ...}` objects; non-text parts (images, audio)
    are dropped. Raises TypeError for anything else.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str) and part.get("type", "text") in _TEXT_PART_TYPES:
                    texts.append(text)
            else:
                raise TypeError(f"content part of type {type(part).__name__}")
        return "".join(texts)
    raise TypeError(f"content of type {type(content).__name__}")


def render_tool_calls(text: str, tool_calls: object) -> str:
    """`text` followed by each tool call as the Qwen3 chat template writes it into the output.

    Each call is `{"function": {"name", "arguments"}}` (OpenAI) or `{"name", "arguments"}`;
    string arguments are kept verbatim, objects are JSON-encoded.
    """
    if not tool_calls:
        return text
    if not isinstance(tool_calls, list):
        raise TypeError("tool_calls is not a list")
    out = text
    for i, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise TypeError("tool call is not an object")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TypeError("tool call without a function name")
        args = fn.get("arguments", {})
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        if i > 0 or out:
            out += "\n"
        out += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args_text}}}\n</tool_call>'
    return out


def message_text(message: dict) -> str:
    """A chat message's text, with an assistant's tool calls rendered into it."""
    text = content_text(message.get("content"))
    if message.get("role") == "assistant" and message.get("tool_calls"):
        text = render_tool_calls(text, message["tool_calls"])
    return text


def _response(value: object) -> tuple[str, dict | None, str | None]:
    """(text, usage, model) of a line's `response`."""
    if isinstance(value, str):
        return value, None, None
    if not isinstance(value, dict):
        raise TypeError("must be a string, a chat completion or an assistant message")
    usage = value.get("usage") if isinstance(value.get("usage"), dict) else None
    model = value.get("model") if isinstance(value.get("model"), str) else None
    if "choices" in value:
        choices = value["choices"]
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise TypeError("completion without choices[0]")
        choice = choices[0]
        if isinstance(choice.get("message"), dict):
            return message_text({**choice["message"], "role": "assistant"}), usage, model
        if isinstance(choice.get("text"), str):
            return choice["text"], usage, model
        raise TypeError("choices[0] has neither message nor text")
    if "content" in value or "tool_calls" in value:
        return message_text({**value, "role": "assistant"}), usage, model
    raise TypeError("an object without choices or content")


def _timestamp(value: object) -> float:
    if isinstance(value, bool):
        raise TypeError("timestamp must be a number or an ISO 8601 string")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError("timestamp is not finite")
        return float(value)
    if isinstance(value, str):
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    raise TypeError("timestamp must be a number or an ISO 8601 string")


def _is_id(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def _parse_line(path: Path, n: int, line: str) -> list[dict]:
    """One line → its calls, each {key, call fields, model, timestamp} (one, or a transcript's assistant turns);
    raises ConvertError naming the line."""
    where = f"line {n}"
    try:
        obj = strict_json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConvertError(path, f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ConvertError(path, f"{where}: expected a JSON object with `messages` and `response`")
    transcript = "response" not in obj and _ends_with_assistant(obj.get("messages"))
    if "messages" not in obj or ("response" not in obj and not transcript):
        missing = [k for k in ("messages", "response") if k not in obj]
        hint = (" (not an openai-chat log line)" if "messages" not in obj else
                " (a call's response, or a transcript whose last message is the assistant's turn)")
        raise ConvertError(path, f"{where}: missing {', '.join(missing)}{hint}")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConvertError(path, f"{where}: messages: expected a non-empty list of chat messages")
    msgs: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConvertError(path, f"{where}: messages[{i}]: expected an object with a string `role`")
        if "content" not in m and not m.get("tool_calls"):
            raise ConvertError(path, f"{where}: messages[{i}]: no content")
        try:
            msgs.append({"role": m["role"], "content": message_text(m)})
        except TypeError as exc:
            raise ConvertError(path, f"{where}: messages[{i}]: {exc}") from None
    if transcript:
        text, usage, model = None, None, None
    else:
        try:
            text, usage, model = _response(obj["response"])
        except TypeError as exc:
            raise ConvertError(path, f"{where}: response: {exc}") from None
    for name in ("agent_id", "query_id"):
        if name in obj and not _is_id(obj[name]):
            raise ConvertError(path, f"{where}: {name}: expected a string or an integer")
    if "role" in obj and obj["role"] is not None and not isinstance(obj["role"], str):
        raise ConvertError(path, f"{where}: role: expected a string")
    timestamp = None
    if obj.get("timestamp") is not None:
        try:
            timestamp = _timestamp(obj["timestamp"])
        except (TypeError, ValueError) as exc:
            raise ConvertError(path, f"{where}: timestamp: {exc}") from None
    arrival = obj.get("arrival_s")
    if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, int | float)):
        raise ConvertError(path, f"{where}: arrival_s: expected a number")
    agent_id = obj.get("agent_id", DEFAULT_AGENT_ID)
    query_id = obj.get("query_id", f"{path.name}:{n}")
    fields = {k: obj[k] for k in _PASS_THROUGH if obj.get(k) is not None}
    if usage is not None:
        fields["extra"] = {"usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens") if k in usage}}
    if model is None and isinstance(obj.get("model"), str):
        model = obj["model"]
    base = {"key": (agent_id, query_id), "anonymous": "query_id" not in obj and not transcript,
            "role": obj.get("role"), "arrival_s": float(arrival) if arrival is not None else None,
            "timestamp": timestamp, "model": model, "fields": fields}
    if not transcript:
        return [{**base, "messages": msgs, "response": text}]
    # A transcript: each assistant turn a call, after the messages before it; only the first keeps the line's
    # arrival (the others follow it as the query's calls do).
    calls = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and i > 0:
            calls.append({**base, "messages": msgs[:i], "response": m["content"],
                          **({} if not calls else {"arrival_s": None, "timestamp": None})})
    if not calls:
        raise ConvertError(path, f"{where}: messages: a transcript needs a message before its first assistant turn")
    return calls


def _ends_with_assistant(messages: object) -> bool:
    return (isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant")


def _conversation(messages: list[dict], response: str | None = None) -> tuple:
    """A chat as a hashable key: its (role, content) pairs, then the response as the assistant's turn."""
    turns = tuple((m["role"], m["content"]) for m in messages)
    return turns if response is None else (*turns, ("assistant", response))


def _continued(call: dict, conversations: dict[tuple, tuple], queries: dict[tuple, list[dict]]) -> tuple | None:
    """The query an anonymous call goes on: the longest earlier conversation (messages + response) its messages
    start with and go beyond, whose query it extends at its end (not a fork from the middle of one)."""
    messages = call["messages"]
    for end in range(len(messages) - 1, 0, -1):
        if messages[end - 1]["role"] != "assistant":
            continue
        key = conversations.get(_conversation(messages[:end]))
        if key is None:
            continue
        last = queries[key][-1]
        if _conversation(last["messages"], last["response"]) == _conversation(messages[:end]):
            return key
    return None


@register("openai-chat", "generic JSONL chat log: one {messages, response} object per LLM call")
def convert(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then the calls of every query (queries in order of first appearance)."""
    files = expand_inputs(paths, "*.jsonl")
    queries: dict[tuple, list[dict]] = {}
    models: set[str] = set()
    # Calls without a query_id: the conversation each one leaves (its messages, then its response) → its query,
    # so a later call that re-sends that history and goes on joins it (as the recording proxy chains them).
    conversations: dict[tuple, tuple] = {}
    files_of: dict[tuple, list[str]] = {}
    for path in files:
        try:
            text = path.read_text("utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConvertError(path, f"cannot read as UTF-8 text ({exc})") from None
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                calls = _parse_line(path, n, line)
            except ConvertError as exc:
                opts.skip_or_raise(exc)  # --skip-bad-lines: counted and named, not fatal
                continue
            for call in calls:
                if call["anonymous"]:
                    call["key"] = _continued(call, conversations, queries) or call["key"]
                    conversations[_conversation(call["messages"], call["response"])] = call["key"]
                else:
                    names = files_of.setdefault(call["key"], [])
                    if path.name not in names:
                        names.append(path.name)
                queries.setdefault(call["key"], []).append(call)
                if call["model"]:
                    models.add(call["model"])
    for (agent_id, query_id), names in files_of.items():
        if len(names) > 1:
            opts.notes.append(f"query_id {query_id!r} (agent {agent_id!r}) is in {len(names)} files "
                              f"({', '.join(names)}): its calls are one query, in the order the files were given")
    if not queries:
        raise ConvertError(files[0] if files else "input", "no calls (empty file)")
    stamps = [c["timestamp"] for calls in queries.values() for c in calls if c["timestamp"] is not None]
    t0 = min(stamps) if stamps else 0.0
    yield {
        "type": "meta", "version": 1, "tokenizer": opts.tokenizer,
        "model": ", ".join(sorted(models)) if models else None, "workload": "chat",
        "source": "openai-chat log: " + ", ".join(p.name for p in files),
    }
    seen_ids: set[str] = set()
    for (agent_id, query_id), calls in queries.items():
        chat_calls = []
        for c in calls:
            arrival = c["arrival_s"]
            if arrival is None and c["timestamp"] is not None:
                arrival = round(c["timestamp"] - t0, 6)
            chat_calls.append(ChatCall(
                messages=c["messages"], response=c["response"], role=c["role"], arrival_s=arrival,
                **c["fields"],
            ))
        for record in chat_call_records(agent_id, query_id, chat_calls, opts):
            if record["id"] in seen_ids:
                raise ConvertError(files[0], f"call id {record['id']!r} is not unique (agent/query ids clash)")
            seen_ids.add(record["id"])
            yield record
