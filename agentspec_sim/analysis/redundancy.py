"""Acceptance vs redundancy: paper Figure 6 (AgentSpec §4.2), for `agentspec-sim analyze redundancy`.

No engine: each call's recorded output is replayed token by token, exactly as the `agentspec`
drafter sees it (`drafters.agentspec.History`, the same code): queries in trace order, calls by
`seq`; a call's prompt is indexed when it starts (the part new to its query), then before each
output token t the same-(agent, query, block) history is searched with the context's last L
tokens (L = the match length; only exact length-L matches count here, as in the figure's "matching
pattern length"), and token t is appended after. At every position with n ≥ 1 candidates:

- redundancy r = c/n (c = candidates agreeing with CT*, or with the plurality path's first token
  when CT* is empty — `drafters/agentspec/block_index.py`);
- the draft: CT* (or P[:1] when CT* is empty), or P[:draft_len] when `draft_len` > 0;
- accepted = the length of the draft's longest prefix equal to the recorded tokens from t on.

Positions are binned by r ([0, 0.1), …, [0.9, 1.0]); each bin reports the acceptance ratio
1 − ρ = accepted / proposed draft tokens (the paper's y-axis), the share of drafts accepted in
full, and the positions it holds; the same by n (1, 2–3, 4–7, ≥ 8) shows how agreement becomes
more telling as more continuations are seen.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agentspec_sim.drafters.agentspec.block_index import META_C, META_CT, META_N, META_P
from agentspec_sim.drafters.agentspec.history import History
from agentspec_sim.trace.schema import Workload

DEFAULT_MATCH_LENS = (2, 4, 8)
BIN_EDGES = tuple(i / 10 for i in range(11))
N_BUCKETS = ((1, 1), (2, 3), (4, 7), (8, None))


def redundancy_profile(workload: Workload, token_bytes: Sequence[bytes] | None,
                       match_lens: Sequence[int] = DEFAULT_MATCH_LENS, max_candidates: int = 64,
                       width: int = 32, draft_len: int = 0, structured: bool = True) -> dict:
    """Figure 6 for `workload`: per match length, acceptance by redundancy bin and by n.

    `token_bytes`: the trace tokenizer's token→bytes map (None: no structure is read);
    `max_candidates`: candidates kept per lookup (the newest); `width`: candidate length;
    `draft_len`: 0 → draft CT* (P[:1] when empty), k > 0 → draft P[:k].

    Returns `{"positions": N, "match_lens": [...], "by_len": {L: {"bins": [row…], "by_n": [row…],
    "overall": row}}}`, each row `{"lo", "hi", "positions", "proposed", "accepted", "acceptance",
    "full_accept"}` (acceptance and full_accept None for an empty row).
    """
    calls = [sorted(q.calls, key=lambda c: c.seq) for q in workload.queries]
    total = sum(int(c.output_tokens.shape[0]) for cs in calls for c in cs)
    by_len: dict[int, dict] = {}
    for L in sorted({int(m) for m in match_lens}):
        if L < 1:
            raise ValueError(f"match length must be ≥ 1, got {L}")
        ratio, proposed, accepted, ns = _replay(calls, token_bytes, L, max_candidates, width, draft_len, structured)
        rows = []
        for lo, hi in itertools.pairwise(BIN_EDGES):
            sel = (ratio >= lo) & ((ratio < hi) if hi < 1 else (ratio <= hi))
            rows.append(_row(lo, hi, sel, proposed, accepted))
        by_n = [_row(lo, hi, (ns >= lo) & ((ns <= hi) if hi is not None else True), proposed, accepted)
                for lo, hi in N_BUCKETS]
        by_len[L] = {"bins": rows, "by_n": by_n,
                     "overall": _row(0.0, 1.0, np.ones(ratio.shape[0], dtype=bool), proposed, accepted)}
    return {"positions": total, "match_lens": sorted(by_len), "draft": "ct*" if draft_len <= 0 else f"P[:{draft_len}]",
            "by_len": by_len}


def _replay(calls, token_bytes, L, max_candidates, width, draft_len, structured):
    history = History(L, L, width, max_candidates, token_bytes, structured=structured)
    ratios, proposed, accepted, ns = [], [], [], []
    for query_calls in calls:
        for call in query_calls:
            prompt = np.asarray(call.prompt_tokens, dtype=np.int32)
            output = np.asarray(call.output_tokens, dtype=np.int32)
            cursor = history.start(call, prompt)
            out, meta = history.replay(cursor, prompt, output)
            history.finish(cursor, np.concatenate([prompt, output]))
            history.evict()  # finished queries' histories, once the arena is over its bound
            has = meta[:, META_N] > 0
            if not has.any():
                continue
            t = np.flatnonzero(has)
            n = meta[t, META_N]
            c = meta[t, META_C]
            d = np.minimum(meta[t, META_P], draft_len) if draft_len > 0 else np.maximum(meta[t, META_CT], 1)
            padded = np.concatenate([output, np.full(width, -2, dtype=np.int32)])
            j = np.arange(width)
            truth = padded[t[:, None] + j[None, :]]
            match = (out[t] == truth) & (j[None, :] < d[:, None])
            acc = np.cumprod(match, axis=1).sum(axis=1)
            ratios.append(c / n)
            proposed.append(d)
            accepted.append(acc)
            ns.append(n)
    if not ratios:
        empty = np.zeros(0)
        return empty, empty.astype(np.int64), empty.astype(np.int64), empty.astype(np.int64)
    return np.concatenate(ratios), np.concatenate(proposed), np.concatenate(accepted), np.concatenate(ns)


def _row(lo, hi, sel, proposed, accepted) -> dict:
    p = int(proposed[sel].sum())
    a = int(accepted[sel].sum())
    k = int(sel.sum())
    full = int((accepted[sel] == proposed[sel]).sum())
    return {"lo": lo, "hi": hi, "positions": k, "proposed": p, "accepted": a,
            "acceptance": a / p if p else None, "full_accept": full / k if k else None}


def plot_redundancy(profile: dict, path: str | Path, title: str | None = None, min_positions: int = 20) -> Path:
    """Figure 6 as a PNG (or SVG / PDF by suffix): acceptance ratio (1 − ρ) vs redundancy c/n, one line per match length
    (bins holding fewer than `min_positions` drafts are left out: their ratio is noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for L in profile["match_lens"]:
        rows = [r for r in profile["by_len"][L]["bins"]
                if r["acceptance"] is not None and r["positions"] >= min_positions]
        xs = [(r["lo"] + r["hi"]) / 2 for r in rows]
        ax.plot(xs, [r["acceptance"] for r in rows], marker="o", label=f"match length {L}")
    ax.set_xlabel("redundancy ratio c/n (candidates agreeing with the draft)")
    ax.set_ylabel("acceptance ratio 1 − ρ (accepted / drafted tokens)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(title=f"draft: {profile['draft']}")
    ax.set_title(title or "Acceptance vs redundancy (AgentSpec Fig. 6)")
    fig.tight_layout()
    from agentspec_sim.io.atomic import atomic_binary

    path = Path(path)
    # The format follows the suffix matplotlib would read from a file name (.png, .svg, .pdf), written
    # atomically like every output; a device or a name without a suffix gets PNG.
    fmt = path.suffix[1:].lower() if path.suffix.lower() in (".png", ".svg", ".pdf") else "png"
    try:
        with atomic_binary(path, compress=False) as out:
            fig.savefig(out, format=fmt, dpi=120)
    finally:
        plt.close(fig)
    return path


__all__ = ["BIN_EDGES", "DEFAULT_MATCH_LENS", "N_BUCKETS", "plot_redundancy", "redundancy_profile"]
