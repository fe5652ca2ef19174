"""The acceptance model's feature streams and its process (drafters/model/rule.py): the copy / code feature of
every output position of some calls, computed exactly as the drafter computes them (`build_streams`); the
expected number of steps and of steps accepting ≥ i + 1 drafts a call produces (`expected_counts`, a forward
recursion over step-start positions: what a replay measures, without sampling noise); the same process with the
drafter's counter-based draws (`sample_steps`), for synthetic data and checks."""


from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from agentspec_sim.drafters.common.structure import segment, token_bytes_of
from agentspec_sim.drafters.model.rule import (
    AcceptanceParams,
    accepted_prefix,
    call_key,
    copy_stream,
    structure_of,
)
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace
from agentspec_sim.trace.schema import Call, Workload

# --------------------------------------------------------------------------------------------
# Feature streams


@dataclass(frozen=True)
class Streams:
    """Features of the output positions of some calls, concatenated: call c owns
    [offsets[c], offsets[c+1]); `copy` / `code` are int8 per output position."""

    call_ids: tuple[str, ...]
    offsets: np.ndarray
    copy: np.ndarray
    code: np.ndarray
    categories: tuple[str | None, ...] = ()

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def index(self) -> dict[str, int]:
        return {cid: i for i, cid in enumerate(self.call_ids)}

    def subset(self, rows: Sequence[int]) -> Streams:
        rows = list(rows)
        lens = np.diff(self.offsets)[rows]
        offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        pick = np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in rows]) if rows else \
            np.zeros(0, dtype=np.int64)
        cats = tuple(self.categories[r] for r in rows) if self.categories else ()
        return Streams(tuple(self.call_ids[r] for r in rows), offsets, self.copy[pick], self.code[pick], cats)


def call_features(call: Call, token_bytes: Sequence[bytes] | None) -> tuple[np.ndarray, np.ndarray]:
    """(copy, code) of each output position of `call`, as the drafter computes them."""
    full = np.concatenate([call.prompt_tokens, call.output_tokens]).astype(np.int32)
    copy = np.zeros(call.output_len, dtype=np.int8)
    copy_stream(full, call.prompt_len, copy)
    if token_bytes is None:
        code = np.zeros(call.output_len, dtype=np.int8)
    else:
        size = len(token_bytes)
        ids = call.output_tokens
        if ids.size and (int(ids.max()) >= size or int(ids.min()) < 0):
            ids = np.where((ids >= 0) & (ids < size), ids, 0)  # unknown ids: no bytes (as the drafter)
        code = (segment(ids, token_bytes, structure_of(call.structure)) != 0).astype(np.int8)
    return copy, code


def build_streams(calls: Iterable[Call], tokenizer: str | None = "qwen3") -> Streams:
    """Feature streams of `calls` (tokenizer: the trace's, for the code feature; None turns it off)."""
    calls = list(calls)
    table = token_bytes_of(tokenizer) if tokenizer else None
    copies, codes = [], []
    for c in calls:
        cp, cd = call_features(c, table)
        copies.append(cp)
        codes.append(cd)
    lens = np.fromiter((c.output_len for c in calls), dtype=np.int64, count=len(calls))
    offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    cats = tuple((c.extra or {}).get("category") for c in calls)
    return Streams(tuple(c.id for c in calls), offsets,
                   np.concatenate(copies) if copies else np.zeros(0, np.int8),
                   np.concatenate(codes) if codes else np.zeros(0, np.int8), cats)


def workload_streams(workload: Workload) -> Streams:
    return build_streams(workload.calls, workload.meta.tokenizer)


# MT-Bench inside the bundled Spec-Bench trace: its first 80 questions (ids 81–160, two turns each).
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
REFERENCE_STREAM = "traces/spec-bench.jsonl.zst, MT-Bench calls (question ids 81-160, both turns)"


def reference_streams() -> Streams:
    """The representative stream the bundled parameters are calibrated on: MT-Bench answers
    (Vicuna-7B, greedy, Qwen3 tokens) from the bundled Spec-Bench trace."""
    workload = load_trace(bundled_trace("spec-bench.jsonl.zst"))
    calls = [c for c in workload.calls if (c.extra or {}).get("category") in MT_BENCH_CATEGORIES]
    return build_streams(calls, workload.meta.tokenizer)


# --------------------------------------------------------------------------------------------
# The process: exact expectations and sampling


@njit(cache=True, nogil=True)
def _walk(copy, code, offsets, a, b_copy, b_code, k, out):
    last = a.shape[0] - 1
    for c in range(offsets.shape[0] - 1):
        lo = offsets[c]
        length = offsets[c + 1] - lo
        if length <= 1:
            continue
        v = np.zeros(length + 1)
        v[1] = 1.0
        for t in range(1, length):
            w = v[t]
            if w == 0.0:
                continue
            out[c, 0] += w
            m = min(k, length - t)
            cum = 1.0
            for j in range(m):
                z = a[min(j, last)] + b_copy * copy[lo + t + j] + b_code * code[lo + t]
                p = 1.0 / (1.0 + math.exp(-z))
                nxt = cum * p
                v[t + j + 1] += w * (cum - nxt)  # exactly j accepted: j + 1 tokens emitted
                out[c, j + 1] += w * nxt
                cum = nxt
            v[min(t + min(m + 1, length - t), length)] += w * cum


def expected_counts(streams: Streams, params: AcceptanceParams, k: int) -> np.ndarray:
    """E[steps] and E[steps accepting ≥ i+1], i < k, per call: a (num_calls, k+1) array."""
    out = np.zeros((streams.num_calls, k + 1))
    _walk(streams.copy, streams.code, streams.offsets, params.a, params.coefficient("copy"),
          params.coefficient("code"), k, out)
    return out


@njit(cache=True, nogil=True)
def _sample(copy, code, offsets, keys, a, b_copy, b_code, k, acc, owner):
    s = 0
    for c in range(offsets.shape[0] - 1):
        lo = offsets[c]
        length = offsets[c + 1] - lo
        t = 1
        while t < length:
            m = min(k, length - t)
            j = accepted_prefix(a, b_copy, b_code, copy[lo + t:lo + t + m], int(code[lo + t]), keys[c], t, k)
            acc[s] = j
            owner[s] = c
            s += 1
            t += min(j + 1, length - t)
    return s


def sample_steps(streams: Streams, params: AcceptanceParams, k: int, seed: int = 0) -> list[np.ndarray]:
    """Per-call accepted counts of every step, drawn as the drafter draws them (same seed ⇒ same)."""
    keys = np.fromiter((call_key(seed, cid) for cid in streams.call_ids), dtype=np.uint64, count=streams.num_calls)
    total = int(np.diff(streams.offsets).clip(min=0).sum()) + 1
    acc = np.zeros(total, dtype=np.int64)
    owner = np.zeros(total, dtype=np.int64)
    s = _sample(streams.copy, streams.code, streams.offsets, keys, params.a, params.coefficient("copy"),
                params.coefficient("code"), k, acc, owner)
    acc, owner = acc[:s], owner[:s]
    bounds = np.searchsorted(owner, np.arange(streams.num_calls + 1))
    return [acc[bounds[c]:bounds[c + 1]] for c in range(streams.num_calls)]
