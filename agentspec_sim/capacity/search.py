"""Capacity: the highest steady request rate at which a configuration still meets its latency SLOs, with its
interval.

DistServe's goodput (the most requests per second served with ≥ 90 % SLO attainment) and Vidur-Search's
capacity (the most QPS under a latency bound) size a deployment by the load it sustains, a property of the
engine, not of where a finite trace ends. Here a *probe* replays the trace under `vllm bench serve
--request-rate R --burstiness b` (engine/load.py: seeded send times, the dataset shuffled as vLLM's client
shuffles it) and is judged on its steady window (capacity/steady.py): it passes when the engine kept up
with the offered load and the attainment there (`met`) reaches `target`.

1. Isolated probe: every query alone (max concurrency 1). If even then attainment misses the target, no
   rate can meet it (more load only adds queueing): capacity 0 after one probe.
2. Lengthening: a probe at rate R sends for at least `min_window` × L seconds (L: `normal`'s isolated p90
   query latency, the same for every drafter, so drafters meet the same sends) and at least `min_queries`
   queries, so its steady window holds many query lifetimes; where the trace is shorter, it is sent as
   that many independent tenants (`replicate`, each tenant a fresh instance of every query, its own drafter
   state), said in the answer (`tenants`). A probe that would need more than `max_tenants` is not run:
   the capacity is then *inconclusive* (at least the rate that passed), never a number to plan with.
3. Per seed (the seed draws the send times and the order; `seeds` of them, the same for every drafter:
   common random numbers): from a first guess — Little's law with the isolated latency, min(max_num_seqs,
   queries) / p50 query latency, halved, or ¾ of the engine's throughput ceiling at a full batch where that
   is lower, the same for every seed — double the rate while it passes and halve it
   while it fails until one passing and one failing rate are found, then bisect (geometric) until
   failing / passing ≤ 1 + `tolerance`. The seed's capacity is the bracket's geometric middle.
4. The capacity is the mean over seeds, its interval the Student-t interval at `confidence` widened by
   the bisection's half-width; a stable engine always fails at a high enough rate (its throughput is
   finite), so there is no "unbounded" capacity.

Probes of one search run in one process, on one cost model (built once), one after another; searches of
different configurations run in parallel on the sweep's executors (agentspec_sim/sweep).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import polars as pl
from scipy import stats

from agentspec_sim.capacity.steady import CRITERIA, Criterion, FailureWatch, steady_state
from agentspec_sim.cost import cost_model_for
from agentspec_sim.cost.base import BatchShape
from agentspec_sim.drafters.common.table_cache import held_in_memory
from agentspec_sim.engine.config import EngineConfig, resolve
from agentspec_sim.metrics import completed_latencies, summarize
from agentspec_sim.run.simulation import simulate
from agentspec_sim.slo import LatencySLO


@dataclass(frozen=True)
class CapacitySearch:
    """How a capacity search runs (module docstring): the SLO, the attainment target and its `criterion`
    ("calls": pooled calls, each by vLLM's good-request rule; "queries": a query is good when every call of it
    met the call SLOs and it met the query SLO), the rate's relative tolerance, the burstiness of the offered
    load (vLLM's gamma shape; 1 is Poisson), the probes one seed may take, the seeds, the steady window
    (`warmup`: the share of the send window left out at its start; `stability`: the share of the offered
    output the engine may fall behind by), the lengthening (`min_window` × the isolated p90 query latency,
    `min_queries`, at most `max_tenants` tenants) and the interval's confidence."""

    slo: LatencySLO
    target: float = 0.9
    tolerance: float = 0.05
    burstiness: float = 1.0
    max_probes: int = 24
    max_rate_factor: float = 1024.0
    seeds: int = 5
    criterion: Criterion = "calls"
    warmup: float = 0.2
    stability: float = 0.1
    min_window: float = 25.0
    min_queries: int = 100
    max_tenants: int = 64
    confidence: float = 0.95

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
        if not 1 <= self.seeds <= 1000:
            raise ValueError(f"seeds must be between 1 and 1000, got {self.seeds}")
        if self.criterion not in CRITERIA:
            raise ValueError(f"the criterion must be one of {', '.join(CRITERIA)}, got {self.criterion!r}")
        if not 0 <= self.warmup < 1 or not 0 <= self.stability < 1:
            raise ValueError("warmup and stability are shares in [0, 1)")
        if not (self.min_window >= 0 and self.min_queries >= 1 and self.max_tenants >= 1):
            raise ValueError("min_window ≥ 0, min_queries ≥ 1 and max_tenants ≥ 1")
        if not 0 < self.confidence < 1:
            raise ValueError(f"the confidence must be in (0, 1), got {self.confidence}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "slo": self.slo.to_dict()}


@dataclass(frozen=True)
class Probe:
    """One replay of the trace at one offered load. `rate` None: the isolated probe (each query alone).
    `met`: attainment over the steady window; `stable`: the engine kept up there (capacity/steady.py).
    `stopped_s`: the simulated second a probe was ended at once its failure was certain (`FailureWatch`; why in
    `stopped_by`): it has no latencies or attainment of its own (None), only its verdict."""

    rate: float | None
    met: float | None
    attainment: dict[str, float | None]
    request_throughput: float | None
    output_throughput_tok_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    query_latency_p50: float | None
    query_latency_p99: float | None
    seed: int = 0
    tenants: int = 1
    stable: bool | None = True
    served_share: float | None = None
    window_s: tuple[float, float] = (0.0, 0.0)
    stopped_s: float | None = None
    stopped_by: str | None = None

    def passes(self, target: float) -> bool:
        return self.stopped_s is None and bool(self.stable) and self.met is not None and self.met >= target

    @property
    def partial(self) -> bool:
        return self.stopped_s is not None


@dataclass(frozen=True)
class SeedCapacity:
    """One seed's search: its bracket [passing, failing] (0 where no rate passes), the capacity it gives (the
    bracket's geometric middle), why it stopped, and whether it could not conclude (the trace too short)."""

    seed: int
    bracket: tuple[float, float]
    rate: float
    stopped: str
    inconclusive: bool = False


@dataclass(frozen=True)
class Capacity:
    """The search's answer: `rate` the steady-state capacity (queries/s; the mean over seeds; 0: no load meets
    the SLO), its interval [low, high], each seed's search, `inconclusive` (why no capacity can be stated:
    then `rate` is a lower bound and nothing may be planned from it), the sustained output tokens/s at
    `rate` (rate × output tokens per query), the tenants a probe at capacity sent, every probe."""

    rate: float
    low: float
    high: float
    output_tok_s: float
    request_throughput: float
    bracket: tuple[float, float]
    stopped: str
    probes: list[Probe] = field(default_factory=list)
    at_capacity: Any = None  # the RunSummary of the first seed's passing probe nearest capacity (None: none)
    isolated: Any = None  # the RunSummary of the isolated probe (each query alone)
    latencies: tuple[float, ...] = ()  # every completed query's latency in that run (isolated: 0)
    seeds: list[SeedCapacity] = field(default_factory=list)
    inconclusive: str | None = None
    tenants: int = 1
    output_tokens_per_query: float = 0.0

    @property
    def conclusive(self) -> bool:
        return self.inconclusive is None


ProbeRun = Callable[[EngineConfig], tuple[Probe, Any, tuple[float, ...]]]


def probe_config(config: EngineConfig, rate: float | None, burstiness: float, seed: int | None = None,
                 tenants: int = 1) -> EngineConfig:
    """The engine config of a probe: `rate` None → every query alone (max concurrency 1, all sent at 0);
    `tenants`: the trace sent as that many independent tenants (times the config's own replicate)."""
    seed = config.seed if seed is None else seed
    if rate is None:
        return replace(config, arrival="request-rate", rate=math.inf, burstiness=burstiness, max_concurrency=1,
                       copies=1, seed=seed)
    return replace(config, arrival="request-rate", rate=rate, burstiness=burstiness, copies=1, seed=seed,
                   replicate=config.replicate * tenants, max_concurrency=None)


def search_capacity(config: EngineConfig, search: CapacitySearch, run: ProbeRun, queries: int,
                    ceiling: Callable[[Any], float | None] | None = None,
                    output_tokens_per_query: float = 0.0, reference_s: float | None = None) -> Capacity:
    """The capacity of one configuration (module docstring). `run(config)` replays the trace on `config` and
    returns (its Probe, its RunSummary, its completed queries' latencies); `queries` is the number of query
    instances one sending of the trace holds; `ceiling(isolated summary)`, an estimate of the most queries/s
    the engine can serve (`throughput_ceiling`), caps the first guess; `reference_s`, the query lifetime the
    lengthening counts in (default: this configuration's isolated p90 query latency)."""
    if config.max_concurrency is not None:
        raise ValueError("a capacity search varies the request rate and clocks latency from each query's send; "
                         "under max concurrency a query's latency starts when it gets a slot, so every rate "
                         "would pass: give no max concurrency")
    probes: list[Probe] = []
    kept: dict[float, tuple[Any, tuple[float, ...]]] = {}  # the first seed's runs, by rate

    def at(rate: float | None, seed: int, tenants: int = 1) -> tuple[Probe, Any, tuple[float, ...]]:
        probe, summary, latencies = run(probe_config(config, rate, search.burstiness, seed, tenants))
        probe = replace(probe, rate=rate, seed=seed, tenants=tenants)
        probes.append(probe)
        if seed == config.seed and rate is not None:
            kept[rate] = (summary, latencies)
        return probe, summary, latencies

    alone, isolated, alone_latencies = at(None, config.seed)
    target = search.target
    if not (alone.met is not None and alone.met >= target):
        return Capacity(0.0, 0.0, 0.0, 0.0, 0.0, (0.0, 0.0), "misses the SLO with each query alone (no load can "
                        "meet it)", probes, None, isolated, alone_latencies,
                        output_tokens_per_query=output_tokens_per_query)
    if reference_s is None:
        lifetimes = np.array(alone_latencies, dtype=np.float64)
        reference_s = float(np.percentile(lifetimes, 90)) if lifetimes.size else 1.0
    reference = max(reference_s, 1e-9)

    def tenants_for(rate: float) -> int:
        need = max(search.min_window * reference * rate, float(search.min_queries))
        return max(1, math.ceil(need / max(queries, 1) - 1e-9))

    latency = max(alone.query_latency_p50 or 1.0, 1e-9)
    seats = max(1, min(config.max_num_seqs or 256, queries))
    guess = 0.5 * seats / latency
    top = ceiling(isolated) if ceiling is not None else None
    if top is not None and top > 0:
        guess = min(guess, 0.75 * float(top))

    results: list[SeedCapacity] = []
    for i in range(search.seeds):
        seed = config.seed + i
        # Every seed starts from the same guess: a start at another seed's capacity would pull its bracket
        # towards that one's crossing of a noisy attainment curve, and the seeds' spread would understate the
        # interval (the M/D/1 coverage test: 26 of 30 intervals covered that way, 28 of 30 this way).
        results.append(_one_seed(lambda r, s=seed: at(r, s, tenants_for(r))[0], tenants_for, guess, 2.0, search,
                                 seed))
        if results[0].rate == 0 and not results[0].inconclusive:
            break  # no rate passes for the first seed: more seeds would only confirm it
    return _combine(results, search, probes, kept, isolated, alone_latencies, tenants_for, output_tokens_per_query)


def _one_seed(at: Callable[[float], Probe], tenants_for: Callable[[float], int], start: float, step: float,
              search: CapacitySearch, seed: int) -> SeedCapacity:
    """Bracket then bisect the rate for one seed (module docstring, step 3)."""
    lo, hi = 0.0, math.inf
    rate = start
    used = 0
    target = search.target
    while used < search.max_probes:
        if tenants_for(rate) > search.max_tenants:
            return SeedCapacity(seed, (lo, hi), lo, _too_short(rate, tenants_for(rate), search), inconclusive=True)
        used += 1
        if at(rate).passes(target):
            lo = rate
            if math.isfinite(hi):
                break
            rate *= step
            if rate > start * search.max_rate_factor:
                return SeedCapacity(seed, (lo, hi), lo, f"meets the SLO up to {search.max_rate_factor:g}× the first "
                                    "guess without failing", inconclusive=True)
        else:
            hi = rate
            if lo > 0:
                break
            rate /= step
            if rate < start / search.max_rate_factor:
                return SeedCapacity(seed, (0.0, hi), 0.0, f"misses the SLO even at {hi:.3g} queries/s")
    while lo > 0 and math.isfinite(hi) and hi / lo > 1 + search.tolerance and used < search.max_probes:
        mid = math.sqrt(lo * hi)
        if tenants_for(mid) > search.max_tenants:
            return SeedCapacity(seed, (lo, hi), lo, _too_short(mid, tenants_for(mid), search), inconclusive=True)
        used += 1
        if at(mid).passes(target):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return SeedCapacity(seed, (0.0, hi), 0.0, f"no passing rate within {search.max_probes} probes")
    if math.isinf(hi):
        return SeedCapacity(seed, (lo, hi), lo, f"probe limit ({search.max_probes}) reached before a failing rate",
                            inconclusive=True)
    stopped = (f"bisected to ±{search.tolerance:.0%}" if hi / lo <= 1 + search.tolerance
               else f"probe limit ({search.max_probes}) reached at ±{hi / lo - 1:.0%}")
    return SeedCapacity(seed, (lo, hi), math.sqrt(lo * hi), stopped)


def _too_short(rate: float, tenants: int, search: CapacitySearch) -> str:
    return (f"inconclusive: the trace is too short to load this configuration (a steady probe at {rate:.3g} "
            f"queries/s needs it sent as {tenants} tenants, more than {search.max_tenants})")


def _combine(results: list[SeedCapacity], search: CapacitySearch, probes: list[Probe],
             kept: dict[float, tuple[Any, tuple[float, ...]]], isolated: Any, alone_latencies: tuple[float, ...],
             tenants_for: Callable[[float], int], per_query: float) -> Capacity:
    """The seeds' capacities as one answer: mean, interval, the first seed's run nearest capacity."""
    first = results[0]
    passing = first.bracket[0]
    summary, latencies = kept.get(passing, (None, alone_latencies)) if passing > 0 else (None, alone_latencies)
    throughput = summary.request_throughput if summary is not None else 0.0
    base = dict(probes=probes, at_capacity=summary, isolated=isolated, latencies=latencies, seeds=results,
                output_tokens_per_query=per_query)
    lost = [r for r in results if r.inconclusive]
    if lost:
        floor = min(r.bracket[0] for r in lost)
        return Capacity(floor, floor, math.inf, floor * per_query, throughput, first.bracket, lost[0].stopped,
                        inconclusive=lost[0].stopped, tenants=tenants_for(floor) if floor > 0 else 1, **base)
    rates = np.array([r.rate for r in results], dtype=np.float64)
    mean = float(rates.mean())
    if mean == 0:
        return Capacity(0.0, 0.0, 0.0, 0.0, 0.0, first.bracket, first.stopped, **base)
    half_bisect = mean * (math.sqrt(1 + search.tolerance) - 1)
    if rates.size > 1:
        spread = float(stats.t.ppf(0.5 + search.confidence / 2, rates.size - 1) * rates.std(ddof=1)
                       / math.sqrt(rates.size))
    else:
        spread = 0.0
    low, high = max(0.0, mean - spread - half_bisect), mean + spread + half_bisect
    stopped = first.stopped if rates.size == 1 else (f"{first.stopped}; {rates.size} seeds, "
                                                     f"{search.confidence:.0%} interval")
    return Capacity(mean, low, high, mean * per_query, throughput, first.bracket, stopped,
                    tenants=tenants_for(mean), **base)


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


def summary_probe(summary: Any, steady: Any = None) -> Probe:
    """A Probe from a run's RunSummary (agentspec_sim.metrics) and, under load, its steady window
    (capacity/steady.py: attainment and stability there)."""
    a = dict(summary.attainment) if steady is None else dict(steady.attainment)
    extra: dict[str, Any] = {}
    if steady is not None:
        extra = dict(stable=steady.stable, served_share=steady.served_share, window_s=(steady.start_s, steady.end_s))
    return Probe(rate=None, met=a.get("met"), attainment=a, request_throughput=summary.request_throughput,
                 output_throughput_tok_s=summary.output_throughput_tok_s, ttft_p50=summary.ttft.p50,
                 ttft_p99=summary.ttft.p99, tpot_p50=summary.tpot.p50, tpot_p99=summary.tpot.p99,
                 query_latency_p50=summary.query_latency.p50, query_latency_p99=summary.query_latency.p99,
                 **extra)


def stopped_probe(result: Any, watch: FailureWatch) -> Probe:
    """The Probe of a run `watch` ended once its failure was certain: its verdict, when and why, no statistics."""
    return Probe(rate=None, met=None, attainment={}, request_throughput=None, output_throughput_tok_s=None,
                 ttft_p50=None, ttft_p99=None, tpot_p50=None, tpot_p99=None, query_latency_p50=None,
                 query_latency_p99=None, stable=False if watch.stopped_by == "stability" else None,
                 window_s=(watch.start, watch.end), stopped_s=result.stopped_s, stopped_by=watch.stopped_by)


def isolated_p90(workload: Any, config: EngineConfig, search: CapacitySearch, cost_model: Any) -> float | None:
    """`normal`'s p90 query latency with each query alone on `config` (None: no query completes): the query
    lifetime a search's lengthening counts in, the same for every drafter on this config."""
    isolated = simulate(workload, "normal", probe_config(config, None, search.burstiness), cost_model)
    lifetimes = isolated.queries.filter(pl.col("completed"))["latency_s"].to_numpy().astype(np.float64)
    return float(np.percentile(lifetimes, 90)) if lifetimes.size else None


# Whether searches take their shortcuts (`find_capacity`'s default): tests turn them off to compare whole sweeps.
SHORTCUTS = True


def find_capacity(workload: Any, drafter: Any, config: EngineConfig, search: CapacitySearch,
                  cost_model: Any = None, shortcuts: bool | None = None,
                  normal_reference: Callable[[], float | None] | None = None) -> Capacity:
    """The capacity of `drafter` on `config` for `workload` (library entry point; probes run here, in order).
    `cost_model` default: the config's roofline model, built once for every probe. `shortcuts`: a probe under
    load ends once its failure is certain (`FailureWatch`); False runs every probe to its end (the same
    capacities: tests compare; None: `SHORTCUTS`). `normal_reference()`: `isolated_p90` of this workload,
    config and cost model where the caller has it already (a plan's other drafters on the same config); default:
    run it."""
    if cost_model is None:
        cost_model = cost_model_for(config)
    if shortcuts is None:
        shortcuts = SHORTCUTS

    def run(probe: EngineConfig) -> tuple[Probe, Any, tuple[float, ...]]:
        watch = None
        if shortcuts and probe.max_concurrency is None:
            watch = FailureWatch(search.slo, search.target, search.warmup, search.stability, search.criterion)
        result = simulate(workload, drafter, probe, cost_model, watch=watch)
        if result.stopped_s is not None:
            return stopped_probe(result, watch), None, ()
        summary = summarize(result, slo=search.slo)
        # The isolated probe sends every query as soon as the one before it ends: all of it is its window.
        steady = steady_state(result, search.slo, search.warmup, search.stability, search.criterion,
                              whole=probe.max_concurrency is not None)
        latencies = tuple(completed_latencies(result))
        return summary_probe(summary, steady), summary, latencies

    out = np.array([c.output_len for q in workload.queries for c in q.calls], dtype=np.float64)
    per_query = float(out.sum() / len(workload.queries)) if workload.queries else 0.0
    # The lengthening counts in `normal`'s isolated p90 query latency, whatever the drafter: every drafter (and
    # every max_num_seqs) then sends the same number of tenants at a given rate, so they meet the same queries
    # at the same times seed for seed (common random numbers), not windows scaled by their own speed.
    reference = None  # `normal` itself: its own isolated probe
    if not (drafter == "normal" or getattr(drafter, "method", None) == "normal"):
        reference = (normal_reference or (lambda: isolated_p90(workload, config, search, cost_model)))()
    # What no probe's load changes is made once for the search: the cost model (above, with its per-shape
    # tables), the drafter's workload tables (held in memory, not read from disk again), compiled code (once
    # per process). Each probe builds its engine state: what it does depends on the arrival times.
    with held_in_memory():
        return search_capacity(config, search, run, len(workload.queries) * config.replicate,
                               lambda isolated: throughput_ceiling(workload, config, cost_model, isolated),
                               per_query, reference)
