"""The recording proxy's overhead on loopback: requests per second through it, and the latency it adds.

    python benchmarks/proxy_bench.py [--requests 3000] [--latency-requests 1000] [--concurrency 32] [--stream]

Three processes: the stub OpenAI-compatible server (agentspec_sim/capture/stub_upstream.py), `agentspec-sim proxy`
pinned to one core (recording to a temporary .jsonl), and this load generator (aiohttp). Measured:
- latency added: the same requests one at a time, straight to the stub and through the proxy; p50 / p99 of
  each, and their difference;
- throughput: `--requests` chat completions at `--concurrency` through the proxy; requests per wall second, and
  per CPU second of the proxy process (what one core sustains when the client and stub are not the limit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_up(url: str, timeout: float = 60) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _pinned(core: int):
    def pin() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core % os.cpu_count()})
    return pin


BODY = {"model": "m", "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "system", "content": "You are a coding agent. " * 20},
                     {"role": "user", "content": "List the files and count the lines of each. " * 5}]}


async def _one(session, url: str, stream: bool) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json={**BODY, "stream": stream}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    return time.perf_counter() - t0


async def _sequential(url: str, n: int, stream: bool) -> np.ndarray:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(20):  # warm-up: connections, the proxy's first calls
            await _one(session, url, stream)
        return np.array([await _one(session, url, stream) for _ in range(n)])


async def _concurrent(url: str, n: int, concurrency: int, stream: bool) -> float:
    import aiohttp

    left = n

    async def worker(session) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await _one(session, url, stream)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t0


def run(requests: int = 3000, latency_requests: int = 1000, concurrency: int = 32, stream: bool = False) -> dict:
    stub_port = _free_port()
    stub = subprocess.Popen([sys.executable, "-m", "agentspec_sim.capture.stub_upstream", "--port", str(stub_port)],
                            preexec_fn=_pinned(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stub_url = f"http://127.0.0.1:{stub_port}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        proxy = subprocess.Popen([sys.executable, "-m", "agentspec_sim.cli", "proxy", "--upstream", stub_url + "/v1",
                                  "-o", str(out), "--port", "0"], preexec_fn=_pinned(0), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        try:
            _wait_up(stub_url + "/v1/models")
            line = proxy.stderr.readline()
            proxy_url = line.split(" on ", 1)[1].split()[0]
            direct = asyncio.run(_sequential(stub_url + "/v1/chat/completions", latency_requests, stream))
            through = asyncio.run(_sequential(proxy_url + "/chat/completions", latency_requests, stream))
            cpu0 = _cpu_s(proxy.pid)
            wall = asyncio.run(_concurrent(proxy_url + "/chat/completions", requests, concurrency, stream))
            proxy_cpu = _cpu_s(proxy.pid) - cpu0
        finally:
            proxy.terminate()
            _, err = proxy.communicate(timeout=60)
            stub.terminate()
            stub.wait(30)
        recorded = sum(1 for _ in out.open()) - 1
    ms = 1000.0

    def pct(a: np.ndarray, q: float) -> float:
        return round(float(np.percentile(a, q)) * ms, 3)

    return {
        "stream": stream, "requests": requests, "concurrency": concurrency, "latency_requests": latency_requests,
        "direct_ms": {"p50": pct(direct, 50), "p99": pct(direct, 99)},
        "through_proxy_ms": {"p50": pct(through, 50), "p99": pct(through, 99)},
        "added_ms": {"p50": round(pct(through, 50) - pct(direct, 50), 3),
                     "p99": round(pct(through, 99) - pct(direct, 99), 3)},
        "requests_per_s": round(requests / wall, 1),
        "requests_per_proxy_cpu_s": round(requests / proxy_cpu, 1) if proxy_cpu > 0 else None,
        "proxy_cpu_s": round(proxy_cpu, 2), "wall_s": round(wall, 2),
        "recorded_calls": recorded, "expected_calls": requests + latency_requests + 20,
        "summary": err.strip().splitlines()[-1] if err.strip() else "",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    a = parser.parse_args(argv)
    print(json.dumps(run(a.requests, a.latency_requests, a.concurrency, a.stream), indent=2))


if __name__ == "__main__":
    main()
