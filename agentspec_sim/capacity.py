"""Capacity: the highest request rate at which a configuration still meets its latency SLOs.

DistServe's goodput (the most requests per second served with ≥ 90 % SLO attainment) and Vidur-Search's
capacity (the most QPS under a P99 bound) size a deployment by load, not by one batch job's makespan.
Here a *probe* replays the whole trace under `vllm bench serve --request-rate R --burstiness b`
(engine/load.py) and measures attainment (agentspec_sim/slo.py); the search finds the highest R whose
attainment `met` ≥ `target`:

1. Isolated probe: every query alone (max concurrency 1, no rate). If even then attainment misses the
   target, no rate can meet it (more load only adds queueing): capacity 0 after one probe.
2. Bracket: from a first guess — Little's law with the isolated latency, min(max_num_seqs, queries) /
   p50 query latency, halved, or ¾ of the engine's throughput ceiling at a full batch (`throughput_ceiling`)
   where that is lower — double the rate while it passes, halve it while it fails, until one
   passing and one failing rate are found. Past the rate that sends every query within one isolated
   query's latency (a burst, or `max_rate_factor` × the guess), the next probe sends them all at once;
   passing there, the capacity is unbounded on this trace (`unbounded`) and ranked by that probe's
   throughput.
3. Bisect (geometric) until failing / passing ≤ 1 + `tolerance`. The capacity is the passing end.

One seed's send times at two rates are one pattern stretched (engine/load.py), so attainment moves with
the rate, not with resampled arrivals; it is still a finite trace, so a probe's attainment is an
estimate, and bisection assumes it falls as the rate rises. Probes of one search run in one process, on
one cost model (built once), one after another; searches of different configurations run in parallel
on the sweep's executors (agentspec_sim/sweep). Cost: 1 + ~2 + log2(log 2 / log(1 + tolerance)) probes,
about 7 at 5 %.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from agentspec_sim.cost import cost_model_for
from agentspec_sim.cost.base import BatchShape
from agentspec_sim.drafters.common.table_cache import held_in_memory
from agentspec_sim.engine.config import EngineConfig, resolve
from agentspec_sim.metrics import completed_latencies, summarize
from agentspec_sim.run.simulation import simulate
from agentspec_sim.slo import LatencySLO


@dataclass(frozen=True)
class CapacitySearch:
    """How a capacity search runs: the SLO, the attainment target, the relative tolerance of the rate, the
    burstiness of the offered load (vLLM's gamma shape; 1 is Poisson), and the most probes it may take."""

    slo: LatencySLO
    target: float = 0.9
    tolerance: float = 0.05
    burstiness: float = 1.0
    max_probes: int = 24
    max_rate_factor: float = 1024.0

    def __post_init__(self) -> None:
        if not self.slo.any:
            raise ValueError("a capacity search needs at least one latency SLO (TTFT, TPOT or query latency)")
        if not 0 < self.target <= 1:
            raise ValueError(f"the attainment target must be in (0, 1], got {self.target}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"the rate tolerance must be in (0, 1), got {self.tolerance}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_probes < 3:
            raise ValueError(f"a search needs at least 3 probes, got {self.max_probes}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "slo": self.slo.to_dict()}


@dataclass(frozen=True)
class Probe:
    """One replay of the trace at one offered load. `rate` None: the isolated probe; inf: all at once."""

    rate: float | None
    met: float | None
    attainment: dict[str, float | None]
    request_throughput: float
    output_throughput_tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    query_latency_p50: float | None
    query_latency_p99: float | None

    def passes(self, target: float) -> bool:
        return self.met is not None and self.met >= target


@dataclass(frozen=True)
class Capacity:
    """The search's answer: `rate` the highest passing request rate (0: none; inf: `unbounded`), the output
    tokens/s measured there, the bracket [passing, failing] it ended with, why it stopped, every probe."""

    rate: float
    output_tok_s: float
    request_throughput: float
    bracket: tuple[float, float]
    stopped: str
    probes: list[Probe] = field(default_factory=list)
    at_capacity: Any = None  # the RunSummary of the passing probe (None: capacity 0)
    isolated: Any = None  # the RunSummary of the isolated probe (each query alone)
    latencies: tuple[float, ...] = ()  # every completed query's latency in the run at capacity (isolated: 0)

    @property
    def unbounded(self) -> bool:
        return math.isinf(self.rate)


ProbeRun = Callable[[EngineConfig], tuple[Probe, Any, tuple[float, ...]]]


def probe_config(config: EngineConfig, rate: float | None, burstiness: float) -> EngineConfig:
    """The engine config of a probe: `rate` None → every query alone (max concurrency 1, all sent at 0)."""
    if rate is None:
        return replace(config, arrival="request-rate", rate=math.inf, burstiness=burstiness, max_concurrency=1,
                       copies=1)
    return replace(config, arrival="request-rate", rate=rate, burstiness=burstiness, copies=1)


def search_capacity(config: EngineConfig, search: CapacitySearch, run: ProbeRun, queries: int,
                    ceiling: Callable[[Any], float | None] | None = None) -> Capacity:
    """The capacity of one configuration (module docstring). `run(config)` replays the trace on `config` and
    returns (its Probe, its RunSummary, its completed queries' latencies); `queries` is the number of query
    instances the trace sends; `ceiling(isolated summary)`, an estimate of the most queries/s the engine can
    serve (`throughput_ceiling`), caps the first guess."""
    probes: list[Probe] = []
    summaries: dict[float | None, tuple[Any, tuple[float, ...]]] = {}
    target = search.target

    def at(rate: float | None) -> Probe:
        probe, summary, latencies = run(probe_config(config, rate, search.burstiness))
        probe = replace(probe, rate=rate)
        probes.append(probe)
        summaries[rate] = (summary, latencies)
        return probe

    def answer(rate: float, bracket: tuple[float, float], stopped: str) -> Capacity:
        best = next((p for p in probes if p.rate == rate), None) if rate > 0 else None
        summary, latencies = summaries[rate] if best is not None else (None, ())
        return Capacity(rate, best.output_throughput_tok_s if best else 0.0,
                        best.request_throughput if best else 0.0, bracket, stopped, probes, summary,
                        summaries[None][0], latencies if best is not None else summaries[None][1])

    alone = at(None)
    if not alone.passes(target):
        return answer(0.0, (0.0, 0.0), "misses the SLO with each query alone (no load can meet it)")
    latency = max(alone.query_latency_p50 or 1.0, 1e-9)
    seats = max(1, min(config.max_num_seqs or 256, queries))
    guess = 0.5 * seats / latency
    top = ceiling(summaries[None][0]) if ceiling is not None else None
    if top is not None and top > 0:
        guess = min(guess, 0.75 * float(top))
    # Past every query sent within one isolated query's latency the load is a burst: try all at once instead.
    burst = max(2 * guess, 2 * queries / latency)
    lo, hi = 0.0, math.inf
    rate = guess
    while len(probes) < search.max_probes:
        if at(rate).passes(target):
            lo = rate
            if math.isinf(rate):
                return answer(math.inf, (math.inf, math.inf), "meets the SLO with every query sent at once")
            if math.isfinite(hi):
                break
            rate = rate * 2 if rate * 2 <= min(burst, guess * search.max_rate_factor) else math.inf
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2
            if rate < guess / search.max_rate_factor:
                return answer(0.0, (0.0, hi), f"misses the SLO even at {hi:.3g} queries/s")
    while lo > 0 and math.isfinite(hi) and hi / lo > 1 + search.tolerance and len(probes) < search.max_probes:
        mid = math.sqrt(lo * hi)
        if at(mid).passes(target):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return answer(0.0, (0.0, hi), f"no passing rate within {search.max_probes} probes")
    if math.isinf(hi):
        failed_at_once = any(p.rate is not None and math.isinf(p.rate) for p in probes)
        return answer(lo, (lo, hi), "meets the SLO up to this rate, misses it only with every query at once"
                      if failed_at_once else f"probe limit ({search.max_probes}) reached before a failing rate")
    stopped = (f"bisected to ±{search.tolerance:.0%}" if hi / lo <= 1 + search.tolerance
               else f"probe limit ({search.max_probes}) reached at ±{hi / lo - 1:.0%}")
    return answer(lo, (lo, hi), stopped)


def throughput_ceiling(workload: Any, config: EngineConfig, cost_model: Any, isolated: Any) -> float | None:
    """Queries/s the engine could serve at most, roughly: max_num_seqs calls decoding at the trace's mean
    context (output-token weighted), each step emitting the isolated run's mean acceptance length per call,
    over the mean output tokens per query. A guess for the search's start (the batch stops limiting the load
    long before it fills), not a bound."""
    calls = [c for q in workload.queries for c in q.calls]
    out = np.array([c.output_len for c in calls], dtype=np.float64)
    if not calls or out.sum() <= 0:
        return None
    context = float(((np.array([c.prompt_len for c in calls], dtype=np.float64) + out / 2) * out).sum() / out.sum())
    seqs = resolve(config).max_num_seqs
    step = float(cost_model.step_time(BatchShape.decode(seqs, int(context))).total_s)
    per_step = seqs * (isolated.mean_acceptance_length or 1.0)
    per_query = out.sum() / len(workload.queries)
    return per_step / step / per_query if step > 0 else None


def summary_probe(summary: Any) -> Probe:
    """A Probe from a run's RunSummary (agentspec_sim.metrics)."""
    a = summary.attainment
    return Probe(rate=None, met=a.get("met"), attainment=dict(a), request_throughput=summary.request_throughput,
                 output_throughput_tok_s=summary.output_throughput_tok_s, ttft_p50=summary.ttft.p50,
                 ttft_p99=summary.ttft.p99, tpot_p50=summary.tpot.p50, tpot_p99=summary.tpot.p99,
                 query_latency_p50=summary.query_latency.p50, query_latency_p99=summary.query_latency.p99)


def find_capacity(workload: Any, drafter: Any, config: EngineConfig, search: CapacitySearch,
                  cost_model: Any = None) -> Capacity:
    """The capacity of `drafter` on `config` for `workload` (library entry point; probes run here, in order).
    `cost_model` default: the config's roofline model, built once for every probe."""
    if cost_model is None:
        cost_model = cost_model_for(config)

    def run(probe: EngineConfig) -> tuple[Probe, Any, tuple[float, ...]]:
        result = simulate(workload, drafter, probe, cost_model)
        summary = summarize(result, slo=search.slo)
        latencies = tuple(completed_latencies(result))
        return summary_probe(summary), summary, latencies

    # What no probe's load changes is made once for the search: the cost model (above, with its per-shape
    # tables), the drafter's workload tables (held in memory, not read from disk again), compiled code (once
    # per process). Each probe builds its engine state: what it does depends on the arrival times.
    with held_in_memory():
        return search_capacity(config, search, run, len(workload.queries) * config.replicate,
                               lambda isolated: throughput_ceiling(workload, config, cost_model, isolated))
