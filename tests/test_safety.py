"""Traces are data: loading and replaying one never opens the files its workspace names, never runs code
it holds, opens no socket, and caches without pickle; databases are opened read-only
(docs/invariants.md, "Safety").

Opens and sockets are watched with a Python audit hook (PEP 578), which sees every `open()`,
`os.open()` and socket call made from Python, whatever module makes it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.trace.io import load_trace
from agentspec_sim.trace.schema import TraceError

_watch: dict[str, object] = {"on": False, "events": []}


def _audit(event: str, args: tuple) -> None:
    if _watch["on"] and (event in ("open", "os.open") or event.startswith("socket.")):
        _watch["events"].append((event, args))  # type: ignore[attr-defined]


_hook_installed = False


@contextlib.contextmanager
def watching():
    """Record open and socket audit events inside the block (the hook, once added, stays for the process)."""
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True
    events: list = []
    _watch.update(on=True, events=events)
    try:
        yield events
    finally:
        _watch["on"] = False


def opened(events, names) -> list:
    return [e for e in events if e[0] in ("open", "os.open") and any(n in str(e[1][0]) for n in names)]


@pytest.fixture
def secret_trace(tmp_path, monkeypatch):
    """A trace whose workspace names system files, a real file beside the trace, and one by relative path."""
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))
    canary = tmp_path / "canary-secret.txt"
    canary.write_text("TOP SECRET\n")
    (tmp_path / "relative-secret.txt").write_text("ALSO SECRET\n")
    workspace = [{"path": "/etc/passwd", "content": "def f(x):\n    return x\n"},
                 {"path": str(canary), "content": "print('hello')\n"},
                 {"path": "relative-secret.txt", "content": "x = 1\n"},
                 {"path": "~/.ssh/id_rsa", "content": "key\n"}]
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 64}]
    for q in range(2):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [q]
        records.append({"type": "call", "id": f"q{q}-0", "agent_id": 0, "query_id": q, "seq": 0, "role": "coder",
                        "prompt_tokens": prompt, "output_tokens": [9, 10, 11, 12] * 4, "workspace": workspace})
        records.append({"type": "call", "id": f"q{q}-1", "agent_id": 0, "query_id": q, "seq": 1,
                        "prompt_extends": f"q{q}-0", "prompt_append_tokens": [13, 14],
                        "output_tokens": [9, 10, 11, 12] * 3, "workspace": workspace[:1]})
    path = tmp_path / "secrets.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


SECRET_NAMES = ("/etc/passwd", "canary-secret.txt", "relative-secret.txt", "id_rsa")


def test_workspace_paths_are_never_opened(secret_trace, monkeypatch, capsys):
    with watching() as events:
        workload = load_trace(secret_trace, cache=False)
        monkeypatch.setattr(sys, "argv", ["agentspec-sim", "replay", str(secret_trace), "--drafter",
                                          "normal,agspec,agentspec,suffix", "--max-num-seqs", "4", "--json"])
        code = run_guarded(app)
        monkeypatch.setattr(sys, "argv", ["agentspec-sim", "inspect", str(secret_trace), "--json"])
        code2 = run_guarded(app)
    assert code == 0 and code2 == 0, capsys.readouterr().err
    assert {f.path for f in workload.calls[0].workspace} >= {"/etc/passwd", "~/.ssh/id_rsa"}  # kept as data
    assert opened(events, SECRET_NAMES) == []
    assert any(e[0] == "open" for e in events)  # the hook did see the trace being opened
    assert [e for e in events if e[0].startswith("socket.")] == []  # nothing connects or listens


def test_structure_strings_are_literals_never_code(tmp_path):
    flag = tmp_path / "pwned"
    for payload in (f"__import__('os').system('touch {flag}')", f"[('a', 'b')] + [open('{flag}', 'w')]",
                    "[(lambda: 1)(), ('a', 'b')]"):
        trace = tmp_path / "code.jsonl"
        trace.write_text(json.dumps({"type": "meta", "version": 1, "tokenizer": None}) + "\n" + json.dumps(
            {"type": "call", "id": "a", "agent_id": 0, "query_id": 0, "seq": 0, "prompt_tokens": [1],
             "output_tokens": [2], "structure": payload}) + "\n")
        with pytest.raises(TraceError, match="structure: string form is not a list"):
            load_trace(trace, cache=False)
    assert not flag.exists()


def test_the_load_cache_holds_no_pickle(secret_trace, tmp_path):
    load_trace(secret_trace)
    files = sorted((tmp_path / "cache").rglob("*"))
    entries = [f for f in files if f.is_file()]
    assert entries and {f.suffix for f in entries} <= {".npy", ".json"}
    for f in entries:
        if f.suffix == ".npy":
            assert np.load(f, allow_pickle=False).dtype == np.int32  # plain data: loads with pickling refused
    again = load_trace(secret_trace)  # served from the cache, same data
    assert [c.id for c in again.calls] == ["q0-0", "q0-1", "q1-0", "q1-1"]


def test_chat_templates_run_sandboxed(tmp_path):
    """A tokenizer_config.json beside a trace's tokenizer may carry any Jinja template: it runs in
    Jinja's immutable sandbox, so reaching Python internals fails as a trace error."""
    from agentspec_sim.trace.tokenizer import BUNDLED

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json.xz").symlink_to(BUNDLED["qwen3"] / "tokenizer.json.xz")
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    trace = tmp_path / "chat.jsonl"
    trace.write_text(json.dumps({"type": "meta", "version": 1, "tokenizer": str(folder / "tokenizer.json.xz")})
                     + "\n" + json.dumps({"type": "call", "id": "a", "agent_id": 0, "query_id": 0, "seq": 0,
                                          "messages": [{"role": "user", "content": "hi"}], "output": "ok"}) + "\n")
    with pytest.raises(TraceError, match="messages: chat template failed"):
        load_trace(trace, cache=False)


def test_tapeagents_database_is_opened_read_only(tmp_path, monkeypatch):
    import sqlite3

    from agentspec_sim.trace.convert import tapeagents
    from agentspec_sim.trace.convert.base import ConvertError

    db = tmp_path / "tapedata.sqlite"
    db.write_bytes(b"")
    seen = []

    def connect(target, *args, **kwargs):
        seen.append((target, kwargs))
        raise sqlite3.OperationalError("stop here")

    monkeypatch.setattr(tapeagents.sqlite3, "connect", connect)
    with pytest.raises(ConvertError):
        tapeagents._read_llm_calls(db)
    assert seen and seen[0][0].endswith("?mode=ro") and seen[0][1].get("uri") is True


def test_no_module_deserialises_with_pickle_or_evaluates_input():
    """The audit behind docs/invariants.md "Safety", kept true by a test: no unpickling, eval, exec or shell in
    the library and CLI sources; `np.load` only with allow_pickle=False. (multiprocessing pickles the
    sweep's own work between its own processes; no input is ever unpickled.)"""
    import re

    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("agentspec_sim", "cli") for p in (root / d).rglob("*.py")]
    banned = re.compile(r"^\s*(import|from)\s+(c?pickle|marshal|shelve|dill|cloudpickle)\b|\b(c?pickle|marshal|dill)\."
                        r"(loads?|Unpickler)\b|(?<![.\w])eval\(|(?<![.\w])exec\(|shell=True|os\.system\(|yaml\.load\(")
    problems = []
    for path in sources:
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if banned.search(code):
                problems.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
            if "np.load(" in code and "allow_pickle=False" not in code:
                problems.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert problems == []
