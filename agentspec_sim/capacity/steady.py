"""What one probe says about steady state: its steady window, whether the engine kept up, and attainment there.

A probe sends N queries over a send window [0, T] (T: the last send). A finite run has two transients that
are not the engine's steady state: it starts empty (the first queries meet no queue) and it ends in a
drain (after T no new work arrives, so the last queries meet a shrinking queue and a backlog built during
the window is served late without failing anyone). DistServe and Vidur-Search define capacity as a
steady-state rate; here each probe is judged on its steady window [w·T, T]:

- **stability** — the engine keeps up: the output tokens it emitted inside the window reach (1 − δ) of the
  output tokens offered by the queries sent inside it (what a stable queue serves over a window: the flow
  in equals the flow out, up to the queries in flight at its two edges). A probe whose engine falls
  behind fails, whatever its attainment: its backlog would grow without bound on a longer trace.
- **attainment** over the window: calls that reached the server inside it (pooled, vLLM's good-request
  rule per call) or queries sent inside it ("every call of the query met the call SLOs" and its latency
  the query SLO). A call refused at max_model_len counts as not good, as `vllm bench serve` counts a
  failed request (its goodput counts only successful requests meeting every SLO).

Tokens are counted where the engine emitted them: each step's tokens at its end (`RunResult.emissions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import polars as pl

from agentspec_sim.engine.result import RunResult
from agentspec_sim.slo import ATTAINMENT_KEYS, LatencySLO, good_calls, inter_token_latencies

Criterion = Literal["calls", "queries"]
CRITERIA = ("calls", "queries")


@dataclass(frozen=True)
class SteadyState:
    """One probe's steady window [start_s, end_s] and what happened in it."""

    start_s: float
    end_s: float
    offered_tokens: float  # output tokens of the queries sent inside the window
    served_tokens: float  # output tokens the engine emitted inside the window
    calls: int  # calls that reached the server inside the window (refused ones included)
    queries: int  # queries sent inside the window
    refused_calls: int  # of `calls`, refused at max_model_len
    attainment: dict[str, float | None]  # `slo.ATTAINMENT_KEYS` over the window
    stable: bool

    @property
    def served_share(self) -> float | None:
        return self.served_tokens / self.offered_tokens if self.offered_tokens > 0 else None

    @property
    def met(self) -> float | None:
        return self.attainment.get("met")


def steady_state(result: RunResult, slo: LatencySLO, warmup: float, stability: float,
                 criterion: Criterion = "calls", whole: bool = False) -> SteadyState:
    """The steady window of `result` (a run under a request rate: every query's send time is its `arrival_s`),
    its stability (served ≥ (1 − `stability`) × offered) and its attainment under `slo` by `criterion`
    (module docstring). `warmup`: the share of the send window left out at its start; `whole`: the whole run
    is the window (each query alone, where nothing is steady or transient)."""
    queries, calls = result.queries, result.calls
    sends = queries["arrival_s"].to_numpy().astype(np.float64)
    end = float(sends.max()) if sends.size else 0.0
    start = warmup * end
    if whole:
        start, end = -np.inf, np.inf
    in_window_q = (sends >= start) & (sends <= end)
    key = ["query_id", "tenant"]
    window_queries = queries.filter(pl.Series(in_window_q)).select(*key, "latency_s", "completed")

    ran = calls.filter(pl.col("status") == "finished")
    offered = float(ran.join(window_queries.select(key), on=key, how="semi")["output_len"].sum() or 0)
    emitted = result.emissions  # each call-step's tokens at its step's end
    when = emitted["time_s"].to_numpy()
    served = float(emitted["tokens"].to_numpy()[(when >= start) & (when <= end)].sum())

    arrival = calls["arrival_s"].to_numpy().astype(np.float64)  # NaN: never sent (after a refusal)
    in_window_c = (arrival >= start) & (arrival <= end)
    gaps = inter_token_latencies(result)[1] if slo.itl_s is not None else None
    good = good_calls(calls, slo, gaps)  # per call of the run, every status
    refused = int(((calls["status"] == "refused").to_numpy() & in_window_c).sum())
    out: dict[str, float | None] = dict.fromkeys(ATTAINMENT_KEYS)
    if in_window_c.any() and slo.per_call:
        for name, flags in good.items():
            out[name] = float(flags[in_window_c].mean())
    queries_ok = None
    if slo.query_latency_s is not None and window_queries.height:
        lat = np.nan_to_num(window_queries["latency_s"].to_numpy().astype(np.float64), nan=np.inf)
        queries_ok = window_queries["completed"].to_numpy() & (lat <= slo.query_latency_s)
    if criterion == "queries" and window_queries.height:
        every = (_every_call_good(calls, good["calls"], window_queries.select(key)) if slo.per_call
                 else np.ones(window_queries.height, dtype=bool))
        out["queries"] = float((every if queries_ok is None else every & queries_ok).mean())
        out["met"] = out["queries"]
    else:
        if queries_ok is not None:
            out["queries"] = float(queries_ok.mean())
        shares = [v for v in (out["calls"], out["queries"]) if v is not None]
        out["met"] = min(shares) if shares else None
    stable = offered <= 0 or served >= (1.0 - stability) * offered
    return SteadyState(start, end, offered, served, int(in_window_c.sum()), window_queries.height, refused, out,
                       stable)


def _every_call_good(calls: pl.DataFrame, good_call_all: np.ndarray, queries: pl.DataFrame) -> np.ndarray:
    # A query's calls after a refusal were never sent: they neither pass nor fail it (the refusal failed it).
    """Per row of `queries` (query_id, tenant): whether every call of it that was sent met the call SLOs."""
    flags = calls.select("query_id", "tenant").with_columns(
        bad=pl.Series(~good_call_all & calls["arrival_s"].is_not_null().to_numpy()))
    per = flags.group_by("query_id", "tenant").agg(pl.col("bad").any())
    joined = queries.join(per, on=["query_id", "tenant"], how="left", maintain_order="left")
    return ~joined["bad"].fill_null(False).to_numpy()
