"""TapeAgents runs (GAIA web agent) → trace records (converter `tapeagents`).

Source: ServiceNow/TapeAgents experiment output: `tapedata.sqlite` (table `LLMCalls`: `prompt_id`,
`timestamp`, `prompt` = JSON `{"messages": [...]}`, `output` = JSON assistant message,
`prompt_length_tokens`, `output_length_tokens`, `cost`) and `tapes/*.json` (one tape per task:
`metadata` with the task, `steps[]` each with `metadata.prompt_id` of the LLM call that produced
it and `metadata.node`, the agent node that made the call).

Input: the experiment folder (holding the sqlite file and `tapes/`), or the sqlite file plus tape
files / tape folders. The database is opened read-only; a `tapedata.sqlite.gz` is read through a
temporary copy when no plain file is there.

Rules:

- One query per tape: `agent_id` "tapeagents-gaia", `query_id` the tape file's stem. Its calls are
  the distinct `prompt_id`s of its steps in step order (an LLM call can yield several steps, e.g.
  an action and `set_next_node`), looked up in `LLMCalls`; a prompt id missing from the database
  is an error. Database calls no tape refers to are not emitted.
- Role: the step's `metadata.node` (plan, facts_survey, act), else its `metadata.agent`.
- Prompt: the recorded `messages`. TapeAgents re-renders the tape for every call (steps as
  pretty-printed JSON, the node's guidance message moved to the end), so a call rarely extends the
  previous call's prompt + output verbatim; the delta form is used exactly where it does, full
  `messages` elsewhere.
- Output: the assistant message's `content` + the end-of-turn text. Outputs that parse as a JSON
  object (the act node's steps) get `emission` "json" and `structure` `[[["{", "}"]]]` (the
  object and the nested objects of its arguments); the free-text plan and survey get none.
- `think_s`: tool time before the call — the sum of `action_execution_time` of the observation
  steps between the previous call's steps and this call's (0 for a tape's first call).
  `extra` keeps `prompt_id`, `timestamp` (when TapeAgents logged the finished call), `usage`
  (the source model's `prompt_tokens` / `completion_tokens`) and `task_id`.

On the bundled run (gpt-4o-mini, 8 GAIA level-1 tasks): 73 calls in 8 queries.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import sqlite3
import tempfile
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

AGENT_ID = "tapeagents-gaia"
DB_NAME = "tapedata.sqlite"
JSON_STRUCTURE = [[["{", "}"]]]


def _resolve(paths: Sequence[Path]) -> tuple[Path, list[Path]]:
    """(sqlite path, tape files) from the inputs."""
    dbs: list[Path] = []
    tapes: list[Path] = []
    for p in paths:
        if p.is_dir():
            db = p / DB_NAME
            if db.is_file():
                dbs.append(db)
            elif (p / f"{DB_NAME}.gz").is_file():
                dbs.append(p / f"{DB_NAME}.gz")
            tape_dir = p / "tapes" if (p / "tapes").is_dir() else p
            found = sorted(f for f in tape_dir.glob("*.json") if f.is_file())
            if not found and not dbs:
                raise ConvertError(p, f"neither {DB_NAME} nor tapes/*.json here; not a TapeAgents run folder")
            tapes.extend(found)
        elif p.is_file():
            if p.suffix == ".json":
                tapes.append(p)
            elif p.name.endswith((".sqlite", ".sqlite.gz", ".db")):
                dbs.append(p)
            else:
                raise ConvertError(p, "expected a TapeAgents sqlite database or a tape .json file")
        else:
            raise ConvertError(p, "no such file or directory")
    dbs = list(dict.fromkeys(dbs))
    if len(dbs) != 1:
        raise ConvertError(paths[0] if paths else Path("."),
                           f"expected one {DB_NAME} (got {len(dbs)}{': ' if dbs else ''}"
                           f"{', '.join(map(str, dbs))})")
    tapes = list(dict.fromkeys(tapes))
    if not tapes:
        raise ConvertError(dbs[0], "no tape files (tapes/*.json) to order the calls by")
    return dbs[0], tapes


def _read_llm_calls(db: Path) -> dict[str, tuple]:
    """prompt_id → (timestamp, prompt JSON, output JSON, prompt tokens, output tokens, llm_info JSON)."""
    with contextlib.ExitStack() as stack:
        path = db
        if db.name.endswith(".gz"):
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            path = Path(tmp) / DB_NAME
            try:
                with gzip.open(db, "rb") as src, path.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (OSError, EOFError) as exc:
                raise ConvertError(db, f"cannot decompress ({exc})") from None
        try:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        except sqlite3.Error as exc:
            raise ConvertError(db, f"cannot open as sqlite ({exc})") from None
        stack.callback(con.close)
        try:
            cur = con.execute("SELECT prompt_id, timestamp, prompt, output, prompt_length_tokens, "
                              "output_length_tokens, llm_info FROM LLMCalls")
            rows = cur.fetchall()
        except sqlite3.Error as exc:
            raise ConvertError(db, f"not a TapeAgents database (reading table LLMCalls: {exc})") from None
    return {r[0]: r[1:] for r in rows}


def _read_tape(path: Path) -> dict:
    try:
        tape = strict_json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConvertError(path, f"not JSON ({exc.msg}); expected a TapeAgents tape") from None
    if not (isinstance(tape, dict) and isinstance(tape.get("steps"), list)
            and all(isinstance(s, dict) and isinstance(s.get("metadata"), dict) for s in tape["steps"])):
        raise ConvertError(path, "not a TapeAgents tape (needs 'steps' with 'metadata')")
    return tape


def _message_text(content: object) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: keep the text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None


def _call(db: Path, prompt_id: str, row: tuple, step_meta: dict, think_s: float,
          task_id: object) -> ChatCall:
    timestamp, prompt_json, output_json, prompt_tokens, output_tokens, _ = row
    try:
        prompt, output = strict_json.loads(prompt_json), strict_json.loads(output_json)
    except (TypeError, json.JSONDecodeError):
        raise ConvertError(db, f"LLMCalls {prompt_id}: prompt/output is not JSON") from None
    raw_messages = prompt.get("messages") if isinstance(prompt, dict) else None
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ConvertError(db, f"LLMCalls {prompt_id}: prompt has no 'messages'")
    messages = []
    for m in raw_messages:
        text = _message_text(m.get("content")) if isinstance(m, dict) else None
        if text is None or not isinstance(m.get("role"), str):
            raise ConvertError(db, f"LLMCalls {prompt_id}: malformed message {m!r:.80}")
        messages.append({"role": m["role"], "content": text})
    text = _message_text(output.get("content")) if isinstance(output, dict) else None
    if not text:
        raise ConvertError(db, f"LLMCalls {prompt_id}: output has no text content")
    try:
        is_json = isinstance(strict_json.loads(text), dict)
    except json.JSONDecodeError:
        is_json = False
    role = step_meta.get("node") or step_meta.get("agent") or None
    extra: dict = {"prompt_id": prompt_id, "timestamp": timestamp}
    if isinstance(prompt_tokens, int) and isinstance(output_tokens, int) and prompt_tokens >= 0:
        extra["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens}
    if task_id is not None:
        extra["task_id"] = task_id
    return ChatCall(messages=messages, response=text, role=role if isinstance(role, str) else None,
                    structure=JSON_STRUCTURE if is_json else None, emission="json" if is_json else None,
                    think_s=round(think_s, 6), extra=extra)


def _tape_calls(db: Path, tape_path: Path, tape: dict, llm_calls: dict[str, tuple]) -> list[ChatCall]:
    task = tape.get("metadata", {}).get("task") if isinstance(tape.get("metadata"), dict) else None
    task_id = task.get("task_id") if isinstance(task, dict) else None
    calls: list[ChatCall] = []
    seen: set[str] = set()
    tool_time = 0.0
    for step in tape["steps"]:
        meta = step["metadata"]
        prompt_id = meta.get("prompt_id")
        if not prompt_id:
            other = meta.get("other")
            t = other.get("action_execution_time") if isinstance(other, dict) else None
            if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0:
                tool_time += float(t)
            continue
        if prompt_id in seen:
            continue
        seen.add(prompt_id)
        if prompt_id not in llm_calls:
            raise ConvertError(tape_path, f"step prompt_id {prompt_id!r} is not in {db.name}'s LLMCalls")
        calls.append(_call(db, prompt_id, llm_calls[prompt_id], meta, tool_time if calls else 0.0,
                           task_id))
        tool_time = 0.0
    return calls


@register("tapeagents", "TapeAgents run folder (tapedata.sqlite + tapes/*.json, e.g. GAIA) → one query per tape")
def convert_tapeagents(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then each tape's calls in step order; rules in the module docstring."""
    db, tape_files = _resolve(paths)
    llm_calls = _read_llm_calls(db)
    queries = [(f, _tape_calls(db, f, _read_tape(f), llm_calls)) for f in tape_files]
    stems = [f.stem for f in tape_files]
    for f in tape_files:
        if stems.count(f.stem) > 1:
            raise ConvertError(f, f"two tapes are named {f.stem!r}; query ids would clash")
    if not any(calls for _, calls in queries):
        raise ConvertError(db, "no tape step refers to an LLM call")
    models = {m for _, calls in queries for c in calls if (m := _model(llm_calls[c.extra["prompt_id"]][5]))}
    meta: dict = {"type": "meta", "version": 1, "tokenizer": opts.tokenizer}
    if models:
        meta["model"] = ",".join(sorted(models))
    meta["workload"] = "web-agent"
    meta["source"] = f"ServiceNow/TapeAgents GAIA run: {db.name} + {len(tape_files)} tapes"
    yield meta
    for f, calls in queries:
        if calls:
            yield from chat_call_records(AGENT_ID, f.stem, calls, opts)


def _model(llm_info: object) -> str | None:
    try:
        name = strict_json.loads(llm_info).get("model_name")  # type: ignore[arg-type]
    except (TypeError, AttributeError, json.JSONDecodeError):
        return None
    return name if isinstance(name, str) else None
