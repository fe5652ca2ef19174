"""Shared pieces of the recording proxy's tests: servers on loopback threads, the CLI proxy as a process, and a
small agent loop on the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def serving(app) -> Iterator[str]:
    """An aiohttp application on a free loopback port, in its own thread; yields its base URL."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@contextmanager
def in_process_proxy(upstream: str, output: Path, **options) -> Iterator:
    """A ProxyServer in a thread; yields the server (its `.url`); stopped and its summary kept on `.result`."""
    from agentspec_sim.capture.proxy import ProxyServer, RecordingProxy
    from agentspec_sim.capture.recorder import TraceRecorder

    server_opts = {k: options.pop(k) for k in ("drain_s",) if k in options}
    recorder = TraceRecorder(output, **{k: options.pop(k) for k in ("tokenizer", "vocab_size") if k in options})
    ready = threading.Event()
    server = ProxyServer(RecordingProxy(upstream, recorder, **options), on_ready=lambda url: ready.set(),
                         **server_opts)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("summary", server.run()), daemon=True)
    thread.start()
    assert ready.wait(30), "the proxy did not start"
    try:
        yield server
    finally:
        server.stop()
        thread.join(60)
        server.result = box.get("summary")


class CliProxy:
    """`agentspec-sim proxy` in a fresh process, on a free port."""

    def __init__(self, upstream: str, output: Path, *args: str, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentspec_sim.cli", "proxy", "--upstream", upstream, "-o", str(output),
             "--port", "0", *args],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "COLUMNS": "200"})
        line = self.proc.stderr.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"proxy did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split(" on ", 1)[1].split()[0]  # …/v1
        self.first_line = line

    def stop(self, sig: int, timeout: float = 60) -> tuple[int, str]:
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, self.first_line + err


TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]


def agent_loop(client, model: str, agent: str, turns: int, stream: bool, tools: bool = True,
               extra_body: dict | None = None, max_tokens: int | None = None, force_tools: bool = False) -> list[dict]:
    """A coding agent's loop: ask, run the tool it asks for (or answer), send the result back, for `turns` calls.
    `force_tools`: every other call names the tool (`tool_choice`), so even a random-weight model calls it.
    Returns what the client received per call: text, tool calls, and vLLM's token ids where present."""
    messages = [{"role": "system", "content": f"You are agent {agent}. Use the run tool."},
                {"role": "user", "content": f"List the files of project {agent} and count them."}]
    received = []
    for turn in range(turns):
        kwargs = {"model": model, "messages": messages, "temperature": 0, "extra_body": extra_body or {}}
        if tools:
            kwargs["tools"] = TOOLS
            if force_tools:
                kwargs["tool_choice"] = {"type": "function", "function": {"name": "run"}} if turn % 2 == 0 else "none"
        if max_tokens:
            kwargs["max_tokens"] = max_tokens
        if stream:
            text, calls, ids, prompt_ids = [], {}, [], None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                extra = chunk.model_extra or {}
                if extra.get("prompt_token_ids") is not None:
                    prompt_ids = extra["prompt_token_ids"]
                for choice in chunk.choices:
                    if choice.delta.content:
                        text.append(choice.delta.content)
                    for piece in choice.delta.tool_calls or ():
                        c = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                        c["id"] = piece.id or c["id"]
                        if piece.function and piece.function.name:
                            c["name"] = piece.function.name
                        if piece.function and piece.function.arguments:
                            c["arguments"] += piece.function.arguments
                    ids.extend((choice.model_extra or {}).get("token_ids") or ())
            got = {"text": "".join(text), "tool_calls": [calls[i] for i in sorted(calls)], "token_ids": ids or None,
                   "prompt_token_ids": prompt_ids}
        else:
            r = client.chat.completions.create(**kwargs)
            m = r.choices[0].message
            got = {"text": m.content or "", "tool_calls": [
                {"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or ()],
                "token_ids": (r.choices[0].model_extra or {}).get("token_ids"),
                "prompt_token_ids": (r.model_extra or {}).get("prompt_token_ids")}
        received.append(got)
        assistant: dict = {"role": "assistant", "content": got["text"]}
        if got["tool_calls"]:
            assistant["tool_calls"] = [{"id": c["id"], "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for c in got["tool_calls"]]
        messages.append(assistant)
        for c in got["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": f"a.py\nb.py\n({turn})"})
        if not got["tool_calls"]:
            messages.append({"role": "user", "content": f"Go on (turn {turn})."})
    return received


def run_agents(base_url: str, model: str, agents: list[str], headers: bool = False,
               **loop_options) -> dict[str, list[dict]]:
    """The agents' loops concurrently, one thread and one client each (`headers`: each names itself in X-Agent-Id)."""
    import openai

    out: dict[str, list[dict]] = {}
    errors: list[BaseException] = []

    def one(agent: str) -> None:
        try:
            client = openai.OpenAI(base_url=base_url, api_key="sk-test-SECRET-never-recorded", max_retries=0,
                                   timeout=300, default_headers={"X-Agent-Id": agent} if headers else None)
            out[agent] = agent_loop(client, model, agent, **loop_options)
        except BaseException as exc:  # surfaced in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def trace_lines(path: Path) -> list[dict]:
    from agentspec_sim.trace.io import read_trace_bytes

    return [json.loads(line) for line in read_trace_bytes(path).splitlines() if line.strip()]
