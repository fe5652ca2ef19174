"""AgentSpec's redundancy-aware budget allocation (paper §4.2, Algorithm 2, equations 1–3): a step's draft
budget split over its calls by the redundancy of their candidates, and the break-even depth that caps a draft
(docs/agentspec.md §3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from agentspec_sim.drafters.agentspec.block_index import (
    META_C,
    META_CT,
    META_MATCH,
    META_N,
    META_P,
)

if TYPE_CHECKING:
    pass

# --------------------------------------------------------------------------------------------
# Redundancy-aware budget allocation (Algorithm 2).


def saturation(n: np.ndarray | int, g_min: float) -> np.ndarray:
    """p(n) = g_min + (1 − g_min)(1 − e^{1−n}) (paper equation 1; p(1) = g_min, p → 1 as n grows).

    Algorithm 2 in the paper's appendix writes e^{−n}; equation 1 is followed here."""
    n = np.asarray(n, dtype=np.float64)
    return g_min + (1.0 - g_min) * (1.0 - np.exp(1.0 - n))


def redundancy_score(c: np.ndarray | int, n: np.ndarray | int, g_min: float) -> np.ndarray:
    """g = (c/n)·p(n); 0 where n = 0."""
    c = np.asarray(c, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    safe = np.maximum(n, 1.0)
    return np.where(n > 0, c / safe * saturation(safe, g_min), 0.0)


def batch_budget(alpha: float, bz: int) -> int:
    """B_t = ⌊α / bz⌋ (paper equation 2); 0 for an empty batch."""
    return math.floor(alpha / bz) if bz > 0 else 0


@dataclass(frozen=True)
class Candidates:
    """One step's candidate summaries, one entry per drafting call: n (candidates), c (agreeing
    with CT*), ct_len (|CT*|). Integer arrays of equal length."""

    n: np.ndarray
    c: np.ndarray
    ct_len: np.ndarray

    @classmethod
    def of(cls, n, c, ct_len) -> Candidates:
        return cls(np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64), np.asarray(ct_len, dtype=np.int64))


def allocate(cands: Candidates, budget: int, g_min: float) -> np.ndarray:
    """Per-call draft lengths L_i = max(|CT_i*|, B·g_i/Σg) for a total budget B (paper equation 3).

    Calls with n_i = 0 get 0. The shares B·g_i/Σg are made integers by largest remainder (the
    floors, then +1 to the largest fractional parts, ties to the earlier call), so they add up to
    B exactly when Σg > 0. Works with any B ≥ 0: ⌊α/bz⌋ (AgentSpec) or M(b) (AgentSpec+)."""
    out = np.zeros(cands.n.shape[0], dtype=np.int64)
    _allocate(cands.n, cands.c, cands.ct_len, int(budget), float(g_min), out)
    return out


@njit(cache=True, nogil=True)
def _allocate(n, c, ct, budget, g_min, out):
    """`allocate`'s kernel (`_allocate_into` with its own work space)."""
    k = n.shape[0]
    fwork = np.empty((2, k))
    iwork = np.empty((3, k), dtype=np.int64)
    _allocate_into(n, c, ct, budget, g_min, out, fwork, iwork, n, 0)


@njit(cache=True, nogil=True)
def _allocate_into(n, c, ct, budget, g_min, out, fwork, iwork, match, strong_match):
    """g by equation 1 (as `redundancy_score`), shares by largest remainder; allocates nothing (the
    engine's compiled loop calls it): fwork float64 [2, ≥ k], iwork int64 [3, ≥ k]. A row whose match
    is shorter than `strong_match` tokens (match[i]) is low-support evidence whatever its n: its
    saturation term is the floor g_min, g = (c/n)·g_min (0: every row by equation 1)."""
    k = n.shape[0]
    g, frac = fwork[0], fwork[1]
    shares, order, tmp = iwork[0], iwork[1], iwork[2]
    total = 0.0
    for i in range(k):
        g[i] = 0.0
        shares[i] = 0
        if n[i] > 0 and ct[i] >= 0:  # ct < 0: a row without candidates for this step (`capped_lengths`)
            support = g_min if match[i] < strong_match else g_min + (1.0 - g_min) * (1.0 - np.exp(1.0 - n[i]))
            g[i] = c[i] / n[i] * support
            total += g[i]
    if total > 0 and budget > 0:
        given = 0
        for i in range(k):
            frac[i] = -1.0
            exact = budget * g[i] / total
            shares[i] = np.int64(np.floor(exact))
            given += shares[i]
            if g[i] > 0:
                frac[i] = exact - shares[i]
        left = budget - given
        if left > 0:
            _order_descending(frac, k, order, tmp)  # stable: equal fractions keep row order
            for j in range(min(left, k)):
                shares[order[j]] += 1
    for i in range(k):
        out[i] = 0 if n[i] <= 0 or ct[i] < 0 else max(ct[i], shares[i])


@njit(cache=True, nogil=True)
def _order_descending(keys, k, order, tmp):
    """order[:k] = the indices of keys[:k] by decreasing key, equal keys in index order (a stable
    bottom-up merge sort: the permutation `np.argsort(-keys, kind="stable")` gives), into `order`."""
    for i in range(k):
        order[i] = i
    src, dst = order, tmp
    passes = 0
    width = 1
    while width < k:
        for lo in range(0, k, 2 * width):
            mid = min(lo + width, k)
            hi = min(lo + 2 * width, k)
            i, j, o = lo, mid, lo
            while i < mid and j < hi:
                if keys[src[j]] > keys[src[i]]:
                    dst[o] = src[j]
                    j += 1
                else:
                    dst[o] = src[i]
                    i += 1
                o += 1
            while i < mid:
                dst[o] = src[i]
                i += 1
                o += 1
            while j < hi:
                dst[o] = src[j]
                j += 1
                o += 1
        src, dst = dst, src
        passes += 1
        width *= 2
    if passes % 2 == 1:
        for i in range(k):
            order[i] = tmp[i]


@njit(cache=True, nogil=True)
def break_even_depth(g, tau, k):
    """The deepest draft position j ≤ k whose estimated acceptance g^j still pays its verification,
    g^j ≥ τ (`cost/break_even.py`): ⌊ln τ / ln g⌋; k when τ ≤ 0 (no cost bound) or g ≥ 1; 0 when g ≤ 0."""
    if tau <= 0.0 or g >= 1.0:
        return k
    if g <= 0.0 or tau >= 1.0:
        return 0
    return min(k, np.int64(math.floor(math.log(tau) / math.log(g) + 1e-9)))


@njit(cache=True, nogil=True)
def capped_lengths(meta, max_lens, budget, g_min, k, budgeted, ct_min, single_ct_only, tau, out, fwork, iwork):
    """`_AgentSpecBase.lengths`: out = min(allocate(n, c, |CT*|) or k, |P|, max_lens, k), where a match
    shorter than `ct_min` is weak: it counts no CT* (it drafts from its budget share alone), its g has
    the floor g_min for saturation, and it drafts only in a loose step, τ ≤ g_min^ct_min (else it has no
    candidates); a one-candidate row drafts only its CT* when `single_ct_only`, and with τ > 0
    (batch-aware drafting) at most `break_even_depth(g_i, τ)`; fwork float64 [2, ≥ m], iwork int64
    [4, ≥ m]: work space (fwork[0] holds each row's g after the allocation)."""
    if budgeted:
        m = meta.shape[0]
        # Weak matches draft where even their best estimate, g_min, pays for a draft as long as the match
        # a strong one needs: where verification is nearly free.
        loose = tau <= g_min ** ct_min
        ct = iwork[3, :m]
        for i in range(m):
            if meta[i, META_MATCH] >= ct_min:
                ct[i] = meta[i, META_CT]
            else:  # weak: no CT* beyond its share, and in a strict step no candidates at all (ct < 0)
                ct[i] = 0 if loose else -1
        _allocate_into(meta[:, META_N], meta[:, META_C], ct, budget, g_min, out, fwork, iwork, meta[:, META_MATCH],
                       ct_min)
    else:
        out[:] = k
    for i in range(out.shape[0]):
        out[i] = min(min(out[i], meta[i, META_P]), min(max_lens[i], k))
        if budgeted and single_ct_only and meta[i, META_N] == 1:
            out[i] = min(out[i], max(iwork[3, i], 0))
        if budgeted and tau > 0.0 and out[i] > 0:
            out[i] = min(out[i], break_even_depth(fwork[0, i], tau, k))


__all__ = ["Candidates", "allocate", "batch_budget", "break_even_depth", "capped_lengths", "redundancy_score",
           "saturation"]
