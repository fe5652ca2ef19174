"""The engine's state of call instances (LLM requests), as vLLM's `Request` holds it.

Token bookkeeping follows vLLM V1: `num_tokens` = prompt + emitted tokens, `num_computed` = tokens
whose KV is written. A decode request has `num_computed == num_tokens − 1` (the last sampled token is
fed in the next step); a request with `num_computed < num_tokens − 1` is (re)prefilling.

Storage is struct-of-arrays: a `CallTable` keeps one row per call instance in numpy arrays (what the
compiled engine steps in `scheduler.py` and `kv.py` read and write), and a `CallState` is a small
handle on one row with the attributes drafters, tests and the simulator use. A `CallState` made on
its own (`CallState(index, call, ...)`) gets a private one-row table; the KV manager adopts it into
its own table the first time it handles it (`CallTable.adopt`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from agentspec_sim.engine.counters import CT_FREE_SLOTS
from agentspec_sim.trace.schema import Call

WAITING, RUNNING, FINISHED, REFUSED, SKIPPED = "waiting", "running", "finished", "refused", "skipped"
STATUS_NAMES = (WAITING, RUNNING, FINISHED, REFUSED, SKIPPED)
STATUS_CODES = {name: code for code, name in enumerate(STATUS_NAMES)}
S_WAITING, S_RUNNING, S_FINISHED, S_REFUSED, S_SKIPPED = range(5)
NO_NEXT = -2  # chain_next: the call is the last of its query
NOT_CHAINED = -1  # chain_next: the next call arrives through the event loop (think time, recorded arrival, refusal)
_EMPTY = np.zeros(0, dtype=np.int32)

# Per-call columns of a CallTable: (name, dtype, initial value).
CALL_COLUMNS: tuple[tuple[str, type, Any], ...] = (
    ("prompt_len", np.int64, 0),
    ("target_len", np.int64, 0),  # tokens vLLM emits: the recording, capped at max_model_len
    ("tenant", np.int64, 0),
    ("hist_off", np.int64, 0),  # offset of prompt + recorded output in `tokens`
    ("hreg", np.int64, 0),  # hash region: calls whose tokens start at the same place share block hashes
    ("chain_next", np.int64, NO_NEXT),  # row of the query's next call when it arrives the instant this one ends
    ("num_emitted", np.int64, 0),
    ("num_computed", np.int64, 0),
    ("status", np.int8, S_WAITING),
    ("decoding", np.bool_, False),  # running and past its (re)prefill: its next step verifies
    ("started", np.bool_, False),  # has emitted its first token (the drafter's start_call ran)
    ("prefix_hit_tokens", np.int64, 0),
    ("drafted", np.int64, 0),
    ("accepted", np.int64, 0),
    ("draft_steps", np.int64, 0),
    ("decode_steps", np.int64, 0),
    ("preemptions", np.int64, 0),
    ("num_cached_blocks", np.int64, 0),
    ("draft_len", np.int64, 0),  # length of the drafts waiting to be scheduled (in slot_drafts)
    ("draft_acc", np.int64, -1),  # how many of them the recording accepts (`Scheduler.set_drafts`), −1 unknown
    ("slot", np.int64, -1),  # row of `slot_blocks` holding its block ids, −1 when it holds none
    ("first_step", np.int64, -1),  # engine step that emitted its first token
    ("not_before", np.int64, 0),  # the first engine step whose schedule may admit it (the scheduler's lag)
    ("arrival_s", np.float64, np.nan),
    ("first_token_s", np.float64, np.nan),
    ("finish_s", np.float64, np.nan),
)


def zeros(shape, dtype=np.int64) -> np.ndarray:
    """`np.zeros` with its memory written. Reading pages that were never written (what a large
    `np.zeros` hands out) costs ~100 ns per element on some VMs, ~400× a normal read; the engine's
    kernels read their arrays sparsely (hash table, block table), so every array is filled once."""
    out = np.empty(shape, dtype=dtype)
    out.fill(0)
    return out


CALL = np.dtype([(name, dtype) for name, dtype, _ in CALL_COLUMNS], align=True)
REGION = np.dtype([("off", np.int64), ("cap", np.int64), ("n", np.int64)], align=True)
SLOT = np.dtype([("nblocks", np.int64), ("free", np.int64)], align=True)


class Calls(NamedTuple):
    """A CallTable's arrays as the compiled engine steps take them (one tuple argument; numba reads
    field f of record array a as `a.f[i]`)."""

    calls: np.ndarray  # [calls] CALL: CALL_COLUMNS (the times are the event loop's alone)
    tokens: np.ndarray  # int32: every call's prompt + recorded output, at hist_off
    hashes: np.ndarray  # int64: block hashes, region r's at regions.off[r] (0 = not computed)
    nodes: np.ndarray  # int64: the block pool's node of each hash (kv.py)
    regions: np.ndarray  # [regions] REGION: off, cap (blocks it can hold), n (hashes computed so far)
    slots: np.ndarray  # [slots] SLOT: nblocks (of slot_blocks' row), free (unused slots, ctr[CT_FREE_SLOTS] of them)
    slot_blocks: np.ndarray  # int32 [slots, max blocks per call]: block ids, head → tail
    slot_drafts: np.ndarray  # int32 [slots, longest draft]: the drafts of the call holding the slot
    ctr: np.ndarray  # int64 counters: [free slots]


def _call_records(n: int) -> np.ndarray:
    out = zeros(n, dtype=CALL)
    for name, _, init in CALL_COLUMNS:
        if init:
            out[name] = init
    return out


class CallTable:
    """Rows of call instances in a numpy record array, plus their `CallState` handles.

    Built in bulk by the simulator (`CallTable.build`) or grown row by row (`adopt`). `cols` maps
    each column to a view of the records; `nt` is the `Calls` tuple the compiled steps take. Both
    are rebuilt whenever an array is reallocated.
    """

    def __init__(self, capacity: int = 4, slots: int = 1, blocks_per_slot: int = 1) -> None:
        self.rows = 0
        self.capacity = max(1, capacity)
        self.calls = _call_records(self.capacity)
        self.tokens = zeros(0, dtype=np.int32)
        self.hashes = zeros(0, dtype=np.int64)
        self.nodes = zeros(0, dtype=np.int64)
        self.regions = zeros(0, dtype=REGION)
        slots = max(1, slots)
        self.slots = zeros(slots, dtype=SLOT)
        self.slots["free"] = np.arange(slots - 1, -1, -1)  # pops slot 0 first
        self.slot_blocks = zeros((slots, max(1, blocks_per_slot)), dtype=np.int32)
        self.slot_drafts = zeros((slots, 8), dtype=np.int32)
        self.ctr = np.array([slots], dtype=np.int64)
        self.handles: list[CallState | None] = []
        self._refresh()

    def _refresh(self) -> None:
        self.cols: dict[str, np.ndarray] = {name: self.calls[name] for name, _, _ in CALL_COLUMNS}
        self.nt = Calls(self.calls, self.tokens, self.hashes, self.nodes, self.regions, self.slots, self.slot_blocks,
                        self.slot_drafts, self.ctr)

    @property
    def hreg_off(self) -> np.ndarray:
        return self.regions["off"]

    @property
    def hreg_n(self) -> np.ndarray:
        return self.regions["n"]

    @property
    def slot_nblocks(self) -> np.ndarray:
        return self.slots["nblocks"]

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, columns: dict[str, np.ndarray], tokens: np.ndarray, region_caps: np.ndarray,
              slots: int, blocks_per_slot: int) -> CallTable:
        """A table with one row per entry of `columns` (any CALL_COLUMNS; the rest take their initial
        value), the token arena `tokens` and one hash region per entry of `region_caps` (in blocks)."""
        n = len(next(iter(columns.values())))
        table = cls(n, slots, blocks_per_slot)
        table.rows = n
        for name, values in columns.items():
            table.calls[name][:n] = values
        table.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        table._set_regions(np.asarray(region_caps, dtype=np.int64))
        table.handles = [None] * n
        table._refresh()
        return table

    def _set_regions(self, caps: np.ndarray) -> None:
        self.regions = zeros(caps.shape[0], dtype=REGION)
        self.regions["cap"] = caps
        if caps.size:
            self.regions["off"][1:] = np.cumsum(caps)[:-1]
        self.hashes = zeros(int(caps.sum()), dtype=np.int64)
        self.nodes = zeros(int(caps.sum()), dtype=np.int64)

    def adopt(self, state: CallState) -> None:
        """Move `state` (a row of another table, usually its private one) into this table."""
        old, r = state._t, state._r
        if old is self:
            return
        if old.calls["slot"][r] >= 0:
            raise ValueError(f"call {state.call_id!r} holds KV blocks in another table")
        row = self.rows
        if row == self.capacity:
            self.capacity *= 2
            grown = _call_records(self.capacity)
            grown[:row] = self.calls[:row]
            self.calls = grown
        self.calls[row] = old.calls[r]
        # The token arena holds the recording (prompt + output up to target), the region its hashes.
        recording = np.concatenate([state.call.prompt_tokens, state.call.output_tokens[:state.target_len]])
        self.calls["hist_off"][row] = self.tokens.shape[0]
        self.tokens = np.concatenate([self.tokens, recording.astype(np.int32)])
        cap = recording.shape[0] + 1
        region = np.zeros(1, dtype=REGION)
        region["off"], region["cap"] = self.hashes.shape[0], cap
        self.calls["hreg"][row] = self.regions.shape[0]
        self.regions = np.concatenate([self.regions, region])
        self.hashes = np.concatenate([self.hashes, zeros(cap, dtype=np.int64)])
        self.nodes = np.concatenate([self.nodes, zeros(cap, dtype=np.int64)])
        self.rows += 1
        self.handles.append(state)
        state._t, state._r = self, row
        self._refresh()

    def reserve_slots(self, slots: int, blocks_per_slot: int) -> None:
        """At least `slots` block-table rows of at least `blocks_per_slot` entries."""
        have, width = self.slot_blocks.shape
        if have >= slots and width >= blocks_per_slot:
            return
        new_slots, new_width = max(have, slots), max(width, blocks_per_slot)
        blocks = zeros((new_slots, new_width), dtype=np.int32)
        blocks[:have, :width] = self.slot_blocks
        drafts = zeros((new_slots, self.slot_drafts.shape[1]), dtype=np.int32)
        drafts[:have] = self.slot_drafts
        records = zeros(new_slots, dtype=SLOT)
        records["nblocks"][:have] = self.slots["nblocks"]
        free = int(self.ctr[CT_FREE_SLOTS])
        added = np.arange(new_slots - 1, have - 1, -1, dtype=np.int64)
        records["free"][:added.shape[0]] = added
        records["free"][added.shape[0]:added.shape[0] + free] = self.slots["free"][:free]
        self.slot_blocks, self.slot_drafts, self.slots = blocks, drafts, records
        self.ctr[CT_FREE_SLOTS] = free + added.shape[0]
        self._refresh()

    def reserve_draft_width(self, length: int) -> None:
        """Room for drafts of `length` tokens in `slot_drafts`."""
        slots, width = self.slot_drafts.shape
        if length <= width:
            return
        grown = zeros((slots, max(length, 2 * width)), dtype=np.int32)
        grown[:, :width] = self.slot_drafts
        self.slot_drafts = grown
        self._refresh()

    def status_names(self) -> list[str]:
        return [STATUS_NAMES[c] for c in self.calls["status"][:self.rows].tolist()]


def _column(name: str, cast: type) -> property:
    def get(self: CallState) -> Any:
        return cast(self._t.cols[name][self._r])

    def set_(self: CallState, value: Any) -> None:
        self._t.cols[name][self._r] = value

    return property(get, set_, doc=f"`{name}` of this call's table row.")


class CallState:
    """One call instance: a trace `Call` run by tenant `tenant` (a replicate copy), index `index`.

    `history` holds the prompt and (in the engine) the recorded output; drafters read `tokens`
    (the valid prefix) only, since everything past `num_tokens` is the answer.
    """

    __slots__ = ("_r", "_t", "call", "call_id", "drafter_state", "draw_id", "index", "last_in_query", "output_len",
                 "prompt_len", "query_index", "target_len", "tenant")

    def __init__(self, index: int, call: Call, call_id: str, tenant: int, query_index: int, target_len: int) -> None:
        table = CallTable(1)
        table.rows = 1
        history = np.empty(call.prompt_len + target_len, dtype=np.int32)
        history[:call.prompt_len] = call.prompt_tokens
        table.tokens = history
        table._set_regions(np.array([history.shape[0] + 1], dtype=np.int64))
        row = table.calls[0]
        row["prompt_len"], row["target_len"], row["tenant"] = call.prompt_len, target_len, tenant
        table.handles = [self]
        table._refresh()
        self._bind(table, 0, index, call, call_id, tenant, query_index, target_len)

    @classmethod
    def in_table(cls, table: CallTable, calls: Sequence[Call], call_ids: Sequence[str],
                 query_of: Sequence[int], draw_ids: Sequence[str] | None = None) -> list[CallState]:
        """The handles of rows 0 … len(calls) − 1 of `table` (built by `CallTable.build`): row r runs
        calls[r] as call_ids[r], of query instance query_of[r], drawing randomness as draw_ids[r]
        (default: its call id; identical copies of one call draw alike, engine/load.py)."""
        n = len(calls)
        tenants, targets = table.cols["tenant"][:n].tolist(), table.cols["target_len"][:n].tolist()
        states = []
        for row, call in enumerate(calls):
            state = cls.__new__(cls)
            state._bind(table, row, row, call, call_ids[row], tenants[row], query_of[row], targets[row])
            if draw_ids is not None:
                state.draw_id = draw_ids[row]
            table.handles[row] = state
            states.append(state)
        return states

    def _bind(self, table: CallTable, row: int, index: int, call: Call, call_id: str, tenant: int,
              query_index: int, target_len: int) -> None:
        self._t, self._r = table, row
        self.index, self.call, self.call_id = index, call, call_id
        # The id a seeded drafter keys its random draws by (model-based acceptance): the call's own id,
        # or the trace call's id for identical copies, which must draw alike.
        self.draw_id = call_id
        self.tenant, self.query_index = tenant, query_index
        self.prompt_len = call.prompt_len
        self.output_len = call.output_len
        self.target_len = target_len
        self.drafter_state: Any = None
        # No later call of its query comes (the engine sets it): drafters may drop state kept for one.
        self.last_in_query = False

    num_emitted = _column("num_emitted", int)
    num_computed = _column("num_computed", int)
    decoding = _column("decoding", bool)
    started = _column("started", bool)
    prefix_hit_tokens = _column("prefix_hit_tokens", int)
    drafted = _column("drafted", int)
    accepted = _column("accepted", int)
    draft_steps = _column("draft_steps", int)
    decode_steps = _column("decode_steps", int)
    preemptions = _column("preemptions", int)
    num_cached_blocks = _column("num_cached_blocks", int)
    arrival_s = _column("arrival_s", float)
    first_token_s = _column("first_token_s", float)
    finish_s = _column("finish_s", float)

    @property
    def status(self) -> str:
        return STATUS_NAMES[self._t.cols["status"][self._r]]

    @status.setter
    def status(self, value: str) -> None:
        self._t.cols["status"][self._r] = STATUS_CODES[value]

    @property
    def drafts(self) -> np.ndarray:
        """The draft tokens proposed for this call's next step (empty once scheduled or preempted)."""
        t, r = self._t, self._r
        n = t.cols["draft_len"][r]
        return t.slot_drafts[t.cols["slot"][r], :n].copy() if n else _EMPTY

    @drafts.setter
    def drafts(self, value: np.ndarray) -> None:
        """Set the drafts of a running call (their acceptance is then checked when they are verified)."""
        t, r = self._t, self._r
        n = value.shape[0]
        if n:
            slot = t.cols["slot"][r]
            if slot < 0:
                raise ValueError(f"call {self.call_id!r} holds no KV blocks: only a running call has drafts")
            t.reserve_draft_width(n)
            t.slot_drafts[slot, :n] = value
        t.cols["draft_len"][r] = n
        t.cols["draft_acc"][r] = -1

    @property
    def history(self) -> np.ndarray:
        """Prompt + output buffer (a view; append-only, so earlier tokens never change)."""
        off = self._t.cols["hist_off"][self._r]
        return self._t.tokens[off:off + self.prompt_len + self.target_len]

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + int(self._t.cols["num_emitted"][self._r])

    @property
    def tokens(self) -> np.ndarray:
        """Prompt + emitted tokens (a view; append-only, so earlier tokens never change)."""
        off = self._t.cols["hist_off"][self._r]
        return self._t.tokens[off:off + self.prompt_len + self._t.cols["num_emitted"][self._r]]

    @property
    def remaining(self) -> int:
        return self.target_len - self.num_emitted

    @property
    def block_ids(self) -> list[int]:
        """The KV blocks this call holds, head → tail."""
        slot = self._t.cols["slot"][self._r]
        if slot < 0:
            return []
        return self._t.slot_blocks[slot, :self._t.slot_nblocks[slot]].tolist()

    @property
    def block_hashes(self) -> list[int]:
        """Hashes of this call's full blocks computed so far (shared by calls with the same token prefix)."""
        t, region = self._t, self._t.cols["hreg"][self._r]
        off = t.hreg_off[region]
        return t.hashes[off:off + t.hreg_n[region]].tolist()

    def __repr__(self) -> str:
        return (f"CallState({self.call_id!r}, {self.status}, emitted={self.num_emitted}/{self.target_len}, "
                f"computed={self.num_computed}/{self.num_tokens})")


@dataclass
class QueryRun:
    """One query instance (a tenant's copy of a trace query): its calls in order."""

    index: int
    query_id: str
    tenant: int
    calls: list[CallState]
    offset_s: float  # added to the trace's arrival_s of its calls
    arrival_s: float = math.nan
    finish_s: float = math.nan
    completed: bool = False
