"""Per-role draft caps for the `agspec` drafter: offline profiling of each agent role's acceptance curve.

The article: "AgSpec balances this by profiling each agent role offline to find its empirical
acceptance curve, setting an individual maximum draft cap per role." This module is that profiler.

Replay (no engine): for every call, after each emitted output position p (p = 1 … n−1; token 0
comes from the prefill), the drafter's retrieval (`agspec.Retriever`, the same corpora and
representations as the drafter configured by `spec`) drafts up to `k_max` tokens from the prompt
and output[:p]; the draft's accepted length a(p) is its common prefix with output[p:] and d(p) its
length. Nothing else is read of the output, and the draft at p does not depend on the cap (a
shorter cap takes a prefix of the same draft), so one replay serves every cap.

Acceptance curve of a role, per draft position i = 1 … k_max over its replayed positions:
`drafted[i]` = P(d ≥ i), `accepted[i]` = P(a ≥ i), and `p_accept[i]` = P(a ≥ i | d ≥ i), the
acceptance probability of draft position i (0 when nothing is drafted that long).

Cap: for each c = 0 … k_max, walk each call as the engine would with that cap and the drafter's
online controller (`CapController`, as configured): at position p, draft min(d(p), allowance),
accept min(a(p), that), move to p + accepted + 1. The role's cap is the c maximising

    J(c) = Σ accepted − λ · Σ drafted        (over the role's walked steps)

i.e. expected accepted tokens minus the verification cost of every drafted token, the smallest c on
ties. λ is the cost of verifying one draft token in units of the decode step an accepted token
saves: λ = t_V(b)/t_A(b) (`agentspec_sim.cost.base`) at batch size `batch_size`, each call
verifying k_max draft tokens, at the workload's median prompt length — from the cost model for
`hardware`/`model` unless `penalty` gives it. A role with no drafted position gets cap 0.

Diagnostics per role: `drafted_positions` (positions drafted from each corpus) and
`accepted_by_source` (Σ a(p) over those positions: token-by-token, not per engine step).

The cap file (JSON, written atomically): `{"version": 1, "method": "agspec", "caps": {role: cap},
"default": cap over every call (calls without a role, or of a role not profiled), "k_max", "penalty",
"penalty_source", "roles": {role: {calls, positions, cap, curve, by_cap}}, "all": {...}, "config"}`;
`agspec`'s `role_caps` key reads `caps` and `default`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from agentspec_sim.drafters.agspec.rule import (
    CAP_FILE_VERSION,
    WORKLOAD_OTHER_QUERIES,
    AgSpecSettings,
    CapController,
    Retriever,
    build_global_corpus,
    load_global_corpus,
)
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.trace.schema import Call, Query, Workload

NO_ROLE = None  # calls without a role count towards "default" only


@njit(cache=True, nogil=True)
def _common_prefix(a: np.ndarray, b: np.ndarray, start: int) -> int:
    m = 0
    n = b.shape[0] - start
    while m < a.shape[0] and m < n and a[m] == b[start + m]:
        m += 1
    return m


@njit(cache=True, nogil=True)
def _walk_static(acc: np.ndarray, dft: np.ndarray, offsets: np.ndarray, cap: int) -> tuple[int, int, int]:
    """(steps, drafted, accepted) over every call walked with a fixed cap (no controller)."""
    steps = drafted = accepted = 0
    for c in range(offsets.shape[0] - 1):
        lo, hi = offsets[c], offsets[c + 1]
        i = lo
        while i < hi:
            d = min(dft[i], cap)
            a = min(acc[i], d)
            steps += 1
            drafted += d
            accepted += a
            i += a + 1
    return steps, drafted, accepted


def replay_call(retriever: Retriever, call: Call, k_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(accepted a(p), drafted d(p), source corpus) for p = 1 … n−1 of one call (module docstring)."""
    history = np.concatenate([call.prompt_tokens, call.output_tokens]).astype(np.int32, copy=False)
    plen, n = call.prompt_len, call.output_len
    m = max(n - 1, 0)
    acc = np.zeros(m, dtype=np.int32)
    dft = np.zeros(m, dtype=np.int32)
    src = np.full(m, -1, dtype=np.int8)
    if n == 0:
        return acc, dft, src
    corpora = retriever.begin(call, history[:plen + 1])
    for p in range(1, n):
        draft, s = retriever.draft(corpora, history[:plen + p], k_max)
        if draft.shape[0]:
            dft[p - 1] = draft.shape[0]
            acc[p - 1] = _common_prefix(draft, history, plen + p)
            src[p - 1] = s
    corpora.session.sync(history)
    retriever.end(corpora)
    return acc, dft, src


def _walk_controlled(acc: np.ndarray, dft: np.ndarray, offsets: np.ndarray, cap: int,
                     settings: AgSpecSettings) -> tuple[int, int, int]:
    """(steps, drafted, accepted) with the drafter's online controller starting each call at `cap`."""
    if not settings.controller:
        return _walk_static(acc, dft, offsets, cap)
    steps = drafted = accepted = 0
    acc_l, dft_l = acc.tolist(), dft.tolist()
    for c in range(offsets.shape[0] - 1):
        lo, hi = int(offsets[c]), int(offsets[c + 1])
        ctl = CapController(cap, settings)
        i = lo
        while i < hi:
            d = min(dft_l[i], ctl.allowance())
            a = min(acc_l[i], d)
            if d:
                ctl.update(d, a)
            steps += 1
            drafted += d
            accepted += a
            i += a + 1
    return steps, drafted, accepted


def _summary(acc: np.ndarray, dft: np.ndarray, offsets: np.ndarray, calls: int, k_max: int, penalty: float,
             settings: AgSpecSettings, src: np.ndarray) -> dict[str, Any]:
    positions = int(acc.shape[0])

    def at_least(values: np.ndarray) -> np.ndarray:  # [#(values ≥ i) for i = 1 … k_max]
        counts = np.bincount(np.minimum(values, k_max), minlength=k_max + 1)
        return np.cumsum(counts[::-1])[::-1][1:]

    d_ge, a_ge = at_least(dft), at_least(acc)
    denom = max(positions, 1)
    p_accept = np.where(d_ge > 0, a_ge / np.maximum(d_ge, 1), 0.0)
    by_cap: dict[str, list] = {"steps": [], "drafted": [], "accepted": [], "objective": []}
    for cap in range(k_max + 1):
        steps, drafted, accepted = _walk_controlled(acc, dft, offsets, cap, settings)
        by_cap["steps"].append(int(steps))
        by_cap["drafted"].append(int(drafted))
        by_cap["accepted"].append(int(accepted))
        by_cap["objective"].append(round(accepted - penalty * drafted, 6))
    objective = by_cap["objective"]
    best = max(range(k_max + 1), key=lambda c: (objective[c], -c)) if int(d_ge[0]) else 0
    sources = {name: int((src == s).sum()) for s, name in enumerate(("session", "workspace", "global"))}
    accepted_by_source = {name: int(acc[src == s].sum()) for s, name in enumerate(("session", "workspace", "global"))}
    return {
        "calls": calls,
        "positions": positions,
        "cap": int(best),
        "drafted_positions": sources,
        "accepted_by_source": accepted_by_source,
        "curve": {
            "drafted": [round(float(x) / denom, 6) for x in d_ge],
            "accepted": [round(float(x) / denom, 6) for x in a_ge],
            "p_accept": [round(float(x), 6) for x in p_accept],
        },
        "by_cap": by_cap,
    }


def verification_penalty(workload: Workload, batch_size: int, k_max: int, hardware: str = "a100-80g",
                         model: str = "qwen3-8b") -> tuple[float, str]:
    """λ = t_V(b)/t_A(b) from the roofline cost model (module docstring) and a line saying so."""
    from agentspec_sim.cost import build_cost_model

    cost = build_cost_model(hardware=hardware, model=model)
    lens = [c.prompt_len for c in workload.calls]
    context = int(statistics.median(lens)) if lens else 0
    t_a = cost.per_token_decode_time(batch_size, context)
    t_v = cost.per_token_verify_time(batch_size, context, max(k_max, 1))
    return float(t_v / t_a), (f"t_V/t_A of {model} on {hardware} at batch size {batch_size}, {k_max} draft tokens "
                              f"per call, context {context} (median prompt)")


# Memory per cap 0 … k_max of each profile (every role and the default): its by-cap row, curve entries and
# JSON (measured: 812 bytes per cap, k_max 10⁵ → 10⁶, one profile); per call of the batch λ is priced at
# (the cost model's per-call arrays; measured: 15.5 bytes, batch size 10⁷ → 10⁸).
BYTES_PER_CAP = 850
BYTES_PER_BATCH_CALL = 16


def _check_memory(queries: Sequence[Query], k_max: int, batch_size: int) -> None:
    """Refuse (`ResourceError`) a k_max or batch size whose profile needs more memory than is available."""
    from agentspec_sim.host.resources import require_memory

    profiles = len({c.role for q in queries for c in q.calls} - {NO_ROLE}) + 1
    require_memory({"k_max": (k_max + 1) * BYTES_PER_CAP * profiles, "batch_size": batch_size * BYTES_PER_BATCH_CALL},
                   "the role profile", values={"k_max": k_max, "batch_size": batch_size})


def role_profile(workload: Workload, spec: str | Mapping[str, Any] | SpeculativeConfig | None = None, *,
                 k_max: int | None = None, penalty: float | None = None, batch_size: int = 16,
                 hardware: str = "a100-80g", model: str = "qwen3-8b",
                 max_queries: int | None = None) -> dict[str, Any]:
    """Profile every role of `workload` under the `agspec` configuration `spec` (default: its defaults)
    and pick its cap; returns the cap-file document (module docstring).

    k_max: the longest draft profiled (default: the config's num_speculative_tokens). penalty: λ
    (default: from the cost model at `batch_size`). max_queries: profile only the first queries.
    """
    spec = parse_drafter(spec if spec is not None else {"method": "agspec"})
    if spec.method != "agspec":
        raise ValueError(f"role profiles are for the agspec drafter, not {spec.method!r}")
    settings = AgSpecSettings.from_spec(spec)
    k_max = settings.k if k_max is None else int(k_max)
    if k_max < 1:
        raise ValueError(f"k_max must be ≥ 1, got {k_max}")
    queries = workload.queries if max_queries is None else workload.queries[:max_queries]
    _check_memory(queries, k_max, batch_size if penalty is None else 0)
    if penalty is None:
        penalty, penalty_source = verification_penalty(workload, batch_size, k_max, hardware, model)
    else:
        penalty, penalty_source = float(penalty), "given"
    if penalty < 0:
        raise ValueError(f"penalty must be ≥ 0, got {penalty}")
    corpus = None
    if "global" in settings.corpora:
        if settings.global_corpus == WORKLOAD_OTHER_QUERIES:
            corpus = build_global_corpus(workload, settings.min_match)
        else:
            corpus = load_global_corpus(settings.global_corpus, settings.min_match, settings.tokenizer)
    retriever = Retriever(settings, corpus)
    per_role: dict[Any, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for q in queries:
        for c in q.calls:
            per_role.setdefault(c.role, []).append(replay_call(retriever, c, k_max))

    def summarise(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, Any]:
        acc = np.concatenate([r[0] for r in rows]) if rows else np.zeros(0, dtype=np.int32)
        dft = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0, dtype=np.int32)
        src = np.concatenate([r[2] for r in rows]) if rows else np.zeros(0, dtype=np.int8)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([r[0].shape[0] for r in rows])
        return _summary(acc, dft, offsets, len(rows), k_max, penalty, settings, src)

    roles = {str(role): summarise(rows) for role, rows in sorted(per_role.items(), key=lambda kv: str(kv[0]))
             if role is not NO_ROLE}
    everything = summarise([r for rows in per_role.values() for r in rows])
    return {
        "version": CAP_FILE_VERSION,
        "method": "agspec",
        "caps": {role: r["cap"] for role, r in roles.items()},
        "default": everything["cap"],
        "k_max": k_max,
        "penalty": round(penalty, 6),
        "penalty_source": penalty_source,
        "queries": len(queries),
        "config": spec.to_json(),
        "roles": roles,
        "all": everything,
    }


def write_cap_file(path: str | Path, profile: Mapping[str, Any]) -> Path:
    """Write a `role_profile` document as the cap file `agspec`'s `role_caps` reads (atomically)."""
    from agentspec_sim.io.atomic import atomic_text

    with atomic_text(path) as out:
        out.write(json.dumps(profile, indent=2, default=_jsonable) + "\n")
    return Path(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def analyze_roles(trace: str | Path | Workload | None = None, output: str | Path | None = None, *,
                  drafter: str | Mapping[str, Any] | None = None, k_max: int | None = None,
                  penalty: float | None = None, batch_size: int = 16, hardware: str = "a100-80g",
                  model: str = "qwen3-8b", max_queries: int | None = None) -> dict[str, Any]:
    """The `agentspec-sim analyze roles` command as a function: profile `trace` (a Workload, a trace
    path, or None for the bundled coding-agent trace) with `role_profile`, write the cap file to
    `output` if given, and return the document (with `trace` and `output` added).

    drafter: the agspec config whose retrieval is profiled (a dict, its JSON text, or "agspec")."""
    if isinstance(trace, Workload):
        workload, where = trace, "(workload)"
    else:
        from agentspec_sim.trace.bundled import default_trace_path
        from agentspec_sim.trace.io import load_trace

        path = Path(trace) if trace is not None else default_trace_path()
        workload, where = load_trace(path), str(path)
    spec = drafter if drafter is not None else {"method": "agspec"}
    if isinstance(spec, str):
        spec = parse_drafter(spec, "--drafter")  # strict JSON, and a list or number named as such
    profile = role_profile(workload, spec, k_max=k_max, penalty=penalty, batch_size=batch_size, hardware=hardware,
                           model=model, max_queries=max_queries)
    profile["trace"] = where
    if output is not None:
        profile["output"] = str(output)
        write_cap_file(output, profile)
    return profile


__all__ = ["analyze_roles", "replay_call", "role_profile", "verification_penalty", "write_cap_file"]
