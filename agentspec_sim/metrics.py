"""Summaries of a run, with exactly the definitions of DESIGN.md "Metrics".

Terms: an engine step is one forward pass; a call-step is one call's part of it; a decode
call-step verifies (prefill chunks, including the one that emits a call's first token, do not); a
drafted call-step is a decode call-step with ≥ 1 draft token actually scheduled (after the token
budget truncated it), as vLLM counts `num_drafts`. `accepted` never includes the bonus token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import polars as pl

from agentspec_sim.engine.load import protocol
from agentspec_sim.engine.result import RunResult
from agentspec_sim.slo import LatencySLO, attainment, call_latencies, inter_token_latencies

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Percentiles:
    """A latency's distribution as `vllm bench serve` prints it (mean, median = p50, std, p99) and p90."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None = None
    std: float | None = None  # population std (ddof 0), numpy's default as vLLM calls it

    @classmethod
    def of(cls, values: np.ndarray) -> Percentiles:
        values = values[~np.isnan(values)]
        if values.size == 0:
            return cls(None, None, None)
        p = np.percentile(values, PERCENTILES)
        return cls(float(p[0]), float(p[1]), float(p[2]), float(values.mean()), float(values.std()))


@dataclass(frozen=True)
class RunSummary:
    """One run's headline numbers. Times in seconds; None where a metric is undefined."""

    drafter: str
    speculative_config: dict[str, Any]
    output_tokens: int
    makespan_s: float
    goodput_tok_s: float
    speedup: float | None  # goodput / goodput(normal) on the same trace and config
    rejection_rate: float | None  # mean over calls with ≥ 1 drafted call-step of (drafted − accepted)/drafted
    rejection_rate_tokens: float | None  # Σ(drafted − accepted) / Σ drafted
    mean_acceptance_length: float | None  # vLLM: 1 + accepted / drafted call-steps
    accepted_per_decode_step: float | None  # accepted / decode call-steps
    drafted_tokens: int
    accepted_tokens: int
    drafted_call_steps: int
    decode_call_steps: int
    draft_tokens_per_step: float | None  # mean over engine steps with a decode call-step
    token_budget_mean: float | None  # mean M(b) over the same steps
    budget_utilisation: float | None  # mean over those steps with M(b) > 0 of drafted / M(b)
    ttft: Percentiles
    tpot: Percentiles
    query_latency: Percentiles
    itl: Percentiles  # every gap between a call's streamed chunks, pooled (vllm bench serve's ITL)
    e2el: Percentiles  # each call's arrival to its last token (vllm bench serve's E2EL)
    draft_time_s: float
    forward_time_s: float
    steps: int
    simulated_s: float  # clock at the last completion
    calls: int
    refused_calls: int
    skipped_calls: int
    truncated_calls: int
    completed_queries: int
    incomplete_queries: int
    preemptions: int
    prefix_hit_tokens: int
    batch_size_mean: float
    batch_size_max: int
    running_mean: float
    running_max: int
    bound_by: str  # what most often kept calls waiting: max_num_seqs, kv_cache, token_budget, or none
    bound_fractions: dict[str, float] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    # Load (engine/load.py, agentspec_sim/slo.py). duration_s: from the load's start (t = 0 under a load protocol,
    # the first arrival on a trace's own timeline) to the last completion, vLLM bench serve's benchmark duration;
    # throughputs divide by it, as vLLM's do.
    protocol: str = ""
    duration_s: float = 0.0
    request_throughput: float = 0.0  # completed queries / duration_s (vLLM: "Request throughput (req/s)")
    call_throughput: float = 0.0  # finished calls / duration_s
    output_throughput_tok_s: float = 0.0  # output tokens / duration_s (vLLM: "Output token throughput")
    attainment: dict[str, float | None] = field(default_factory=dict)  # slo.ATTAINMENT_KEYS; None: no SLO
    # copies: the mean over queries of (B copies' output tokens / their batch's time) ÷ the same in the normal
    # run, i.e. the per-request speedup papers report; `speedup` is the pooled figure (all tokens / all time).
    speedup_mean_per_query: float | None = None
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (NaN/inf become None)."""
        return _clean(asdict(self))

    def to_row(self) -> dict[str, Any]:
        """One flat row for tables and parquet: nested values become `ttft_p50`, `bound_fractions_kv_cache`,
        `limits_max_num_seqs`…; the speculative config becomes JSON text. Keys are stable across drafters."""
        row: dict[str, Any] = {}
        for key, value in self.to_dict().items():
            if key == "speculative_config":
                row[key] = json.dumps(value, sort_keys=True)
            elif isinstance(value, dict):
                for sub, inner in sorted(value.items()):
                    row[f"{key}_{sub}"] = inner
            else:
                row[key] = value
        return row


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return _clean(value.item())
    return value


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def per_query_batch_s(result: RunResult) -> np.ndarray:
    """Under `copies`: each trace query's batch time, from its copies' send to the last one's finish (NaN where a
    copy did not complete). Query instances are copy-major (engine/layout.py)."""
    q = result.queries
    copies = result.config.copies
    per = q.height // copies
    arrival = q["arrival_s"].to_numpy().astype(np.float64).reshape(copies, per)
    finish = q["finish_s"].to_numpy().astype(np.float64).reshape(copies, per)
    done = q["completed"].to_numpy().reshape(copies, per).all(axis=0)
    return np.where(done, finish.max(axis=0) - arrival.min(axis=0), np.nan)


def completed_latencies(result: RunResult) -> list[float]:
    """Every completed query's latency, seconds, in query order (a sweep row's `query_latencies_s`)."""
    return [float(x) for x in result.queries.filter(pl.col("completed"))["latency_s"]]


def speedup_mean_per_query(batch_s: np.ndarray, base_batch_s: np.ndarray) -> float | None:
    """Mean over queries of normal's batch time ÷ this run's (= the ratio of their batch throughputs)."""
    ok = np.isfinite(batch_s) & np.isfinite(base_batch_s) & (batch_s > 0)
    return float((base_batch_s[ok] / batch_s[ok]).mean()) if ok.any() else None


def summarize(result: RunResult, baseline: RunResult | None = None, slo: LatencySLO | None = None) -> RunSummary:
    """The summary of `result`; `baseline` (the `normal` run on the same trace and config) gives the speedup;
    `slo` the attainment (agentspec_sim/slo.py; all None without one)."""
    calls = result.calls
    finished = calls.filter(pl.col("status") == "finished")
    arrivals = calls["arrival_s"].drop_nulls()
    ends = calls.filter(pl.col("status").is_in(["finished", "refused"]))["finish_s"].drop_nulls()
    start = float(arrivals.min()) if arrivals.len() else 0.0
    end = float(ends.max()) if ends.len() else start
    makespan = end - start
    output_tokens = int(calls["output_len"].sum())
    goodput = output_tokens / makespan if makespan > 0 else 0.0
    base_goodput = summarize(baseline).goodput_tok_s if baseline is not None else None

    speculative = result.spec.method != "normal"
    drafted_calls = calls.filter(pl.col("draft_steps") > 0)
    drafted = int(calls["drafted"].sum())
    accepted = int(calls["accepted"].sum())
    draft_steps = int(calls["draft_steps"].sum())
    decode_steps = int(calls["decode_steps"].sum())
    per_call_rejection = ((drafted_calls["drafted"] - drafted_calls["accepted"]) / drafted_calls["drafted"]).to_numpy()

    eng = result.engine_steps
    decode_eng = eng.filter(pl.col("decode_calls") > 0)
    with_budget = decode_eng.filter(pl.col("budget") > 0)

    ttft, tpot = call_latencies(calls)  # TPOT NaN (left out) for one-token outputs
    itl, longest_gap = inter_token_latencies(result)
    queries = result.queries
    done_queries = queries.filter(pl.col("completed"))

    bounds = eng["bound"].value_counts()
    counts = dict(zip(bounds["bound"].to_list(), bounds["count"].to_list(), strict=True))
    n_steps = eng.height
    fractions = {k: counts.get(k, 0) / n_steps if n_steps else 0.0
                 for k in ("max_num_seqs", "kv_cache", "token_budget")}
    limiting = {k: v for k, v in fractions.items() if v > 0}
    limits = result.limits
    # vLLM bench serve's duration runs from the benchmark's start: t = 0 for a load protocol (the first query is
    # sent after its gap), the first arrival for a trace's own timeline (which may start anywhere, e.g. epoch s).
    cfg = result.config
    load_start = 0.0 if cfg.arrival in ("request-rate", "poisson", "zero") or cfg.copies_protocol else start
    duration = max(end - min(load_start, start), 0.0)
    per_query = None
    if baseline is not None and result.config.copies_protocol:
        per_query = speedup_mean_per_query(per_query_batch_s(result), per_query_batch_s(baseline))
    return RunSummary(
        drafter=result.drafter,
        speculative_config=result.spec.to_json(),
        output_tokens=output_tokens,
        makespan_s=makespan,
        goodput_tok_s=goodput,
        speedup=(goodput / base_goodput) if base_goodput else None,
        rejection_rate=float(per_call_rejection.mean()) if speculative and per_call_rejection.size else None,
        rejection_rate_tokens=_ratio(drafted - accepted, drafted) if speculative else None,
        mean_acceptance_length=(1.0 + accepted / draft_steps) if speculative and draft_steps else None,
        accepted_per_decode_step=_ratio(accepted, decode_steps) if speculative else None,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        drafted_call_steps=draft_steps,
        decode_call_steps=decode_steps,
        draft_tokens_per_step=float(decode_eng["D"].mean()) if decode_eng.height else None,
        token_budget_mean=float(decode_eng["budget"].mean()) if decode_eng.height else None,
        budget_utilisation=float((with_budget["D"] / with_budget["budget"]).mean()) if with_budget.height else None,
        ttft=Percentiles.of(ttft),
        tpot=Percentiles.of(tpot),
        query_latency=Percentiles.of(done_queries["latency_s"].to_numpy().astype(np.float64)),
        itl=Percentiles.of(itl),
        e2el=Percentiles.of((finished["finish_s"] - finished["arrival_s"]).to_numpy().astype(np.float64)),
        draft_time_s=float(eng["draft_s"].sum()),
        forward_time_s=float(eng["forward_s"].sum()),
        steps=n_steps,
        simulated_s=end,
        calls=calls.height,
        refused_calls=int((calls["status"] == "refused").sum()),
        skipped_calls=int((calls["status"] == "skipped").sum()),
        truncated_calls=int(calls["truncated"].sum()),
        completed_queries=done_queries.height,
        incomplete_queries=queries.height - done_queries.height,
        preemptions=result.num_preemptions,
        prefix_hit_tokens=int(calls["prefix_hit_tokens"].sum()),
        batch_size_mean=float(eng["batch_size"].mean()) if n_steps else 0.0,
        batch_size_max=int(eng["batch_size"].max()) if n_steps else 0,
        running_mean=float(eng["running"].mean()) if n_steps else 0.0,
        running_max=int(eng["running"].max()) if n_steps else 0,
        bound_by=max(limiting, key=limiting.__getitem__) if limiting else "none",
        bound_fractions=fractions,
        limits={"max_num_seqs": limits.max_num_seqs, "max_num_batched_tokens": limits.max_num_batched_tokens,
                "max_model_len": limits.max_model_len, "num_kv_blocks": limits.num_kv_blocks,
                "block_size": result.config.block_size},
        protocol=protocol(result.config),
        duration_s=duration,
        request_throughput=done_queries.height / duration if duration > 0 else 0.0,
        call_throughput=finished.height / duration if duration > 0 else 0.0,
        output_throughput_tok_s=output_tokens / duration if duration > 0 else 0.0,
        attainment=attainment(result, slo or LatencySLO(), longest_gap),
        speedup_mean_per_query=per_query,
        wall_s=result.wall_s,
    )
