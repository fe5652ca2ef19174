"""One capacity search timed in CPU seconds: `python benchmarks/capacity_search.py DRAFTER MAX_NUM_SEQS SEEDS [TRACE]`
(A100-80G / Qwen3-8B, TTFT ≤ 5 s and TPOT ≤ 0.1 s, `agentspec_sim.capacity.find_capacity`; default: the bundled
trace). Prints one JSON line: the capacity, its interval, the probes, CPU and wall seconds, and which
agentspec_sim ran — with `PYTHONPATH=<a checkout of another commit>` the same search on that commit's code, to time
two commits alternately on one machine (docs/performance.md, fifteenth pass)."""

from __future__ import annotations

import json
import sys
import time

import agentspec_sim
from agentspec_sim import capacity, load_trace
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.slo import LatencySLO
from agentspec_sim.trace.bundled import default_trace_path


def main(argv: list[str]) -> None:
    drafter, seqs, seeds = argv[0], int(argv[1]), int(argv[2])
    workload = load_trace(argv[3] if len(argv) > 3 else default_trace_path())
    search = capacity.CapacitySearch(LatencySLO(ttft_s=5, tpot_s=0.1), seeds=seeds)
    cpu, wall = time.process_time(), time.perf_counter()
    cap = capacity.find_capacity(workload, drafter, EngineConfig(max_num_seqs=seqs), search)
    print(json.dumps({"code": agentspec_sim.__file__, "drafter": drafter, "max_num_seqs": seqs, "seeds": seeds,
                      "rate": cap.rate, "low": cap.low, "high": cap.high, "probes": len(cap.probes),
                      "cpu_s": round(time.process_time() - cpu, 1), "wall_s": round(time.perf_counter() - wall, 1)}))


if __name__ == "__main__":
    main(sys.argv[1:])
