"""`suffix`: vLLM 0.33's suffix decoding (`method: "suffix"`, `vllm/v1/spec_decode/suffix_decoding.py`),
which drives ArcticInference 0.3.0's `SuffixDecodingCache`; re-implemented draft for draft.

Rule. Each running call has a *prompt tree* (its prompt, then its own output) and all calls share a
*global tree* of responses (every cached call's output, its own in-flight output included). After
each step, for every call that sampled tokens, in batch-row order: (1) if the call is not active —
its first decode step, or it was absent from some step's batch since (vLLM stops such calls) —
start it: drop its cached response if any, build its prompt tree from the prompt alone, and give
it a new response slot in the global tree (FIFO eviction beyond `max_cached_requests`); (2) append
the sampled tokens to both trees; (3) draft from the last ≤ depth tokens of prompt + output with
budget min(k, max_model_len − len − 1): each tree proposes its best greedy path (see
`suffix_tree._speculate_tree`), the prompt tree wins ties. Rows are handled one at a time, so a row
sees the tokens every earlier row appended in the same step, and none of a later row's.

How the engine's calls map onto that order: `observe` only queues the tokens; `propose(rows)`
applies the queue up to each row's own tokens, then drafts that row, then applies the rest (rows
that finished or have no budget). `finish_call` ends the call (its response stays cached). A call
that was active but not observed between two `propose` calls was absent from a step's batch: it is
stopped, and restarted on its next `observe`. That is exact because the engine calls `propose`
once after every step vLLM runs the proposer in, also with no rows (`driven_per_step`:
`Simulator._per_step_drafts`; docs/suffix-decoding.md, "How the engine drives it").

State: one `SuffixForest` arena holding the global tree and the prompt trees. A finished call's
prompt tree is kept (LRU, bounded; not the last call's of a query, which nothing extends) and, when
it holds exactly a prefix of a later call's prompt — the agent case, where call i+1's prompt is call
i's prompt + output + more — that call's prompt tree extends it instead of being rebuilt: a tree
depends only on the token sequence appended, so the drafts are the same (tests/test_suffix.py checks
it against the real library).

Config (vLLM `SpeculativeConfig`): `suffix_decoding_max_tree_depth` 24 (≥ 1),
`suffix_decoding_max_cached_requests` 10000 (≥ 0; 0 disables the global tree),
`suffix_decoding_max_spec_factor` 1.0 (≥ 0), `suffix_decoding_min_token_prob` 0.1 (in [0, 1]);
`num_speculative_tokens` defaults to the depth and is a maximum. The offset is 0 (no vLLM knob).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from agentspec_sim.drafters.registry import register_drafter
from agentspec_sim.drafters.suffix.tree import (
    OP_APPEND,
    OP_FIELDS,
    OP_REMOVE,
    OP_STEP,
    OP_TABLE_STEP,
    SCAP,
    SOFF,
    LocalTable,
    SuffixForest,
    is_prefix,
)
from agentspec_sim.engine.drafting import MAX_SPECULATIVE_TOKENS, BaseDrafter, SpecConfigError, SpeculativeConfig, grown

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState

DEFAULTS: dict[str, Any] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
# Finished calls' prompt trees kept for reuse: at most this many, holding at most this many tokens in
# all — or twice what the running calls' trees hold, if more (one kept tree per running query).
# A kept tree waits for its query's next call, which may wait behind a full KV cache: on the default
# trace at max_num_seqs 256 (~220 queries waiting, ~20k-token prompts) a 2M-token bound evicted most
# of them before use and 75M prompt tokens were re-indexed (163 CPU s); 5M: 48 s (+0.7 GiB peak).
REUSE_MAX_TREES = 1024
REUSE_MAX_TOKENS = 5_000_000

_START, _ADD, _FINISH, _DIVERGE = 0, 1, 2, 3
# What the engine's compiled steps log when they start or finish a call themselves (`sync`).
KERNEL_START, KERNEL_FINISH = 0, 1


class _Slot:
    """The drafter's view of one call: its prompt tree, its response in the global tree, its queue marks."""

    __slots__ = ("active", "global_seq", "local_root", "local_seq", "qidx", "qround", "row", "seen", "started", "state",
                 "table_at")

    def __init__(self, state: CallState) -> None:
        self.state = state
        self.row = state.index  # the engine's table row (`SuffixDrafter.row_state`)
        self.local_root = -1
        self.local_seq = -1
        self.global_seq = -1  # its response's sequence in the global tree; -1: not cached
        self.active = False  # vLLM's `active_requests`: started and not stopped since
        self.seen = -1  # the round (propose to propose) it last emitted in
        self.qidx = -1  # queue index of its latest ADD, valid in round `qround`
        self.qround = -1
        self.started = False  # started once (a later start is a restart)
        self.table_at = -1  # ≥ 0: its prompt tree's drafts are the local table's, from this position on


@register_drafter("suffix")
class SuffixDrafter(BaseDrafter):
    """Suffix decoding as vLLM 0.33 runs it (module docstring); one instance per run and tenant."""

    # Memory per token of the trace (its workload table, one tenant; its live state, per tenant).
    bytes_per_token = (112.0, 220.0)
    # `--drafter suffix`: the paper's k=32; vLLM's defaults for the tree (depth 24, factor 1.0, min prob 0.1).
    shorthand: ClassVar[dict] = {"method": "suffix", "num_speculative_tokens": 32}

    config_keys: ClassVar[frozenset[str]] = frozenset(DEFAULTS)
    supports_batch_size_schedule: ClassVar[bool] = False
    # The engine drives it as vLLM's V1 runner drives its suffix proposer (`Simulator._per_step_drafts`):
    # `propose` after every step with a forward pass, also with no rows; budget min(k, max_model_len −
    # num_tokens − 1); no `observe` for rows at max_model_len or in steps where the proposer is skipped.
    driven_per_step: ClassVar[bool] = True

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        opts = {**DEFAULTS, **dict(spec.options)}
        self.depth = int(opts["suffix_decoding_max_tree_depth"])
        self.max_cached = int(opts["suffix_decoding_max_cached_requests"])
        self.factor = float(opts["suffix_decoding_max_spec_factor"])
        self.min_prob = float(opts["suffix_decoding_min_token_prob"])
        self.offset = 0.0
        self.k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else self.depth
        self.forest = SuffixForest(self.depth)
        self.global_root = self.forest.new_tree()
        self.cached: dict[int, _Slot] = {}  # global seq → call, in FIFO order
        self.active: dict[_Slot, None] = {}  # vLLM's active requests (a dict: deterministic order)
        # Kept prompt trees, least recently kept first: root → (seq, its length, its last token).
        self.reuse: dict[int, tuple[int, int, int]] = {}
        self.reuse_tokens = 0
        self.tree_of_query: dict[int, int] = {}  # query index → the root its last finished call kept
        self.queue: list[tuple[int, _Slot, int, int]] = []  # (kind, call, end of its tokens, how many)
        self.round = 0
        # For the engine's compiled steps (drafters/suffix/fastpath.py `Forest`): per table row [local_root,
        # local_seq, global_seq, active], and how many calls are active; written by `propose`.
        # [4]: the call's first position in the local table while it drafts from it, else -1.
        self.row_state = np.full((64, 5), -1, dtype=np.int64)
        self.n_active = np.zeros(1, dtype=np.int64)
        self.n_cached = np.zeros(1, dtype=np.int64)  # len(cached), for the compiled steps' starts
        self.table_at: np.ndarray | None = None  # engine table row → its first position in the local table
        # With a local table the compiled steps also start and finish calls (`use_local_table`): each row's
        # response sequence made up front, whether the kernel may start it, and the starts and finishes it
        # made (kind, row), which `sync` applies to the Python side.
        self.response_seq = np.full(1, -1, dtype=np.int64)
        self.kernel_fresh = np.zeros(1, dtype=np.int8)
        self.events = np.zeros((1, 2), dtype=np.int64)
        self.n_events = np.zeros(1, dtype=np.int64)
        self.states: Sequence[CallState] = ()
        self.touched: list[_Slot] = []  # slots whose row_state changed since the last `propose`
        # Tenants that are copies share the first tenant's arena and per-row arrays (`share_arena`): each
        # tenant's drafter, by tenant, and the engine's row → tenant.
        self.peers: list[SuffixDrafter] = [self]
        self.row_tenant: np.ndarray | None = None

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        """vLLM's defaults and `_validate_suffix_decoding`: fill every key, k defaults to the depth."""
        opts = {**DEFAULTS, **dict(spec.options)}
        depth = opts["suffix_decoding_max_tree_depth"]
        cached = opts["suffix_decoding_max_cached_requests"]
        factor = opts["suffix_decoding_max_spec_factor"]
        prob = opts["suffix_decoding_min_token_prob"]
        if not _is_int(depth) or not 1 <= depth <= MAX_SPECULATIVE_TOKENS:  # trees are sized by the depth
            raise SpecConfigError(f"suffix_decoding_max_tree_depth={depth!r} must be an integer in [1, "
                                  f"{MAX_SPECULATIVE_TOKENS}]")
        if not _is_int(cached) or cached < 0:
            raise SpecConfigError(f"suffix_decoding_max_cached_requests={cached!r} must be an integer ≥ 0")
        if not _is_number(factor) or factor < 0:
            raise SpecConfigError(f"suffix_decoding_max_spec_factor={factor!r} must be a number ≥ 0")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise SpecConfigError(f"suffix_decoding_min_token_prob={prob!r} must be a number in [0, 1]")
        k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else depth
        return replace(spec, num_speculative_tokens=k, options=tuple(sorted(opts.items())))

    def use_local_table(self, table: LocalTable, at: np.ndarray, states: Sequence[CallState],
                        output_lens: np.ndarray) -> None:
        """Draft the prompt trees of the engine's calls (table rows) from `table` (drafters/suffix/tables.py):
        the prompt tree's draft of row r after t output tokens is the table's at position at[r] + t, as long
        as its tree holds its prompt and its first t output tokens — a call that restarts, or whose tokens
        the proposer skipped, builds its tree instead (`skip_tokens`).

        Such a call's start is then only a response slot (if responses are cached) and its finish only
        bookkeeping, which the engine's compiled steps can do themselves: every row gets its response
        sequence now (room for its `output_lens` tokens), and `sync` tells the Python side what they did."""
        self.forest.local_table = table
        self.table_at = at
        self.states = states
        n = len(states)
        self.row_state = grown(self.row_state, n + 1, -1)
        self.response_seq = np.full(n + 1, -1, dtype=np.int64)
        if self.max_cached:
            for r, length in enumerate(output_lens.tolist()):
                if length > 0:
                    self.response_seq[r] = self.forest.new_seq(length + 1)
        self.kernel_fresh = np.append(output_lens > 0, False).astype(np.int8)
        self.events = np.zeros((2 * n + 2, 2), dtype=np.int64)

    def share_arena(self, first: SuffixDrafter, tenant: int, counts: np.ndarray) -> None:
        """Be tenant `tenant`'s drafter of a run whose tenants are copies, in `first`'s arena: its own global
        tree there (a tree is its node set: sharing the arena shares no tokens between tenants), `first`'s
        per-row arrays (each tenant's drafter writes only its own rows) and its counts of active calls and
        cached responses at counts[:, tenant] (first's made a view of counts[:, 0] likewise). Before the run's
        first step, after `first.use_local_table`."""
        self.forest = first.forest
        self.global_root = self.forest.new_tree()
        for name in ("row_state", "table_at", "states", "response_seq", "kernel_fresh", "events", "n_events",
                     "row_tenant"):
            setattr(self, name, getattr(first, name))
        self.n_active, self.n_cached = counts[0, tenant:tenant + 1], counts[1, tenant:tenant + 1]
        self.peers = first.peers

    def sync(self) -> None:
        """Apply the starts and finishes the compiled steps made (in their order) to the calls' slots, the
        active calls and the FIFO of cached responses — before anything in Python reads them — each by the
        drafter of the call's tenant."""
        m = int(self.n_events[0])
        if not m:
            return
        tenant = self.row_tenant
        for kind, r in self.events[:m].tolist():
            owner = self.peers[int(tenant[r])] if tenant is not None else self
            state = owner.states[r]
            if kind == KERNEL_START:
                slot = state.drafter_state
                if slot is None:
                    slot = state.drafter_state = _Slot(state)
                slot.active = slot.started = True
                owner.active[slot] = None
                slot.table_at = int(owner.table_at[r])
                slot.global_seq = int(owner.response_seq[r])
                if slot.global_seq >= 0:
                    owner.cached[slot.global_seq] = slot
            else:  # _FINISH: a call drafting from the table keeps no prompt tree
                slot = state.drafter_state
                slot.active = False
                del owner.active[slot]
                slot.state = None
        self.n_events[0] = 0

    # -- the engine's hooks ------------------------------------------------------------------------
    def start_call(self, state: CallState) -> None:
        """Attach the call; its prompt tree is built when its first tokens are applied (vLLM: first decode step)."""
        state.drafter_state = _Slot(state)

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        """Queue the call's new tokens (applied in row order by the next `propose`); restart it if it was stopped."""
        slot = state.drafter_state
        if slot is None:  # not started through start_call: start it now
            slot = state.drafter_state = _Slot(state)
        if not slot.active:
            slot.active = True
            self.active[slot] = None
            self.queue.append((_START, slot, 0, 0))
            self.touched.append(slot)
        slot.seen = self.round
        slot.qround = self.round
        slot.qidx = len(self.queue)
        self.queue.append((_ADD, slot, state.prompt_len + state.num_emitted, int(emitted.shape[0])))

    def finish_call(self, state: CallState) -> None:
        """The call is done: its prompt tree is released (kept for reuse), its response stays cached."""
        slot = state.drafter_state
        if slot is not None:
            self.queue.append((_FINISH, slot, 0, 0))

    def skip_tokens(self, state: CallState, n: int) -> None:
        """The call emitted n tokens in a step in which the proposer did not run: no tree ever gets them.
        Only with a local table (`use_local_table`) does it matter: a call drafting from it gets its own tree
        now (prompt + output before these tokens), and one not started yet may not draft from it."""
        if self.table_at is None:
            return
        slot = state.drafter_state
        if slot is None:
            slot = state.drafter_state = _Slot(state)
        if slot.table_at >= 0:
            self.queue.append((_DIVERGE, slot, state.prompt_len + state.num_emitted - n, 0))
            slot.table_at = -1
            self.touched.append(slot)
        slot.started = True
        self.kernel_fresh[state.index] = 0

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Apply the queued tokens in row order, drafting each row right after its own tokens."""
        max_lens = np.asarray(max_lens)
        batch = _Batch(self, len(rows), max_lens)
        pos = 0
        queue = self.queue
        for i, row in enumerate(rows):
            slot = row.drafter_state
            if slot.qround == self.round:
                while pos <= slot.qidx:
                    batch.apply(queue[pos])
                    pos += 1
            batch.speculate(slot, i, int(max_lens[i]))
        while pos < len(queue):
            batch.apply(queue[pos])
            pos += 1
        self.queue = []
        out, out_n = batch.run()
        # Calls active but absent from this step's batch are stopped (vLLM: `stop_request`); their
        # prompt tree (prompt + part of the output) is dropped, as vLLM drops it.
        for slot in [s for s in self.active if s.seen != self.round]:
            slot.active = False
            del self.active[slot]
            if slot.local_root >= 0:
                batch.dropped.append((slot.local_root, slot.local_seq))
            slot.local_root = slot.local_seq = slot.table_at = -1
            self.touched.append(slot)
        self._settle(batch)
        self.round += 1
        return [out[i, :out_n[i]] for i in range(len(rows))]

    def _settle(self, batch: _Batch) -> None:
        """After a batch ran: keep or free the prompt trees it released, mirror the changed rows."""
        dropped = batch.dropped
        for root, seq in batch.kept:
            self._keep_tree(root, seq)
        if len(self.reuse) > REUSE_MAX_TREES or self.reuse_tokens > REUSE_MAX_TOKENS:
            self._trim_reuse(dropped)
        if dropped:
            self.forest.free_trees(dropped)
        self._mirror_rows()

    # -- the engine's compiled steps (`Simulator._per_step_drafts`) ------------------------------------
    # A step whose calls, beyond those emitting as in `suffix_step`'s (drafters/suffix/fastpath.py), only start fresh
    # or finish is driven in three parts: `start_fresh` here, then the compiled kernel appends every
    # row's tokens and drafts in batch order, then `finish_rows`. That is `propose`'s order: a fresh
    # start touches only its own prompt tree (and opens an empty response), so starting it before the
    # rows ahead of it in the batch changes nothing they see; a finish comes after its row's tokens.

    def can_start_fresh(self, states: Sequence[CallState]) -> bool:
        """Whether `start_fresh(states)` would start them (no restart, no FIFO eviction, nothing queued)."""
        if self.queue or self.touched:
            return False
        if self.max_cached and len(self.cached) + len(states) > self.max_cached:
            return False
        for state in states:
            slot = state.drafter_state
            if slot is not None and (slot.active or slot.global_seq >= 0 or slot.local_root >= 0):
                return False
        return True

    def start_fresh(self, states: Sequence[CallState]) -> bool:
        """Start calls that were never active (`_start`: prompt tree, empty response), or do nothing and
        return False when one needs more than that: a restart (a cached response to drop) or FIFO eviction."""
        if not self.can_start_fresh(states):
            return False
        slots = [state.drafter_state if state.drafter_state is not None else _Slot(state) for state in states]
        batch = _Batch(self, 0, np.zeros(0, dtype=np.int64))
        for state, slot in zip(states, slots, strict=True):
            state.drafter_state = slot
            slot.active = True
            self.active[slot] = None
            batch._start(slot)
        batch.run()
        self._settle(batch)
        return True

    def make_step_room(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Room for the compiled step to append counts[i] tokens of engine call rows[i] to both its trees."""
        forest = self.forest
        state = self.row_state[rows]
        # The calls' sequences that receive the tokens: the prompt tree's (unless drafted from the table)
        # and the response's (if cached); only those short of room are grown.
        seqs = np.concatenate([state[:, 1][state[:, 4] < 0], state[:, 2][state[:, 2] >= 0]])
        ns = np.concatenate([counts[state[:, 4] < 0], counts[state[:, 2] >= 0]])
        short = forest.seq_len[seqs] + ns > forest.sq[seqs, SCAP]
        for s, n in zip(seqs[short].tolist(), ns[short].tolist(), strict=True):
            forest.make_seq_room(s, n)
        forest.make_room(2 * self.depth * int(counts.sum()) + counts.shape[0])

    def finish_rows(self, states: Sequence[CallState]) -> None:
        """`finish_call` for calls whose last tokens the compiled step appended, applied at once."""
        batch = _Batch(self, 0, np.zeros(0, dtype=np.int64))
        for state in states:
            batch.apply((_FINISH, state.drafter_state, 0, 0))
        self._settle(batch)

    def _mirror_rows(self) -> None:
        """Write the changed calls' trees and activity into `row_state` (what compiled steps read)."""
        for slot in self.touched:
            table = self.row_state = grown(self.row_state, slot.row + 1, -1)
            table[slot.row] = (slot.local_root, slot.local_seq, slot.global_seq, int(slot.active), slot.table_at)
        self.touched = []
        self.n_active[0] = len(self.active)
        self.n_cached[0] = len(self.cached)

    # -- prompt trees ------------------------------------------------------------------------------
    def _trim_reuse(self, dropped: list[tuple[int, int]]) -> None:
        """Drop the least recently kept prompt trees beyond the bound (at least what the running calls hold)."""
        running = sum(int(self.forest.seq_len[s.local_seq]) for s in self.active if s.local_seq >= 0)
        max_trees = max(REUSE_MAX_TREES, 2 * len(self.active))
        max_tokens = max(REUSE_MAX_TOKENS, 2 * running)
        while self.reuse and (len(self.reuse) > max_trees or self.reuse_tokens > max_tokens):
            root = next(iter(self.reuse))
            seq, n, _ = self.reuse.pop(root)
            self.reuse_tokens -= n
            dropped.append((root, seq))

    def _keep_tree(self, root: int, seq: int) -> None:
        """Keep a prompt tree no call uses any more (its ops all applied) for reuse."""
        if root < 0:
            return
        n = int(self.forest.seq_len[seq])
        last = int(self.forest.seq_tokens(seq)[n - 1]) if n else -1
        self.reuse[root] = (seq, n, last)
        self.reuse_tokens += n

    def _take_tree(self, prompt: np.ndarray, query: int) -> tuple[int, int]:
        """A kept prompt tree whose tokens are a prefix of `prompt` — the one the query's previous call
        kept, else the longest — or (-1, -1). (Any such tree drafts the same once extended.)"""
        forest = self.forest
        n_prompt = prompt.shape[0]

        def extends(seq: int, n: int, last: int) -> bool:
            return (n <= n_prompt and prompt[n - 1] == last
                    and is_prefix(forest.pool, int(forest.sq[seq, SOFF]), n, prompt))

        best, best_n = self.tree_of_query.pop(query, -1), 0
        if best not in self.reuse or not extends(*self.reuse[best]):
            best = -1
            for root, (seq, n, last) in self.reuse.items():
                if best_n < n and extends(seq, n, last):
                    best, best_n = root, n
        if best < 0:
            return -1, -1
        seq, n, _ = self.reuse.pop(best)
        self.reuse_tokens -= n
        return best, seq


class _Batch:
    """The operations of one `propose`, built in queue order and run in one compiled call."""

    def __init__(self, drafter: SuffixDrafter, num_rows: int, max_lens: np.ndarray) -> None:
        self.d = drafter
        self.ops: list[list[int]] = []
        self.pieces: list[np.ndarray] = []
        self.top = 0
        self.kept: list[tuple[int, int]] = []  # finished calls' prompt trees, kept for reuse after the run
        self.dropped: list[tuple[int, int]] = []  # prompt trees to free after the run
        self.last_step: dict[int, int] = {}  # id(slot) → index of its latest STEP op in this batch
        width = min(int(max_lens.max()), drafter.k) if num_rows else 0
        self.out = np.empty((num_rows, max(width, 0)), dtype=np.int32)  # row i is read to out_n[i] only
        self.out_n = np.zeros(num_rows, dtype=np.int32)

    def _tokens(self, tokens: np.ndarray) -> int:
        off = self.top
        self.pieces.append(tokens)
        self.top += tokens.shape[0]
        return off

    def apply(self, entry: tuple[int, _Slot, int, int]) -> None:
        kind, slot, end, n = entry
        if kind == _ADD:
            # The tokens history[end − n:end], with the ≤ depth tokens before `end` as the context.
            d = self.d
            forest = d.forest
            first = max(0, end - max(n, d.depth))
            off = self._tokens(slot.state.history[first:end])
            if slot.table_at < 0:
                forest.reserve(slot.local_seq, n)
            if slot.global_seq >= 0:
                forest.reserve(slot.global_seq, n)
            ctx_len = min(d.depth, end)
            self.last_step[id(slot)] = len(self.ops)
            self.ops.append([*self._local(slot, end), slot.global_seq, off + (end - first) - n, n,
                             off + (end - first) - ctx_len, ctx_len, 0, -1])
        elif kind == _START:
            self._start(slot)
        elif kind == _DIVERGE:
            # Off the table: its prompt tree as the table assumed it so far (prompt + output before `end`).
            state, forest = slot.state, self.d.forest
            slot.local_root, slot.local_seq = forest.new_tree(), forest.new_seq()
            off = self._tokens(state.history[:end])
            forest.reserve(slot.local_seq, end)
            self.ops.append([OP_APPEND, slot.local_root, slot.local_seq, -1, off, end, 0, 0, 0, -1])
            self.d.touched.append(slot)
        else:  # _FINISH
            if slot.active:
                slot.active = False
                del self.d.active[slot]
            if slot.local_root >= 0:
                # Kept for reuse only while a later call of its query may extend it.
                if slot.state.last_in_query:
                    self.dropped.append((slot.local_root, slot.local_seq))
                else:
                    self.kept.append((slot.local_root, slot.local_seq))
                    self.d.tree_of_query[slot.state.query_index] = slot.local_root
            slot.local_root = slot.local_seq = -1
            self.d.touched.append(slot)
            slot.state = None  # the response may stay cached long after; the call's buffers need not

    def _start(self, slot: _Slot) -> None:
        """vLLM: evict the call's cached response, `start_request(prompt)` (FIFO eviction beyond the limit)."""
        d = self.d
        forest = d.forest
        if slot.global_seq >= 0:
            self._evict(slot)
        if slot.local_root >= 0:  # (a stopped call's tree was dropped at the stop)
            self.dropped.append((slot.local_root, slot.local_seq))
            slot.local_root = slot.local_seq = -1
        state = slot.state
        first = d.table_at is not None and not slot.started
        if first:  # its prompt tree's drafts are the table's
            slot.table_at = int(d.table_at[slot.row])
            d.kernel_fresh[slot.row] = 0
        else:
            slot.table_at = -1
            prompt = state.history[:state.prompt_len]
            root, seq = d._take_tree(prompt, state.query_index)
            if root < 0:
                root, seq = forest.new_tree(), forest.new_seq()
            have = int(forest.seq_len[seq])
            n = state.prompt_len - have
            if n:
                off = self._tokens(prompt[have:])
                forest.reserve(seq, n)
                self.ops.append([OP_APPEND, root, seq, -1, off, n, 0, 0, 0, -1])
            slot.local_root, slot.local_seq = root, seq
        slot.started = True
        d.touched.append(slot)
        if d.max_cached != 0:
            gseq = int(d.response_seq[slot.row]) if first else -1
            if gseq < 0:
                gseq = forest.new_seq()
            slot.global_seq = gseq
            d.cached[gseq] = slot
            while len(d.cached) > d.max_cached:
                oldest = next(s for s in d.cached if s != gseq)
                self._evict(d.cached[oldest])

    def _evict(self, slot: _Slot) -> None:
        d = self.d
        gseq = slot.global_seq
        del d.cached[gseq]
        slot.global_seq = -1
        d.touched.append(slot)
        # The removed response's tokens stay in the pool (nodes of the global tree may still read them):
        # its sequence is never released.
        self.ops.append([OP_REMOVE, d.global_root, gseq, -1, 0, 0, 0, 0, 0, -1])

    def speculate(self, slot: _Slot, row: int, max_len: int) -> None:
        i = self.last_step.get(id(slot), -1)
        if i >= 0 and i == len(self.ops) - 1:
            op = self.ops[i]
        elif slot.local_root >= 0 or slot.table_at >= 0:
            # No tokens of its own in this batch (outside the contract): draft as it stands.
            state = slot.state
            end = state.prompt_len + state.num_emitted
            ctx_len = min(self.d.depth, end)
            off = self._tokens(state.history[end - ctx_len:end])
            op = [*self._local(slot, end), -1, off, 0, off, ctx_len, 0, -1]
            self.ops.append(op)
        else:  # never observed, or stopped: vLLM would not draft for it
            return
        op[8] = min(max_len, self.d.k)
        op[9] = row

    @staticmethod
    def _local(slot: _Slot, end: int) -> list[int]:
        """An OP_STEP's first three fields: its prompt tree, or its table position once `end` tokens are in."""
        if slot.table_at >= 0:
            return [OP_TABLE_STEP, slot.table_at + end - slot.state.prompt_len, -1]
        return [OP_STEP, slot.local_root, slot.local_seq]

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        if self.ops:
            d = self.d
            tb = np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype=np.int32)
            ops = np.asarray(self.ops, dtype=np.int64).reshape(-1, OP_FIELDS)
            d.forest.run(d.global_root, ops, tb, d.factor, d.offset, d.min_prob, self.out, self.out_n)
        return self.out, self.out_n


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
