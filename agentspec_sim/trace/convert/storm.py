"""STORM deep-research call history → trace records (converter `storm`).

Source: stanford-oval/storm `llm_call_history.jsonl`, one line per LLM call:
`{"prompt": <the dspy prompt text>, "response": <OpenAI chat completion with usage>, "raw_kwargs": {}}`.

Rules:

- One query per history file (one STORM run on one topic): `agent_id` "storm", `query_id` = the
  folder name when the file is called `llm_call_history.jsonl`, else the file's stem.
- Order: STORM writes the history grouped by LM object (all conversation-simulator calls, then all
  question-asker calls, then outline, then article), not in the order the calls ran. Calls are
  therefore ordered by the completion's `created` time (seconds), ties kept in file order, which
  restores the pipeline order: personas → (question → search queries → expert answer) turns →
  outline → sections → lead. STORM ran its perspectives' conversations and its sections
  concurrently; this query serialises them in that order. `extra.history_index` keeps the file line
  (0-based), `extra.created` the timestamp.
- Prompt: dspy sent each prompt as one user message, so `messages` = `[{"role": "user", ...}]`
  (a line with a `messages` list instead of `prompt` is taken as is). No call re-sends an earlier
  call's output as a prefix, so every call carries full messages.
- Output: `choices[0].message.content` (or `choices[0].text`) + the end-of-turn text. A completion
  that stopped on `finish_reason` "length" hit max_tokens and never emitted an end-of-turn, so
  none is appended; it is marked `extra.truncated`.
- Role, from the prompt's opening instruction (STORM's dspy signatures):

      "…recommend some Wikipedia pages on closely related subjects"   related_topics
      "You need to select a group of Wikipedia editors"               persona_generator
      "You are an experienced Wikipedia writer"                       question_asker
      "You want to answer the question using Google search"           query_writer
      "You are an expert who can use information effectively"         topic_expert
      "Write an outline for a Wikipedia page"                         outline_writer
      "Improve an outline for a Wikipedia page"                       outline_refiner
      "Write a Wikipedia section"                                     section_writer
      "Write a lead section"                                          lead_writer
      "You are a faithful text editor"                                polisher
      anything else                                                   other

- `structure`: STORM's text blocks are citations `[n]` and markdown headings (`# …` to the end of
  the line; "# " also opens "## " and "### " headings): `[[["[", "]"]], [["# ", "\\n"]]]`.
- `extra.usage` is the completion's `usage`; `extra.model` the model that answered.

On the bundled run (topic "CRW telesystem"): 48 calls in one query.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from agentspec_sim.io import strict_json
from agentspec_sim.trace.convert.base import (
    ChatCall,
    ConvertError,
    ConvertOptions,
    chat_call_records,
    register,
)

AGENT_ID = "storm"
HISTORY_NAME = "llm_call_history.jsonl"
STRUCTURE = [[["[", "]"]], [["# ", "\n"]]]

ROLE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), role) for pattern, role in (
        (r"recommend some Wikipedia pages on closely related subjects", "related_topics"),
        (r"You need to select a group of Wikipedia editors", "persona_generator"),
        (r"You are an experienced Wikipedia writer", "question_asker"),
        (r"You want to answer the question using Google search", "query_writer"),
        (r"You are an expert who can use information effectively", "topic_expert"),
        (r"Improve an outline for a Wikipedia page", "outline_refiner"),
        (r"Write an outline for a Wikipedia page", "outline_writer"),
        (r"Write a Wikipedia section", "section_writer"),
        (r"Write a lead section", "lead_writer"),
        (r"You are a faithful text editor", "polisher"),
    )
)
_HEAD_CHARS = 600  # the instruction is at the top of every STORM prompt


def classify_role(prompt: str) -> str:
    """The STORM module that wrote `prompt`, from its opening instruction (table in the docstring)."""
    head = prompt[:_HEAD_CHARS]
    for pattern, role in ROLE_PATTERNS:
        if pattern.search(head):
            return role
    return "other"


def _response_text(response: object) -> tuple[str, str | None] | None:
    """(text, finish_reason) of a recorded response, or None when it has no text."""
    if isinstance(response, str):
        return response, None
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    if not isinstance(text, str):
        return None
    finish = choice.get("finish_reason")
    return text, finish if isinstance(finish, str) else None


def _read_history(path: Path) -> list[tuple[int, dict, list[dict], str, str | None]]:
    """(line index, row, messages, output text, finish reason) per call, validated."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read ({exc})") from None
    out = []
    def not_json(n: int, exc: strict_json.StrictJSONError) -> ConvertError:
        return ConvertError(path, f"line {n}: not JSON ({exc.msg}); expected a STORM call record")

    for n, row in strict_json.json_lines(text, not_json):
        if not isinstance(row, dict) or "response" not in row or not ("prompt" in row or "messages" in row):
            raise ConvertError(path, f"line {n}: not a STORM call record (needs 'prompt' and 'response')")
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            messages = [{"role": "user", "content": row["prompt"]}]
        elif isinstance(row.get("messages"), list) and row["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in row["messages"]
        ):
            messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        else:
            raise ConvertError(path, f"line {n}: 'prompt' must be a non-empty string")
        got = _response_text(row["response"])
        if got is None or not got[0]:
            raise ConvertError(path, f"line {n}: 'response' has no completion text (choices[0].message.content)")
        out.append((len(out), row, messages, got[0], got[1]))
    if not out:
        raise ConvertError(path, "empty file; expected STORM call records")
    return out


def _inputs(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob(HISTORY_NAME) if f.is_file())
            if not found:
                raise ConvertError(p, f"no {HISTORY_NAME} in this directory")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ConvertError(p, "no such file or directory")
    return list(dict.fromkeys(files))


def _query_id(path: Path) -> str:
    return path.parent.name if path.name == HISTORY_NAME else path.stem


def _created(row: dict) -> float | None:
    response = row.get("response")
    value = response.get("created") if isinstance(response, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _records(path: Path, rows: list, opts: ConvertOptions) -> Iterator[dict]:
    created = [_created(r[1]) for r in rows]
    if all(c is not None for c in created):
        rows = [r for _, r in sorted(zip(created, rows, strict=True), key=lambda cr: (cr[0], cr[1][0]))]
    calls = []
    truncated = []
    for index, row, messages, text, finish in rows:
        response = row["response"] if isinstance(row["response"], dict) else {}
        extra: dict = {"history_index": index}
        if isinstance(response.get("usage"), dict):
            extra["usage"] = response["usage"]
        if isinstance(response.get("model"), str):
            extra["model"] = response["model"]
        if _created(row) is not None:
            extra["created"] = _created(row)
        if finish is not None:
            extra["finish_reason"] = finish
        if finish == "length":
            extra["truncated"] = True
        truncated.append(finish == "length")
        calls.append(ChatCall(messages=messages, response=text, role=classify_role(messages[-1]["content"]),
                              structure=STRUCTURE, extra=extra))
    for record, cut in zip(chat_call_records(AGENT_ID, _query_id(path), calls, opts), truncated, strict=True):
        if cut and opts.eot_text and record["output"].endswith(opts.eot_text):
            record["output"] = record["output"][: -len(opts.eot_text)]
        yield record


@register("storm", "STORM llm_call_history.jsonl (deep research) → one query of role-tagged calls per run")
def convert_storm(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then each run's calls in pipeline order; rules in the module docstring."""
    files = _inputs(paths)
    runs = [(f, _read_history(f)) for f in files]  # validate everything before yielding
    ids = [_query_id(f) for f in files]
    if len(set(ids)) != len(ids):
        dup = next(f for f, q in zip(files, ids, strict=True) if ids.count(q) > 1)
        raise ConvertError(dup, f"two inputs share the run name {_query_id(dup)!r}; rename a folder")
    models = sorted({r[1]["response"]["model"] for _, rows in runs for r in rows
                     if isinstance(r[1]["response"], dict) and isinstance(r[1]["response"].get("model"), str)})
    meta: dict = {"type": "meta", "version": 1, "tokenizer": opts.tokenizer}
    if models:
        meta["model"] = ",".join(models)
    meta["workload"] = "deep-research"
    meta["source"] = "stanford-oval/storm llm_call_history: " + ", ".join(ids)
    yield meta
    for f, rows in runs:
        yield from _records(f, rows, opts)
