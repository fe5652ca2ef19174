"""Chat-log converters: mini-swe-agent, SWE-agent and generic OpenAI-style JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentspec_sim.trace.convert import CONVERTERS, mini_swe_agent, openai_chat, swe_agent
from agentspec_sim.trace.convert.base import ConvertError, ConvertOptions
from agentspec_sim.trace.convert.mini_swe_agent import command_emission, read_command, strip_line_numbers
from agentspec_sim.trace.convert.swe_agent import action_emission, observation_files

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MINI_DIR = TRACES / "mini-swe-agent_gemini3pro_swebench_verified"
SWE_DIR = TRACES / "swe-agent_repo_trajs"
OPTS = ConvertOptions()
EOT = OPTS.eot_text


# ---------------------------------------------------------------------------------------------
# helpers


def convert(name: str, paths: list[Path]) -> list[dict]:
    return list(CONVERTERS[name].convert(paths, OPTS))


def check_records(records: list[dict]) -> list[dict]:
    """Meta first; ids unique; seq 0..n-1 per query; outputs end with the end-of-turn text."""
    meta, calls = records[0], records[1:]
    assert meta["type"] == "meta" and meta["version"] == 1 and meta["tokenizer"] == OPTS.tokenizer
    assert calls and all(r["type"] == "call" for r in calls)
    ids = [r["id"] for r in calls]
    assert len(ids) == len(set(ids))
    by_query: dict[tuple, list[int]] = {}
    for r in calls:
        by_query.setdefault((r["agent_id"], r["query_id"]), []).append(r["seq"])
        assert r["output"].endswith(EOT)
    for seqs in by_query.values():
        assert seqs == list(range(len(seqs)))
    return calls


def assert_chained(calls: list[dict]) -> None:
    """Every call after a query's first extends the previous call of that query."""
    previous: dict[tuple, str] = {}
    for r in calls:
        key = (r["agent_id"], r["query_id"])
        if key in previous:
            assert r.get("prompt_extends") == previous[key], r["id"]
            assert "messages" not in r and r["messages_append"]
        else:
            assert "messages" in r and "prompt_extends" not in r
        previous[key] = r["id"]


def full_messages(records: list[dict], call_id: str) -> list[dict]:
    """The whole chat of a call, following prompt_extends links."""
    by_id = {r["id"]: r for r in records[1:]}
    r = by_id[call_id]
    if "messages" in r:
        return list(r["messages"])
    parent = by_id[r["prompt_extends"]]
    reply = {"role": "assistant", "content": parent["output"].removesuffix(EOT)}
    return [*full_messages(records, parent["id"]), reply, *r["messages_append"]]


def write_json(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj), "utf-8")
    return path


def obs(output: str, code: int = 0) -> dict:
    return {"role": "user", "content": f"<returncode>{code}</returncode>\n<output>\n{output}</output>"}


def asst(command: str, extra: object = None) -> dict:
    msg = {"role": "assistant", "content": f"THOUGHT: step.\n\n```bash\n{command}\n```"}
    if extra is not None:
        msg["extra"] = extra
    return msg


def mini_traj(messages: list[dict], instance_id: str = "repo__repo-1") -> dict:
    return {
        "info": {"config": {"model": {"model_name": "test/model"}}, "mini_version": "1.15.0"},
        "messages": messages, "trajectory_format": "mini-swe-agent-1", "instance_id": instance_id,
    }


def test_registered() -> None:
    assert CONVERTERS["mini-swe-agent"].convert is mini_swe_agent.convert
    assert CONVERTERS["swe-agent"].convert is swe_agent.convert
    assert CONVERTERS["openai-chat"].convert is openai_chat.convert


# ---------------------------------------------------------------------------------------------
# shell heuristics


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("cat src/app.py", ("src/app.py", False)),
        ("cat -n ./src/app.py", ("src/app.py", True)),
        ("cd /testbed && nl -ba a/b.py | sed -n '10,40p'", ("a/b.py", True)),
        ("nl -b a a/b.py", ("a/b.py", True)),
        ("sed -n '5,9p' a.py", ("a.py", False)),
        ("sed -n '/def f/,/return/p' a.py", ("a.py", False)),
        ("head -n 20 a.py", ("a.py", False)),
        ("tail -30 a.py 2>&1", ("a.py", False)),
        ("cat 'my file.py' | head -5", ("my file.py", False)),
        ("cat a.py b.py", None),
        ("cat a.py | grep def", None),
        ("nl -ba a.py | grep -n x", None),
        ("cat a.py > b.py", None),
        ("cat <<'EOF' > a.py\nx = 1\nEOF", None),
        ("ls && cat a.py", None),
        ("sed -n '1,5p;9,12p' a.py", None),
        ("sed -i 's/a/b/' a.py", None),
        ("grep -n def a.py", None),
        ("cat 'unbalanced", None),
    ],
)
def test_read_command(command: str, expected: tuple | None) -> None:
    assert read_command(command) == expected


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("git apply fix.patch", "diff"),
        ("patch -p1 < fix.diff", "diff"),
        ("cat <<'EOF' > f.patch && git apply f.patch\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\nEOF", "diff"),
        ("cat <<'EOF' > x.py\nprint(1)\nEOF", "raw"),
        ("cat > x.py <<'EOF'\nprint(1)\nEOF", "raw"),
        ("cat <<'EOF' >> tests/test_x.py\ndef test(): pass\nEOF", "raw"),
        ("tee x.py <<'EOF'\nprint(1)\nEOF", "raw"),
        ("sed -i 's/a/b/' x.py", "raw"),
        ("sed -i.bak -e 's/a/b/' x.py", "raw"),
        ("echo 'x = 1' > x.py", "raw"),
        ("python3 -c \"open('x.py', 'w').write('x = 1')\"", "raw"),
        ("python - <<'EOF'\nfrom pathlib import Path\nPath('x.py').write_text('x')\nEOF", "raw"),
        ("python reproduce.py", None),
        ("python3 - <<'EOF'\nprint(1)\nEOF", None),
        ("cat x.py", None),
        ("echo hi 2>&1", None),
        ("echo hi > /dev/null", None),
        ("python -c 'from unittest.mock import patch'", None),
        ("grep -rn 'sed -i' .", None),
    ],
)
def test_command_emission(command: str, expected: str | None) -> None:
    assert command_emission(command) == expected


def test_strip_line_numbers() -> None:
    assert strip_line_numbers("     1\tdef f():\n     2\t\treturn 1\n     3\t\n") == "def f():\n\treturn 1\n\n"
    assert strip_line_numbers("     1\ta\n       \n     2\tb") == "a\n\nb"  # `nl` without -ba


# ---------------------------------------------------------------------------------------------
# mini-swe-agent


def crafted_mini(tmp_path: Path) -> Path:
    usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "<pr_description>Fix f.</pr_description>"}]},
        asst("nl -ba src/app.py | sed -n '1,3p'", extra={"response": {"usage": usage}}),
        obs("     1\tdef f():\n     2\t    return 1\n     3\t\n"),
        asst("cat <<'EOF' > src/new.py\nprint('new')\nEOF", extra=repr({"response": {"usage": usage}})),
        obs(""),
        asst("git apply fix.patch", extra="not a dict"),
        obs("", code=1),
        asst("cat src/other.py"),
        {"role": "user", "content": "<returncode>0</returncode>\n<warning>\nlong\n</warning><output_head>\na\n"
                                    "</output_head>\n<elided_chars>\n9 characters elided\n</elided_chars>"},
        asst("cat src/app.py"),
        obs("def f():\n    return 2\n"),
        asst("echo done"),
    ]
    return write_json(tmp_path / "repo__repo-1.traj.json", mini_traj(messages))


def test_mini_swe_agent_crafted(tmp_path: Path) -> None:
    records = convert("mini-swe-agent", [crafted_mini(tmp_path)])
    meta = records[0]
    assert meta["model"] == "test/model" and meta["workload"] == "coding"
    calls = check_records(records)
    assert len(calls) == 6
    assert_chained(calls)
    assert calls[0]["messages"][1]["content"] == "<pr_description>Fix f.</pr_description>"
    assert all(r["agent_id"] == "mini-swe-agent" and r["query_id"] == "repo__repo-1" for r in calls)
    assert all(r["role"] == "coder" and r["structure"] == mini_swe_agent.STRUCTURE for r in calls)
    assert calls[0]["output"] == "THOUGHT: step.\n\n```bash\nnl -ba src/app.py | sed -n '1,3p'\n```" + EOT
    # workspace: what call k read appears on call k+1 only, numbers stripped
    assert "workspace" not in calls[0]
    assert calls[1]["workspace"] == [{"path": "src/app.py", "content": "def f():\n    return 1\n\n"}]
    assert "workspace" not in calls[2] and "workspace" not in calls[3]
    assert "workspace" not in calls[4]  # truncated output: not the file's content
    assert calls[5]["workspace"] == [{"path": "src/app.py", "content": "def f():\n    return 2\n"}]
    assert [r.get("emission") for r in calls] == [None, "raw", "diff", None, None, None]
    usage = {"prompt_tokens": 100, "completion_tokens": 20}
    assert calls[0]["extra"] == {"usage": usage} and calls[1]["extra"] == {"usage": usage}
    assert "extra" not in calls[2] and "extra" not in calls[3]


def test_mini_swe_agent_failed_read_adds_nothing(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "task"},
        asst("cat missing.py"), obs("cat: missing.py: No such file or directory\n", code=1),
        asst("echo hi"),
    ]
    calls = check_records(convert("mini-swe-agent", [write_json(tmp_path / "a.traj.json", mini_traj(messages))]))
    assert all("workspace" not in r for r in calls)


def test_mini_swe_agent_directory_and_duplicate_ids(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "t"}, asst("ls")]
    write_json(tmp_path / "a.traj.json", mini_traj(messages, "same"))
    write_json(tmp_path / "b.traj.json", mini_traj(messages, "same"))
    write_json(tmp_path / "empty.traj.json", mini_traj(messages[:2], "none"))  # no calls: skipped
    (tmp_path / "notes.json").write_text("[]")  # not matched by *.traj.json
    calls = check_records(convert("mini-swe-agent", [tmp_path]))
    assert [r["query_id"] for r in calls] == ["same", "same#2"]


def test_mini_swe_agent_rejects_other_formats(tmp_path: Path) -> None:
    storm = tmp_path / "llm_call_history.jsonl"
    storm.write_text('{"prompt": "p", "response": {"choices": []}}\n{"prompt": "q", "response": {}}\n')
    with pytest.raises(ConvertError, match=r"llm_call_history\.jsonl: not a mini-swe-agent trajectory"):
        convert("mini-swe-agent", [storm])
    swe = write_json(tmp_path / "x.traj", {"history": [], "trajectory": []})
    with pytest.raises(ConvertError, match=r"x\.traj: .*use the swe-agent converter"):
        convert("mini-swe-agent", [swe])
    other = write_json(tmp_path / "y.traj.json", {"messages": [], "trajectory_format": "other-1"})
    with pytest.raises(ConvertError, match="trajectory_format"):
        convert("mini-swe-agent", [other])
    bad_msg = write_json(tmp_path / "z.traj.json", {"messages": [{"content": "no role"}]})
    with pytest.raises(ConvertError, match=r"z\.traj\.json: messages\[0\]"):
        convert("mini-swe-agent", [bad_msg])
    with pytest.raises(ConvertError, match="no such file"):
        convert("mini-swe-agent", [tmp_path / "absent.traj.json"])


def test_usage_of_variants() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    assert mini_swe_agent.usage_of({"response": {"usage": usage}}) == usage
    assert mini_swe_agent.usage_of(json.dumps({"response": {"usage": usage}})) == usage
    assert mini_swe_agent.usage_of(repr({"response": {"usage": usage, "x": None}})) == usage
    assert mini_swe_agent.usage_of("__import__('os').system('true')") is None  # never evaluated
    assert mini_swe_agent.usage_of({"response": {}}) is None
    assert mini_swe_agent.usage_of(None) is None


# ---------------------------------------------------------------------------------------------
# SWE-agent

_TRAILER = "\n(Open file: /r/a.py)\n(Current directory: /r)\nbash-$"


def text_format_traj() -> dict:
    window = "[File: /r/a.py (3 lines total)]\n1:def f():\n2:    return 1\n3:\n"
    edited = "[File: /r/a.py (3 lines total)]\n(0 more lines above)\n1:def f():\n2:    return 2\n3:\n"
    preview = ("Your proposed edit has introduced new syntax error(s).\n[File: /r/a.py (3 lines total)]\n"
               "1:def f(:\n")
    return {
        "environment": "swe_main",
        "history": [
            {"role": "system", "content": "SETTING: ..."},
            {"role": "user", "content": "demo", "is_demo": True},
            {"role": "user", "content": "ISSUE: f returns 1"},
            {"role": "assistant", "content": "Open it.\n\n```\nopen a.py\n```", "action": "open a.py\n"},
            {"role": "user", "content": window + _TRAILER},
            {"role": "assistant", "content": "Bad edit.\n\n```\nedit 1:1\ndef f(:\nend_of_edit\n```",
             "action": "edit 1:1\ndef f(:\nend_of_edit\n"},
            {"role": "user", "content": preview + _TRAILER},
            {"role": "assistant", "content": "Fix.\n\n```\nedit 2:2\n    return 2\nend_of_edit\n```"},
            {"role": "user", "content": edited + "File updated." + _TRAILER},
            {"role": "assistant", "content": "Look.\n\n```\ncat -n b.py\n```", "action": "cat -n b.py\n"},
            {"role": "user", "content": "     1\tx = 1\n" + _TRAILER},
            {"role": "assistant", "content": "Done.\n\n```\nsubmit\n```", "action": "submit\n"},
        ],
        "trajectory": [],
        "info": {"exit_status": "submitted"},
    }


def tool_format_traj() -> dict:
    def call(name: str, args: dict) -> list[dict]:
        return [{"function": {"name": name, "arguments": json.dumps(args)}, "id": "c", "type": "function"}]

    return {
        "history": [
            {"role": "system", "content": "SETTING"},
            {"role": "user", "content": [{"type": "text", "text": "ISSUE"}]},
            {"role": "assistant", "content": "Open.", "action": 'open "/r/a.py"',
             "tool_calls": call("open", {"path": "/r/a.py"})},
            {"role": "tool", "content": "[File: /r/a.py (1 lines total)]\r\n1:x = 1\r\n" + _TRAILER},
            {"role": "assistant", "content": "Edit.", "action": "edit 'x = 1' 'x = 2' False",
             "tool_calls": call("edit", {"search": "x = 1", "replace": "x = 2"})},
            {"role": "tool", "content": "Replaced 1 occurrences."},
            {"role": "assistant", "content": "", "tool_calls": call("bash", {"command": "python a.py"})},
        ],
        "trajectory": [],
        "replay_config": {"agent": {"model": {"name": "gpt-4o"}}},
    }


def test_swe_agent_text_format(tmp_path: Path) -> None:
    records = convert("swe-agent", [write_json(tmp_path / "inst-1.traj", text_format_traj())])
    calls = check_records(records)
    assert len(calls) == 5
    assert_chained(calls)
    assert all(r["query_id"] == "inst-1" and r["agent_id"] == "swe-agent" and r["role"] == "coder" for r in calls)
    assert all(r["structure"] == swe_agent.TEXT_STRUCTURE for r in calls)
    assert calls[1]["workspace"] == [{"path": "/r/a.py", "content": "def f():\n    return 1\n\n"}]
    assert "workspace" not in calls[2]  # the preview of an edit that was not applied
    assert calls[3]["workspace"] == [{"path": "/r/a.py", "content": "def f():\n    return 2\n\n"}]
    assert calls[4]["workspace"] == [{"path": "b.py", "content": "x = 1"}]  # `cat -n`, numbers stripped
    assert [r.get("emission") for r in calls] == [None, "raw", "raw", None, None]
    assert len(calls[0]["messages"]) == 3  # system, demonstration, issue


def test_swe_agent_function_calling(tmp_path: Path) -> None:
    records = convert("swe-agent", [write_json(tmp_path / "fc.traj", tool_format_traj())])
    assert records[0]["model"] == "gpt-4o"
    calls = check_records(records)
    assert_chained(calls)
    assert calls[0]["output"] == (
        'Open.\n<tool_call>\n{"name": "open", "arguments": {"path": "/r/a.py"}}\n</tool_call>' + EOT
    )
    assert calls[2]["output"].startswith('<tool_call>\n{"name": "bash"')  # no text: no leading newline
    assert calls[0]["messages"][1] == {"role": "user", "content": "ISSUE"}
    assert calls[1]["messages_append"][0]["role"] == "tool"
    assert all(r["structure"] == swe_agent.TOOL_STRUCTURE for r in calls)
    assert calls[1]["workspace"] == [{"path": "/r/a.py", "content": "x = 1\n"}]
    assert [r.get("emission") for r in calls] == [None, "json", None]


def test_swe_agent_helpers() -> None:
    assert action_emission("edit 3:4\nx\nend_of_edit", tool_format=False) == "raw"
    assert action_emission("str_replace_editor create /a.py --file_text x", tool_format=True) == "json"
    assert action_emission("str_replace_editor view /a.py", tool_format=True) is None
    assert action_emission("git apply p.diff", tool_format=False) == "diff"
    assert action_emission("create a.py", tool_format=False) is None
    view = "Here's the result of running `cat -n` on /r/a.py:\n     1\tx = 1\n     2\ty = 2\n"
    expected = [{"path": "/r/a.py", "content": "x = 1\ny = 2\n"}]
    assert observation_files("str_replace_editor view /r/a.py", view) == expected
    assert observation_files("cat a.py", "cat: a.py: No such file or directory" + _TRAILER) == []


def test_swe_agent_rejects_other_formats(tmp_path: Path) -> None:
    mini = write_json(tmp_path / "m.traj", mini_traj([{"role": "system", "content": "s"}]))
    with pytest.raises(ConvertError, match=r"m\.traj: not a SWE-agent trajectory.*mini-swe-agent converter"):
        convert("swe-agent", [mini])
    text = tmp_path / "t.traj"
    text.write_text("not json")
    with pytest.raises(ConvertError, match=r"t\.traj: not a SWE-agent trajectory: not a JSON document"):
        convert("swe-agent", [text])
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ConvertError, match="empty_dir: no files matching"):
        convert("swe-agent", [empty])


# ---------------------------------------------------------------------------------------------
# openai-chat


def test_openai_chat(tmp_path: Path) -> None:
    sys_msg = {"role": "system", "content": "sys"}
    q1 = [sys_msg, {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]
    tool_call = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    completion = {"model": "gpt-x", "choices": [{"message": {"role": "assistant", "content": None,
                                                             "tool_calls": tool_call}}],
                  "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    rendered = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    lines = [
        {"agent_id": "a", "query_id": 1, "role": "planner", "messages": q1, "response": completion,
         "timestamp": 100.0},
        {"messages": [{"role": "user", "content": "solo"}], "response": "alone", "timestamp": 101.5},
        {"agent_id": "a", "query_id": 1, "role": "planner", "timestamp": "1970-01-01T00:01:45Z",
         "messages": [*q1, {"role": "assistant", "content": None, "tool_calls": tool_call},
                      {"role": "tool", "content": "42"}],
         "response": {"role": "assistant", "content": "done"}, "structure": [["<tool_call>", "</tool_call>"]]},
        {"agent_id": "a", "query_id": 1, "messages": [{"role": "user", "content": "fresh"}], "response": "x",
         "arrival_s": 9},
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[2:]))
    records = convert("openai-chat", [path])
    assert records[0]["model"] == "gpt-x" and records[0]["workload"] == "chat"
    calls = check_records(records)
    q = [r for r in calls if r["query_id"] == 1]
    solo = [r for r in calls if r["query_id"] != 1]
    assert [r["seq"] for r in q] == [0, 1, 2] and len(solo) == 1
    assert solo[0]["query_id"] == "log.jsonl:2" and solo[0]["agent_id"] == "openai-chat"
    assert q[0]["messages"][1] == {"role": "user", "content": "hi"}
    assert q[0]["output"] == rendered + EOT
    assert q[0]["extra"] == {"usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    assert q[1]["prompt_extends"] == q[0]["id"] and q[1]["messages_append"] == [{"role": "tool", "content": "42"}]
    assert q[1]["structure"] == [["<tool_call>", "</tool_call>"]] and q[1]["role"] == "planner"
    assert "prompt_extends" not in q[2] and q[2]["arrival_s"] == 9  # does not re-send the history
    assert [q[0]["arrival_s"], solo[0]["arrival_s"], q[1]["arrival_s"]] == [0.0, 1.5, 5.0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"prompt": "p", "response": "r"}', "line 2: missing messages"),
        ('{"messages": [], "response": "r"}', "line 2: messages: expected a non-empty list"),
        ('{"messages": [{"content": "x"}], "response": "r"}', r"line 2: messages\[0\]"),
        ('{"messages": [{"role": "user", "content": 5}], "response": "r"}', r"line 2: messages\[0\]: content"),
        ('{"messages": [{"role": "user", "content": "x"}], "response": 3}', "line 2: response"),
        ('{"messages": [{"role": "user", "content": "x"}], "response": {"choices": []}}', "line 2: response"),
        ('{"messages": [{"role": "user", "content": "x"}], "response": "r", "query_id": [1]}', "line 2: query_id"),
        ('{"messages": [{"role": "user", "content": "x"}], "response": "r", "timestamp": "soon"}',
         "line 2: timestamp"),
    ],
)
def test_openai_chat_rejects_bad_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}], "response": "ok"}\n' + line + "\n")
    with pytest.raises(ConvertError, match=rf"bad\.jsonl: {message}"):
        convert("openai-chat", [path])


def test_openai_chat_rejects_storm_log() -> None:
    storm = TRACES / "storm_deep_research" / "llm_call_history.jsonl"
    if not storm.is_file():
        pytest.skip("shared STORM trace not present")
    with pytest.raises(ConvertError, match=r"llm_call_history\.jsonl: line 1: missing messages"):
        convert("openai-chat", [storm])


# ---------------------------------------------------------------------------------------------
# real trajectories


def real_mini_files(n: int) -> list[Path]:
    files = sorted(MINI_DIR.glob("*.traj.json"))[:n] if MINI_DIR.is_dir() else []
    if len(files) < n:
        pytest.skip("shared mini-swe-agent traces not present")
    return files


def test_mini_swe_agent_real_files() -> None:
    files = real_mini_files(3)
    records = convert("mini-swe-agent", files)
    assert records[0]["model"] == "google/gemini-3-pro-preview"
    calls = check_records(records)
    assert_chained(calls)
    raw = [json.loads(f.read_text("utf-8")) for f in files]
    assert len(calls) == sum(sum(m["role"] == "assistant" for m in d["messages"]) for d in raw)
    assert {r["query_id"] for r in calls} == {d["instance_id"] for d in raw}
    assert all("usage" in r["extra"] and r["extra"]["usage"]["prompt_tokens"] > 0 for r in calls)
    assert sum("workspace" in r for r in calls) >= 3
    assert any(r.get("emission") == "raw" for r in calls)
    for r in calls:
        for f in r.get("workspace", []):
            assert f["path"] and not f["content"].startswith("<returncode>")


def test_swe_agent_real_files() -> None:
    if not SWE_DIR.is_dir():
        pytest.skip("shared SWE-agent traces not present")
    records = convert("swe-agent", [SWE_DIR])
    calls = check_records(records)
    assert_chained(calls)
    assert len({r["query_id"] for r in calls}) == 3
    assert any(r.get("workspace") for r in calls)
    assert any(r.get("emission") == "raw" for r in calls) and any(r.get("emission") == "json" for r in calls)


# ---------------------------------------------------------------------------------------------
# the loader reads what the converters write


def load(records: list[dict], tmp_path: Path):
    from agentspec_sim.trace.io import load_trace, write_records

    path = tmp_path / "trace.jsonl"
    write_records(records, path)
    return load_trace(path, cache=False)


def assert_loads_as_delta(records: list[dict], tmp_path: Path) -> None:
    """Every call after the first extends the previous one in the loaded workload, and its
    delta-form prompt is exactly the rendering of the whole chat."""
    from agentspec_sim.trace.tokenizer import load_tokenizer

    tok = load_tokenizer(OPTS.tokenizer)
    workload = load(records, tmp_path)
    assert workload.num_calls == len(records) - 1
    by_id = {r["id"]: r for r in records[1:]}
    for query in workload.queries:
        for k, call in enumerate(query.calls):
            assert call.prompt_extends == (query.calls[k - 1].id if k else None)
            if k:
                prev = query.calls[k - 1]
                n = prev.prompt_len + prev.output_len
                assert (call.prompt_tokens[:n] == [*prev.prompt_tokens, *prev.output_tokens]).all()
            assert tok.decode(call.prompt_tokens) == tok.render_chat(full_messages(records, call.id))
            assert tok.decode(call.output_tokens) == by_id[call.id]["output"]
            assert call.extra == by_id[call.id].get("extra")
            assert call.emission == by_id[call.id].get("emission")


def test_loader_reads_crafted_traces(tmp_path: Path) -> None:
    mini = convert("mini-swe-agent", [crafted_mini(tmp_path)])
    assert_loads_as_delta(mini, tmp_path)
    workload = load(mini, tmp_path)
    calls = workload.queries[0].calls
    assert [len(c.workspace) for c in calls] == [0, 1, 1, 1, 1, 1]  # cumulative; a re-read replaces
    assert calls[5].workspace[0].content == "def f():\n    return 2\n"
    assert calls[0].structure == ((("```bash", "```"), ("```python", "```")),)
    swe = convert("swe-agent", [write_json(tmp_path / "a.traj", text_format_traj()),
                                write_json(tmp_path / "b.traj", tool_format_traj())])
    assert_loads_as_delta(swe, tmp_path)


def test_loader_reads_real_traces(tmp_path: Path) -> None:
    assert_loads_as_delta(convert("mini-swe-agent", real_mini_files(1)), tmp_path)
    if SWE_DIR.is_dir():
        assert_loads_as_delta(convert("swe-agent", [SWE_DIR]), tmp_path)
