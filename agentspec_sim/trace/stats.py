"""Descriptive statistics of a workload: what `agentspec-sim inspect` reports."""

from __future__ import annotations

import numpy as np

from agentspec_sim.trace.schema import Workload

PERCENTILES = (50, 90, 99)


def _distribution(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"mean": 0.0, "min": 0, "max": 0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    out = {"mean": float(values.mean()), "min": int(values.min()), "max": int(values.max())}
    out.update({f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES})
    return out


def trace_stats(workload: Workload, max_model_len: int | None = None) -> dict:
    """Counts, token totals, per-call distributions and context-limit violations.

    `unique_prompt_tokens` counts each prompt token once per chain (the delta form's view): the
    prefill work a prefix cache that never evicts would do.
    """
    calls = workload.calls
    prompt = np.fromiter((c.prompt_len for c in calls), dtype=np.int64, count=len(calls))
    output = np.fromiter((c.output_len for c in calls), dtype=np.int64, count=len(calls))
    by_id = workload.call_by_id()
    shared = np.fromiter(
        (by_id[c.prompt_extends].prompt_len + by_id[c.prompt_extends].output_len if c.prompt_extends else 0
         for c in calls), dtype=np.int64, count=len(calls))
    per_query = np.array([len(q.calls) for q in workload.queries], dtype=np.int64)
    roles: dict[str, int] = {}
    for c in calls:
        roles[c.role or "-"] = roles.get(c.role or "-", 0) + 1
    stats: dict = {
        "queries": len(workload.queries),
        "calls": len(calls),
        "agents": len({q.agent_id for q in workload.queries}),
        "prompt_tokens": int(prompt.sum()),
        "unique_prompt_tokens": int((prompt - shared).sum()),
        "output_tokens": int(output.sum()),
        "calls_in_delta_form": int(sum(1 for c in calls if c.prompt_extends)),
        "calls_with_structure": int(sum(1 for c in calls if c.structure)),
        "calls_with_workspace": int(sum(1 for c in calls if c.workspace)),
        "roles": dict(sorted(roles.items())),
        "prompt_len": _distribution(prompt),
        "output_len": _distribution(output),
        "calls_per_query": _distribution(per_query),
        "skipped_lines": len(workload.skipped),
    }
    if max_model_len is not None:
        # vLLM refuses a prompt that leaves no room for one output token; a call whose recorded
        # output would run past the limit cannot be replayed either.
        over_prompt = prompt >= max_model_len
        over_total = (prompt + output) > max_model_len
        stats["max_model_len"] = max_model_len
        stats["calls_prompt_over_context"] = int(over_prompt.sum())
        stats["calls_total_over_context"] = int(over_total.sum())
        stats["calls_over_context_ids"] = [calls[i].id for i in np.flatnonzero(over_total)[:20]]
    return stats
