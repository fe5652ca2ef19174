"""The bundled traces and the trace-taking CLI commands, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentspec_sim.trace.bundled import bundled_dir, default_trace_path
from agentspec_sim.trace.convert_run import convert_records
from agentspec_sim.trace.io import load_trace, parse_records, write_trace

RAW = Path(__file__).resolve().parents[2] / "shared" / "traces"
needs_raw = pytest.mark.skipif(not RAW.is_dir(), reason="raw traces (../shared/traces) not present")

BUNDLED = ["default.jsonl.zst", "reflexion.jsonl.zst", "gaia.jsonl.zst", "deep-research.jsonl.zst",
           "spec-bench.jsonl.zst", "swe-agent.jsonl.zst"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentspec_sim.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_trace_loads_with_provenance(name):
    workload = load_trace(bundled_dir() / name)
    assert workload.num_calls > 0 and workload.meta.tokenizer == "qwen3"
    assert f"`{name}`" in (bundled_dir() / "README.md").read_text()
    eot = 151645  # <|im_end|>: converters end every output with it, unless the source shows it was cut off
    for c in workload.calls:
        truncated = bool(c.extra and c.extra.get("truncated"))
        assert (c.output_tokens[-1] == eot) != truncated, c.id


def test_default_trace_has_enough_concurrency():
    workload = load_trace(default_trace_path())
    assert len(workload.queries) >= 100
    assert all(c.structure for c in workload.calls)


def test_default_round_trip_is_identical(tmp_path):
    first = load_trace(default_trace_path())
    write_trace(first, tmp_path / "again.jsonl.zst")
    assert load_trace(tmp_path / "again.jsonl.zst", cache=False) == first


@needs_raw
def test_default_matches_raw_source():
    """Calls = assistant messages of the raw trajectories; outputs close to the source's own usage."""
    files = sorted((RAW / "mini-swe-agent_gemini3pro_swebench_verified").glob("*.traj.json"))
    assistant = sum(sum(m["role"] == "assistant" for m in json.loads(f.read_text())["messages"]) for f in files)
    workload = load_trace(default_trace_path())
    assert (len(workload.queries), workload.num_calls) == (len(files), assistant)
    usage = [c.extra["usage"]["completion_tokens"] for c in workload.calls if c.extra and "usage" in c.extra]
    assert len(usage) == workload.num_calls
    # Another tokenizer (Gemini's) and Gemini counts hidden reasoning tokens as completion tokens:
    # ours (visible text + end-of-turn) must not exceed theirs by much.
    ratio = workload.output_tokens / sum(usage)
    assert 0.2 < ratio < 1.2


SOURCES = [
    ("mini-swe-agent", ["mini-swe-agent_gemini3pro_swebench_verified/astropy__astropy-12907.traj.json",
                        "mini-swe-agent_gemini3pro_swebench_verified/django__django-11095.traj.json"]),
    ("swe-agent", ["swe-agent_repo_trajs"]),
    ("reflexion", ["reflexion_noahshinn/programming_runs/root/reflexion_humaneval_rs_hard50"]),
    ("tapeagents", ["tapeagents_gaia"]),
    ("storm", ["storm_deep_research"]),
    ("spec-bench", ["spec-bench"]),
]


@needs_raw
@pytest.mark.parametrize(("fmt", "inputs"), SOURCES, ids=[s[0] for s in SOURCES])
def test_every_raw_source_converts_loads_and_round_trips(tmp_path, fmt, inputs):
    from agentspec_sim.trace.tokenizer import load_tokenizer

    records = convert_records(fmt, [RAW / p for p in inputs])
    workload = parse_records(enumerate(records, start=1), source=fmt)
    write_trace(workload, tmp_path / "t.jsonl.gz")
    assert load_trace(tmp_path / "t.jsonl.gz", cache=False) == workload
    # The delta form expands to exactly the full prompt: re-render each chat from scratch.
    tok = load_tokenizer("qwen3")
    chats: dict[str, list[dict]] = {}
    by_id = workload.call_by_id()
    record_of = {r["id"]: r for r in records[1:]}
    for rec in records[1:]:
        if "messages" in rec:
            chats[rec["id"]] = rec["messages"]
        elif "messages_append" in rec:
            parent = rec["prompt_extends"]
            out = record_of[parent]["output"].removesuffix(tok.eot_text)
            chats[rec["id"]] = [*chats[parent], {"role": "assistant", "content": out}, *rec["messages_append"]]
        else:
            continue
        full = tok.encode_batch([tok.render_chat(chats[rec["id"]])])[0]
        assert np.array_equal(by_id[rec["id"]].prompt_tokens, full), rec["id"]


def test_inspect_json_on_default():
    result = cli("inspect", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    workload = load_trace(default_trace_path())
    assert stats["queries"] == len(workload.queries) and stats["calls"] == workload.num_calls
    assert stats["output_tokens"] == workload.output_tokens
    assert stats["prompt_tokens"] == workload.prompt_tokens
    assert stats["unique_prompt_tokens"] < stats["prompt_tokens"] / 10  # delta form: history stored once
    assert stats["calls_total_over_context"] >= stats["calls_prompt_over_context"] > 0
    rep = stats["repetition"]["by_k"]
    assert set(rep) == {"4", "8", "16", "32"}
    shares = [rep[k]["total"] for k in ("4", "8", "16", "32")]
    assert shares == sorted(shares, reverse=True) and 0 < shares[-1] <= shares[0] < 1


def test_inspect_bad_trace_exit_code_and_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "meta", "version": 1, "tokenizer": null}\n{"type": "call", "id": 3}\n')
    result = cli("inspect", str(bad))
    assert result.returncode == 2
    assert f"{bad}:2: id: expected a string, got an integer" in result.stderr
    assert "Traceback" not in result.stderr
    missing = cli("inspect", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_convert_cli_rejects_wrong_format_and_unknown_format(tmp_path):
    storm_like = tmp_path / "x.jsonl"
    storm_like.write_text('{"prompt": "p", "response": {"choices": []}}\n')
    result = cli("convert", "mini-swe-agent", str(storm_like), "-o", str(tmp_path / "o.jsonl"))
    assert result.returncode == 2 and str(storm_like) in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o.jsonl").exists()
    unknown = cli("convert", "nope", str(storm_like), "-o", str(tmp_path / "o.jsonl"))
    assert unknown.returncode == 2 and "unknown format 'nope'" in unknown.stderr


@needs_raw
def test_convert_cli_tokens_form(tmp_path):
    out = tmp_path / "storm.jsonl.xz"
    result = cli("convert", "storm", str(RAW / "storm_deep_research"), "-o", str(out), "--tokens")
    assert result.returncode == 0, result.stderr
    text_form = parse_records(enumerate(convert_records("storm", [RAW / "storm_deep_research"]), start=1))
    assert load_trace(out, cache=False) == text_form
