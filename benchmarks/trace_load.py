"""Trace loading speed: size on disk, cold load (parse + tokenize), warm load (cache hit).

Usage: python benchmarks/trace_load.py [--raw ../shared/traces]
With --raw, also converts the mini-swe-agent source to the *text* form (chat messages, delta form)
and times loading it, which is where tokenization and chat-template rendering cost show.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from agentspec_sim.trace.bundled import bundled_dir
from agentspec_sim.trace.io import load_trace, read_trace_bytes


def time_load(path: Path) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["AGENTSPEC_SIM_CACHE"] = cache
        t0 = time.perf_counter()
        workload = load_trace(path)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_trace(path)
        warm = time.perf_counter() - t0
    unique = int(workload.calls[0].prompt_tokens.base.size) if workload.calls else 0
    return {
        "trace": path.name, "bytes": path.stat().st_size, "decompressed_bytes": len(read_trace_bytes(path)),
        "calls": workload.num_calls, "unique_tokens": unique, "output_tokens": workload.output_tokens,
        "cold_s": round(cold, 3), "warm_s": round(warm, 3), "cold_tokens_per_s": round(unique / cold),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raw", type=Path, help="raw traces folder (adds a text-form measurement)")
    args = parser.parse_args()
    rows = [time_load(p) for p in sorted(bundled_dir().glob("*.jsonl.zst"))]
    if args.raw is not None:
        from agentspec_sim.trace.convert_run import convert_to_trace

        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp) / "mini-swe-agent.text.jsonl.zst"
            convert_to_trace("mini-swe-agent", [args.raw / "mini-swe-agent_gemini3pro_swebench_verified"], text)
            rows.append(time_load(text))
    header = f"{'trace':<34}{'MB':>7}{'calls':>8}{'unique tok':>12}{'cold s':>8}{'warm s':>8}{'tok/s cold':>12}"
    print(header)
    for r in rows:
        print(f"{r['trace']:<34}{r['bytes'] / 1e6:>7.2f}{r['calls']:>8}{r['unique_tokens']:>12,}"
              f"{r['cold_s']:>8.2f}{r['warm_s']:>8.2f}{r['cold_tokens_per_s']:>12,}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
