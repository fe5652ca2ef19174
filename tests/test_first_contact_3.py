"""Issue 39 (first contact, round 3), the classes fixed so far: concurrent writers of one baseline, late or silent
failures refused up front (a clock past what float64 resolves, `-j 0`), and `--version`."""

from __future__ import annotations

import math

import pytest
from test_capacity_cli import trace  # noqa: F401  (fixture)
from test_plan_and_units import one_error_line, run_cli

from agentspec_sim.io.outputs import OutputError, sole_writer


def test_check_update_refuses_a_second_writer_of_the_same_baseline(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Two `check --update` of one baseline at once: the second is refused while the first holds the baseline
    (before, both printed "wrote" and one update was lost)."""
    baseline = tmp_path / "b.json"
    args = ["check", str(trace), "--baseline", str(baseline), "--update", "--drafter", "ngram", "--max-num-seqs", "2"]
    lock = tmp_path / "b.json.lock"
    with sole_writer(baseline, lock):  # another `check --update` mid-run
        code, _, err = run_cli(args, monkeypatch, capsys)
        assert "another process is writing it now" in one_error_line(code, err)
        assert not baseline.exists()
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0 and "wrote" in out, err
    assert not lock.exists()  # the lock goes with its writer
    with sole_writer(baseline, lock):  # the lock itself: a second holder is refused on entering
        second = sole_writer(baseline, lock)
        with pytest.raises(OutputError, match="another process is writing it now"):
            second.__enter__()


@pytest.mark.parametrize("args", [["--request-rate", "1e-300"], ["--think-time", "1e300"]])
def test_a_clock_past_what_float64_resolves_is_refused(trace, args, monkeypatch, capsys):  # noqa: F811
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", *args], monkeypatch, capsys)
    assert "resolve one step" in one_error_line(code, err)


def test_unix_timestamps_as_arrival_times_still_replay(tmp_path, monkeypatch, capsys):
    from agentspec_sim.trace.io import write_records

    t0 = 1.8e9  # a Unix timestamp: far from 0, well inside what the clock resolves
    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100}]
    for q in range(3):
        records.append({"type": "call", "id": f"q{q}", "agent_id": 0, "query_id": q, "seq": 0, "arrival_s": t0 + q,
                        "prompt_tokens": [1, 2, 3, q], "output_tokens": [5, 6, 7, 8]})
    path = tmp_path / "epoch.jsonl"
    write_records(records, path)
    code, out, err = run_cli(["replay", str(path), "--drafter", "ngram", "--json"], monkeypatch, capsys)
    assert code == 0, err
    import json

    runs = json.loads(out)["runs"]
    assert all(math.isfinite(r["goodput_tok_s"]) and r["goodput_tok_s"] > 0 for r in runs)
    assert all(r["duration_s"] < 60 for r in runs)  # the trace's own timeline starts at its first arrival


def test_zero_jobs_is_refused_like_negative_ones(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    for jobs in ("0", "-3"):
        code, _, err = run_cli(["sweep", str(trace), "-o", str(tmp_path / "s.parquet"), "-j", jobs],
                               monkeypatch, capsys)
        assert "jobs must be ≥ 1" in one_error_line(code, err)


def test_version(monkeypatch, capsys):
    from importlib.metadata import version

    code, out, _ = run_cli(["--version"], monkeypatch, capsys)
    assert code == 0 and out.strip() == f"agentspec-sim {version('agentspec-sim')}"


def test_a_symlink_loop_and_a_dangling_link_say_what_they_are(tmp_path, monkeypatch, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.jsonl")
    code, _, err = run_cli(["inspect", str(tmp_path / "a")], monkeypatch, capsys)
    assert "a symlink loop" in one_error_line(code, err)
    code, _, err = run_cli(["inspect", str(tmp_path / "dangling")], monkeypatch, capsys)
    assert "which does not exist" in one_error_line(code, err)


def test_cut_calls_are_said_in_the_table(trace, monkeypatch, capsys):  # noqa: F811
    """A call longer than max_model_len is emitted only up to it: the table says so, not only --json."""
    code, out, err = run_cli(["replay", str(trace), "--drafter", "ngram", "--max-model-len", "100"], monkeypatch,
                             capsys)
    assert code == 0, err
    assert "cut at max_model_len 100" in " ".join(out.split())


def test_a_draft_network_the_model_lacks_is_refused_before_any_cell(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "mtp.parquet"
    code, _, err = run_cli(["sweep", str(trace), "--drafter", "ngram,mtp", "-o", str(out), "-j", "1"], monkeypatch,
                           capsys)
    assert "no 'mtp' draft network" in one_error_line(code, err)
    assert not list(tmp_path.glob("mtp.parquet*"))  # nothing written, no journal a later plan could read


def test_the_kv_message_names_the_batch_flags(monkeypatch, capsys):
    code, _, err = run_cli(["replay", "--max-num-seqs", "1000000000", "--max-num-batched-tokens", "1000000000"],
                           monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "max_num_batched_tokens 1,000,000,000" in line and "max_num_seqs 1,000,000,000" in line


def test_plan_serve_line_says_what_vllm_needs(tmp_path, trace, monkeypatch, capsys):  # noqa: F811
    code, out, err = run_cli(["plan", str(trace), "--drafter", "suffix", "--max-num-seqs", "2", "--max-model-len",
                              "100000", "-j", "1", "--json"], monkeypatch, capsys)
    assert code == 0, err
    import json

    (p,) = json.loads(out)
    assert p["vllm_env"].get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1"
    if p["best"]["drafter"] == "suffix":
        assert "arctic-inference" in p["vllm_note"]


def test_a_suffix_serve_line_says_arctic_inference_is_needed():
    from types import SimpleNamespace

    from agentspec_sim.sweep.plan import serve_flags

    best = SimpleNamespace(speculative_config={"method": "suffix", "num_speculative_tokens": 32}, max_num_seqs=8, k=32)
    config, _args, env, note, _served = serve_flags(best, "qwen3-8b", {}, [])
    assert config["method"] == "suffix" and "arctic-inference" in note and env == {}


def test_the_vllm_worker_starts_from_a_checkouts_root_with_a_non_editable_install(tmp_path):
    """`validate vllm` from the checkout's root with `pip install .`: the child `python -m
    agentspec_sim.validation.vllm_worker` must not let the checkout's `agentspec_sim/` (no `validation/` in it)
    shadow the installed package. The worker is started with `-P` (no working directory on sys.path)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), str(root)], check=True, capture_output=True)
    import sysconfig

    # A non-editable install: the copy in `target`, the venv's packages for its dependencies, and no `.pth`
    # processing (-S), so this checkout's editable finder is not in play.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])}
    probe = "import agentspec_sim.validation.vllm_worker as w; print(w.__file__)"
    # What the worker was started as before: the checkout's package wins and has no `validation`.
    shadowed = subprocess.run([sys.executable, "-S", "-c", probe], cwd=root, env=env, capture_output=True, text=True)
    assert shadowed.returncode != 0 and "agentspec_sim.validation" in shadowed.stderr
    from agentspec_sim.validation import vllm_worker

    started = subprocess.run([sys.executable, "-S", *vllm_worker._ISOLATED, "-c", probe], cwd=root, env=env,
                             capture_output=True, text=True)
    assert started.returncode == 0 and started.stdout.strip().startswith(str(target)), started.stderr


@pytest.mark.parametrize("name", ["openai-chat", "otel-genai"])
def test_converters_read_a_utf8_bom(tmp_path, name):
    """A log saved with a UTF-8 byte-order mark (Windows editors, PowerShell) converts as without one."""
    import json

    from agentspec_sim.trace.convert import CONVERTERS
    from agentspec_sim.trace.convert.base import ConvertOptions

    if name == "openai-chat":
        line = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                           "response": {"choices": [{"message": {"content": "hello"}}]}})
    else:
        span = {"name": "chat", "traceId": "t1", "spanId": "s1", "startTimeUnixNano": "1", "endTimeUnixNano": "2",
                "attributes": [
                    {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                    {"key": "gen_ai.input.messages", "value": {"stringValue": json.dumps(
                        [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}])}},
                    {"key": "gen_ai.output.messages", "value": {"stringValue": json.dumps(
                        [{"role": "assistant", "parts": [{"type": "text", "content": "hello"}]}])}}]}
        line = json.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                              "scopeSpans": [{"scope": {}, "spans": [span]}]}]})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain, bom = tmp_path / "a" / "log.jsonl", tmp_path / "b" / "log.jsonl"
    plain.write_text(line + "\n", encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + (line + "\n").encode())
    got = [list(CONVERTERS[name].convert([p], ConvertOptions())) for p in (plain, bom)]
    strip = [[{k: v for k, v in r.items() if k != "source"} for r in records] for records in got]
    assert strip[0] == strip[1] and len(got[0]) == 2


def test_resume_with_another_grid_says_what_it_drops(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "s.parquet"
    base = ["sweep", str(trace), "-o", str(out), "-j", "1", "--max-num-seqs", "2", "-q"]
    code, _, err = run_cli([*base, "--drafter", "ngram"], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli([*base, "--drafter", "suffix", "--resume"], monkeypatch, capsys)
    assert code == 0 and "1 finished cell(s)" in " ".join(err.split()), err  # ngram's; normal's is kept


def test_report_finds_the_trace_from_another_folder(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The results keep the trace's absolute path (`trace_file`): a report run elsewhere still has Figure 5."""
    import shutil

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(trace, work / "agents.jsonl")
    monkeypatch.chdir(work)
    code, _, err = run_cli(["sweep", "agents.jsonl", "--drafter", "ngram", "--max-num-seqs", "2", "-j", "1", "-o",
                            "r.parquet", "-q"], monkeypatch, capsys)
    assert code == 0, err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_cli(["report", str(work / "r.parquet"), "-o", "rep"], monkeypatch, capsys)
    assert code == 0, err
    text = (elsewhere / "rep" / "report.md").read_text()
    assert "AgentSpec's premise" in text and "Not computed" not in text


def test_a_missing_relative_baseline_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["check"], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert f"in {tmp_path}" in line and "--baseline PATH" in line


def test_an_arrival_before_the_previous_calls_is_refused_naming_the_line(tmp_path, monkeypatch, capsys):
    from agentspec_sim.trace.io import write_records

    records = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100},
               {"type": "call", "id": "a", "agent_id": 0, "query_id": 0, "seq": 0, "arrival_s": 10.0,
                "prompt_tokens": [1, 2], "output_tokens": [3]},
               {"type": "call", "id": "b", "agent_id": 0, "query_id": 0, "seq": 1, "arrival_s": 4.0,
                "prompt_tokens": [1, 2, 3], "output_tokens": [4]}]
    path = tmp_path / "back.jsonl"
    write_records(records, path)
    code, _, err = run_cli(["replay", str(path)], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "back.jsonl:3: arrival_s" in line and "before the arrival of call 'a'" in line


def test_a_metrics_file_without_per_step_drafted_names_the_missing_field(tmp_path):
    from agentspec_sim.drafters.model.observations import CalibrationError, load_vllm_metrics

    path = tmp_path / "m.jsonl"
    path.write_text('{"per_step_accepted": [1, 0, 2]}\n')
    with pytest.raises(CalibrationError, match=r"m.jsonl:1: per_step_drafted: missing"):
        load_vllm_metrics(path)


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """SIGKILL mid-write leaves `.NAME.PID.….tmp`; the next write of NAME removes it when PID is gone, and leaves
    a live writer's alone."""
    import os
    import subprocess
    import sys

    from agentspec_sim.io.atomic import write_json_atomic

    out = tmp_path / "summary.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f".summary.json.{dead}.abc123.tmp").write_bytes(b"")
    live = tmp_path / f".summary.json.{os.getpid()}.zzz999.tmp"
    live.write_bytes(b"")
    write_json_atomic(out, {"a": 1})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["summary.json", live.name])


def test_convert_skip_bad_lines_skips_a_truncated_line_and_says_so(tmp_path, monkeypatch, capsys):
    import json

    good = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                       "response": {"choices": [{"message": {"content": "hello"}}]}})
    log = tmp_path / "log.jsonl"
    log.write_text(good + "\n" + good + "\n" + good[: len(good) // 2] + "\n")  # the last line cut short
    out = tmp_path / "t.jsonl"
    code, _, err = run_cli(["convert", "openai-chat", str(log), "-o", str(out)], monkeypatch, capsys)
    assert "line 3: not valid JSON" in one_error_line(code, err) and not out.exists()
    code, _, err = run_cli(["convert", "openai-chat", str(log), "-o", str(out), "--skip-bad-lines"], monkeypatch,
                           capsys)
    assert code == 0, err
    said = " ".join(err.split())  # the console wraps long paths at its width, anywhere in the line
    assert "skipped 1 bad input line(s); the first:" in said and "line 3" in said
    assert "2 queries" in said or "2 calls" in said


def test_openai_chat_chains_a_resent_history_without_query_ids(tmp_path, monkeypatch, capsys):
    import json

    def line(messages, response, **extra):
        return json.dumps({"messages": messages, "response": response, **extra})

    u1, u2, u3 = ({"role": "user", "content": t} for t in ("fix the bug", "tests fail", "now?"))
    a1, a2 = ({"role": "assistant", "content": t} for t in ("patch 1", "patch 2"))
    log = tmp_path / "agent.jsonl"
    log.write_text("\n".join([
        line([u1], "patch 1"),
        line([{"role": "user", "content": "unrelated"}], "ok"),
        line([u1, a1, u2], "patch 2"),
        line([u1, a1, u2, a2, u3], "done"),
        line([u1, a1, {"role": "user", "content": "a fork"}], "other"),  # goes on from the first call, not the last
    ]) + "\n")
    from agentspec_sim.trace.convert import CONVERTERS
    from agentspec_sim.trace.convert.base import ConvertOptions

    records = list(CONVERTERS["openai-chat"].convert([log], ConvertOptions()))[1:]
    by_query: dict = {}
    for r in records:
        by_query.setdefault(r["query_id"], []).append(r["seq"])
    assert sorted(len(v) for v in by_query.values()) == [1, 1, 3]  # the chain, the unrelated call, the fork
    chain = [r for r in records if r["query_id"] == "agent.jsonl:1"]
    assert [r["seq"] for r in chain] == [0, 1, 2] and chain[1]["prompt_extends"] == chain[0]["id"]


def test_one_query_id_in_two_files_is_said(tmp_path, monkeypatch, capsys):
    import json

    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"messages": [{"role": "user", "content": name}], "response": "x",
                                                 "query_id": "q7"}) + "\n")
    out = tmp_path / "t.jsonl"
    code, _, err = run_cli(["convert", "openai-chat", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "-o",
                            str(out)], monkeypatch, capsys)
    assert code == 0, err
    assert "query_id 'q7'" in err and "a.jsonl, b.jsonl" in err


def test_replay_json_shows_progress_on_stderr(trace, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`replay --json -o F` ran silent for minutes: its progress goes to stderr, the document alone to stdout."""
    import json

    code, out, err = run_cli(["replay", str(trace), "--drafter", "ngram", "--json", "-o", str(tmp_path / "r.json")],
                             monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["runs"] and "finished normal" in err and "finished ngram" in err


def test_proxy_counts_a_client_that_leaves_mid_stream_as_gone_not_as_an_upstream_cut(tmp_path):
    pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (pip install 'agentspec-sim[proxy]')")
    import json
    import socket
    import time
    from urllib.parse import urlparse

    from proxyhelpers import in_process_proxy, serving

    from agentspec_sim.capture.stub_upstream import stub_app

    with serving(stub_app()) as stub, in_process_proxy(stub, tmp_path / "t.jsonl") as proxy:
        where = urlparse(proxy.url)
        body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "a b c d e f g"}]})
        with socket.create_connection((where.hostname, where.port)) as s:
            s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"X-Stub-Fault: trickle\r\nX-Stub-Delay-S: 0.3\r\nContent-Length: {len(body)}\r\n\r\n"
                       f"{body}").encode())
            assert b"data:" in s.recv(4096) or b"data:" in s.recv(4096)  # the answer has started
        time.sleep(1.5)  # the proxy's next write finds the client gone
    passed = proxy.result.passed
    assert passed["client_gone"] == 1 and passed["dropped_streams"] == 0, passed


def test_proxy_on_a_busy_port_is_one_line(tmp_path):
    pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (pip install 'agentspec-sim[proxy]')")
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "proxy", "--upstream", "http://127.0.0.1:9/v1",
                            "-o", "t.jsonl", "--port", str(port)], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "cannot listen" in lines[0], r.stderr
    assert "Unclosed" not in r.stderr


def test_a_recorded_arrival_past_the_clock_is_refused_up_front(tmp_path, monkeypatch, capsys):
    from agentspec_sim.trace.io import write_records

    path = tmp_path / "late.jsonl"
    write_records([{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100},
                   {"type": "call", "id": "a", "agent_id": 0, "query_id": 0, "seq": 0, "arrival_s": 1e300,
                    "prompt_tokens": [1, 2], "output_tokens": [3, 4]}], path)
    code, _, err = run_cli(["replay", str(path)], monkeypatch, capsys)
    assert "would be sent at 1e+300 s" in one_error_line(code, err)
