"""Where a workload's calls go in the engine's call table: rows, ids, lengths, the token arena and the
prefix-hash regions — everything a run's table takes from the workload and a few engine settings.

`call_layout` makes it once per (workload, settings) and keeps the last workload's layouts: a sweep's
worker runs many cells over one workload that differ in max_num_seqs or the drafter only, and this is
a pass over every call in Python (~0.1 s on the default trace's 9,662 calls). Workloads are immutable
and compared by identity; the memo holds the last one (a layout refers to its calls and tokens anyway)
until another is laid out. A layout is never written to; each run builds its own table and call
states from it (engine/simulator.py `_build`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentspec_sim.engine.request import NO_NEXT, NOT_CHAINED
from agentspec_sim.trace.schema import Call, Workload


@dataclass(frozen=True)
class CallLayout:
    """Rows in engine order: each tenant's copy of each query's calls, in order."""

    calls: list[Call]
    ids: list[str]  # call ids, "#tenant" appended for copies
    query_of: list[int]  # row → its query instance
    position: list[int]  # row → its position in its query
    queries: list[tuple[str, int]]  # query instance → (its id, tenant)
    columns: dict[str, np.ndarray]  # int64 prompt_len, target_len, tenant, chain_next, hist_off, hreg
    tokens: np.ndarray  # int32 token arena: row i's prompt + output at hist_off[i]
    region_caps: np.ndarray  # int64 blocks of each prefix-hash region
    blocks_needed: np.ndarray  # int64 KV blocks each row needs for its prompt and output
    first_empty: int  # the first row whose recorded output is empty (no run can replay it), −1: none

    @functools.cached_property
    def tokens_digest(self) -> bytes:
        """A digest of the arena's bytes: what drafter tables' keys hash instead of its ~20 MB every run
        (made when a drafter with a table first asks; `normal` never does)."""
        return hashlib.blake2b(self.tokens.tobytes(), digest_size=20).digest()


_MEMO: dict[str, Any] = {"workload": None, "layouts": {}}


def call_layout(workload: Workload, replicate: int, max_model_len: int, block_size: int,
                think_time: float | None) -> CallLayout:
    """The layout of `workload` under these settings (the last workload's are kept: see the module doc)."""
    if _MEMO["workload"] is not workload:
        _MEMO["workload"], _MEMO["layouts"] = workload, {}
    key = (replicate, max_model_len, block_size, think_time)
    layouts = _MEMO["layouts"]
    if key not in layouts:
        layouts[key] = _make_layout(workload, *key)
    return layouts[key]


def _make_layout(workload: Workload, replicate: int, max_len: int, bs: int, think_time: float | None) -> CallLayout:
    calls: list[Call] = []
    columns: dict[str, list[int]] = {"prompt_len": [], "target_len": [], "tenant": [], "chain_next": []}
    ids: list[str] = []
    query_of: list[int] = []
    position: list[int] = []
    queries: list[tuple[str, int]] = []
    first_empty = -1
    for tenant in range(replicate):
        suffix = "" if tenant == 0 else f"#{tenant}"
        for query in workload.queries:
            first = len(calls)
            for k, call in enumerate(query.calls):
                if call.output_len == 0 and first_empty < 0:
                    first_empty = len(calls)
                calls.append(call)
                ids.append(f"{call.id}{suffix}")
                query_of.append(len(queries))
                position.append(k)
                columns["prompt_len"].append(call.prompt_len)
                columns["target_len"].append(max(0, min(call.output_len, max_len - call.prompt_len)))
                columns["tenant"].append(tenant)
                columns["chain_next"].append(_chain_next(query.calls, k, first + k + 1, max_len, think_time))
            queries.append((f"{query.query_id}{suffix}", tenant))
    hist_off, tokens = _token_arena(calls, columns["target_len"])
    cols = {k: np.asarray(v, dtype=np.int64) for k, v in columns.items()}
    # Calls of one tenant whose tokens start at the same place of the arena share block hashes.
    region_of: dict[tuple[int, int], int] = {}
    hreg = np.empty(len(calls), dtype=np.int64)
    caps: list[int] = []
    blocks = ((cols["prompt_len"] + cols["target_len"]) // bs + 1).tolist()
    for i, (tenant, off) in enumerate(zip(columns["tenant"], hist_off.tolist(), strict=True)):
        region = region_of.setdefault((tenant, off), len(caps))
        if region == len(caps):
            caps.append(blocks[i])
        else:
            caps[region] = max(caps[region], blocks[i])
        hreg[i] = region
    needed = -((cols["prompt_len"] + cols["target_len"]) // -bs)
    return CallLayout(calls, ids, query_of, position, queries, {**cols, "hist_off": hist_off, "hreg": hreg},
                      tokens, np.asarray(caps, dtype=np.int64), needed, first_empty)


def next_arrival_s(finish_s: float, nxt: Call, think_time: float | None, offset_s: float) -> float:
    """The agent workflow between two calls of a query: the next call arrives its think time after the previous
    one finished (`think_time` when set, else the trace's `think_s`), never before its recorded `arrival_s`
    (shifted by the query's `offset_s`, the send time the load protocol gave it)."""
    arrival = finish_s + (think_time if think_time is not None else nxt.think_s)
    if nxt.arrival_s is not None:
        arrival = max(arrival, nxt.arrival_s + offset_s)
    return arrival


def arrives_at_finish(nxt: Call, think_time: float | None) -> bool:
    """`next_arrival_s` is the finish instant itself, whatever it is: no think time, no recorded arrival."""
    return (think_time if think_time is not None else nxt.think_s) == 0.0 and nxt.arrival_s is None


def _chain_next(calls: tuple[Call, ...], k: int, next_row: int, max_len: int, think_time: float | None) -> int:
    """chain_next of a query's k-th call: the next call's row if it arrives the instant this one ends (the
    compiled loop then queues it inside a run of steps) and is not refused at max_model_len."""
    if k + 1 == len(calls):
        return NO_NEXT
    nxt = calls[k + 1]
    if arrives_at_finish(nxt, think_time) and nxt.prompt_len < max_len:
        return next_row
    return NOT_CHAINED


def _token_arena(calls: list[Call], targets: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(offset of each call's prompt + recorded output, the arena holding them).

    Traces loaded from files lay every call's prompt and output side by side in one int32 buffer
    (trace/io.py); that buffer is read in place. Calls laid out otherwise get a copy appended.
    """
    offsets = np.empty(len(calls), dtype=np.int64)
    base: np.ndarray | None = None
    base_ptr = 0
    copies: list[np.ndarray] = []
    seen: dict[int, int] = {}
    copied = 0
    for i, call in enumerate(calls):
        key = id(call)
        if key in seen:  # a replicate copy: the same tokens
            offsets[i] = seen[key]
            continue
        p, o = call.prompt_tokens, call.output_tokens
        owner = p.base
        if base is None and isinstance(owner, np.ndarray) and owner.dtype == np.int32 and owner.ndim == 1 \
                and owner.flags.c_contiguous:
            base, base_ptr = owner, owner.__array_interface__["data"][0]
        p_ptr = p.__array_interface__["data"][0]
        if (owner is base and base is not None and o.base is base and p.dtype == np.int32 and o.dtype == np.int32
                and p.flags.c_contiguous and o.flags.c_contiguous
                and o.__array_interface__["data"][0] == p_ptr + 4 * p.shape[0]):
            offsets[i] = (p_ptr - base_ptr) // 4
        else:
            piece = np.concatenate([p, o[:targets[i]]]).astype(np.int32)
            offsets[i] = -1 - copied  # fixed below, once the base's length is known
            copies.append(piece)
            copied += piece.shape[0]
        seen[key] = int(offsets[i])
    head = base if base is not None else np.zeros(0, dtype=np.int32)
    if copies:
        copy_off = np.concatenate([[0], np.cumsum([c.shape[0] for c in copies])[:-1]])
        starts = {-1 - int(s): head.shape[0] + int(s) for s in copy_off}
        offsets = np.array([starts[o] if o < 0 else o for o in offsets.tolist()], dtype=np.int64)
        return offsets, np.concatenate([head, *copies])
    return offsets, head


__all__ = ["CallLayout", "call_layout"]
