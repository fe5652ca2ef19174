"""Latency SLOs and their attainment: the share of calls and of queries that meet them.

Per-request SLOs as serving benchmarks count them:

- a call meets the call SLOs when its TTFT ≤ `ttft_s` and its TPOT ≤ `tpot_s` (each where set), TPOT
  taken as 0 for a one-token output — `vllm bench serve --goodput ttft:MS tpot:MS`'s "good request"
  (vllm/benchmarks/serve.py `calculate_metrics`), DistServe's per-request attainment — and, where
  `itl_s` is set, no gap between two of its streamed chunks exceeds it (ITL as `vllm bench serve` measures
  it: one value per chunk after the first, the time since the previous one; a speculative step streams its
  accepted tokens as one chunk, so a call can meet a TPOT SLO on average while stalling its reader longer
  between bursts — vLLM's --goodput has no ITL key; the longest gap is the stall a reader sees);
- a query (the agent's whole task: every call, think times included) meets the query SLO when its
  latency ≤ `query_latency_s`.

Attainment is over the calls sent and the queries that completed: a call refused at max_model_len is not
good, as `vllm bench serve` counts a failed request (its goodput counts only successful requests meeting every
SLO); the later calls of its query are never sent. Refused calls are also counted apart
(`RunSummary.refused_calls`). `met` is the smaller of the two shares that have an SLO (the capacity
criterion, agentspec_sim/capacity.py: both must reach the target).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from agentspec_sim.engine.result import RunResult

ATTAINMENT_KEYS = ("calls", "calls_ttft", "calls_tpot", "calls_itl", "queries", "met")


@dataclass(frozen=True)
class LatencySLO:
    """Per-request latency objectives, in seconds (None: no objective)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    query_latency_s: float | None = None
    itl_s: float | None = None

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
                                                              ("ITL", self.itl_s),
                                                              ("query latency", self.query_latency_s))
                 if value is not None]
        return ", ".join(parts) or "no SLO"

    def looser(self, factor: float) -> LatencySLO:
        """Every objective multiplied by `factor` (> 1: looser)."""
        return LatencySLO(*(None if v is None else v * factor for v in (self.ttft_s, self.tpot_s,
                                                                          self.query_latency_s, self.itl_s)))

    @property
    def per_call(self) -> bool:
        """Whether an objective applies to each call (TTFT, TPOT or ITL)."""
        return self.ttft_s is not None or self.tpot_s is not None or self.itl_s is not None


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


def inter_token_latencies(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """ITL as `vllm bench serve` collects it: every gap between two successive streamed chunks of one call (a
    chunk: the tokens one engine step emitted for it), pooled; and per row of `result.calls` its longest gap
    (NaN: fewer than two chunks)."""
    e = result.emissions
    call = e["call"].to_numpy()
    t = e["time_s"].to_numpy()
    order = np.argsort(call, kind="stable")  # emissions are in step order: each call's stay chronological
    call, t = call[order], t[order]
    same = call[1:] == call[:-1]
    gaps = np.diff(t)[same]
    longest = np.full(result.calls.height, np.nan)
    if gaps.size:
        # Each call's gaps are contiguous (sorted by call): one reduction per call, not one scatter per gap.
        owners = call[1:][same]
        starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        longest[owners[starts]] = np.maximum.reduceat(gaps, starts)
    return gaps, longest


def good_calls(calls: pl.DataFrame, slo: LatencySLO, longest_gap: np.ndarray | None = None
               ) -> dict[str, np.ndarray]:
    """Per row of `calls` (every status): whether it meets TTFT (`calls_ttft`), TPOT (`calls_tpot`), ITL
    (`calls_itl`, its longest gap between chunks: `inter_token_latencies(result)[1]`) and all the call SLOs set
    (`calls`) — vLLM's good-request rule, TPOT 0 for a one-token output, no ITL for a one-chunk one; a call that
    did not finish (refused at max_model_len) meets none, as vLLM's benchmark counts a failed request."""
    finished = (calls["status"] == "finished").to_numpy()
    first = calls["first_token_s"].to_numpy().astype(np.float64)
    ttft = first - calls["arrival_s"].to_numpy().astype(np.float64)
    n = calls["output_len"].to_numpy().astype(np.float64)
    decode = calls["finish_s"].to_numpy().astype(np.float64) - first
    tpot = np.where(n >= 2, decode / np.maximum(n - 1, 1), 0.0)
    out: dict[str, np.ndarray] = {}
    ok = finished.copy()
    for name, value, limit in (("calls_ttft", ttft, slo.ttft_s), ("calls_tpot", tpot, slo.tpot_s),
                               ("calls_itl", longest_gap, slo.itl_s)):
        if limit is None:
            continue
        if value is None:
            raise ValueError("an ITL SLO needs the calls' longest gaps (inter_token_latencies)")
        good = finished & (np.nan_to_num(value, nan=0.0 if name == "calls_itl" else np.inf) <= limit)
        out[name] = good
        ok &= good
    out["calls"] = ok
    return out


def sent_calls(calls: pl.DataFrame) -> np.ndarray:
    """The calls that reached the server: finished or refused (a call after a refusal in its query never is)."""
    return calls["status"].is_in(["finished", "refused"]).to_numpy()


def attainment(result: RunResult, slo: LatencySLO, longest_gap: np.ndarray | None = None
               ) -> dict[str, float | None]:
    """Shares in [0, 1] (module docstring): `calls` (every call SLO), `calls_ttft`, `calls_tpot`, `calls_itl`
    over the calls sent (a refused call is not good), `queries` (query latency, over completed queries), `met`
    (the least of `calls` and `queries` where each has an SLO); None where no SLO applies or nothing ran.
    `longest_gap`: `inter_token_latencies(result)[1]` when the caller has it already."""
    out: dict[str, float | None] = dict.fromkeys(ATTAINMENT_KEYS)
    calls = result.calls
    sent = sent_calls(calls)
    if sent.any() and slo.per_call:
        if slo.itl_s is not None and longest_gap is None:
            longest_gap = inter_token_latencies(result)[1]
        for name, flags in good_calls(calls, slo, longest_gap).items():
            out[name] = float(flags[sent].mean())
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


def parse_slo_options(ttft: float | None, tpot: float | None, query_latency: float | None,
                      itl: float | None = None) -> LatencySLO:
    """The SLO the command line gave (ValueError naming the option for a bad value)."""
    for flag, value in (("--slo-ttft", ttft), ("--slo-tpot", tpot), ("--slo-query-latency", query_latency),
                        ("--slo-itl", itl)):
        _check_seconds(flag, value)
    return LatencySLO(ttft, tpot, query_latency, itl)
