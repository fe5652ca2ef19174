"""SWE-agent trajectories (`*.traj`) → trace records.

Input: `.traj` files or directories of them: JSON objects with `history` (the chat messages the
agent kept: system prompt, demonstrations, task, then assistant actions and observations) and
`trajectory` (thought/action/observation steps). Every assistant message of `history` is one LLM
call whose prompt is all earlier `history` messages. (SWE-agent may have shortened old
observations with its history processors before sending; the `.traj` keeps the full history, so
prompts here are that full history. A final step that appears in `trajectory` but not in
`history` is not a call here.)

Per call: agent_id `"swe-agent"`, query_id = the file name without `.traj` (a repeated one gets
`#2`, `#3`...), role `"coder"`. Two output formats are recognised, per message:

- **text** (DISCUSSION + one fenced command block, SWE-agent ≤ 0.7): structure
  `[[["```", "```"]]]`, output = the message text.
- **function calling** (the message has `tool_calls`, SWE-agent ≥ 1.0): output = the thought text
  followed by each tool call written the way the Qwen3 chat template renders it
  (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`), also inside later prompts, so
  the delta form still applies; structure `[[["<tool_call>", "</tool_call>"]]]`; observations keep
  their `tool` role.

The action is the message's `action` field (else the tool call, else the last fenced block).

- **Emission**: `edit`/`insert`/`append` and `str_replace_editor create|str_replace|insert` write
  code; other actions go through the shell heuristics of the mini-swe-agent converter (`sed -i`,
  heredoc into a file → raw; `git apply`/`patch` → diff). The code is written raw in the text
  format (`"raw"`, or `"diff"` for patches), but JSON-escaped inside the tool-call arguments in
  the function-calling format (`"json"`).
- **Workspace** (incremental: the files seen in the observation of call k are listed on call
  k+1): a file window in an observation (`[File: PATH (N lines total)]` followed by `N:line`
  lines, as `open`, `goto`, `scroll_*`, `edit` print), with the line numbers and the
  `(N more lines above/below)` markers removed; `str_replace_editor view` output (`cat -n` form);
  and shell reads (`cat FILE`, `nl -ba FILE | sed -n ...`, `head FILE`: the rules of the
  mini-swe-agent converter) whose output is not an error message. Edit previews that were not
  applied ("Your proposed edit has introduced new syntax error(s)") add nothing.
"""

from __future__ import annotations

import json
import re
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
from agentspec_sim.trace.convert.mini_swe_agent import command_emission, read_command, strip_line_numbers
from agentspec_sim.trace.convert.openai_chat import content_text, message_text

AGENT_ID = "swe-agent"
ROLE = "coder"
TEXT_STRUCTURE = [[["```", "```"]]]
TOOL_STRUCTURE = [[["<tool_call>", "</tool_call>"]]]

_EDIT_COMMANDS = {"edit", "insert", "append"}
_EDITOR_WRITES = {"create", "str_replace", "insert"}
_FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_TRAILER = re.compile(r"\s*\(Open file: [^\n]*\)\s*\n\(Current directory: [^\n]*\)\s*(?:\n\S*\$\s*)?$")
_WINDOW_HEADER = re.compile(r"^\[File: (?P<path>[^\n]+?) \(\d+ lines total\)\]$", re.M)
_WINDOW_LINE = re.compile(r"^(\d+):(.*)$")
_WINDOW_MARK = re.compile(r"^\(\d+ more lines (?:above|below)\)$")
_EDITOR_VIEW = re.compile(r"^Here's the result of running `cat -n` on (?P<path>[^\n]+?):\n", re.M)
_NOT_APPLIED = ("Your proposed edit has introduced", "This is how your edit would have looked")
_READ_ERROR = re.compile(r"^(?:cat|nl|sed|head|tail): ")


def _action(message: dict) -> str:
    """The command an assistant message issued ("" when none is recognisable)."""
    action = message.get("action")
    if isinstance(action, str) and action.strip():
        return action.strip()
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls and isinstance(calls[0], dict):
        fn = calls[0].get("function", calls[0])
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = strict_json.loads(args)
                except json.JSONDecodeError:
                    args = {}
            if fn["name"] == "bash" and isinstance(args, dict) and isinstance(args.get("command"), str):
                return args["command"].strip()
            values = [str(v) for v in args.values()] if isinstance(args, dict) else []
            return " ".join([fn["name"], *values])
    blocks = _FENCED.findall(content_text(message.get("content")))
    return blocks[-1].strip() if blocks else ""


def action_emission(action: str, tool_format: bool) -> str | None:
    """How the call that issued `action` writes code (see the module docstring)."""
    words = action.split(maxsplit=2)
    if not words:
        return None
    head = words[0]
    if head in _EDIT_COMMANDS or (head == "str_replace_editor" and words[1:2] and words[1] in _EDITOR_WRITES):
        kind: str | None = "raw"
    elif head in ("str_replace_editor", "create", "open", "goto", "scroll_up", "scroll_down", "submit",
                  "find_file", "search_dir", "search_file"):
        kind = None
    else:
        kind = command_emission(action)
    if kind is not None and tool_format:
        return "json"
    return kind


def _strip_trailer(observation: str) -> str:
    return _TRAILER.sub("", observation.replace("\r\n", "\n"))


def _window(observation: str) -> dict | None:
    """The file window an observation shows, as {path, content} without line numbers."""
    m = _WINDOW_HEADER.search(observation)
    if not m:
        return None
    lines: list[str] = []
    for line in observation[m.end() + 1:].split("\n"):
        if _WINDOW_MARK.match(line):
            continue
        numbered = _WINDOW_LINE.match(line)
        if not numbered:
            break
        lines.append(numbered.group(2))
    if not lines:
        return None
    return {"path": m.group("path"), "content": "\n".join(lines) + "\n"}


def observation_files(action: str, observation: str) -> list[dict]:
    """Files an observation shows (the workspace of the next call)."""
    if any(phrase in observation for phrase in _NOT_APPLIED):
        return []
    obs = _strip_trailer(observation)
    window = _window(obs)
    if window is not None:
        return [window]
    view = _EDITOR_VIEW.search(obs)
    if view is not None:
        return [{"path": view.group("path"), "content": strip_line_numbers(obs[view.end():])}]
    read = read_command(action)
    if read is not None and obs.strip() and not _READ_ERROR.match(obs):
        path, numbered = read
        return [{"path": path, "content": strip_line_numbers(obs) if numbered else obs}]
    return []


def _load(path: Path) -> dict:
    try:
        data = strict_json.loads(path.read_text("utf-8-sig"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConvertError(path, f"not a SWE-agent trajectory: not a JSON document ({exc.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("history"), list):
        hint = ""
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            hint = " (a mini-swe-agent trajectory: use the mini-swe-agent converter)"
        raise ConvertError(path, f"not a SWE-agent trajectory: no `history` list{hint}")
    if not isinstance(data.get("trajectory", []), list):
        raise ConvertError(path, "not a SWE-agent trajectory: `trajectory` is not a list")
    for i, m in enumerate(data["history"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConvertError(path, f"history[{i}]: expected an object with a string `role`")
    return data


def _model(data: dict) -> str | None:
    """The model from `replay_config.agent.model.name` (newer SWE-agent), else None."""
    replay = data.get("replay_config")
    if isinstance(replay, str):
        try:
            replay = strict_json.loads(replay)
        except json.JSONDecodeError:
            replay = None
    agent = replay.get("agent") if isinstance(replay, dict) else None
    model = agent.get("model") if isinstance(agent, dict) else None
    if isinstance(model, dict) and isinstance(model.get("name"), str):
        return model["name"]
    return None


def trajectory_calls(path: Path, history: list[dict]) -> list[ChatCall]:
    """One ChatCall per assistant message of a SWE-agent `history`."""
    try:
        msgs = [{"role": m["role"], "content": message_text(m)} for m in history]
    except TypeError as exc:
        raise ConvertError(path, f"history: {exc}") from None
    calls: list[ChatCall] = []
    pending: list[dict] = []
    for i, m in enumerate(history):
        if m["role"] != "assistant":
            continue
        tool_format = bool(m.get("tool_calls"))
        action = _action(m)
        calls.append(ChatCall(
            messages=msgs[:i], response=msgs[i]["content"], role=ROLE,
            structure=TOOL_STRUCTURE if tool_format else TEXT_STRUCTURE,
            workspace=pending or None, emission=action_emission(action, tool_format),
        ))
        pending = []
        j = i + 1
        while j < len(history) and history[j]["role"] != "assistant":
            for f in observation_files(action, msgs[j]["content"]):
                pending = [p for p in pending if p["path"] != f["path"]] + [f]
            j += 1
    return calls


@register("swe-agent", "SWE-agent trajectories (*.traj): one call per assistant message of `history`")
def convert(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then every trajectory's calls (one query per file)."""
    files = expand_inputs(paths, "*.traj")
    queries: list[tuple[str, list[ChatCall]]] = []
    models: set[str] = set()
    seen: dict[str, int] = {}
    for path in files:
        data = _load(path)
        calls = trajectory_calls(path, data["history"])
        if not calls:
            continue
        qid = path.name.removesuffix(".traj")
        seen[qid] = seen.get(qid, 0) + 1
        if seen[qid] > 1:
            qid = f"{qid}#{seen[qid]}"
        queries.append((qid, calls))
        if model := _model(data):
            models.add(model)
    if not queries:
        raise ConvertError(files[0], "no LLM calls (no assistant messages in `history`)")
    yield {
        "type": "meta", "version": 1, "tokenizer": opts.tokenizer,
        "model": ", ".join(sorted(models)) if models else None, "workload": "coding",
        "source": f"SWE-agent trajectories ({len(queries)} files)",
    }
    for qid, calls in queries:
        yield from chat_call_records(AGENT_ID, qid, calls, opts)
