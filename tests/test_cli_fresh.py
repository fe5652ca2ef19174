"""Every command, run as a user runs it: the console script in a fresh process, on small real inputs.

In-process CLI tests share pytest's import order, which hides an import cycle or a module missing from the
install (`analyze redundancy` once failed in every fresh process and passed its tests). Here each command
of `agentspec-sim --help` starts its own interpreter through the installed entry point and does real work;
the chain feeds one command's output to the next (replay --steps → calibrate cost, sweep → plan/report).
Commands whose optional dependency is missing (torch, vLLM) must still check their arguments and answer
with one line and exit 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

VOCAB = 64


def _script() -> list[str]:
    """The installed console script next to this interpreter (what `pip install` put on PATH), else -m."""
    script = Path(sys.executable).with_name("agentspec-sim")
    if script.exists():
        return [str(script)]
    found = shutil.which("agentspec-sim")
    return [found] if found else [sys.executable, "-m", "agentspec_sim.cli"]


def run(*args: str, env: dict[str, str], ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([*_script(), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert "Traceback" not in done.stderr, done.stderr
    if ok:
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done


def trace_text() -> str:
    """Four queries of three calls whose outputs repeat their prompts (so lookup drafters draft)."""
    lines = [json.dumps({"type": "meta", "version": 1, "tokenizer": None, "vocab_size": VOCAB})]
    for q in range(4):
        body = [(7 * q + 3 * i) % (VOCAB - 1) + 1 for i in range(40)]
        for seq in range(3):
            lines.append(json.dumps({"type": "call", "id": f"q{q}c{seq}", "agent_id": q % 2, "query_id": q,
                                     "seq": seq, "prompt_tokens": body[: 24 + 4 * seq],
                                     "output_tokens": body[8 + seq: 30 + seq]}))
    return "\n".join(lines) + "\n"


def command_names(env: dict[str, str]) -> set[str]:
    """The commands `agentspec-sim --help` lists (so a command added later without a test fails here)."""
    text = run("--help", env=env).stdout
    return set(re.findall(r"^│ (\w[\w-]*) ", text, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "AGENTSPEC_SIM_CACHE": str(cache), "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def test_every_command_runs_in_a_fresh_process(tmp_path, env):
    trace = tmp_path / "t.jsonl"
    trace.write_text(trace_text())
    exercised: set[str] = set()

    def cmd(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        exercised.add(args[0])
        return run(*args, env=env, ok=ok)

    assert "calls" in cmd("inspect", trace).stdout
    replay = json.loads(cmd("replay", trace, "--drafter", "ngram", "--max-num-seqs", "4", "--json",
                            "--steps", tmp_path / "steps.parquet").stdout)
    assert [r["drafter"] for r in replay["runs"]] == ["normal", "ngram"]
    assert replay["cost_model"].startswith("cost model: a100-80g + qwen3-8b, AIConfigurator 0.12.0 measured vllm")
    cmd("calibrate", "cost", tmp_path / "steps.parquet", "-o", tmp_path / "cal.json")
    assert json.loads((tmp_path / "cal.json").read_text())

    priced = json.loads(cmd("cost", "--kind", "verify", "--batch", "8", "--context", "1024", "--query-tokens", "4",
                            "--json").stdout)
    assert priced["steps"][0]["seconds"] > 0

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"id": f"r{i}", "per_step_drafted": [3] * 6,
                                           "per_step_accepted": [i % 4, 3, 1, 0, 2, 3]}) + "\n" for i in range(8)))
    cmd("calibrate", "acceptance", metrics, "-o", tmp_path / "params.json")
    assert (tmp_path / "params.json").exists()

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"query_id": "q", "messages": [{"role": "user", "content": f"say hello {n}"}],
                                        "response": "hello " * n}) + "\n" for n in (2, 3)))
    cmd("convert", "openai-chat", chat, "-o", tmp_path / "chat-trace.jsonl")
    cmd("inspect", tmp_path / "chat-trace.jsonl")

    cmd("analyze", "redundancy", trace)
    cmd("analyze", "roles", trace, "-o", tmp_path / "caps.json")
    cmd("synth", "--like", trace, "--queries", "6", "-o", tmp_path / "synth.jsonl.zst")
    assert "calls" in cmd("inspect", tmp_path / "synth.jsonl.zst").stdout

    results = tmp_path / "s.parquet"
    cmd("sweep", trace, "-o", results, "--drafter", "ngram", "--max-num-seqs", "1,4", "-j", "1", "-q")
    assert json.loads(cmd("plan", "--results", results, "--json").stdout)
    cmd("report", results, "-o", tmp_path / "report")
    assert (tmp_path / "report" / "README.md").exists() or any((tmp_path / "report").iterdir())

    baseline = tmp_path / "baseline.json"
    cmd("check", trace, "--baseline", baseline, "--update", "--drafter", "ngram", "--max-num-seqs", "4")
    cmd("check", "--baseline", baseline)

    # The recording proxy serves until stopped: tests/test_proxy.py runs it in fresh processes against a server;
    # here, that the command loads in one and refuses a bad upstream in one line.
    done = cmd("proxy", "--upstream", "ftp://nowhere", "-o", tmp_path / "rec.jsonl", ok=False)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: --upstream"), done.stderr

    # Commands whose optional dependency may be missing: arguments first, then one line naming the extra.
    for args, module in ((("validate", "timing", tmp_path / "steps.parquet", "-o", tmp_path / "vt",
                           "--sample", "2", "--repeats", "1", "--warmup", "0"), "torch"),
                         (("validate", "vllm", trace, "--model", tmp_path / "no-weights", "--method", "normal"),
                          "vllm"),
                         (("record", trace, "--model", tmp_path / "no-weights", "-o", tmp_path / "r.jsonl"), "vllm")):
        if importlib.util.find_spec(module) is not None and module == "vllm":
            exercised.add(args[0])  # with vLLM installed its own tests run these against a real engine
            continue
        done = cmd(*args, ok=importlib.util.find_spec(module) is not None)
        if done.returncode:
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and module.lower() in lines[0].lower(), done.stderr

    assert command_names(env) <= exercised, command_names(env) - exercised
