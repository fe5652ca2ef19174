"""Latency SLOs and their attainment: the share of calls and of queries that meet them.

Per-request SLOs as serving benchmarks count them:

- a call meets the call SLOs when its TTFT ≤ `ttft_s` and its TPOT ≤ `tpot_s` (each where set), TPOT
  taken as 0 for a one-token output — `vllm bench serve --goodput ttft:MS tpot:MS`'s "good request"
  (vllm/benchmarks/serve.py `calculate_metrics`), DistServe's per-request attainment;
- a query (the agent's whole task: every call, think times included) meets the query SLO when its
  latency ≤ `query_latency_s`.

Attainment is over the calls that ran and the queries that completed: a call refused at max_model_len
(and the rest of its query) fails at every load and says nothing about capacity; it is counted apart
(`RunSummary.refused_calls`). `met` is the smaller of the two shares that have an SLO (the capacity
criterion, agentspec_sim/capacity.py: both must reach the target).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from agentspec_sim.engine.result import RunResult

ATTAINMENT_KEYS = ("calls", "calls_ttft", "calls_tpot", "queries", "met")


@dataclass(frozen=True)
class LatencySLO:
    """Per-request latency objectives, in seconds (None: no objective)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    query_latency_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            _check_seconds(name, value)

    @property
    def any(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{name} ≤ {value:g} s" for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s),
                                                              ("query latency", self.query_latency_s))
                 if value is not None]
        return ", ".join(parts) or "no SLO"

    def looser(self, factor: float) -> LatencySLO:
        """Every objective multiplied by `factor` (> 1: looser)."""
        return LatencySLO(*(None if v is None else v * factor for v in (self.ttft_s, self.tpot_s,
                                                                          self.query_latency_s)))


def call_latencies(calls: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, TPOT) of every finished call, seconds; TPOT NaN for a one-token output, which has none (the
    percentiles leave it out; vLLM's goodput rule counts it as 0, `attainment`)."""
    finished = calls.filter(pl.col("status") == "finished")
    first = finished["first_token_s"].to_numpy().astype(np.float64)
    ttft = first - finished["arrival_s"].to_numpy().astype(np.float64)
    n = finished["output_len"].to_numpy().astype(np.float64)
    decode = finished["finish_s"].to_numpy().astype(np.float64) - first
    tpot = np.where(n >= 2, decode / np.maximum(n - 1, 1), np.nan)
    return ttft, tpot


def attainment(result: RunResult, slo: LatencySLO,
               latencies: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, float | None]:
    """Shares in [0, 1] (module docstring): `calls` (every call SLO), `calls_ttft`, `calls_tpot`, `queries`
    (query latency), `met` (the least of `calls` and `queries` where each has an SLO); None where no SLO
    applies or nothing ran. `latencies`: `call_latencies(result.calls)` when the caller has it already."""
    out: dict[str, float | None] = dict.fromkeys(ATTAINMENT_KEYS)
    ttft, tpot = latencies if latencies is not None else call_latencies(result.calls)
    if ttft.size:
        ok = np.ones(ttft.size, dtype=bool)
        if slo.ttft_s is not None:
            good = ttft <= slo.ttft_s
            out["calls_ttft"] = float(good.mean())
            ok &= good
        if slo.tpot_s is not None:
            good = np.nan_to_num(tpot, nan=0.0) <= slo.tpot_s  # a one-token output meets any TPOT SLO
            out["calls_tpot"] = float(good.mean())
            ok &= good
        if slo.ttft_s is not None or slo.tpot_s is not None:
            out["calls"] = float(ok.mean())
    if slo.query_latency_s is not None:
        latency = result.queries.filter(pl.col("completed"))["latency_s"].to_numpy().astype(np.float64)
        if latency.size:
            out["queries"] = float((latency <= slo.query_latency_s).mean())
    shares = [v for v in (out["calls"], out["queries"]) if v is not None]
    out["met"] = min(shares) if shares else None
    return out


def _check_seconds(name: str, value: object) -> None:
    """ValueError naming `name` unless `value` is None or a finite number of seconds > 0."""
    if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                  and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0 seconds (a finite number), got {value}")


def parse_slo_options(ttft: float | None, tpot: float | None, query_latency: float | None) -> LatencySLO:
    """The SLO the command line gave (ValueError naming the option for a bad value)."""
    for flag, value in (("--slo-ttft", ttft), ("--slo-tpot", tpot), ("--slo-query-latency", query_latency)):
        _check_seconds(flag, value)
    return LatencySLO(ttft, tpot, query_latency)
