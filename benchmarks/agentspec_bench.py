"""Drafting cost of the AgentSpec family (and ngram / suffix for reference), per call-step, no engine.

The trace's queries are replayed with `--concurrency` queries in flight (calls of a query in
sequence): every step, each running call emits the accepted prefix of its last draft plus one token
(greedy verification against the recording), the drafter's hooks run as the engine runs them
(`start_call` at the first token, `observe`, `finish_call`, one `propose` over the rows that go on,
each allowed k tokens). Only the drafter's own time is measured. The paper's claim to check: under
2 ms of drafting per engine step (§5.6).

Usage: python benchmarks/agentspec_bench.py [--trace PATH] [--queries N] [--concurrency 1,16,64,256]
       [--drafters agentspec,agentspec-s,agentspec-n,agentspec-r,agentspec+,ngram,suffix] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import numpy as np

from agentspec_sim.cost import build_cost_model
from agentspec_sim.drafters.registry import make_drafter, parse_drafter
from agentspec_sim.engine.request import CallState
from agentspec_sim.trace.io import load_trace

ROOT = Path(__file__).resolve().parent.parent


def replay(queries: list, spec, concurrency: int) -> dict:
    drafter = make_drafter(spec)
    if hasattr(drafter, "bind_cost_model"):  # agentspec+ sizes drafts by M(b): the engine's cost model
        drafter.bind_cost_model(build_cost_model("a100-80g", "qwen3-8b"))
    k = spec.num_speculative_tokens
    waiting = deque(sorted(q.calls, key=lambda c: c.seq) for q in queries)
    active: list[list] = []  # [calls left of the query, CallState, draft]
    index = 0
    t_start = t_hooks = t_propose = 0.0
    steps = call_steps = starts = drafted = accepted = 0
    tic = time.perf_counter
    while waiting or active:
        while waiting and len(active) < concurrency:
            calls = deque(waiting.popleft())
            active.append([calls, None, None])
        going, lens = [], []
        for slot in active:
            calls, st, draft = slot
            if st is None:  # the query's next call: its first token, then start_call
                call = calls.popleft()
                st = slot[1] = CallState(index, call, call.id, 0, index, call.output_len)
                index += 1
                e = 1
            else:
                truth = st.call.output_tokens[st.num_emitted:st.num_emitted + draft.shape[0]]
                n = int(np.cumprod(draft[:truth.shape[0]] == truth).sum()) if draft.shape[0] else 0
                drafted += draft.shape[0]
                accepted += n
                e = min(n + 1, st.remaining)
            end = st.num_tokens
            st.history[end:end + e] = st.call.output_tokens[st.num_emitted:st.num_emitted + e]
            st.num_emitted += e
            if e and st.num_emitted == e:
                s0 = tic()
                drafter.start_call(st)
                t_start += tic() - s0
                starts += 1
            emitted = st.history[st.num_tokens - e:st.num_tokens]
            done = st.remaining == 0
            h0 = tic()
            drafter.observe(st, emitted)
            if done:
                drafter.finish_call(st)
            t_hooks += tic() - h0
            call_steps += 1
            if done:
                slot[1] = None
            else:
                going.append(slot)
                lens.append(k)
        p0 = tic()
        if going:
            out = drafter.propose([slot[1] for slot in going], np.asarray(lens, dtype=np.int64))
            for slot, d in zip(going, out, strict=True):
                slot[2] = d
        t_propose += tic() - p0
        steps += 1
        active = [slot for slot in active if slot[1] is not None or slot[0]]
    total = t_start + t_hooks + t_propose
    return {
        "concurrency": concurrency, "steps": steps, "call_steps": call_steps, "calls": starts,
        "drafted": drafted, "accepted": accepted,
        "us_per_call_step": round(total / call_steps * 1e6, 2),
        "us_per_call_step_without_starts": round((total - t_start) / call_steps * 1e6, 2),
        "propose_us_per_call_step": round(t_propose / call_steps * 1e6, 2),
        "start_ms_per_call": round(t_start / max(starts, 1) * 1e3, 3),
        "ms_per_engine_step": round(total / steps * 1e3, 3),
        "seconds": round(total, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "traces" / "reflexion.jsonl.zst"))
    ap.add_argument("--queries", type=int, default=200, help="the first N queries (every query when 0)")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--drafters", default="agentspec,agentspec-s,agentspec-n,agentspec-r,agentspec+,ngram,suffix")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    wl = load_trace(args.trace)
    queries = list(wl.queries[:args.queries] if args.queries else wl.queries)
    # warm the compiled code (numba caches) outside the measurement
    for name in args.drafters.split(","):
        replay(list(replace(wl, queries=wl.queries[:2]).queries), parse_drafter(name), 2)
    results = []
    for name in args.drafters.split(","):
        spec = parse_drafter(name)
        for c in (int(x) for x in args.concurrency.split(",")):
            row = {"drafter": name, **replay(queries, spec, c)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
