"""The recording proxy (`agentspec-sim proxy`) against a stub OpenAI-compatible server: the official openai SDK as the
client, identity rules, the delta form, faults passing through unrecorded, durability (SIGKILL, restart, a trace
read while written), graceful stop, and the limits. The same proxy against a real vLLM: tests/test_proxy_vllm.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (pip install 'agentspec-sim[proxy]')")
openai = pytest.importorskip("openai", reason="the proxy's client tests use the openai SDK")

from proxyhelpers import CliProxy, in_process_proxy, run_agents, serving, trace_lines  # noqa: E402

from agentspec_sim.capture.exchange import Exchange, NotRecordable, StreamAssembler  # noqa: E402
from agentspec_sim.capture.recorder import Identity, TraceRecorder, conversation_digests  # noqa: E402
from agentspec_sim.capture.stub_upstream import stub_app  # noqa: E402
from agentspec_sim.trace.io import load_trace  # noqa: E402

SECRET = "sk-test-SECRET-never-recorded"


@pytest.fixture(scope="module")
def stub():
    with serving(stub_app()) as url:
        yield url


def _post(url: str, body: dict | bytes, headers: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}

# ---- pieces --------------------------------------------------------------------------------------------------


def test_stream_assembly_is_independent_of_chunking():
    from agentspec_sim.capture.stub_upstream import _stream_events

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": "run"}}]}
    events = _stream_events("abcdefghij", True, {"id": "c1", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}},
                            "tool_calls", True, "m", body)
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\n\n"
    results = []
    for size in (1, 3, 7, len(raw)):
        a = StreamAssembler(Exchange.for_request("/v1/chat/completions", body))
        for i in range(0, len(raw), size):
            a.feed(raw[i:i + size])
        x = a.finish()
        results.append((x.output_text, x.tool_calls, x.output_token_ids, x.finish_reason, x.prompt_token_ids))
    assert all(r == results[0] for r in results)
    text, tools, ids, finish, prompt_ids = results[0]
    assert text == "abcdefghij" and ids == [ord(c) for c in text] and finish == "tool_calls"
    assert tools == [{"id": "c1", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]
    assert prompt_ids is not None
    # The output the trace records: the text, then the call as the Qwen3 chat template writes it.
    assert x.output_message_text == 'abcdefghij\n<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'


def test_a_stream_without_done_is_not_recordable():
    a = StreamAssembler(Exchange.for_request("/v1/completions", {"prompt": "x"}))
    a.feed(b'data: {"choices": [{"index": 0, "text": "ab"}]}\n\n')
    with pytest.raises(NotRecordable, match="dropped"):
        a.finish()


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": "hi"}, {"prompt": ""}, {"prompt": ["a", "b"]},
                                  {"prompt": [1, True]}])
def test_requests_the_trace_cannot_hold(body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with pytest.raises(NotRecordable):
        Exchange.for_request(path, body)


def test_identity_rules():
    h = {"X-Agent-Id": "coder", "X-Query-Id": "t1"}
    assert Identity.of(h, {"metadata": {"agent_id": "x", "query_id": "y"}}) == Identity("coder", "t1")
    assert Identity.of({}, {"metadata": {"agent_id": "x", "query_id": 7, "role": "planner"}, "user": "u"}) == \
        Identity("x", "7", "planner", "u")
    assert Identity.of({}, {"metadata": "not an object", "user": ""}) == Identity()


def test_conversation_digests_are_prefix_digests():
    a = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    b = [*a, {"role": "user", "content": "z"}]
    assert conversation_digests(b)[:3] == conversation_digests(a)
    assert conversation_digests([{"content": "x", "role": "user"}])[1] == conversation_digests(a[:1])[1]


# ---- through the proxy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_two_agents_with_tool_calls_make_two_queries_in_delta_form(stub, tmp_path, stream):
    out = tmp_path / "t.jsonl"
    with in_process_proxy(stub, out, ask_token_ids=False) as proxy:
        got = run_agents(proxy.url + "/v1", "m", ["alpha", "beta"], turns=4, stream=stream)
    assert proxy.result.recorded["recorded"] == 8
    assert all(len(v) == 4 for v in got.values()) and got["alpha"][0]["tool_calls"]
    lines = trace_lines(out)
    meta, calls = lines[0], lines[1:]
    assert meta["source"] == "agentspec-sim proxy" and meta["tokenizer"] == "qwen3"
    # Two queries (found by the conversation alone), seq 0..3 each, every later call in the delta form.
    by_query: dict[str, list[dict]] = {}
    for c in calls:
        by_query.setdefault(c["query_id"], []).append(c)
    assert sorted(len(v) for v in by_query.values()) == [4, 4]
    for q in by_query.values():
        assert [c["seq"] for c in q] == [0, 1, 2, 3]
        assert "messages" in q[0] and "arrival_s" in q[0]
        assert all(c["prompt_extends"] == p["id"] and "messages_append" in c and c["think_s"] >= 0
                   for p, c in itertools.pairwise(q))
        assert q[0]["output"].endswith('</tool_call><|im_end|>')
        assert q[1]["messages_append"][0]["role"] == "tool"
        # The stub calls the tool after a user message and answers after the tool's result.
        assert [c["extra"]["finish_reason"] for c in q] == ["tool_calls", "stop", "tool_calls", "stop"]
        assert all(c["extra"]["stream"] is stream for c in q)
    assert SECRET not in out.read_text() and "authorization" not in out.read_text().lower()
    wl = load_trace(out, cache=False)
    assert wl.num_calls == 8 and len(wl.queries) == 2
    assert all(c.prompt_extends is not None for q in wl.queries for c in q.calls[1:])


def test_token_ids_recorded_as_the_server_returned_them(stub, tmp_path):
    out = tmp_path / "t.jsonl.zst"
    with in_process_proxy(stub, out, ask_token_ids=True) as proxy:
        got = run_agents(proxy.url + "/v1", "m", ["a"], turns=3, stream=True)["a"]
        got += run_agents(proxy.url + "/v1", "m", ["b"], turns=2, stream=False)["b"]
    calls = trace_lines(out)[1:]
    assert [c["output_tokens"] for c in calls] == [g["token_ids"] for g in got]
    assert calls[0]["prompt_tokens"] == got[0]["prompt_token_ids"]
    assert proxy.result.recorded["as_token_ids"] == 5
    # Each later call of a query re-sends the answer: written as the ids it appends.
    assert [("prompt_append_tokens" in c) for c in calls] == [False, True, True, False, True]
    wl = load_trace(out, cache=False)
    assert [c.prompt_tokens.tolist() for q in wl.queries for c in q.calls] == [g["prompt_token_ids"] for g in got]


def test_header_and_metadata_identity(stub, tmp_path):
    out = tmp_path / "t.jsonl"
    with in_process_proxy(stub, out) as proxy:
        base = proxy.url + "/v1/chat/completions"
        _post(base, CHAT, {"X-Agent-Id": "planner", "X-Query-Id": "task-1", "X-Agent-Role": "plan"})
        _post(base, {**CHAT, "messages": [{"role": "user", "content": "other"}]},
              {"X-Agent-Id": "planner", "X-Query-Id": "task-1"})
        _post(base, {**CHAT, "metadata": {"agent_id": "coder", "query_id": "task-2"}})
        _post(base, {**CHAT, "user": "someone"})
        # Messages that start with an earlier call's but do not go on with an answer: a query of their own.
        _post(base, {**CHAT, "messages": [*CHAT["messages"], {"role": "user", "content": "and more"}]})
    calls = trace_lines(out)[1:]
    assert [(c["agent_id"], c["query_id"], c["seq"]) for c in calls] == [
        ("planner", "task-1", 0), ("planner", "task-1", 1), ("coder", "task-2", 0), ("someone", "auto-1", 0),
        ("agent", "auto-2", 0)]
    assert calls[0]["role"] == "plan"
    assert "messages" in calls[1]  # same query, but its messages do not extend the first call's


def test_upstream_faults_pass_through_unrecorded(stub, tmp_path):
    out = tmp_path / "t.jsonl"
    with in_process_proxy(stub, out, timeout_s=0.5) as proxy:
        base = proxy.url + "/v1/chat/completions"
        status, body = _post(base, CHAT, {"X-Stub-Fault": "500"})
        assert status == 500 and json.loads(body)["error"]["message"] == "stub failure"  # unchanged
        status, body = _post(base, CHAT, {"X-Stub-Fault": "slow", "X-Stub-Delay-S": "3"})
        assert status == 504 and json.loads(body)["error"]["type"] == "upstream_timeout"
        status, body = _post(base, CHAT, {"X-Stub-Fault": "garbage"})
        assert status == 200 and body == b"not json"
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIError):
            list(client.chat.completions.create(model="m", messages=CHAT["messages"], stream=True,
                                                extra_headers={"X-Stub-Fault": "drop"}))
        status, _ = _post(base, CHAT)
        assert status == 200
        status, body = _post(proxy.url + "/v1/models", b"", {})  # POST to a path not recorded: passed through
        assert status == 405
    r, p = proxy.result.recorded, proxy.result.passed
    assert r["recorded"] == 1 and [c["seq"] for c in trace_lines(out)[1:]] == [0]
    assert p["upstream_errors"] == {"500": 1} and p["timeouts"] == 1 and p["dropped_streams"] == 1
    assert r["not_recorded"] == {"response is not JSON": 1} and p["passed_through"] == 1
    assert "1 upstream errors (500: 1)" in proxy.result.line()


def test_upstream_down_is_502_and_not_recorded(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "t.jsonl"
    with in_process_proxy(f"http://127.0.0.1:{port}/v1", out) as proxy:
        status, body = _post(proxy.url + "/v1/chat/completions", CHAT)
    assert status == 502 and json.loads(body)["error"]["type"] == "upstream_unreachable"
    assert proxy.result.passed["unreachable"] == 1 and len(trace_lines(out)) == 1


def test_body_over_the_limit_is_refused_before_upstream(stub, tmp_path):
    out = tmp_path / "t.jsonl"
    with in_process_proxy(stub, out, max_body_bytes=4096) as proxy:
        big = {**CHAT, "messages": [{"role": "user", "content": "x " * 5000}]}
        status, body = _post(proxy.url + "/v1/chat/completions", big)
        assert status == 413 and b"limit" in body
        assert _post(proxy.url + "/v1/chat/completions", CHAT)[0] == 200
    assert proxy.result.passed["too_large"] == 1 and proxy.result.recorded["recorded"] == 1


def test_restart_continues_the_file_and_cuts_an_unfinished_line(stub, tmp_path):
    out = tmp_path / "t.jsonl"
    with in_process_proxy(stub, out) as proxy:
        _, body = _post(proxy.url + "/v1/chat/completions", CHAT)
    answer = json.loads(body)["choices"][0]["message"]["content"]
    with open(out, "a") as f:
        f.write('{"type": "call", "id": "half')  # a write the machine never finished
    with in_process_proxy(stub, out) as proxy:
        assert proxy.proxy.recorder.stats.resumed_calls == 1
        # The conversation of the first run goes on: it joins that query, at seq 1.
        _post(proxy.url + "/v1/chat/completions", {**CHAT, "messages": [
            *CHAT["messages"], {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]})
    calls = trace_lines(out)[1:]
    assert [(c["query_id"], c["seq"]) for c in calls] == [("auto-1", 0), ("auto-1", 1)]
    assert calls[1]["think_s"] > 0  # the gap since the first run's call ended
    assert load_trace(out, cache=False).num_calls == 2


def test_refuses_an_output_it_did_not_record(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"type": "meta", "version": 1, "tokenizer": "qwen3"}\n')
    with pytest.raises(OSError, match="not a trace this proxy recorded"):
        TraceRecorder(other)
    with pytest.raises(OSError, match=r"writes \.jsonl or \.jsonl\.zst"):
        TraceRecorder(tmp_path / "t.jsonl.gz")
    edited = tmp_path / "edited.jsonl"
    TraceRecorder(edited).close()
    with open(edited, "a") as f:
        f.write('{"type": "call", "seq": "x"}\n')
    with pytest.raises(OSError, match="line 2 is not a call this proxy wrote"):
        TraceRecorder(edited)
    (tmp_path / "link.jsonl").symlink_to(other)
    with pytest.raises(OSError, match="not a regular file"):
        TraceRecorder(tmp_path / "link.jsonl")
    assert other.read_text() == '{"type": "meta", "version": 1, "tokenizer": "qwen3"}\n'


# ---- the command, in a fresh process -------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_sigkill_loses_only_calls_in_flight_and_inspect_reads_a_live_trace(stub, tmp_path, suffix):
    out = tmp_path / f"t{suffix}"
    proxy = CliProxy(stub + "/v1", out, cwd=tmp_path)
    try:
        run_agents(proxy.url, "m", ["a", "b"], turns=3, stream=True)
        live = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "inspect", str(out), "--json"],
                              capture_output=True, text=True, cwd=tmp_path)
        assert live.returncode == 0, live.stderr
        assert json.loads(live.stdout)["calls"] == 6
        # A slow call in flight when the process is killed: lost, the rest intact.
        import threading

        def in_flight() -> None:
            with contextlib.suppress(OSError):  # the proxy dies under it
                _post(proxy.url + "/chat/completions", CHAT, {"X-Stub-Fault": "slow", "X-Stub-Delay-S": "5"})

        slow = threading.Thread(target=in_flight, daemon=True)
        slow.start()
        time.sleep(0.5)
    finally:
        proxy.proc.kill()
        proxy.proc.wait()
    assert load_trace(out, cache=False).num_calls == 6
    # Restarted on the same file: continues it.
    again = CliProxy(stub + "/v1", out, cwd=tmp_path)
    assert "6 calls there already" in again.first_line
    _post(again.url + "/chat/completions", CHAT)
    rc, err = again.stop(signal.SIGINT)
    assert rc == 0, err
    assert "1 calls recorded" in err and "6 were there before" in err
    assert load_trace(out, cache=False).num_calls == 7


def test_sigterm_lets_calls_in_flight_finish(stub, tmp_path):
    import threading

    out = tmp_path / "t.jsonl"
    proxy = CliProxy(stub + "/v1", out, "--drain-s", "20", cwd=tmp_path)
    result: dict = {}
    slow = threading.Thread(target=lambda: result.setdefault("r", _post(
        proxy.url + "/chat/completions", CHAT, {"X-Stub-Fault": "slow", "X-Stub-Delay-S": "1.5"})))
    slow.start()
    time.sleep(0.5)
    rc, err = proxy.stop(signal.SIGTERM)
    slow.join()
    assert rc == 0, err
    assert result["r"][0] == 200 and "1 calls recorded" in err
    assert load_trace(out, cache=False).num_calls == 1
    assert not os.path.exists(f"{out}.lock")


def test_command_line_errors_are_one_line(tmp_path, stub):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "proxy", *args], capture_output=True,
                              text=True, cwd=tmp_path)

    for args, needle in [
        (["--upstream", "ftp://x", "-o", "t.jsonl"], "--upstream"),
        (["--upstream", stub, "-o", "t.csv"], "--output"),
        (["--upstream", stub, "-o", "t.jsonl", "--port", "70000"], "--port"),
        (["--upstream", stub, "-o", "t.jsonl", "--timeout-s", "0"], "--timeout-s"),
    ]:
        r = cli(*args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.jsonl").exists()


def test_replay_of_a_recording(stub, tmp_path):
    out = tmp_path / "t.jsonl"
    with in_process_proxy(stub, out) as proxy:
        run_agents(proxy.url + "/v1", "m", ["a", "b"], turns=3, stream=False)
    r = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "replay", str(out), "--drafter", "normal,ngram",
                        "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = {run["drafter"]: run for run in json.loads(r.stdout)["runs"]}
    assert set(runs) == {"normal", "ngram"}
    assert all(run["calls"] == 6 and run["completed_queries"] == 2 for run in runs.values())


def test_a_full_disk_never_fails_the_agent_and_leaves_whole_calls(stub, tmp_path, monkeypatch):
    import errno

    from agentspec_sim.capture import recorder as recorder_module

    out = tmp_path / "t.jsonl"
    real_write = os.write
    with in_process_proxy(stub, out) as proxy:
        assert _post(proxy.url + "/v1/chat/completions", CHAT)[0] == 200
        fd = proxy.proxy.recorder._fd

        def full_disk(target: int, data) -> int:
            if target != fd:
                return real_write(target, data)
            real_write(target, bytes(data)[:10])  # part of the line reaches the disk, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(recorder_module.os, "write", full_disk)
        other = {**CHAT, "messages": [{"role": "user", "content": "x"}]}
        status, body = _post(proxy.url + "/v1/chat/completions", other)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "echo 1 words"
        monkeypatch.setattr(recorder_module.os, "write", real_write)
        assert _post(proxy.url + "/v1/chat/completions", CHAT)[0] == 200
    assert proxy.result.recorded["not_recorded"] == {"trace not written (No space left on device)": 1}
    assert load_trace(out, cache=False).num_calls == 2  # the cut line was taken back


def test_a_damaged_zstd_recording_is_refused_not_cut(stub, tmp_path):
    out = tmp_path / "t.jsonl.zst"
    with in_process_proxy(stub, out) as proxy:
        for _ in range(3):
            _post(proxy.url + "/v1/chat/completions", CHAT)
    raw = bytearray(out.read_bytes())
    second = raw.index(b"\x28\xb5\x2f\xfd", raw.index(b"\x28\xb5\x2f\xfd", 1) + 1)  # the 2nd call's frame
    raw[second] ^= 0xFF  # its magic number damaged: not a frame cut off at the end
    out.write_bytes(bytes(raw))
    with pytest.raises(OSError, match="cannot read it back"):
        TraceRecorder(out)
    assert out.read_bytes() == bytes(raw)  # the calls after the damage are still there
