"""The repetition profile of a trace: paper Figure 5 (AgentSpec §4.1), for `agentspec-sim inspect`.

For each minimum span length k, the share of output tokens that lie in repeated spans: a k-gram
of output tokens is *repeated* if the same k tokens occurred starting at an earlier position of
the generated history — outputs only, in trace order (queries in order, calls by `seq`, positions
in order), so an earlier place in the same call, an earlier call or an earlier query. No k-gram
crosses a call boundary. Overlapping matched k-windows merge into spans: a token is repeated if
any matched k-window covers it (this is the paper's "maximal repeated segments with at least k
consecutive tokens", with segments built from matched k-grams).

Each matched window gets the most local category for which an earlier occurrence exists:
`same_block` (same query, and the earlier occurrence starts in the same semantic block kind),
`same_query_other_block`, `other_query`. A token covered by windows of several categories counts
once, in the most local one. A window's block is the `segment` label of its first token, from the
call's own structure automaton (fed with the call's output only, as the drafter is); blocks of
different calls compare by their delimiter pair (open, close), the root block with the root block.
A query is one `Query` of the workload (its agent and query ids).

Method (vectorised, numpy): 64-bit polynomial hashes of every k-window (tokens mixed with
splitmix64 first), one stable sort per k; in that order a group of equal windows is in trace order,
so its first member is the first occurrence, (hash, query) groups are contiguous runs, and the
first of each block inside a run takes one pass per block kind; prefix sums over window starts
then count the covered tokens. Every window is checked against its group's first with a second, independent
64-bit hash, and a detected collision re-hashes with other seeds, so a wrong answer needs two
simultaneous 64-bit collisions. A window of length k can only repeat if its prefix of a smaller k
does, so larger ks only look at those windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentspec_sim.drafters.common.structure import segment_many
from agentspec_sim.trace.schema import Workload

CATEGORIES = ("same_block", "same_query_other_block", "other_query")
DEFAULT_KS = (4, 8, 16, 32)

_M64 = (1 << 64) - 1


def _mixed(tokens: np.ndarray, salt: int) -> np.ndarray:
    """Tokens through splitmix64 (salted), so the polynomial hash sees well-spread 64-bit values."""
    z = tokens.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (salt + 1)) & _M64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _base(salt: int) -> np.uint64:
    """An odd 64-bit multiplier per salt."""
    return np.uint64(((0x100000001B3 * (2 * salt + 1)) ^ (0xD6E8FEB86659FD93 * (salt + 7))) & _M64 | 1)


def _window_hashes(x: np.ndarray, k: int, base: np.uint64) -> np.ndarray:
    """Hash of every window x[i:i+k], i in [0, n-k]: Σ x[i+j]·base^(k-1-j) mod 2^64."""
    m = x.shape[0] - k + 1
    h = x[:m].copy()
    for j in range(1, k):
        h *= base
        h += x[j : j + m]
    return h


def _covered(starts: np.ndarray, k: int, n: int) -> int:
    """How many of the n tokens lie in at least one window [s, s+k), s in `starts`."""
    if starts.shape[0] == 0:
        return 0
    is_start = np.zeros(n, dtype=bool)
    is_start[starts] = True
    c = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(is_start, out=c[1:])
    # token t is covered iff a window starts in [t-k+1, t]: c[t+1] - c[max(t-k+1, 0)] > 0
    lo = np.concatenate((np.zeros(min(k - 1, n), dtype=np.int64), c[: n - k + 1]))
    return int(np.count_nonzero(c[1:] != lo))


def _flatten(workload: Workload, token_bytes: Sequence[bytes] | None):
    """Output tokens of the trace in order, with per-token call end, query index and block id."""
    tokens, query_of_call, structures = [], [], []
    for qi, query in enumerate(workload.queries):
        for call in sorted(query.calls, key=lambda c: c.seq):
            out = np.asarray(call.output_tokens)
            if out.shape[0] == 0:
                continue
            if call.structure and token_bytes is None:
                raise ValueError(f"call {call.id!r} has a structure: token_bytes is needed to segment it")
            tokens.append(out)
            query_of_call.append(qi)
            structures.append(call.structure)
    if not tokens:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty, 1
    lens = np.fromiter((t.shape[0] for t in tokens), dtype=np.int64, count=len(tokens))
    # Blocks: segment the calls of each distinct structure together, then map each structure's
    # labels to trace-wide ids keyed by the delimiter pair (the root block is 0).
    blocks: list[np.ndarray] = [None] * len(tokens)  # type: ignore[list-item]
    members: dict = {}
    for i, structure in enumerate(structures):
        members.setdefault(structure, []).append(i)
    block_ids: dict[tuple[str, str] | None, int] = {None: 0}
    for structure, idx in members.items():
        if not structure:
            for i in idx:
                blocks[i] = np.zeros(lens[i], dtype=np.int64)
            continue
        pairs = [None, *(tuple(pair) for group in structure for pair in group)]
        to_global = np.array([block_ids.setdefault(p, len(block_ids)) for p in pairs], dtype=np.int64)
        local = segment_many([tokens[i] for i in idx], token_bytes, structure)
        parts = np.split(to_global[local], np.cumsum(lens[idx])[:-1])
        for i, part in zip(idx, parts, strict=True):
            blocks[i] = part
    ends = np.cumsum(lens)
    return (
        np.concatenate(tokens).astype(np.int64),
        np.repeat(ends, lens),
        np.repeat(np.asarray(query_of_call, dtype=np.int64), lens),
        np.concatenate(blocks),
        len(block_ids),
    )


def _classify(mixes, starts, k, query, block, num_blocks):
    """Sort the k-windows at `starts` (ascending) by content; returns the starts of windows matched
    anywhere earlier, matched earlier in the same query, matched earlier in the same query and
    block, and of windows whose content occurs more than once — or None on a hash collision."""
    (x1, b1), (x2, b2) = mixes
    h = _window_hashes(x1, k, b1)[starts]
    order = np.argsort(h, kind="stable")  # ties keep trace order: a group's first is the earliest
    hs = h[order]
    m = hs.shape[0]
    new_h = np.ones(m, dtype=bool)
    new_h[1:] = hs[1:] != hs[:-1]
    del h, hs
    sorted_starts = starts[order]
    # Every window must equal its group's first under a second, independent hash.
    h2 = _window_hashes(x2, k, b2)[sorted_starts]
    group_start = np.maximum.accumulate(np.where(new_h, np.arange(m), 0))
    if not np.array_equal(h2, h2[group_start]):
        return None
    del h2, group_start
    single = new_h.copy()
    single[:-1] &= new_h[1:]
    # In an equal-content group windows are in trace order, so query indices are non-decreasing:
    # (content, query) groups are contiguous runs.
    qs = query[sorted_starts]
    new_hq = new_h.copy()
    new_hq[1:] |= qs[1:] != qs[:-1]
    if num_blocks == 1:
        new_hqb = new_hq
    else:  # first window of each block in each (content, query) run, one pass per block kind
        gid = np.cumsum(new_hq)
        bs = block[sorted_starts]
        new_hqb = np.zeros(m, dtype=bool)
        for b in np.unique(bs):
            idx = np.flatnonzero(bs == b)
            g = gid[idx]
            first = np.ones(idx.shape[0], dtype=bool)
            first[1:] = g[1:] != g[:-1]
            new_hqb[idx[first]] = True
    return sorted_starts[~new_h], sorted_starts[~new_hq], sorted_starts[~new_hqb], sorted_starts[~single]


def repetition_profile(
    workload: Workload, token_bytes: Sequence[bytes] | None, ks: Sequence[int] = DEFAULT_KS
) -> dict:
    """Figure 5 of the paper for `workload`.

    `token_bytes`: the trace tokenizer's token→bytes map (`TraceTokenizer.token_bytes()`), used to
    find semantic blocks; may be None when no call has a structure.

    Returns `{"output_tokens": N, "calls": C, "queries": Q, "ks": [..],
    "by_k": {k: {"same_block": s, "same_query_other_block": s, "other_query": s, "total": s}},
    "tokens_by_k": {k: {same keys: token counts}}}` with shares in [0, 1] of the N output tokens
    (0.0 when N = 0); the three categories add up to `total`.
    """
    tokens, call_end, query, block, num_blocks = _flatten(workload, token_bytes)
    n = int(tokens.shape[0])
    by_k: dict[int, dict[str, float]] = {}
    counts_by_k: dict[int, dict[str, int]] = {}
    mixes: dict[int, tuple] = {}
    repeated = None  # window starts whose shorter window occurs twice: the only candidates at larger k
    for k in sorted({int(k) for k in ks}):
        if k < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        counts = dict.fromkeys((*CATEGORIES, "total"), 0)
        if n >= k:
            ok = np.arange(n - k + 1) + k <= call_end[: n - k + 1]  # no window crosses a call boundary
            if repeated is not None:
                ok &= repeated[: n - k + 1]
            starts = np.flatnonzero(ok)
            for salt in range(0, 16, 2):
                if salt not in mixes:
                    mixes[salt] = tuple((_mixed(tokens, s), _base(s)) for s in (salt, salt + 1))
                found = _classify(mixes[salt], starts, k, query, block, num_blocks)
                if found is not None:
                    break
            else:  # pragma: no cover - eight double 64-bit collisions
                raise RuntimeError("repetition_profile: hash collisions with every seed")
            any_starts, query_starts, block_starts, multi_starts = found
            repeated = np.zeros(n, dtype=bool)
            repeated[multi_starts] = True
            cover_b = _covered(block_starts, k, n)
            cover_q = _covered(query_starts, k, n)
            cover_any = _covered(any_starts, k, n)
            counts.update(
                same_block=cover_b, same_query_other_block=cover_q - cover_b, other_query=cover_any - cover_q,
                total=cover_any,
            )
        counts_by_k[k] = counts
        by_k[k] = {name: (c / n if n else 0.0) for name, c in counts.items()}
    ks_out = [int(k) for k in ks]
    by_k = {k: by_k[k] for k in ks_out}
    counts_by_k = {k: counts_by_k[k] for k in ks_out}
    return {
        "output_tokens": n,
        "calls": sum(1 for q in workload.queries for c in q.calls),
        "queries": len(workload.queries),
        "ks": ks_out,
        "by_k": by_k,
        "tokens_by_k": counts_by_k,
    }


def workload_repetition(workload: Workload, ks: Sequence[int] = DEFAULT_KS) -> dict:
    """`repetition_profile` with the blocks read by the trace's own tokenizer (none named: no blocks).
    Raises ValueError (`UnknownTokenizerError`) for a tokenizer that does not load."""
    from agentspec_sim.trace.tokenizer import load_tokenizer

    tok = load_tokenizer(workload.meta.tokenizer) if workload.meta.tokenizer else None
    return repetition_profile(workload, tok.token_bytes() if tok is not None else None, ks)


PREMISE_K = 4  # the span length the verdict reads: AgentSpec's lookups match from a few tokens
VERDICT_WORDS = {"holds": "holds", "partly": "holds only partly", "fails": "does not hold"}


def isolation_premise(profile: dict, k: int = PREMISE_K) -> dict:
    """Whether the paper's Figure-5 premise holds on a profile (`repetition_profile`): that repeated text
    comes overwhelmingly from the same block of the same query, the only text AgentSpec drafts from.

    At span length `k` (the smallest profiled length ≥ k, else the largest): `same_block` s against
    `elsewhere` x = same query other block + other query. "holds": s ≥ 2x — isolation gives up little
    reusable text (and keeps out what would be rejected); "partly": x ≤ s < 2x; "fails": s < x — most
    reusable text lies outside the call's block, where agentspec cannot draft from by design while
    suffix, agentspec-r and agentspec+ (other queries' outputs) can. `same_block` also bounds the
    output share agentspec can draft at all (before acceptance). Returns {"k", "same_block",
    "elsewhere", "verdict", "reason"}."""
    ks = sorted(int(x) for x in profile["by_k"])
    if not ks:
        raise ValueError("isolation_premise: the profile has no span lengths")
    at = next((x for x in ks if x >= k), ks[-1])
    row = profile["by_k"][at]
    same, elsewhere = row["same_block"], row["same_query_other_block"] + row["other_query"]
    if same >= 2 * elsewhere:
        verdict, reason = "holds", "repeats come mostly from the same block: isolation loses little reusable text"
    elif same >= elsewhere:
        verdict, reason = "partly", ("a third or more of the repeats are outside the call's block (other blocks or "
                                     "queries): isolation gives them up")
    else:
        verdict, reason = "fails", ("most repeats are outside the call's block (other queries/blocks): AgentSpec "
                                    "cannot draft them by design; suffix, agentspec-r and agentspec+ can")
    return {"k": at, "same_block": same, "elsewhere": elsewhere, "verdict": verdict, "reason": reason}


def premise_sentence(premise: dict) -> str:
    """`isolation_premise`'s result in words: "holds at k = 4: 41.2% same block vs 0.4% elsewhere; …"."""
    return (f"{VERDICT_WORDS[premise['verdict']]} at k = {premise['k']}: {100 * premise['same_block']:.1f}% same "
            f"block vs {100 * premise['elsewhere']:.1f}% elsewhere; {premise['reason']}.")


__all__ = ["CATEGORIES", "DEFAULT_KS", "PREMISE_K", "isolation_premise", "premise_sentence", "repetition_profile",
           "workload_repetition"]
