"""AgentSpec's history cache H(agent, query, block) (paper §4.1, Algorithm 1): per (agent, query) the token
stream of every structural block, indexed by n-gram hash chains in one arena (block_index.py), looked up for
a call's current block; docs/agentspec.md §2 works the rules out."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from agentspec_sim.drafters.agentspec.block_index import (
    META_FIELDS,
    OP_APPEND,
    OP_FIELDS,
    OP_LOOKUP,
    BlockArena,
    match_levels,
)
from agentspec_sim.drafters.common.structure import (
    ROOT,
    StructureAutomaton,
    block_labels,
    segment,
    segment_fed,
)
from agentspec_sim.engine.drafting import grown

if TYPE_CHECKING:
    from agentspec_sim.trace.schema import Call

DOCS_KEPT = 4  # earlier calls of a query whose token sequences a new prompt is compared with
MAX_LIVE_TOKENS = 8_000_000  # the live history's memory bound: arena tokens kept before idle ones are dropped (LRU)
MAX_SCAN = 256  # chain entries a lookup examines at its matching level (newest first)
MIN_SUPPORT = 2  # candidates that must agree with every CT* token, besides a strict majority (docs/agentspec.md)
_EMPTY = np.zeros(0, dtype=np.int32)
# Digests of token→bytes maps, by identity (a map lives as long as its tokenizer and is never mutated):
# every run's table key takes one, a Python pass over the whole vocabulary (~0.1 s for Qwen3's).
_TABLE_DIGESTS: dict[int, tuple[Sequence[bytes], bytes]] = {}


# --------------------------------------------------------------------------------------------
# The history cache H(agent, query, block).


class _Store:
    """The history of one (agent, query): its blocks (delimiter pair or None → arena block), the
    position where each block's last segment ends, and the query's last calls' token sequences."""

    __slots__ = ("automaton", "blocks", "docs", "lineage", "running", "structure", "used")

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, str] | None, int] = {}
        self.docs: list[np.ndarray] = []  # last calls' prompt + output, oldest first
        self.automaton: StructureAutomaton | None = None  # the automaton at the end of docs[-1], if known
        self.structure: Any = None  # the structure of docs[-1]'s call
        self.lineage = -1  # positions of the current lineage are positions in docs[-1] (and its extensions)
        self.running = 0
        self.used = 0


class _Cursor:
    """One call's view of the history: its store, its output automaton, label → block."""

    __slots__ = ("automaton", "blocks", "labels", "lineage", "output", "output_automaton", "prompt_clean",
                 "prompt_len", "store", "structure")

    def __init__(self, store: _Store, blocks: list[int], structure: Any, lineage: int) -> None:
        self.store = store
        self.blocks = blocks  # label index (block_labels order) → arena block
        self.structure = structure
        self.automaton: StructureAutomaton | None = StructureAutomaton(structure) if len(blocks) > 1 else None
        self.lineage = lineage
        self.prompt_clean = True  # the prompt left the automaton at ROOT with nothing pending
        # When the call's output is known up front (the engine's calls): every output token's label,
        # and the automaton is fed only when its state is needed past them (`History._catch_up`).
        self.labels: np.ndarray | None = None
        self.output: np.ndarray | None = None
        self.output_automaton: StructureAutomaton | None = None  # the automaton after the whole output
        self.prompt_len = 0


class History:
    """H(agent, query, block) for one drafter instance (or one offline replay): stores, the arena,
    and the queue of appends applied at the next `lookup`.

    `structured=False` puts every token in one block per (agent, query) (agentspec-n);
    `token_bytes=None` does the same for every call (no token→bytes map, structure unreadable)."""

    def __init__(self, min_n: int, max_n: int, width: int, max_candidates: int, token_bytes: Sequence[bytes] | None,
                 structured: bool = True, index_prompts: bool = True) -> None:
        self.arena = BlockArena(match_levels(min_n, max_n))
        self.min_n = min_n
        self.max_n = max_n
        self.width = width
        self.max_candidates = max_candidates
        self.table = token_bytes
        self.structured = structured and token_bytes is not None
        self.index_prompts = index_prompts  # False: only emitted tokens are history (the outputs-only rule)
        self.stores: dict[tuple[Any, Any], _Store] = {}
        self.query_keys: dict[Any, list[tuple[Any, Any]]] = {}  # query id → its calls' history keys
        self.queue: list[tuple[int, np.ndarray, np.ndarray | None]] = []  # (block, tokens, lead-in or None)
        self.evicted = 0  # stores dropped over MAX_LIVE_TOKENS before their query ended
        # (block, tokens): room an attached call's output will take, made once the queue is applied.
        self.room: list[tuple[int, int]] = []
        self.clock = itertools.count()
        self.lineages = itertools.count()
        # Per arena block: (lineage, end position) of its last segment; a run that starts there continues it.
        self.tail_lin = np.full(64, -1, dtype=np.int64)
        self.tail_pos = np.zeros(64, dtype=np.int64)
        # Engine calls (`attach_row`): the block of each output token, from row_at[row]; each row's lineage.
        self.tok_block = np.zeros(1024, dtype=np.int64)
        self.tok_top = 0
        self.row_at = np.full(64, -1, dtype=np.int64)
        self.row_lineage = np.full(64, -1, dtype=np.int64)

    def options(self) -> dict[str, Any]:
        """The constructor's arguments but the token→bytes map (`table_digest`)."""
        return {"min_n": self.min_n, "max_n": self.max_n, "width": self.width, "max_candidates": self.max_candidates,
                "structured": self.structured, "index_prompts": self.index_prompts}

    def empty_copy(self) -> History:
        """A new, empty history with the same options."""
        return History(self.min_n, self.max_n, self.width, self.max_candidates, self.table, self.structured,
                       self.index_prompts)

    def table_digest(self) -> bytes:
        """A digest of the token→bytes map (b"" without one)."""
        if self.table is None:
            return b""
        known = _TABLE_DIGESTS.get(id(self.table))
        if known is not None and known[0] is self.table:
            return known[1]
        h = hashlib.blake2b(digest_size=16)
        for token in self.table:
            h.update(len(token).to_bytes(2, "little"))
            h.update(token)
        if len(_TABLE_DIGESTS) >= 8:
            _TABLE_DIGESTS.clear()
        _TABLE_DIGESTS[id(self.table)] = (self.table, h.digest())
        return h.digest()

    # -- calls --------------------------------------------------------------------------------
    def start(self, call: Call, prompt: np.ndarray, output: np.ndarray | None = None) -> _Cursor:
        """A call starts: index the part of its prompt not yet in the query's history. `output`: the
        tokens it will emit, when known (a replay): their labels are taken from one `segment` pass
        instead of feeding the automaton token by token. A label depends only on the tokens before
        it (`segment`'s contract), so the drafter still sees nothing it could not have seen."""
        key = (call.agent_id, call.query_id)
        store = self.stores.get(key)
        if store is None:
            store = self.stores[key] = _Store()
            self.query_keys.setdefault(call.query_id, []).append(key)
        store.running += 1
        store.used = next(self.clock)
        structure = call.structure if self.structured and call.structure else ()
        blocks = [self._block(store, None if label == ROOT else tuple(structure[label[0]][label[1]]))
                  for label in block_labels(structure)]
        shared, which = _shared_prefix(store.docs, prompt)
        extends = bool(store.docs) and which == len(store.docs) - 1 and shared == store.docs[-1].shape[0]
        if not extends:
            store.lineage = next(self.lineages)
        cursor = _Cursor(store, blocks, structure, store.lineage)
        rest = prompt[shared:]
        if len(blocks) == 1:
            labels = np.zeros(rest.shape[0], dtype=np.int32)
        else:
            auto = store.automaton if extends and store.structure == structure else None
            store.automaton = None
            table = self.table
            if auto is not None and auto.block == ROOT and not auto.pending:
                labels, auto = segment_fed(rest, table, structure)  # a clean automaton is a fresh one
            elif auto is not None:
                labels = self._feed(auto, rest)
            else:
                labels, auto = segment_fed(prompt, table, structure)
                labels = labels[shared:]
            cursor.prompt_clean = auto.block == ROOT and not auto.pending
        if self.index_prompts:
            self._queue_runs(cursor, prompt, shared, labels)
        if output is not None:
            if cursor.automaton is not None:
                cursor.labels, cursor.output_automaton = segment_fed(output, self.table, structure)
            else:
                cursor.labels = np.zeros(output.shape[0], dtype=np.int32)
            cursor.output = output
            cursor.prompt_len = prompt.shape[0]
        return cursor

    def attach_row(self, row: int, cursor: _Cursor) -> None:
        """Record an engine call (table row `row`, output labels known) for compiled drafting: its lineage
        and the block of each of its output tokens (drafters/agentspec/fastpath.py `HistoryDrafting`)."""
        blocks = np.asarray(cursor.blocks, dtype=np.int64)[cursor.labels]
        n = blocks.shape[0]
        if n:
            # The compiled path appends only into room made beforehand, and a step where a block lacks it
            # goes back to the event loop (Python observes and proposes for every row). Room for the whole
            # output up front: its tokens plus a SEP and lead-in for each run of a block (at most).
            starts = np.flatnonzero(np.diff(blocks, prepend=-1))
            ids, counts = np.unique(blocks, return_counts=True)
            runs = np.bincount(np.searchsorted(ids, blocks[starts]), minlength=ids.shape[0])
            self.room.extend(zip(ids.tolist(), (counts + runs * (self.max_n + 1)).tolist(), strict=True))
        self.tok_block = grown(self.tok_block, self.tok_top + n, 0)
        self.tok_block[self.tok_top:self.tok_top + n] = blocks
        self.row_at = grown(self.row_at, row + 1, -1)
        self.row_lineage = grown(self.row_lineage, row + 1, -1)
        self.row_at[row] = self.tok_top
        self.row_lineage[row] = cursor.lineage
        self.tok_top += n

    def detach_row(self, row: int) -> None:
        if row < self.row_at.shape[0]:
            self.row_at[row] = -1

    def emit(self, cursor: _Cursor, stream: np.ndarray, start: int, n: int) -> None:
        """The call emitted stream[start:start + n] (its prompt + output buffer): label and queue them."""
        if cursor.automaton is None:
            labels = np.zeros(n, dtype=np.int32)
        elif cursor.labels is not None:
            i = start - cursor.prompt_len
            labels = cursor.labels[i:i + n]
        else:
            labels = self._feed(cursor.automaton, stream[start:start + n])
        self._queue_runs(cursor, stream, start, labels)

    def finish(self, cursor: _Cursor, tokens: np.ndarray) -> None:
        """The call is done: `tokens` (prompt + output) is what the next prompt of its query may extend."""
        self._catch_up(cursor, tokens.shape[0] - cursor.prompt_len)
        store = cursor.store
        store.running -= 1
        store.docs.append(np.array(tokens, dtype=np.int32))  # a copy: the engine owns the call's buffer
        del store.docs[:-DOCS_KEPT]
        store.structure = cursor.structure
        # The document view of the text (the prompt's automaton continued through the output) is in
        # the output automaton's state when the prompt left its automaton in the start state.
        store.automaton = cursor.automaton if cursor.prompt_clean else None
        cursor.automaton = None

    def block_of(self, cursor: _Cursor, emitted: int = 0) -> int:
        """The arena block of the call's active block (where the next token starts), after `emitted`
        output tokens (read only when the output's labels were precomputed)."""
        if cursor.labels is not None:
            if emitted < cursor.labels.shape[0]:
                return cursor.blocks[cursor.labels[emitted]]
            self._catch_up(cursor, emitted)
        return cursor.blocks[cursor.automaton.block_index if cursor.automaton is not None else 0]

    def _catch_up(self, cursor: _Cursor, emitted: int) -> None:
        """Feed the automaton the first `emitted` output tokens (their labels were precomputed) and drop
        the labels: from here on the automaton is fed as tokens come."""
        if cursor.labels is None:
            return
        if cursor.automaton is not None:
            if emitted == cursor.output.shape[0]:  # the whole output: segment_fed's automaton is that state
                cursor.automaton = cursor.output_automaton
            else:
                table = self.table
                cursor.automaton.feed(b"".join([table[t] for t in cursor.output[:emitted].tolist()]))
        cursor.labels = cursor.output = cursor.output_automaton = None

    # -- shared histories (agentspec+'s global corpus) -----------------------------------------
    def blocks_for(self, key: Any, structure: Any) -> list[int]:
        """The arena blocks of history `key` for a call with `structure`, in `block_labels` order
        (the same label → block map a cursor of that call has); blocks are created on first use."""
        store = self.stores.get(key)
        if store is None:
            store = self.stores[key] = _Store()
        structure = structure if self.structured and structure else ()
        return [self._block(store, None if label == ROOT else tuple(structure[label[0]][label[1]]))
                for label in block_labels(structure)]

    def add_text(self, key: Any, structure: Any, tokens: np.ndarray) -> None:
        """Index `tokens` (one finished piece of text, e.g. a call's output) into history `key`, each
        token under the block the automaton of `structure` gives it; a new lineage, so its first
        segment starts fresh (no lead-in) and nothing is joined to earlier text."""
        blocks = self.blocks_for(key, structure)
        structure = structure if self.structured and structure else ()
        tokens = np.asarray(tokens, dtype=np.int32)
        labels = (segment(tokens, self.table, structure) if len(blocks) > 1
                  else np.zeros(tokens.shape[0], dtype=np.int32))
        self._queue_runs(_Cursor(self.stores[key], blocks, structure, next(self.lineages)), tokens, 0, labels)

    # -- batches ------------------------------------------------------------------------------
    def lookup(self, requests: Sequence[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """Apply the queued appends, then look up each (block, context): (paths [k, width], meta [k, 5])."""
        ops: list[list[int]] = []
        pieces: list[np.ndarray] = []
        grow: list[tuple[int, int]] = []  # (block, tokens it receives), for the arena's reservations
        top = 0
        for block, tokens, lead in self.queue:
            n = tokens.shape[0]
            if lead is None:
                ops.append([OP_APPEND, block, top, n, 0, -1, 0, 0])
                pieces.append(tokens)
                grow.append((block, n))
                top += n
            else:
                ops.append([OP_APPEND, block, top, n, top + n, lead.shape[0], 0, 0])
                pieces.append(tokens)
                pieces.append(lead)
                grow.append((block, n + lead.shape[0] + 1))
                top += n + lead.shape[0]
        self.queue = []
        room, self.room = self.room, []
        for row, (block, ctx) in enumerate(requests):
            ops.append([OP_LOOKUP, block, top, ctx.shape[0], row, 0, 0, 0])
            pieces.append(ctx)
            top += ctx.shape[0]
        out = np.zeros((len(requests), self.width), dtype=np.int32)
        meta = np.zeros((len(requests), META_FIELDS), dtype=np.int64)
        if ops:
            tb = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else _EMPTY
            self.arena.run(np.asarray(ops, dtype=np.int64).reshape(-1, OP_FIELDS), tb, out, meta,
                           self.max_candidates, MAX_SCAN, MIN_SUPPORT, grow)
        for block, n in room:
            self.arena.ensure_room(block, n)
        return out, meta

    def replay(self, cursor: _Cursor, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Offline: draft before every output token, then emit it (one compiled call for the whole
        output). Returns (paths [T, width], meta [T, 5]) of the lookup before token t. Labels come
        from `segment` (a fresh automaton: what feeding token by token gives); the cursor's
        automaton is advanced to the end of the output."""
        self.lookup(())  # apply the prompt's appends
        T = output.shape[0]
        if T == 0:
            return np.zeros((0, self.width), dtype=np.int32), np.zeros((0, META_FIELDS), dtype=np.int64)
        if cursor.automaton is None:
            labels = np.zeros(T, dtype=np.int32)
        else:
            labels, cursor.automaton = segment_fed(output, self.table, cursor.structure)
        pre = min(self.max_n, prompt.shape[0])
        tb = np.concatenate([prompt[prompt.shape[0] - pre:], output]).astype(np.int32)
        P = prompt.shape[0]
        t = np.arange(T, dtype=np.int64)
        ctx_n = np.minimum(self.max_n, P + t)
        ops = np.zeros((2 * T, OP_FIELDS), dtype=np.int64)
        look, app = ops[0::2], ops[1::2]
        look[:, 0] = OP_LOOKUP
        look[:, 1] = np.asarray(cursor.blocks, dtype=np.int64)[labels]
        look[:, 2] = pre + t - ctx_n
        look[:, 3] = ctx_n
        look[:, 4] = t
        app[:, 0] = OP_APPEND
        app[:, 1] = look[:, 1]
        app[:, 2] = pre + t
        app[:, 3] = 1
        app[:, 5] = -1
        # Runs of one label: their first token continues the block's last segment or starts one.
        starts = np.flatnonzero(np.diff(labels, prepend=-1))
        ends = np.append(starts[1:], T)
        tail_lin, tail_pos = self.tail_lin, self.tail_pos
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            block = cursor.blocks[labels[s]]
            pos = P + s
            if tail_lin[block] != cursor.lineage or tail_pos[block] != pos:
                lead = min(self.max_n, pos)
                app[s, 4] = pre + s - min(lead, pre + s)
                app[s, 5] = min(lead, pre + s)
            tail_lin[block], tail_pos[block] = cursor.lineage, P + e
        out = np.zeros((T, self.width), dtype=np.int32)
        meta = np.zeros((T, META_FIELDS), dtype=np.int64)
        # Room per block for all of its appends at once (a token each, a new segment's SEP and lead-in),
        # not one reservation per token.
        blocks, which = np.unique(app[:, 1], return_inverse=True)
        sizes = np.bincount(which.reshape(-1), weights=1 + np.where(app[:, 5] >= 0, app[:, 5] + 1, 0))
        grow = list(zip(blocks.tolist(), sizes.astype(np.int64).tolist(), strict=True))
        self.arena.run(ops, tb, out, meta, self.max_candidates, MAX_SCAN, MIN_SUPPORT, grow)
        return out, meta

    def evict(self) -> None:
        """Drop idle queries' histories, least recently used first, while the arena is over its bound."""
        if self.arena.live_tokens <= MAX_LIVE_TOKENS:
            return
        for key, store in sorted(self.stores.items(), key=lambda kv: kv[1].used):
            if self.arena.live_tokens <= MAX_LIVE_TOKENS // 2:
                break
            if not store.running:
                self._drop(key)
                self.evicted += 1

    def end_query(self, query_id: Any) -> None:
        """The query's last call finished: no later call reads its histories (every agent's), drop them."""
        for key in self.query_keys.pop(query_id, ()):
            store = self.stores.get(key)
            if store is not None and not store.running:
                self._drop(key)

    def _drop(self, key: tuple[Any, Any]) -> None:
        """Free a history's blocks, with the appends still queued for them."""
        freed = set(self.stores.pop(key).blocks.values())
        for block in freed:
            self.arena.free_block(block)
        self.queue = [entry for entry in self.queue if entry[0] not in freed]
        self.room = [entry for entry in self.room if entry[0] not in freed]

    # -- internals ----------------------------------------------------------------------------
    def _block(self, store: _Store, key: tuple[str, str] | None) -> int:
        block = store.blocks.get(key)
        if block is None:
            block = store.blocks[key] = self.arena.new_block()
            self.tail_lin = grown(self.tail_lin, block + 1, -1)
            self.tail_pos = grown(self.tail_pos, block + 1, 0)
        return block

    def _feed(self, automaton: StructureAutomaton, tokens: np.ndarray) -> np.ndarray:
        """Label each token with the block active when it starts, feeding its bytes."""
        table = self.table
        feed = automaton.feed
        labels = np.empty(tokens.shape[0], dtype=np.int32)
        for i, t in enumerate(tokens.tolist()):
            labels[i] = automaton.block_index
            feed(table[t])
        return labels

    def _queue_runs(self, cursor: _Cursor, stream: np.ndarray, start: int, labels: np.ndarray) -> None:
        """Queue stream[start:start + len(labels)] as runs of equal labels; a run continues its block's
        last segment when that segment ended right before it (same lineage), else starts a new one
        with the ≤ max_n tokens before it as lead-in."""
        n = labels.shape[0]
        if n == 0:
            return
        if n == 1 or not labels.any():
            bounds = [(0, n)]
        else:
            cuts = np.flatnonzero(labels[1:] != labels[:-1]) + 1
            edges = [0, *cuts.tolist(), n]
            bounds = list(itertools.pairwise(edges))
        tail_lin, tail_pos = self.tail_lin, self.tail_pos
        for s, e in bounds:
            block = cursor.blocks[labels[s]]
            pos = start + s
            if tail_lin[block] == cursor.lineage and tail_pos[block] == pos:
                self.queue.append((block, stream[pos:start + e], None))
            else:
                self.queue.append((block, stream[pos:start + e], stream[max(0, pos - self.max_n):pos]))
            tail_lin[block], tail_pos[block] = cursor.lineage, start + e


def _shared_prefix(docs: list[np.ndarray], prompt: np.ndarray) -> tuple[int, int]:
    """(longest common prefix of `prompt` with any of `docs`, index of that doc); (0, -1) if none."""
    best, which = 0, -1
    for i in range(len(docs) - 1, -1, -1):
        doc = docs[i]
        m = min(doc.shape[0], prompt.shape[0])
        if m <= best:
            continue
        diff = np.flatnonzero(doc[:m] != prompt[:m])
        n = int(diff[0]) if diff.shape[0] else m
        if n > best:
            best, which = n, i
        if which == len(docs) - 1 and best == doc.shape[0]:
            break  # the prompt extends the last call: the usual agent case
    return best, which


__all__ = ["History"]
