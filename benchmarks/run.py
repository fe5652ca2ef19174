"""The simulator's speed, in one script: prints tables and writes benchmarks/results.json.

Usage: python benchmarks/run.py [--sections engine,scale,sweep,arctic,cold,proxy,capacity,parallel]
                                [--trace PATH]… [--queries N] [--replicate R]
                                [--drafters normal,ngram,suffix,agentspec] [--seqs 1,32,256]
                                [--scale reflexion:1M,3M,10M coding:1M] [--scale-drafter agentspec]
                                [--sweep-jobs 1,2] [--sweep-repeats R] [--sweep-queries N]
                                [--parallel-drafters normal,ngram,suffix,mtp] [--parallel-hardware b200]
                                [--out benchmarks/results.json]

Sections (each runs only when named; results.json keeps the sections not run this time, and the
engine and scale runs not repeated this time):

- engine: every (trace, drafter, max_num_seqs) simulated in a fresh child process whose cache directory
  (AGENTSPEC_SIM_CACHE) holds the loaded trace and nothing else, all queries arriving at t = 0, after a
  one-query warm-up (imports, numba); --replicate R sends the trace as R tenants. Per run: wall seconds of
  `simulate` and its CPU seconds
  (steadier on a shared machine) — including the drafters' workload tables' build (suffix, agentspec,
  ngram, ngram-v2; eagle3's code(n) segments: drafters/agentspec/tables.py, suffix_tables.py,
  ngram_tables.py), which is also reported alone (`tables_cpu_s`; a
  later run of the same workload reads them from the cache: `tokens_per_cpu_s_cached`) —, simulated
  output tokens per wall and per CPU second, engine steps and call-steps, the drafter's own time
  (every hook the drafter overrides and the engine's batched proposer, timed in place):
  µs per proposing call-step, µs per observed call-step, ms per call start (`start_call`: prompt
  indexing), the engine's overhead per step (wall minus drafter time, per step), the child's peak RSS.
- scale: synthetic traces (`agentspec_sim.trace.synth`, seed 0, cached in the temp dir)
  of N output tokens resampled from a bundled trace, replayed with `--scale-drafter` at max_num_seqs
  256 in a child each: load seconds, simulate seconds, tokens per second, peak RSS.
- sweep: wall time of `agentspec-sim sweep TRACE --max-num-seqs 1,2,4,…,256 -j J` (the Figure-1
  drafters, one seed) for each J in --sweep-jobs, first with an empty table cache (the sweep builds
  every workload table once; the trace itself is loaded into that cache beforehand), then again with
  the tables that run left (`table_cache`: "empty" / "warm": a later sweep of the same trace);
  --sweep-repeats R runs each pair R times (this machine's speed drifts); --sweep-queries N sweeps
  the first N queries only.
- cold: a fresh install's first runs — `agentspec-sim replay traces/swe-agent.jsonl.zst --drafter normal`
  and the README's `agentspec-sim replay` — in a child with empty numba and table caches (every kernel
  the run uses compiled, every table built: CPU and wall seconds), then again warm; --cold-repeats R. First,
  the same commands from installed copies (`pip install --target`): a first install with an empty per-user
  kernel cache, then a second install of the same sources (agentspec_sim/host/kernel_cache.py: the kernels
  the first compiled are reused), empty table caches both times.
- capacity: `agentspec-sim sweep TRACE --capacity --slo-ttft 5 --slo-tpot 0.1` (--capacity-slo) over the
  Figure-1 drafters × max_num_seqs 1, 4, 16, 64, 256, -j J for each J in --sweep-jobs, the table cache empty
  but for the loaded trace: wall and CPU seconds, probes (one simulation each), CPU seconds per probe.
- arctic: benchmarks/suffix_vs_arctic.py (suffix vs ArcticInference's C++ per call-step and per call
  start) when arctic-inference is installed; otherwise recorded as skipped.
- parallel: DeepSeek-V3 on 8 GPUs (--parallel-hardware, default b200) at tp 8 + EP and at tp 1 × dp 8 + EP (eight
  lockstep ranks, engine/data_parallel.py) with --parallel-drafters at max_num_seqs --parallel-seqs (per rank), the
  default trace, every query at t = 0, one child each as for engine: wall, CPU, simulated tokens per CPU second.
- proxy: benchmarks/proxy_bench.py, the recording proxy on loopback against the stub server, whole and
  streamed answers: requests per second through it (the proxy pinned to one core) and the latency it adds
  (p50 / p99, one request at a time, against the stub directly).

Timings on a shared machine are noisy: the load average at each run is recorded with it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HOOKS = ("propose", "observe", "start_call", "finish_call", "begin_step")
FIGURE1_SEQS = "1,2,4,8,16,32,64,128,256"


# -- child side ---------------------------------------------------------------------------------------
class DrafterClock:
    """Wraps a drafter class's own hooks (only those it overrides: the engine skips the others) and the
    event loop's proposals through its fast path (engine/drafting.py `EngineDrafting.propose`: the
    n-gram index or table, eagle3/mtp's acceptance tables, agentspec's table), summing seconds and rows
    per hook. Proposals made inside the engine's compiled loop (`draft_between_steps`) are not seen here:
    they are part of the engine's time, and "propose" counts only those made by the event loop."""

    def __init__(self, kind: type) -> None:
        from agentspec_sim.engine.drafting import BaseDrafter

        self.seconds = dict.fromkeys(HOOKS, 0.0)
        self.rows = dict.fromkeys(HOOKS, 0)
        for name in HOOKS:
            own = getattr(kind, name, None)
            if own is not None and own is not getattr(BaseDrafter, name, None):
                setattr(kind, name, self._timed(name, own, rows_at=1))
        own_fast = kind.engine_drafting

        def engine_drafting(drafter, run):
            fast = own_fast(drafter, run)
            if fast is not None:
                fast.propose = self._timed("propose", fast.propose, rows_at=0)
            return fast

        kind.engine_drafting = engine_drafting

    def _timed(self, name: str, fn, rows_at: int):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            out = fn(*args, **kwargs)
            self.seconds[name] += clock() - t0
            if name != "propose":
                self.rows[name] += 1
            elif rows_at == 1 or out is not None:  # a fast path's None: the drafter's own propose follows
                self.rows[name] += len(args[rows_at])  # propose(rows, max_lens): one row per call-step
            return out

        return timed

    def per_row_us(self, name: str) -> float | None:
        return self.seconds[name] / self.rows[name] * 1e6 if self.rows[name] else None


def _load(trace: str | None, queries: int | None):
    from agentspec_sim import load_trace
    from agentspec_sim.trace.bundled import default_trace_path

    path = Path(trace) if trace else default_trace_path()
    t0 = time.perf_counter()
    workload = load_trace(path)
    load_s = time.perf_counter() - t0
    if queries:
        workload = replace(workload, queries=workload.queries[:queries])
    return path, workload, load_s


class TableClock:
    """CPU seconds spent building workload tables (AgentSpec's lookups, suffix's prompt-tree drafts, the
    n-gram matches, eagle3/mtp's code(n) segments)."""

    def __init__(self) -> None:
        from agentspec_sim.drafters.agentspec import tables as history_tables
        from agentspec_sim.drafters.model.rule import ModelBasedDrafter
        from agentspec_sim.drafters.ngram import tables as ngram_tables
        from agentspec_sim.drafters.suffix import tables as suffix_tables

        self.seconds = 0.0
        history_tables.build_tables = self._timed(history_tables.build_tables)
        suffix_tables.build_local_table = self._timed(suffix_tables.build_local_table)
        ngram_tables.build_ngram_table = self._timed(ngram_tables.build_ngram_table)
        ModelBasedDrafter._segment_code = self._timed(ModelBasedDrafter._segment_code)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            c0 = time.process_time()
            out = fn(*args, **kwargs)
            self.seconds += time.process_time() - c0
            return out

        return timed


def run_one(trace: str | None, queries: int | None, drafter: str, seqs: int, hardware: str, model: str = "qwen3-8b",
            layout: tuple[int, int, bool] = (1, 1, False), replicate: int = 1) -> dict:
    """One simulation in this process, with the drafter's hooks timed; returns its measurements. `layout`:
    (tensor_parallel_size, data_parallel_size, enable_expert_parallel); `replicate`: the trace sent as that
    many tenants (each with its own drafter)."""
    from agentspec_sim import EngineConfig, simulate
    from agentspec_sim.cost import build_cost_model
    from agentspec_sim.drafters.registry import make_drafter, parse_drafter
    from agentspec_sim.metrics import summarize

    _, workload, load_s = _load(trace, queries)
    tp, dp, ep = layout
    cost = build_cost_model(hardware, model, tp, expert_parallel=ep, data_parallel_size=dp)
    engine = {"hardware": hardware, "model": model, "tensor_parallel_size": tp, "data_parallel_size": dp,
              "enable_expert_parallel": ep}
    tables = TableClock()
    # Warm-up: numba compilation and imports are not the engine's speed.
    simulate(replace(workload, queries=workload.queries[:1]), drafter, EngineConfig(**engine), cost)
    tables.seconds = 0.0
    clock = DrafterClock(type(make_drafter(parse_drafter(drafter))))
    config = EngineConfig(max_num_seqs=seqs, arrival="zero", replicate=replicate, **engine)
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate(workload, drafter, config, cost)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = summarize(result)
    drafting = sum(clock.seconds.values())
    return {
        "drafter": drafter, "max_num_seqs": seqs, "replicate": replicate, "model": model, "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "expert_parallel": ep, "load_s": load_s, "wall_s": wall, "output_tokens": s.output_tokens,
        "tokens_per_s": s.output_tokens / wall, "cpu_s": cpu, "tokens_per_cpu_s": s.output_tokens / cpu,
        "tables_cpu_s": tables.seconds, "tokens_per_cpu_s_cached": s.output_tokens / (cpu - tables.seconds),
        "engine_steps": s.steps,
        "call_steps": int(result.engine_steps["batch_size"].sum()),
        "us_per_step": wall / s.steps * 1e6, "engine_us_per_step": (wall - drafting) / s.steps * 1e6,
        "drafter_s": drafting, "propose_us_per_call_step": clock.per_row_us("propose"),
        "observe_us_per_call_step": clock.per_row_us("observe"),
        "start_ms_per_call": (clock.per_row_us("start_call") or 0) / 1e3 if clock.rows["start_call"] else None,
        "finish_ms_per_call": (clock.per_row_us("finish_call") or 0) / 1e3 if clock.rows["finish_call"] else None,
        "batch_size_mean": s.batch_size_mean, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "simulated_s": s.simulated_s, "goodput_tok_s": s.goodput_tok_s, "preemptions": s.preemptions,
        "load_average": os.getloadavg()[0],
    }


# -- parent side --------------------------------------------------------------------------------------
def _child(args: list[str], trace: str | None, timeout: float | None = None) -> dict:
    """Run `args` in a child process with its own cache directory, holding the loaded trace and nothing else
    (no workload tables from earlier runs)."""
    cmd = [sys.executable, __file__, "--child", *args]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "AGENTSPEC_SIM_CACHE": cache}
        _load_into_cache(trace, env)
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _load_into_cache(trace: str | Path | None, env: dict[str, str]) -> None:
    """Load `trace` (None: the default) once in a separate process, so that its loader cache in env's
    AGENTSPEC_SIM_CACHE is warm (a run's load and memory are then those of a cache read)."""
    code = ("import sys; from agentspec_sim.trace.io import load_trace; "
            "from agentspec_sim.trace.bundled import default_trace_path; "
            "load_trace(sys.argv[1] if len(sys.argv) > 1 else default_trace_path())")
    subprocess.run([sys.executable, "-c", code, *([str(trace)] if trace else [])], check=True, env=env)


def _fmt(value, spec: str = ",.1f") -> str:
    return "—" if value is None else format(value, spec)


def section_engine(args, console) -> dict:
    from rich.table import Table

    traces = args.trace or [None]
    runs = []
    for trace in traces:
        for seqs in (int(s) for s in args.seqs.split(",")):
            for drafter in args.drafters.split(","):
                child = ["engine", drafter, str(seqs), "--hardware", args.hardware]
                if trace:
                    child += ["--trace", trace]
                if args.queries:
                    child += ["--queries", str(args.queries)]
                if args.replicate > 1:
                    child += ["--replicate", str(args.replicate)]
                r = _child(child, trace)
                r["trace"] = Path(trace).name if trace else "default.jsonl.zst"
                runs.append(r)
                console.print(f"engine: {r['trace']} ×{args.replicate} {drafter} @ {seqs}: {r['wall_s']:.1f} s wall, "
                              f"{r['cpu_s']:.1f} s CPU, {r['tokens_per_cpu_s']:,.0f} tok / CPU s")
    table = Table(title="engine speed (all queries at t = 0; one child process per run)")
    for name in ("trace", "drafter", "seqs", "steps", "call-steps", "wall s", "CPU s", "tables CPU s",
                 "sim tok / CPU s", "… tables cached", "µs / step", "engine µs / step", "propose µs / call-step",
                 "observe µs / call-step", "start ms / call", "peak RSS MiB"):
        table.add_column(name, justify="left" if name in ("trace", "drafter") else "right")
    for r in runs:
        # Per-step and per-call figures are timed on the wall clock; on a shared machine they are
        # shown scaled by the run's CPU / wall ratio (the JSON keeps the wall-clock values).
        scale = r["cpu_s"] / r["wall_s"]

        def cpu(value, spec, scale=scale):
            return _fmt(None if value is None else value * scale, spec)

        table.add_row(r["trace"] + (f" ×{r['replicate']}" if r.get("replicate", 1) > 1 else ""), r["drafter"],
                      str(r["max_num_seqs"]), f"{r['engine_steps']:,}",
                      f"{r['call_steps']:,}", f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                      _fmt(r.get("tables_cpu_s") or None, ".2f"), f"{r['tokens_per_cpu_s']:,.0f}",
                      _fmt(r.get("tokens_per_cpu_s_cached") if r.get("tables_cpu_s") else None, ",.0f"),
                      cpu(r["us_per_step"], ".1f"),
                      cpu(r["engine_us_per_step"], ".1f"),
                      cpu(r["propose_us_per_call_step"], ".2f"), cpu(r["observe_us_per_call_step"], ".2f"),
                      cpu(r["start_ms_per_call"], ".3f"), f"{r['peak_rss_mib']:,.0f}")
    console.print(table)
    console.print("µs and ms columns: wall-clock timings × the run's CPU / wall ratio. ngram, ngram-v2 and eagle3 "
                  "draft inside the compiled loop: their propose column counts only the proposals left to the event "
                  "loop. CPU s and sim tok / CPU s include building the workload's tables (suffix, agentspec, "
                  "the n-gram proposers, eagle3's code segments), which a sweep does once: '… tables cached' is a "
                  "run that finds them.")
    return {"hardware": args.hardware, "model": "qwen3-8b", "queries": args.queries, "runs": runs}


def _parse_scale(items: list[str]) -> list[tuple[str, int]]:
    out = []
    for item in items:
        name, sizes = item.split(":")
        for size in sizes.split(","):
            mult = {"k": 1_000, "M": 1_000_000}.get(size[-1], 1)
            out.append((name, int(float(size.rstrip("kM")) * mult)))
    return out


def synth_trace(name: str, tokens: int) -> Path:
    """<temp dir>/agentspec-sim-synth/<name>-<tokens>.jsonl.zst, made once (seed 0)."""
    from agentspec_sim.trace.bundled import bundled_trace
    from agentspec_sim.trace.io import load_trace, write_trace
    from agentspec_sim.trace.synth import synthesize

    out = Path(tempfile.gettempdir()) / "agentspec-sim-synth" / f"{name}-{tokens}.jsonl.zst"
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        source = bundled_trace(f"{'default' if name == 'coding' else name}.jsonl.zst")
        write_trace(synthesize(load_trace(source), output_tokens=tokens, seed=0), out)
    return out


def section_scale(args, console) -> dict:
    from rich.table import Table

    runs = []
    for name, tokens in _parse_scale(args.scale):
        t0 = time.perf_counter()
        path = synth_trace(name, tokens)
        made = time.perf_counter() - t0
        r = _child(["engine", args.scale_drafter, "256", "--hardware", args.hardware, "--trace", str(path)], str(path))
        r.update(source=name, target_tokens=tokens, synth_s=made, trace_mib=path.stat().st_size / 2**20)
        runs.append(r)
        console.print(f"scale: {name} {tokens:,}: load {r['load_s']:.1f} s, simulate {r['wall_s']:.1f} s, "
                      f"RSS {r['peak_rss_mib']:,.0f} MiB")
    table = Table(title=f"scale: synthetic traces replayed with {args.scale_drafter} at max_num_seqs 256")
    for col in ("from", "output tokens", "call-steps", "file MiB", "load s", "simulate s", "CPU s", "sim tok / CPU s",
                "CPU s per M tokens", "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "from" else "right")
    for r in runs:
        table.add_row(r["source"], f"{r['output_tokens']:,}", f"{r['call_steps']:,}", f"{r['trace_mib']:.0f}",
                      f"{r['load_s']:.1f}", f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['tokens_per_cpu_s']:,.0f}",
                      f"{r['cpu_s'] / r['output_tokens'] * 1e6:.1f}", f"{r['peak_rss_mib']:,.0f}")
    console.print(table)
    return {"drafter": args.scale_drafter, "max_num_seqs": 256, "runs": runs}


def _timed_child(cmd: list[str], env: dict[str, str], what: str) -> tuple[float, float]:
    """(wall, CPU seconds of it and every process it started) of one command; SystemExit when it fails."""
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed: {done.stderr.strip().splitlines()[-1:]}")
    return wall, (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)


def section_sweep(args, console) -> dict:
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace, write_trace

    trace = Path(args.trace[0]) if args.trace else default_trace_path()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.sweep_queries:
            w = load_trace(trace)
            trace_used = Path(tmp) / "subset.jsonl.zst"
            write_trace(replace(w, queries=w.queries[:args.sweep_queries]), trace_used)
        else:
            trace_used = trace
        for repeat, jobs in itertools.product(range(args.sweep_repeats), (int(j) for j in args.sweep_jobs.split(","))):
            # An empty cache but for the loaded trace: the sweep builds its workload tables itself; then the
            # same sweep again, reading them.
            env = {**os.environ, "AGENTSPEC_SIM_CACHE": str(Path(tmp) / f"cache-{jobs}-{repeat}")}
            _load_into_cache(trace_used, env)
            for table_cache in ("empty", "warm"):
                out = Path(tmp) / f"sweep-{jobs}-{repeat}-{table_cache}.parquet"
                cmd = [sys.executable, "-m", "agentspec_sim.cli", "sweep", str(trace_used), "--max-num-seqs",
                       FIGURE1_SEQS, "-j", str(jobs), "-o", str(out), "-q"]
                if args.sweep_drafters:
                    cmd += ["--drafter", args.sweep_drafters]
                wall, cpu = _timed_child(cmd, env, f"sweep -j {jobs}")
                import polars as pl

                cells = pl.read_parquet(out).height
                runs.append({"trace": trace.name, "queries": args.sweep_queries,
                             "drafters": args.sweep_drafters or "sweep's default", "jobs": jobs,
                             "table_cache": table_cache, "wall_s": wall, "cpu_s": cpu, "cells": cells,
                             "load_average": os.getloadavg()[0]})
                console.print(f"sweep -j {jobs}, {table_cache} table cache: {cells} cells in {wall:.1f} s wall "
                              f"({cpu:.1f} s CPU in all processes)")
    return {"trace": trace.name, "queries": args.sweep_queries, "drafters": args.sweep_drafters or "sweep's default",
            "max_num_seqs": FIGURE1_SEQS, "runs": runs}


CAPACITY_SEQS = "1,4,16,64,256"


def section_capacity(args, console) -> dict:
    """`agentspec-sim sweep TRACE --capacity` over the Figure-1 drafters × max_num_seqs 1, 4, 16, 64, 256 with
    the SLOs of docs/sweep-and-plan.md's worked example, -j J for each J in --sweep-jobs: wall and CPU seconds
    in all processes, probes (simulations) in all, CPU seconds per probe; the table cache as a user's first
    search of the trace finds it (empty: the search builds the drafters' tables) unless --capacity-warm."""
    import polars as pl

    from agentspec_sim.sweep.cells import FIGURE1_DRAFTERS
    from agentspec_sim.trace.bundled import default_trace_path

    trace = Path(args.trace[0]) if args.trace else default_trace_path()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for jobs in (int(j) for j in args.sweep_jobs.split(",")):
            env = {**os.environ, "AGENTSPEC_SIM_CACHE": str(Path(tmp) / f"cache-{jobs}")}
            _load_into_cache(trace, env)
            out = Path(tmp) / f"capacity-{jobs}.parquet"
            cmd = [sys.executable, "-m", "agentspec_sim.cli", "sweep", str(trace), "--capacity",
                   *args.capacity_slo.split(), "--max-num-seqs", CAPACITY_SEQS, "-j", str(jobs), "-o", str(out), "-q"]
            wall, cpu = _timed_child(cmd, env, f"capacity -j {jobs}")
            frame = pl.read_parquet(out)
            if args.capacity_keep:
                import shutil

                shutil.copyfile(out, args.capacity_keep)
            probes = int(frame["capacity_probes"].sum())
            per_drafter = {d: int(p) for d, p in frame.group_by("drafter", maintain_order=True)
                           .agg(pl.col("capacity_probes").sum()).rows()}
            runs.append({"trace": trace.name, "jobs": jobs, "slo": args.capacity_slo, "cells": frame.height,
                         "probes": probes, "probes_by_drafter": per_drafter, "wall_s": wall, "cpu_s": cpu,
                         "cpu_s_per_probe": cpu / probes, "load_average": os.getloadavg()[0]})
            console.print(f"capacity -j {jobs}: {frame.height} searches, {probes} probes in {wall:.1f} s wall, "
                          f"{cpu:.1f} CPU s ({cpu / probes:.2f} CPU s per probe)")
    # One search per drafter at max_num_seqs 16 in a child with an empty table cache, each probe timed: what one
    # more probe costs once the search has its tables (drafters/common/table_cache.py `held_in_memory`).
    costs = []
    for drafter in FIGURE1_DRAFTERS:
        got = _child(["probes", drafter, "16", "--slo", f"{args.capacity_slo}", "--hardware", args.hardware,
                      *(["--trace", str(trace)] if args.trace else [])], str(trace) if args.trace else None)
        costs.append(got)
        console.print(f"capacity probes: {drafter} @16: {got['probes']} probes, first {got['first_probe_cpu_s']:.2f} "
                      f"CPU s, marginal {got['marginal_probe_cpu_s']:.2f} CPU s, outside the probes "
                      f"{got['outside_probes_cpu_s']:.2f} CPU s")
    return {"trace": trace.name, "max_num_seqs": CAPACITY_SEQS, "runs": runs, "probe_costs": costs}


def section_arctic(args, console) -> dict:
    try:
        import arctic_inference  # noqa: F401
    except ImportError:
        console.print("arctic: arctic-inference is not installed; skipped (see docs/suffix-decoding.md)")
        return {"skipped": "arctic-inference not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "arctic.json"
        cmd = [sys.executable, str(HERE / "suffix_vs_arctic.py"), "--json", str(out)]
        if args.queries:
            cmd += ["--queries", str(args.queries)]
        subprocess.run(cmd, check=True)
        runs = json.loads(out.read_text())
        return {"queries": args.queries, "runs": runs if isinstance(runs, list) else [runs]}


# The cold-start commands: replay's own arguments (the README's first replay: `agentspec-sim replay`).
COLD_COMMANDS = {"swe-agent normal": ["traces/swe-agent.jsonl.zst", "--drafter", "normal"], "readme replay": []}


def _timed_replay(replay_args: list[str], env: dict[str, str], site: Path | None = None) -> dict:
    """CPU (user + system) and wall seconds of one `agentspec-sim replay` in a child process; `site`: run the
    copy installed there (no site-packages processing, no working directory on sys.path: not the checkout)."""
    code = "import sys; from agentspec_sim.cli.app import main; sys.argv[0] = 'agentspec-sim'; main()"
    python = [sys.executable]
    if site is not None:
        python += ["-S", "-P"]
        env = {**env, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([*python, "-c", code, "replay", *replay_args], check=True, capture_output=True,
                   env=env, cwd=HERE.parent)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}


def section_cold(args, console) -> dict:
    """Each cold-start command with empty numba and workload-table caches (a fresh install's first run:
    every kernel it uses compiled, every table built), then again with the caches that run left (warm).
    Then as installed copies (`pip install --target`, run from there): a first install with an empty per-user
    kernel cache (cold), and a second install of the same sources with the kernels the first one left
    (`installed_again`: a reinstall or a new venv of the same version; data caches empty both times)."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        sites = [Path(tmp) / "site1", Path(tmp) / "site2"]
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(sites[0]),
                        str(HERE.parent)], check=True, capture_output=True)
        shutil.rmtree(HERE.parent / "build", ignore_errors=True)
        shutil.copytree(sites[0], sites[1])
        for name, replay_args in COLD_COMMANDS.items():
            env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
            env["AGENTSPEC_SIM_KERNEL_CACHE"] = f"{tmp}/kernels-{name}"
            first = _timed_replay(replay_args, {**env, "AGENTSPEC_SIM_CACHE": f"{tmp}/cache1-{name}"}, sites[0])
            again = _timed_replay(replay_args, {**env, "AGENTSPEC_SIM_CACHE": f"{tmp}/cache2-{name}"}, sites[1])
            runs.append({"command": f"agentspec-sim replay {' '.join(replay_args)}".strip(), "name": name,
                         "installed_first": first, "installed_again": again, "load": os.getloadavg()[0]})
            console.print(f"cold: {name}: installed, first {first['cpu_s']:.1f} CPU s / {first['wall_s']:.1f} s wall, "
                          f"second install of the same sources {again['cpu_s']:.1f} CPU s / {again['wall_s']:.1f} s")
    for name, replay_args in COLD_COMMANDS.items():
        for repeat in range(args.cold_repeats):
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "NUMBA_CACHE_DIR": f"{tmp}/numba", "AGENTSPEC_SIM_CACHE": f"{tmp}/cache"}
                cold = _timed_replay(replay_args, env)
                warm = _timed_replay(replay_args, env)
            runs.append({"command": f"agentspec-sim replay {' '.join(replay_args)}".strip(), "name": name,
                         "repeat": repeat, "cold": cold, "warm": warm, "load": os.getloadavg()[0]})
            console.print(f"cold: {name}: cold {cold['cpu_s']:.1f} CPU s / {cold['wall_s']:.1f} s wall, "
                          f"warm {warm['cpu_s']:.1f} CPU s / {warm['wall_s']:.1f} s wall")
    return {"runs": runs}


def section_proxy(args, console) -> dict:
    """The recording proxy's overhead (benchmarks/proxy_bench.py), non-streamed and streamed."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        console.print("proxy: aiohttp is not installed; skipped (pip install 'agentspec-sim[proxy]')")
        return {"skipped": "aiohttp not installed"}
    sys.path.insert(0, str(HERE))
    import proxy_bench

    runs = []
    for stream in (False, True):
        r = proxy_bench.run(stream=stream)
        runs.append(r)
        console.print(f"proxy ({'streamed' if stream else 'whole'}): {r['requests_per_s']:,.0f} requests/s "
                      f"({r['requests_per_proxy_cpu_s']:,.0f} per proxy CPU s), added latency p50 "
                      f"{r['added_ms']['p50']:.2f} ms, p99 {r['added_ms']['p99']:.2f} ms")
    return {"runs": runs}


def section_parallel(args, console) -> dict:
    """DeepSeek-V3 on 8 GPUs at tp 8 + EP against tp 1 × dp 8 + EP (lockstep ranks), every query at t = 0."""
    from rich.table import Table

    runs = []
    for layout in ("8,1,1", "1,8,1"):
        for drafter in args.parallel_drafters.split(","):
            child = ["engine", drafter, str(args.parallel_seqs), "--hardware", args.parallel_hardware, "--model",
                     "deepseek-v3", "--layout", layout]
            r = _child(child, None)
            runs.append(r)
            console.print(f"parallel: tp {r['tensor_parallel_size']} dp {r['data_parallel_size']} {drafter}: "
                          f"{r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, {r['tokens_per_cpu_s']:,.0f} tok / CPU s")
    table = Table(title=f"parallel layouts: deepseek-v3 on 8 × {args.parallel_hardware}, max_num_seqs "
                        f"{args.parallel_seqs} (per rank), default trace, all queries at t = 0")
    for name in ("layout", "drafter", "engine steps", "wall s", "CPU s", "sim tok / CPU s", "simulated s",
                 "peak RSS MiB"):
        table.add_column(name, justify="left" if name in ("layout", "drafter") else "right")
    for r in runs:
        table.add_row(f"tp {r['tensor_parallel_size']} × dp {r['data_parallel_size']}", r["drafter"],
                      f"{r['engine_steps']:,}", f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                      f"{r['tokens_per_cpu_s']:,.0f}", f"{r['simulated_s']:,.0f}", f"{r['peak_rss_mib']:,.0f}")
    console.print(table)
    return {"hardware": args.parallel_hardware, "model": "deepseek-v3", "max_num_seqs": args.parallel_seqs,
            "runs": runs}


SECTIONS = {"engine": section_engine, "scale": section_scale, "sweep": section_sweep, "arctic": section_arctic,
            "cold": section_cold, "proxy": section_proxy, "capacity": section_capacity, "parallel": section_parallel}


def probe_costs(trace: str | None, drafter: str, seqs: int, slo_args: str, hardware: str) -> dict:
    """One capacity search (agentspec_sim/capacity) in this process, each probe's simulation timed: CPU seconds
    of the search, of each probe (the first reads or builds the drafter's tables; the rest are what one more
    probe costs), and of the search outside its probes."""
    from agentspec_sim import capacity
    from agentspec_sim.capacity import search as capacity_search
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.slo import LatencySLO
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import load_trace

    words = slo_args.split()
    slo = LatencySLO(**{w.removeprefix("--slo-").replace("-", "_") + "_s": float(v)
                        for w, v in zip(words[::2], words[1::2], strict=True)})
    workload = load_trace(trace or default_trace_path())
    config = EngineConfig(max_num_seqs=seqs, hardware=hardware)
    simulate, times = capacity_search.simulate, []

    def timed(*args, **kwargs):
        t0 = time.process_time()
        result = simulate(*args, **kwargs)
        times.append(time.process_time() - t0)
        return result

    capacity_search.simulate = timed
    capacity.find_capacity(replace(workload, queries=workload.queries[:1]), drafter, config,
                           capacity.CapacitySearch(slo))  # compiles the kernels (and builds a query's tables): untimed
    times.clear()
    t0 = time.process_time()
    cap = capacity.find_capacity(workload, drafter, config, capacity.CapacitySearch(slo))
    total = time.process_time() - t0
    rest = sorted(times[1:])
    return {"drafter": drafter, "max_num_seqs": seqs, "probes": len(cap.probes), "search_cpu_s": round(total, 2),
            "first_probe_cpu_s": round(times[0], 2), "probe_cpu_s": [round(t, 2) for t in times],
            "marginal_probe_cpu_s": round(sum(rest) / len(rest), 2) if rest else None,
            "outside_probes_cpu_s": round(total - sum(times), 2)}


def child_main(argv: list[str]) -> None:
    if argv[:1] == ["probes"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("what")
        parser.add_argument("drafter")
        parser.add_argument("seqs", type=int)
        parser.add_argument("--trace", default=None)
        parser.add_argument("--slo", default="--slo-ttft 5 --slo-tpot 0.1")
        parser.add_argument("--hardware", default="a100-80g")
        a = parser.parse_args(argv)
        print(json.dumps(probe_costs(a.trace, a.drafter, a.seqs, a.slo, a.hardware)))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["engine"])
    parser.add_argument("drafter")
    parser.add_argument("seqs", type=int)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--queries", type=int, default=None)
    parser.add_argument("--hardware", default="a100-80g")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--layout", default="1,1,0", help="tensor parallel, data parallel, expert parallel (0/1)")
    parser.add_argument("--replicate", type=int, default=1)
    a = parser.parse_args(argv)
    tp, dp, ep = (int(x) for x in a.layout.split(","))
    print(json.dumps(run_one(a.trace, a.queries, a.drafter, a.seqs, a.hardware, a.model, (tp, dp, bool(ep)),
                             a.replicate)))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="engine", help="comma-separated: " + ",".join(SECTIONS))
    parser.add_argument("--trace", action="append", default=[], help="trace for engine/sweep (repeatable; "
                        "default: the bundled default trace)")
    parser.add_argument("--queries", type=int, default=None, help="engine: keep only the first N queries")
    parser.add_argument("--replicate", type=int, default=1, help="engine: send the trace as R tenants (each with "
                        "its own drafter; their workload tables shared)")
    parser.add_argument("--drafters", default="normal,ngram,suffix,agentspec")
    parser.add_argument("--seqs", default="1,32,256", help="max_num_seqs values (comma-separated)")
    parser.add_argument("--hardware", default="a100-80g")
    parser.add_argument("--scale", nargs="*", default=["reflexion:1M,3M,10M", "coding:1M"],
                        help="NAME:TOKENS,… synthetic traces from bundled NAME (coding = the default trace)")
    parser.add_argument("--scale-drafter", default="agentspec")
    parser.add_argument("--sweep-jobs", default="1,2")
    parser.add_argument("--sweep-repeats", type=int, default=1,
                        help="run each sweep pair (empty, warm table cache) R times")
    parser.add_argument("--sweep-queries", type=int, default=None, help="sweep only the first N queries")
    parser.add_argument("--sweep-drafters", default=None, help="sweep these drafters (default: sweep's own list)")
    parser.add_argument("--cold-repeats", type=int, default=1, help="cold: run each cold/warm pair R times")
    parser.add_argument("--capacity-slo", default="--slo-ttft 5 --slo-tpot 0.1",
                        help="capacity: the SLO options of the search")
    parser.add_argument("--capacity-keep", type=Path, default=None, help="capacity: keep the results parquet here")
    parser.add_argument("--parallel-drafters", default="normal,ngram,suffix,mtp")
    parser.add_argument("--parallel-hardware", default="b200")
    parser.add_argument("--parallel-seqs", type=int, default=256)
    parser.add_argument("--out", type=Path, default=HERE / "results.json", help="JSON results file")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")

    from rich.console import Console

    from agentspec_sim.io.atomic import write_bytes_atomic

    console = Console(width=200)
    document = {}
    if args.out.exists():
        try:
            document = json.loads(args.out.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            document = {}
        if "sections" not in document:  # an older single-section file: start afresh
            document = {}
    document.setdefault("sections", {})
    for name in sections:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result = SECTIONS[name](args, console)
        result.update(measured_at=started, python=platform.python_version(), machine=platform.machine(),
                      cpus=os.cpu_count())
        previous = document["sections"].get(name)
        if name in ("engine", "scale", "sweep") and previous:
            # Runs measured earlier and not this time are kept (one run's key: trace or source, drafter(s),
            # size; a sweep's: its trace, queries, drafters and -j).
            key = ("trace", "source", "target_tokens", "drafter", "max_num_seqs", "replicate", "drafters", "queries",
                   "jobs")
            def ident(r: dict, key: tuple = key) -> tuple:
                return tuple(r.get(k, 1 if k == "replicate" else None) for k in key)

            fresh = {ident(r) for r in result["runs"]}
            result["runs"] = [r for r in previous.get("runs", []) if ident(r) not in fresh] + result["runs"]
        document["sections"][name] = result
        write_bytes_atomic(args.out, (json.dumps(document, indent=2) + "\n").encode("utf-8"))


if __name__ == "__main__":
    main()
