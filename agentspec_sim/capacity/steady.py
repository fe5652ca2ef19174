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

`FailureWatch` is the same verdict in its early form: it ends a probe as soon as its failure is certain
(engine/watch.py), so an overloaded probe does not serve its backlog — often several times its send window of
simulated time, and most of a search's cost — only to be judged failing. It only ever stops a probe that
`steady_state` would fail, so a search's verdicts, and with them its capacities, are those of whole runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import polars as pl

from agentspec_sim.engine.request import S_FINISHED, S_REFUSED
from agentspec_sim.engine.result import RunResult
from agentspec_sim.engine.watch import RunSoFar
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


class FailureWatch:
    """Ends a probe once `steady_state` would certainly fail it (module docstring), looking about `looks` times
    over its send window and once more as the window closes. A look at time t (everything up to t settled)
    counts the calls (queries) of the window that have already missed an SLO — a TTFT over its limit, or no
    first token t − arrival after it; a TPOT over its limit, or a decode already longer than (output − 1) × the
    limit; a refusal; a query latency over its limit, or still running that long after its send — against the
    most the window can still hold (every call not yet arrived, until the window has closed): when even all the
    rest meeting their SLOs would leave attainment under `target`, the probe has failed. Once the window has
    closed its served output is final: short of (1 − `stability`) of the offered, the probe has failed. Streamed
    chunks' gaps (an ITL SLO) are not watched: such a probe is only stopped for its other SLOs or stability.
    `stopped_by`: "attainment" or "stability" once it stopped a run."""

    def __init__(self, slo: LatencySLO, target: float, warmup: float, stability: float,
                 criterion: Criterion = "calls", looks: int = 64) -> None:
        self.slo, self.target, self.warmup, self.stability, self.criterion = slo, target, warmup, stability, criterion
        self.looks = looks
        self.next_s = 0.0
        self.stopped_by: str | None = None
        self._ready = False
        self._served_checked = False

    def _prepare(self, run: RunSoFar) -> None:
        sends = run.query_sends()
        self.sends = sends
        self.end = float(sends.max()) if sends.size else 0.0
        self.start = self.warmup * self.end
        self.query_in = (sends >= self.start) & (sends <= self.end)
        self.call_query = run.call_queries()
        prompt, target = run.column("prompt_len"), run.column("target_len")
        # A call runs unless a call of its query at or before it is refused (its rows ascend in call order).
        refused = (prompt >= run.max_model_len).astype(np.int64)
        order = np.argsort(self.call_query, kind="stable")
        counted = np.cumsum(refused[order])
        owner = self.call_query[order]
        opens = np.ones(owner.shape[0], dtype=bool)
        opens[1:] = owner[1:] != owner[:-1]
        before = np.maximum.accumulate(np.where(opens, counted - refused[order], 0)) if owner.size else counted
        runs = np.empty(owner.shape[0], dtype=bool)
        runs[order] = counted - before == 0
        self.offered = float(target[runs & self.query_in[self.call_query]].sum())
        self.outputs = target
        # The last call of each query: its finish is the query's.
        self.last_call = np.full(sends.shape[0], -1, dtype=np.int64)
        np.maximum.at(self.last_call, self.call_query, np.arange(self.call_query.shape[0]))
        self.query_refused = np.zeros(sends.shape[0], dtype=bool)
        self.query_refused[self.call_query[~runs]] = True
        self.every = max(self.end, 1e-9) / self.looks
        self._ready = True

    def look(self, run: RunSoFar) -> bool:
        if not self._ready:
            self._prepare(run)
            if not np.isfinite(self.end) or not self.query_in.any():
                self.next_s = np.inf  # queries not all sent up front (a gated protocol): nothing to watch
                return False
        t = run.known_s
        self.next_s = max(self.start, min(t + self.every, self.end if t < self.end else np.inf))
        if t >= self.end and not self._served_checked:  # the window has closed: what it served is final
            self._served_checked = True
            served = float(run.emitted_between(self.start, self.end))
            if not (self.offered <= 0 or served >= (1.0 - self.stability) * self.offered):
                self.stopped_by = "stability"
                return True
        if t < self.start:
            return False
        if self._attainment_failed(run, t):
            self.stopped_by = "attainment"
            return True
        return False

    def _calls_missed(self, run: RunSoFar, t: float, arrival: np.ndarray) -> np.ndarray:
        """Per call: it reached the server and has certainly missed a call SLO by t (`good_calls`' rule)."""
        slo = self.slo
        status = run.column("status")
        first = run.column("first_token_s")
        missed = status == S_REFUSED
        started = ~np.isnan(first)
        if slo.ttft_s is not None:
            waited = np.where(started, first, t) - arrival
            missed |= waited > slo.ttft_s
        if slo.tpot_s is not None:
            n = self.outputs.astype(np.float64)
            done = status == S_FINISHED
            end = np.where(done, run.column("finish_s"), t)
            tpot = np.where(started & (n >= 2), (end - first) / np.maximum(n - 1, 1), 0.0)
            missed |= np.nan_to_num(tpot, nan=0.0) > slo.tpot_s
        return missed & ~np.isnan(arrival)

    def _queries_missed(self, run: RunSoFar, t: float) -> np.ndarray:
        """Per query: it has certainly missed the query-latency SLO by t (or will never complete: a refusal)."""
        status = run.column("status")
        last = self.last_call
        done = (status[last] == S_FINISHED) & ~self.query_refused
        latency = np.where(done, run.column("finish_s")[last], t) - self.sends
        return self.query_refused | (latency > self.slo.query_latency_s)

    def _attainment_failed(self, run: RunSoFar, t: float) -> bool:
        slo, target = self.slo, self.target
        arrival = run.column("arrival_s")
        query_bad = self._queries_missed(run, t) if slo.query_latency_s is not None else None
        if self.criterion == "queries":
            bad = np.zeros(self.sends.shape[0], dtype=bool)
            if slo.per_call:
                np.logical_or.at(bad, self.call_query, self._calls_missed(run, t, arrival))
            if query_bad is not None:
                bad |= query_bad
            return _short_of(int(self.query_in.sum()), int((bad & self.query_in).sum()), target)
        if query_bad is not None and _short_of(int(self.query_in.sum()), int((query_bad & self.query_in).sum()),
                                               target):
            return True
        if not slo.per_call:
            return False
        inside = (arrival >= self.start) & (arrival <= self.end)
        most = int(inside.sum())
        if t <= self.end:
            most += int(np.isnan(arrival).sum())  # calls not yet arrived may still arrive inside the window
        return _short_of(most, int((self._calls_missed(run, t, arrival) & inside).sum()), target)


def _short_of(most: int, missed: int, target: float) -> bool:
    """Whether attainment over a window of at most `most` items of which `missed` have failed is certainly under
    `target`: even every other item good gives (most − missed) / most, and a window of fewer items no more."""
    return most > 0 and (most - missed) / most < target
