"""mini-swe-agent trajectories (`*.traj.json`) → trace records.

Input: `.traj.json` files or directories of them, each `{"messages": [...], "instance_id": ...,
"info": {...}, "trajectory_format": "mini-swe-agent-1"}`. Every assistant message is one LLM
call whose prompt is all earlier messages (system, task, earlier turns and observations).

Per call: agent_id `"mini-swe-agent"`, query_id = `instance_id` (else the file name without
`.traj.json`; a repeated id gets `#2`, `#3`...), role `"coder"`, structure = the fenced blocks the
recorded outputs use (```` ```bash ````, ```` ```python ````), output = the assistant text (+ the
end-of-turn text), `extra.usage` = `{prompt_tokens, completion_tokens}` from the message's
`extra.response.usage` when present (`extra` may be a dict, a JSON string or a Python-repr string,
read with `ast.literal_eval`; anything else is skipped). Trajectories without any assistant message
are skipped.

Shell heuristics (shared with the swe-agent converter; they look at the command only, and at one
command per call: the single ```` ```bash ```` block of the output):

- **Workspace** (what the agent read). A command that, after leading `cd DIR &&` steps and a
  trailing `2>&1`/`2>/dev/null`, is exactly one pipeline `cat [-n] FILE`, `nl [-ba] FILE`,
  `sed -n 'A,Bp' FILE`, `head [-n N] FILE` or `tail [-n N] FILE`, optionally piped through
  `sed -n 'A,Bp'` / `head` / `tail`, reads FILE (a sed address is a line number, `$` or
  `/regex/`; one range only). If it succeeded (return code 0) and its output was
  not truncated by the harness, the output becomes `{path, content}` on the **next** call, with the
  line-number prefixes of `nl`/`cat -n` removed so the content is the file's text. `path` is FILE
  as written (normalised). The field is incremental: a call lists only the files read since the
  previous call of its query (a path read again later replaces its content for the consumer).
  Anything else (`grep`, several files, redirections, heredocs) adds nothing.
- **Emission** (how a call writes code), on the call that issues the command: `"diff"` when it
  applies a patch (`git apply`, `patch -p1 ...`/`patch < f`, or a heredoc holding a unified diff);
  else `"raw"` when it writes file text: `sed -i`/`perl -pi`, a heredoc redirected into a file
  (`cat <<EOF > f`, `cat > f <<EOF`, `tee f <<EOF`), `echo`/`printf` redirected into a file, or a
  Python snippet that calls `.write(`/`.write_text(`/`.writelines(`. Otherwise no emission.
"""

from __future__ import annotations

import ast
import json
import posixpath
import re
import shlex
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
from agentspec_sim.trace.convert.openai_chat import content_text

AGENT_ID = "mini-swe-agent"
ROLE = "coder"
STRUCTURE = [[["```bash", "```"], ["```python", "```"]]]

# ---------------------------------------------------------------------------------------------
# Shell-command heuristics (also used by the swe-agent converter)
# ---------------------------------------------------------------------------------------------

_STDERR_REDIRECT = re.compile(r"\s*2>\s*(?:&1|/dev/null)")
_SED_ADDR = r"(?:\d+|\$|/[^/\n]*/)"
_SED_PRINT = re.compile(rf"^{_SED_ADDR}(?:,(?:{_SED_ADDR}|\+\d+))?p$")
_NUMBERED_LINE = re.compile(r" *\d+\t")
_BLANK_NL_LINE = re.compile(r" +\t?$")


def _tokens(command: str) -> list[str] | None:
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # unbalanced quotes
        return None


def _count_flag(args: list[str]) -> list[str] | None:
    """`head`/`tail` options: `-n N`, `-nN`, `-N`, `--lines=N`; returns the remaining operands."""
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-n" and i + 1 < len(args) and args[i + 1].lstrip("+-").isdigit():
            i += 2
            continue
        if re.fullmatch(r"-n?[+-]?\d+|--lines=[+-]?\d+", a):
            i += 1
            continue
        if a.startswith("-"):
            return None
        rest.append(a)
        i += 1
    return rest


def _read_source(stage: list[str]) -> tuple[str, bool] | None:
    """(file, numbered) when the first pipeline stage prints one file, else None."""
    if not stage:
        return None
    cmd, args = stage[0], stage[1:]
    if cmd == "cat":
        numbered = "-n" in args
        files = [a for a in args if a != "-n"]
    elif cmd == "nl":
        numbered, files = True, []
        i = 0
        while i < len(args):
            if args[i] == "-ba":
                i += 1
            elif args[i] == "-b" and args[i + 1:i + 2] == ["a"]:
                i += 2
            elif args[i].startswith("-"):
                return None
            else:
                files.append(args[i])
                i += 1
    elif cmd == "sed":
        if len(args) != 3 or args[0] != "-n" or not _SED_PRINT.match(args[1]):
            return None
        numbered, files = False, args[2:]
    elif cmd in ("head", "tail"):
        numbered = False
        files = _count_flag(args) or []
    else:
        return None
    if len(files) != 1 or files[0].startswith("-"):
        return None
    return files[0], numbered


def _is_filter(stage: list[str]) -> bool:
    if not stage:
        return False
    cmd, args = stage[0], stage[1:]
    if cmd == "sed":
        return len(args) == 2 and args[0] == "-n" and bool(_SED_PRINT.match(args[1]))
    if cmd in ("head", "tail"):
        return _count_flag(args) == []
    return False


def read_command(command: str) -> tuple[str, bool] | None:
    """(path, numbered) if `command` just prints (part of) one file, else None.

    `numbered` says the output carries `nl`/`cat -n` line-number prefixes.
    """
    command = command.strip()
    if not command or "\n" in command or "<<" in command:
        return None
    tokens = _tokens(_STDERR_REDIRECT.sub("", command))
    if not tokens:
        return None
    # steps separated by && or ;
    steps: list[list[str]] = [[]]
    for t in tokens:
        if t in ("&&", ";"):
            steps.append([])
        else:
            steps[-1].append(t)
    while len(steps) > 1 and steps[0][:1] == ["cd"] and len(steps[0]) == 2:
        steps.pop(0)
    if len(steps) != 1:
        return None
    stages: list[list[str]] = [[]]
    for t in steps[0]:
        if t == "|":
            stages.append([])
        elif set(t) <= set("<>&|;()"):
            return None  # redirections, background, subshells, ||
        else:
            stages[-1].append(t)
    source = _read_source(stages[0])
    if source is None or not all(_is_filter(s) for s in stages[1:]):
        return None
    path, numbered = source
    return posixpath.normpath(path), numbered


def strip_line_numbers(text: str) -> str:
    """Remove `nl -ba` / `cat -n` prefixes (`     12\\t`) from every line."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = _NUMBERED_LINE.match(line)
        if m:
            lines[i] = line[m.end():]
        elif _BLANK_NL_LINE.match(line):  # `nl` without -ba leaves blank lines unnumbered
            lines[i] = ""
    return "\n".join(lines)


_DIFF_APPLY = re.compile(r"\bgit\s+apply\b|\bpatch\b(?:\s+-{1,2}[\w=.-]+)*\s+(?:<|-p\d|-i\b|--input)")
_DIFF_BODY = re.compile(r"^--- \S.*\n\+\+\+ \S.*\n(?:.*\n)*?@@ ", re.M)
_AT_COMMAND = r"(?:^|[;&|(])\s*"  # a word in command position, not an argument
_SED_INPLACE = re.compile(_AT_COMMAND + r"(?:sed|perl)\s[^\n|;&]*?-(?:[a-zA-Z]*i|pi)\b", re.M)
_HEREDOC_WRITE = re.compile(
    r"^[^\n]*(?:\bcat\b[^\n]*(?<![0-9&])>>?[^\n]*<<|\bcat\b[^\n]*<<[^\n]*(?<![0-9&])>>?|\btee\b[^\n]*<<"
    r"|<<[^\n]*\|\s*tee\b)",
    re.M,
)
_ECHO_WRITE = re.compile(
    _AT_COMMAND + r"(?:echo|printf)\b[^\n;&|]*?(?<![0-9&])>>?\s*(?!/dev/null)(?!&)[^\s;&|]+", re.M
)
_PY_WRITE = re.compile(r"\.write(?:_text|lines)?\(")
_PYTHON = re.compile(r"\bpython[\d.]*\b")


def command_emission(command: str) -> str | None:
    """`"diff"`, `"raw"` or None: how `command` writes code (see the module docstring)."""
    if _DIFF_APPLY.search(command) or ("<<" in command and _DIFF_BODY.search(command)):
        return "diff"
    if (
        _SED_INPLACE.search(command)
        or ("<<" in command and _HEREDOC_WRITE.search(command))
        or _ECHO_WRITE.search(command)
        or (_PYTHON.search(command) and _PY_WRITE.search(command))
    ):
        return "raw"
    return None


# ---------------------------------------------------------------------------------------------
# The converter
# ---------------------------------------------------------------------------------------------

_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n```", re.S)
_RETURNCODE = re.compile(r"^<returncode>(-?\d+)</returncode>")
_OUTPUT = re.compile(r"<output>\n(.*)</output>\s*$", re.S)


def _command(text: str) -> str | None:
    """The action of an assistant message: its only ```bash block (mini-swe-agent's rule)."""
    blocks = _BASH_BLOCK.findall(text)
    return blocks[0].strip() if len(blocks) == 1 else None


def _observation_output(text: str) -> str | None:
    """The complete output of a successful command, or None (failed, truncated, not an observation)."""
    m = _RETURNCODE.match(text)
    if not m or m.group(1) != "0" or "<output_head>" in text:
        return None
    out = _OUTPUT.search(text)
    return out.group(1) if out else None


def _parse_obj(value: object) -> object:
    """A dict from a dict, a JSON string or a Python-repr string; else None. Never evaluates code."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        return None
    for parse in (strict_json.loads, ast.literal_eval):
        try:
            parsed = parse(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(parsed, dict):
            return parsed
    return None


def usage_of(extra: object) -> dict | None:
    """`{prompt_tokens, completion_tokens}` from a message's `extra.response.usage` (or `extra.usage`)."""
    extra = _parse_obj(extra)
    if not isinstance(extra, dict):
        return None
    usage = None
    response = _parse_obj(extra.get("response"))
    if isinstance(response, dict):
        usage = _parse_obj(response.get("usage"))
    if not isinstance(usage, dict):
        usage = _parse_obj(extra.get("usage"))
    if not isinstance(usage, dict):
        return None
    picked = {
        k: usage[k] for k in ("prompt_tokens", "completion_tokens")
        if isinstance(usage.get(k), int) and not isinstance(usage.get(k), bool)
    }
    return picked or None


def _load(path: Path) -> dict:
    try:
        data = strict_json.loads(path.read_text("utf-8-sig"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConvertError(path, f"not a mini-swe-agent trajectory: not a JSON document ({exc.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        hint = ""
        if isinstance(data, dict) and "history" in data:
            hint = " (a SWE-agent .traj: use the swe-agent converter)"
        raise ConvertError(path, f"not a mini-swe-agent trajectory: no `messages` list{hint}")
    fmt = data.get("trajectory_format")
    if fmt is not None and not (isinstance(fmt, str) and fmt.startswith("mini-swe-agent")):
        raise ConvertError(path, f"not a mini-swe-agent trajectory: trajectory_format {fmt!r}")
    for i, m in enumerate(data["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ConvertError(path, f"messages[{i}]: expected an object with `role` and `content`")
    return data


def _model(data: dict) -> str | None:
    config = data.get("info", {}).get("config") if isinstance(data.get("info"), dict) else None
    model = config.get("model") if isinstance(config, dict) else None
    name = model.get("model_name") if isinstance(model, dict) else None
    return name.lstrip("@") if isinstance(name, str) else None


def trajectory_calls(path: Path, messages: list[dict]) -> list[ChatCall]:
    """One ChatCall per assistant message of a mini-swe-agent `messages` list."""
    try:
        msgs = [{"role": m["role"], "content": content_text(m["content"])} for m in messages]
    except TypeError as exc:
        raise ConvertError(path, f"messages: {exc}") from None
    calls: list[ChatCall] = []
    pending: list[dict] = []  # files read by the previous call, for the next one
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        command = _command(m["content"])
        emission = command_emission(command) if command else None
        usage = usage_of(messages[i].get("extra"))
        calls.append(ChatCall(
            messages=msgs[:i], response=m["content"], role=ROLE, structure=STRUCTURE,
            workspace=pending or None, emission=emission,
            extra={"usage": usage} if usage else None,
        ))
        pending = []
        read = read_command(command) if command else None
        if read and i + 1 < len(msgs) and msgs[i + 1]["role"] != "assistant":
            output = _observation_output(msgs[i + 1]["content"])
            if output is not None:
                file, numbered = read
                pending = [{"path": file, "content": strip_line_numbers(output) if numbered else output}]
    return calls


@register("mini-swe-agent", "mini-swe-agent trajectories (*.traj.json): one call per assistant message")
def convert(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then every trajectory's calls (one query per file)."""
    files = expand_inputs(paths, "*.traj.json")
    queries: list[tuple[str, list[ChatCall]]] = []
    models: set[str] = set()
    versions: set[str] = set()
    seen: dict[str, int] = {}
    for path in files:
        data = _load(path)
        calls = trajectory_calls(path, data["messages"])
        if not calls:
            continue
        iid = data.get("instance_id")
        qid = iid if isinstance(iid, str) and iid else path.name.removesuffix(".json").removesuffix(".traj")
        seen[qid] = seen.get(qid, 0) + 1
        if seen[qid] > 1:
            qid = f"{qid}#{seen[qid]}"
        queries.append((qid, calls))
        if model := _model(data):
            models.add(model)
        info = data.get("info")
        if isinstance(info, dict) and isinstance(info.get("mini_version"), str):
            versions.add(info["mini_version"])
    if not queries:
        raise ConvertError(files[0], "no LLM calls (no assistant messages) in the input")
    version = f" {', '.join(sorted(versions))}" if versions else ""
    yield {
        "type": "meta", "version": 1, "tokenizer": opts.tokenizer,
        "model": ", ".join(sorted(models)) if models else None, "workload": "coding",
        "source": f"mini-swe-agent{version} trajectories ({len(queries)} files)",
    }
    for qid, calls in queries:
        yield from chat_call_records(AGENT_ID, qid, calls, opts)
