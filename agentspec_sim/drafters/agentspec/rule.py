"""`agentspec` and its ablations `agentspec-s`, `agentspec-n`, `agentspec-r` (the AgentSpec paper, §4,
Algorithms 1–2, Table 6); docs/agentspec.md works the rules out with examples.

**Structure-isolated drafting (Algorithm 1).** Each call has a `StructureAutomaton` over its
`structure`, fed the bytes of every emitted token through the cached token→bytes map
(`TraceTokenizer.token_bytes()`, never the tokenizer); its state names the active block. The
history cache H(agent, query, block) holds, per (agent_id, query_id) and per block — keyed by the
block's delimiter strings `(open, close)`, or ROOT outside every block, so calls with different
structures share a block's history when its delimiters match:

- the call's **prompt**, segmented by the same automaton rules run over the prompt from its start
  (the API sends the prompt with the structure; in agent workloads earlier tool outputs, files and
  the agent's own earlier turns live there). An agent's prompt mostly repeats the previous call's
  prompt + output: the part shared with one of the query's last `DOCS_KEPT` calls (longest common
  prefix, compared token by token) is already in the cache and is not indexed again (indexing it
  twice would count one occurrence twice in n and c); only the rest is. When the prompt extends
  the previous call exactly, the automaton continues from that call's final state instead of
  re-reading the prompt;
- every emitted token of every earlier call of the same (agent, query), and the current call's
  own output so far (indexed as it is emitted, under the block the automaton gives each token:
  the block active when the token starts, so an opener's tokens belong to the outer block and a
  closer's to the inner one).

Drafts come only from the cache of (the call's agent, its query, the active block); an empty cache
or no match → no draft. The index is `block_index.BlockArena` (n-gram hash chains over each block's
segments; see that module): the context is the call's last `max_match_len` tokens (whatever
block they were in), the match is the **longest suffix of the context, of length in
[min_match_len, max_match_len], that occurs in the block's history with ≥ 1 token after it**,
and the candidates are the continuations after its occurrences (the `max_candidates` newest, each
≤ k tokens, never past the end of the segment it is in).

**Candidates → CT* and c (Algorithm 2, lines 10–11).** The plurality path P (at each depth the
most frequent next token among the candidates that agree so far; ties to the newest); CT* is the
longest prefix of P on which a strict majority of the n candidates, and at least `MIN_SUPPORT` = 2
of them, agree (a continuation seen once is not "frequent"); c is how many agree with all of CT*
(if CT* is empty, how many share P's first token). Hand-made examples in tests/test_agentspec.py.

**Redundancy-aware budget (Algorithm 2, equations 1–3).** g = (c/n)·p(n), p(n) = g_min + (1 −
g_min)(1 − e^{1−n}) — equation 1; Algorithm 2's pseudocode writes e^{−n}, which would make p(1) =
g_min + 0.63(1 − g_min) instead of g_min; we follow equation 1. B_t = ⌊α / bz⌋, bz = the number of
calls drafting in this step (the rows of this `propose`: decode calls with budget ≥ 1; prefill
chunks do not draft). L_i = max(|CT_i\\*|, B_t·g_i/Σg), n_i = 0 → L_i = 0; the fractional shares
are rounded by largest remainder so they add up to B_t exactly (`allocate`). The draft is P[:L_i],
capped by k (`num_speculative_tokens`) and by the engine's per-call limit. `"budget":
"token_budget"` replaces B_t with the paper's M(bz) = AI − bz from the engine's cost model
(AgentSpec+; needs the engine context, `bind_engine_context`).

**Variants** (paper Table 6). `agentspec-s`: structure-isolated drafting, no budget: P[:k] (CT*
and then the most frequent continuation) with a fixed k. `agentspec-n`: no structure input: one
block per (agent, query) — the whole query scope. `agentspec-r`: vLLM's `suffix` drafter, used as
is (composition: its trees, its drafts), plus the redundancy budget: n = the count of the tree
node the context matches, c_j = the count of the node after j draft tokens (suffix-tree counts
include the context's own occurrence, so a context seen once before has c/n ≤ 1/2, as the
tree's own probabilities say), CT* and L_i as above, the draft truncated to L_i.

**Batch-aware drafting (the defaults of `agentspec` and `agentspec-n`; docs/agentspec.md §3b).** Per
step, τ = t_V(bz)/t_A(bz) at the drafting calls' mean context, from the engine's cost model
(`cost/break_even.py`): every draft stops at the break-even depth ⌊ln τ / ln g⌋ (token j only while
g^j ≥ τ, `depth: break_even`); B = M(bz) (`budget: token_budget`); lookups match from one token, but a
match shorter than `ct_min_match` is weak — no CT* beyond its budget share, g with the saturation floor
g_min, and drafted only in a loose step, τ ≤ g_min^ct_min_match. `agentspec-paper` is the paper's
behaviour (`PAPER_PRESET`: ⌊α/bz⌋, no depth bound, one minimum match length 3), the defaults before.

Config keys: `num_speculative_tokens` k (the per-call cap and the candidate length; default
`DEFAULT_K`), `alpha`, `g_min`, `budget`, `depth`, `min_match_len`, `ct_min_match`, `max_match_len`,
`max_candidates`, the paper's open rules `single_candidate` ("share" / "ct_only"), `prompt_history`
(true / false: outputs only) and `match` ("longest" / "pattern"), `tokenizer` (the trace's; null: no
structure is read), and the engine context for `token_budget` and `break_even`: `hardware`, `model`,
`tensor_parallel_size`, `calibration`. `agentspec-r` takes
the suffix keys instead of the match keys; `agentspec-s` takes no budget keys, `agentspec-n` no
tokenizer. The defaults and the sweeps behind them are in docs/agentspec.md.

State: one `BlockArena` and one `_Store` per (agent, query) per drafter instance; a query's stores
are dropped when its last call finishes — AgentSpec keeps every running query's history (the paper's
space O(H), appendix A.4). The simulator's live history bounds its own memory: past `MAX_LIVE_TOKENS`
arena tokens it drops stores whose query has no running call, least recently used first, and counts
them (`History.evicted`; the run reports them, and its drafts are then an approximation). The engine
drafts agentspec, agentspec-s and agentspec-n from a table made once per workload where it can
(drafters/agentspec/tables.py), which holds no histories and has no such bound.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numba import njit

from agentspec_sim.drafters.agentspec.block_index import (
    META_C,
    META_CT,
    META_FIELDS,
    META_MATCH,
    META_N,
    META_P,
    OP_APPEND,
    OP_FIELDS,
    OP_LOOKUP,
    BlockArena,
    match_levels,
    suffix_batch_meta,
)
from agentspec_sim.drafters.common.structure import (
    ROOT,
    StructureAutomaton,
    block_labels,
    segment,
    segment_fed,
    token_bytes_of,
)
from agentspec_sim.drafters.registry import register_drafter
from agentspec_sim.engine.drafting import MAX_SPECULATIVE_TOKENS, BaseDrafter, SpecConfigError, SpeculativeConfig, grown

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.engine.drafting import CallState
    from agentspec_sim.trace.schema import Call

DEFAULT_K = 32
DEFAULT_K_S = 5  # agentspec-s: fixed draft length (the paper's NGram k, A.1)
MATCH_DEFAULTS: dict[str, Any] = {"min_match_len": 3, "max_match_len": 16, "max_candidates": 32}
BUDGET_DEFAULTS: dict[str, Any] = {"alpha": 512, "g_min": 0.5, "budget": "alpha"}
# Batch-aware drafting (docs/agentspec.md §3): lookups match from one token, but only a match of ≥
# `ct_min_match` tokens drafts its CT* beyond the step's budget M(b) (shorter ones draft inside it,
# where verification is nearly free), and every draft stops at the break-even depth ("depth":
# token j only while g^j ≥ τ(b), `cost/break_even.py`; "allocation": the paper's L_i alone).
BATCH_AWARE_DEFAULTS: dict[str, Any] = {"min_match_len": 1, "ct_min_match": 3, "budget": "token_budget",
                                        "depth": "break_even"}
# The paper's open rules, as switches (docs/agentspec.md §4): whether a one-candidate row gets a budget
# share ("share") or only its CT* ("ct_only"); whether the call's prompt is history (else outputs only);
# "longest": candidates follow the longest matching suffix, "pattern": every occurrence of the last
# min_match_len tokens.
RULE_DEFAULTS: dict[str, Any] = {"single_candidate": "share", "prompt_history": True, "match": "longest"}
STRUCTURE_DEFAULTS: dict[str, Any] = {"tokenizer": "qwen3"}
DEFAULTS: dict[str, Any] = {**MATCH_DEFAULTS, **BUDGET_DEFAULTS, **BATCH_AWARE_DEFAULTS, **RULE_DEFAULTS,
                            **STRUCTURE_DEFAULTS}
# `agentspec-paper`: the behaviour the paper describes, with nothing of ours on top: B_t = ⌊α/bz⌋,
# L_i = max(|CT*|, B_t·g_i/Σg) with no cost bound, one minimum match length (3, this project's
# measured choice: the paper names none) for lookups and CT* alike.
PAPER_PRESET: dict[str, Any] = {"min_match_len": 3, "ct_min_match": 3, "budget": "alpha", "depth": "allocation"}
SINGLE_CANDIDATE_RULES = ("share", "ct_only")
MATCH_RULES = ("longest", "pattern")
BUDGET_MODES = ("alpha", "token_budget")
DEPTH_RULES = ("break_even", "allocation")
BREAK_EVEN_BATCHES = 1024  # the break-even grid's reach (vLLM's largest default max_num_seqs); grown on demand
ENGINE_KEYS = frozenset({"hardware", "model", "tensor_parallel_size", "calibration"})
DOCS_KEPT = 4  # earlier calls of a query whose token sequences a new prompt is compared with
MAX_LIVE_TOKENS = 8_000_000  # the live history's memory bound: arena tokens kept before idle ones are dropped (LRU)
MAX_SCAN = 256  # chain entries a lookup examines at its matching level (newest first)
MIN_SUPPORT = 2  # candidates that must agree with every CT* token, besides a strict majority (docs/agentspec.md)

_EMPTY = np.zeros(0, dtype=np.int32)
# Digests of token→bytes maps, by identity (a map lives as long as its tokenizer and is never mutated):
# every run's table key takes one, a Python pass over the whole vocabulary (~0.1 s for Qwen3's).
_TABLE_DIGESTS: dict[int, tuple[Sequence[bytes], bytes]] = {}


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


# --------------------------------------------------------------------------------------------
# Config.


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_budget_options(opts: dict[str, Any]) -> None:
    alpha, g_min, mode = opts["alpha"], opts["g_min"], opts["budget"]
    if not _is_number(alpha) or alpha < 0:
        raise SpecConfigError(f"alpha={alpha!r} must be a number ≥ 0")
    if not _is_number(g_min) or not 0 <= g_min <= 1:
        raise SpecConfigError(f"g_min={g_min!r} must be a number in [0, 1]")
    if mode not in BUDGET_MODES:
        raise SpecConfigError(f"budget={mode!r} must be one of {', '.join(BUDGET_MODES)}")
    depth = opts.get("depth", "allocation")
    if depth not in DEPTH_RULES:
        raise SpecConfigError(f"depth={depth!r} must be one of {', '.join(DEPTH_RULES)}")


def _check_rule_options(opts: dict[str, Any]) -> None:
    """The batch-aware and paper-rule switches, where the variant takes them."""
    if "ct_min_match" in opts and (not _is_int(opts["ct_min_match"]) or opts["ct_min_match"] < 1):
        raise SpecConfigError(f"ct_min_match={opts['ct_min_match']!r} must be an integer ≥ 1")
    if opts.get("single_candidate", "share") not in SINGLE_CANDIDATE_RULES:
        raise SpecConfigError(f"single_candidate={opts['single_candidate']!r} must be one of "
                              f"{', '.join(SINGLE_CANDIDATE_RULES)}")
    if not isinstance(opts.get("prompt_history", True), bool):
        raise SpecConfigError(f"prompt_history={opts['prompt_history']!r} must be true or false")
    if opts.get("match", "longest") not in MATCH_RULES:
        raise SpecConfigError(f"match={opts['match']!r} must be one of {', '.join(MATCH_RULES)}")


def engine_cost_model(opts: dict[str, Any]) -> StepCostModel | None:
    """The cost model named by the bound engine context (for `budget: token_budget`), or None."""
    if opts.get("hardware") is None or opts.get("model") is None:
        return None
    from agentspec_sim.cost import build_cost_model

    return build_cost_model(opts["hardware"], opts["model"], int(opts.get("tensor_parallel_size") or 1),
                            opts.get("calibration"))


_UNSET: Any = object()  # `bind_engine_context`'s "not given" (None is a value: an ids-only trace)


class BatchBudget:
    """The step budget B_t: ⌊α/bz⌋, or M(bz) from the engine's cost model."""

    @classmethod
    def bind_context(cls, spec: SpeculativeConfig, *, hardware: str | None = None, model: str | None = None,
                     tensor_parallel_size: int | None = None, calibration: str | None = None,
                     tokenizer: str | None = _UNSET, **_: Any) -> SpeculativeConfig:
        return bind_engine_context(spec, hardware=hardware, model=model, tensor_parallel_size=tensor_parallel_size,
                                   calibration=calibration, tokenizer=tokenizer)

    def _init_budget(self, opts: dict[str, Any]) -> None:
        self.alpha = float(opts["alpha"])
        self.g_min = float(opts["g_min"])
        self.mode = opts["budget"]
        self.depth_rule = opts.get("depth", "allocation")
        needs_cost = self.mode == "token_budget" or self.depth_rule == "break_even"
        self.cost: StepCostModel | None = engine_cost_model(opts) if needs_cost else None
        self._step_rows: int | None = None  # drafting rows of the whole engine step, if the engine says
        self._grid: np.ndarray | None = None  # the break-even grid of `cost` (`break_even_grid`)

    def begin_step(self, num_drafting: int) -> None:
        """Engine hook (optional): the next `propose` is part of a step in which `num_drafting` calls
        draft in all — more than this drafter's rows when replicate copies each have a drafter. Then
        bz = num_drafting and this drafter allocates its rows' share of B_t, ⌊B_t·rows/bz⌋."""
        self._step_rows = int(num_drafting)

    def bind_cost_model(self, cost: StepCostModel) -> None:
        """Engine hook: the run's cost model (used by `budget: token_budget` and `depth: break_even`;
        wins over named profiles)."""
        self.cost = cost
        self._grid = None

    def batch_share(self, rows: int) -> tuple[int, int]:
        """(B_t for this drafter's `rows` drafting calls, the step's drafting calls bz); consumes the
        `begin_step` count."""
        bz, self._step_rows = max(self._step_rows or rows, rows), None
        budget = self.step_budget(bz)
        return (budget if bz == rows else budget * rows // bz), bz

    def break_even_grid(self, max_batch: int = BREAK_EVEN_BATCHES) -> np.ndarray:
        """The cost model's τ grid (`cost/break_even.py`) when drafting is batch-aware, else an empty
        [1, 1] grid (τ off). Its batch sizes are a prefix-stable ladder, so every grid of one cost model
        agrees where they overlap: the engine's compiled steps and this drafter's `propose` read one τ."""
        if self.depth_rule != "break_even":
            return np.zeros((1, 1))
        if self.cost is None:
            raise SpecConfigError("depth 'break_even' needs the engine's cost model: bind the engine context "
                                  "(agentspec.bind_engine_context) or call bind_cost_model")
        if self._grid is None or self._grid[-1, 0] < max_batch:
            from agentspec_sim.cost.break_even import break_even_grid

            self._grid = break_even_grid(self.cost, max(max_batch, BREAK_EVEN_BATCHES))
        return self._grid

    def step_break_even(self, bz: int, mean_context: float) -> float:
        """τ for a step of `bz` drafting calls at `mean_context` (−1: batch-aware drafting is off)."""
        if self.depth_rule != "break_even" or bz <= 0:
            return -1.0
        from agentspec_sim.cost.break_even import break_even_at

        return float(break_even_at(self.break_even_grid(bz), float(bz), float(mean_context)))

    def step_budget(self, bz: int) -> int:
        if self.mode == "alpha":
            return batch_budget(self.alpha, bz)
        if self.cost is None:
            raise SpecConfigError("budget 'token_budget' needs the engine's cost model: bind the engine context "
                                  "(agentspec.bind_engine_context) or call bind_cost_model")
        return int(self.cost.token_budget(bz)) if bz > 0 else 0


# --------------------------------------------------------------------------------------------
# Drafters.


class _AgentSpecBase(BatchBudget, BaseDrafter):
    """Structure-isolated drafting over `History`, with or without the redundancy budget."""

    # Memory per token of the trace (its workload table, one tenant; its live state, per tenant).
    bytes_per_token = (32.0, 170.0)

    structured: ClassVar[bool] = True
    budgeted: ClassVar[bool] = True
    default_k: ClassVar[int] = DEFAULT_K
    option_defaults: ClassVar[dict[str, Any]] = DEFAULTS
    config_keys: ClassVar[frozenset[str]] = frozenset(DEFAULTS) | ENGINE_KEYS
    supports_batch_size_schedule: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        opts = {**self.option_defaults, **dict(spec.options)}
        self.k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else self.default_k
        if self.budgeted:
            self._init_budget(opts)
        table = None
        if self.structured and opts.get("tokenizer") is not None:
            table = token_bytes_of(str(opts["tokenizer"]))
        self.ct_min_match = int(opts.get("ct_min_match", 0))
        self.single_ct_only = opts.get("single_candidate", "share") == "ct_only"
        self.history = History(int(opts["min_match_len"]), int(opts["max_match_len"]), max(self.k, 1),
                               int(opts["max_candidates"]), table, structured=self.structured,
                               index_prompts=bool(opts.get("prompt_history", True)))
        self.max_n = int(opts["max_match_len"])
        self.last: tuple[np.ndarray, np.ndarray] | None = None  # (meta, lengths) of the last propose, for tools

    def evictions(self) -> int:
        return self.history.evicted

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        opts = {**cls.option_defaults, **dict(spec.options)}
        if cls.budgeted:
            _check_budget_options(opts)
        lo, hi, cand = opts["min_match_len"], opts["max_match_len"], opts["max_candidates"]
        if not _is_int(lo) or not _is_int(hi) or not 1 <= lo <= hi:
            raise SpecConfigError(f"need integers 1 ≤ min_match_len ≤ max_match_len, got {lo!r}, {hi!r}")
        if not _is_int(cand) or not 1 <= cand <= MAX_SPECULATIVE_TOKENS:  # per-lookup buffers are sized by it
            raise SpecConfigError(f"max_candidates={cand!r} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if opts.get("tokenizer") is not None and not isinstance(opts["tokenizer"], str):
            raise SpecConfigError(f"tokenizer={opts['tokenizer']!r} must be a tokenizer name, a path, or null")
        _check_rule_options(opts)
        if opts.get("match") == "pattern":
            opts["max_match_len"] = lo  # every occurrence of the last min_match_len tokens
        k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else cls.default_k
        return replace(spec, num_speculative_tokens=k, options=tuple(sorted(opts.items())))

    # -- the engine's hooks ----------------------------------------------------------------------
    def start_call(self, state: CallState) -> None:
        """Index the prompt (the part new to the query's history); the first token comes with `observe`."""
        cursor = self.history.start(state.call, state.history[:state.prompt_len],
                                    state.call.output_tokens[:state.target_len])
        state.drafter_state = cursor
        if cursor.labels is not None:
            self.history.attach_row(state.index, cursor)

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        """Feed the emitted tokens to the call's automaton and queue them into their blocks."""
        cursor = state.drafter_state
        if cursor is None:
            self.start_call(state)
            cursor = state.drafter_state
        end = state.prompt_len + state.num_emitted
        self.history.emit(cursor, state.history, end - emitted.shape[0], emitted.shape[0])

    def finish_call(self, state: CallState) -> None:
        cursor = state.drafter_state
        if cursor is not None:
            self.history.finish(cursor, state.tokens)
            self.history.detach_row(state.index)
            state.drafter_state = None
        if state.last_in_query:
            self.history.end_query(state.call.query_id)
        self.history.evict()

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Look up every row's block (one compiled call), then allocate the lengths over the batch."""
        history = self.history
        max_n = self.max_n
        requests = []
        for row in rows:
            end = row.prompt_len + row.num_emitted
            requests.append((history.block_of(row.drafter_state, row.num_emitted),
                             row.history[max(0, end - max_n):end]))
        out, meta = history.lookup(requests)
        mean_context = sum(row.prompt_len + row.num_emitted for row in rows) / len(rows) if rows else 0.0
        lengths = self.lengths(meta, np.asarray(max_lens, dtype=np.int64), mean_context)
        self.last = (meta, lengths)
        return [out[i, :lengths[i]] for i in range(len(rows))]

    def lengths(self, meta: np.ndarray, max_lens: np.ndarray, mean_context: float = 0.0) -> np.ndarray:
        """Draft lengths from the lookups' (n, c, |CT*|, |P|): the budget (`allocate`), then the caps
        min(·, |P|, max_lens, k) and, batch-aware, the break-even depth at τ(bz, mean_context) — in one
        compiled call, a step's fixed cost at small batches."""
        m = meta.shape[0]
        out = np.empty(m, dtype=np.int64)
        budget, tau = 0, -1.0
        if self.budgeted:
            budget, bz = self.batch_share(m)
            tau = self.step_break_even(bz, mean_context)
        capped_lengths(meta, max_lens, int(budget), float(self.g_min) if self.budgeted else 0.0, int(self.k),
                       self.budgeted, self.ct_min_match, self.single_ct_only, tau, out, np.empty((2, m)),
                       np.empty((4, m), dtype=np.int64))
        return out


@register_drafter("agentspec")
class AgentSpecDrafter(_AgentSpecBase):
    """AgentSpec: structure-isolated drafting + redundancy-aware budget (module docstring)."""


@register_drafter("agentspec-s")
class AgentSpecSDrafter(_AgentSpecBase):
    """AgentSpec (S): structure-isolated drafting only — P[:k], a fixed k (default `DEFAULT_K_S`)."""

    budgeted = False
    default_k = DEFAULT_K_S
    option_defaults: ClassVar[dict[str, Any]] = {**MATCH_DEFAULTS, "prompt_history": True, "match": "longest",
                                                 **STRUCTURE_DEFAULTS}
    config_keys = frozenset(option_defaults)


@register_drafter("agentspec-n")
class AgentSpecNDrafter(_AgentSpecBase):
    """AgentSpec (N): no structure input — one history per (agent, query), plus the budget."""

    structured = False
    option_defaults: ClassVar[dict[str, Any]] = {**MATCH_DEFAULTS, **BUDGET_DEFAULTS, **BATCH_AWARE_DEFAULTS,
                                                 **RULE_DEFAULTS}
    config_keys = frozenset(option_defaults) | ENGINE_KEYS


@register_drafter("agentspec-paper")
class AgentSpecPaperDrafter(_AgentSpecBase):
    """AgentSpec as the paper describes it (`PAPER_PRESET`: ⌊α/bz⌋, L_i = max(|CT*|, share), one minimum
    match length, no cost bound), beside the batch-aware defaults of `agentspec`."""

    option_defaults: ClassVar[dict[str, Any]] = {**DEFAULTS, **PAPER_PRESET}


# --------------------------------------------------------------------------------------------
# agentspec-r: the suffix drafter + the redundancy budget.


@register_drafter("agentspec-r")
class AgentSpecRDrafter(BatchBudget, BaseDrafter):
    """AgentSpec (R): vLLM's suffix decoding (`drafters/suffix/rule.py`, composed) + the redundancy budget."""

    supports_batch_size_schedule: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        from agentspec_sim.drafters.suffix.rule import SuffixDrafter

        super().__init__(spec)
        opts = {**BUDGET_DEFAULTS, **dict(spec.options)}
        self._init_budget(opts)
        self.inner = SuffixDrafter(_suffix_spec(spec))
        self.k = self.inner.k
        self.last: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        opts = {**BUDGET_DEFAULTS, **dict(spec.options)}
        _check_budget_options(opts)
        k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else DEFAULT_K
        inner = _suffix_spec(replace(spec, num_speculative_tokens=k, options=tuple(sorted(opts.items()))))
        opts.update(dict(inner.options))
        return replace(spec, num_speculative_tokens=inner.num_speculative_tokens, options=tuple(sorted(opts.items())))

    def start_call(self, state: CallState) -> None:
        self.inner.start_call(state)

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        self.inner.observe(state, emitted)

    def finish_call(self, state: CallState) -> None:
        self.inner.finish_call(state)

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Suffix drafts, then n / c from the tree counts along each draft, then L_i truncates."""
        drafts = self.inner.propose(rows, max_lens)
        forest = self.inner.forest
        depth = self.inner.depth
        roots = np.full((len(rows), 2), -1, dtype=np.int64)
        ctxs, drs = [], []
        for i, row in enumerate(rows):
            end = row.prompt_len + row.num_emitted
            ctxs.append(row.history[max(0, end - depth):end])
            drs.append(drafts[i])
            slot = row.drafter_state
            if slot is not None and slot.local_root >= 0:
                roots[i, 0] = slot.local_root  # the prompt tree first: it wins ties, as in suffix.py
            roots[i, 1] = self.inner.global_root
        meta = np.zeros((len(rows), META_FIELDS), dtype=np.int64)
        if rows:
            ctx_off = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([c.shape[0] for c in ctxs], out=ctx_off[1:])
            draft_off = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([d.shape[0] for d in drs], out=draft_off[1:])
            suffix_batch_meta(forest.nd, forest.sq, forest.pool, forest.ht, roots,
                              np.concatenate(ctxs).astype(np.int32, copy=False),
                              ctx_off, np.concatenate(drs).astype(np.int32, copy=False), draft_off, meta)
        cands = Candidates.of(meta[:, META_N], meta[:, META_C], meta[:, META_CT])
        lengths = np.minimum(allocate(cands, self.batch_share(len(rows))[0], self.g_min), meta[:, META_P])
        self.last = (meta, lengths)
        return [d[:lengths[i]] for i, d in enumerate(drafts)]


def _suffix_spec(spec: SpeculativeConfig) -> SpeculativeConfig:
    """The inner `suffix` config of an agentspec-r config (its suffix keys, its k), resolved by suffix's rules."""
    from agentspec_sim.drafters.suffix.rule import DEFAULTS as SUFFIX_DEFAULTS
    from agentspec_sim.drafters.suffix.rule import SuffixDrafter

    options = tuple(sorted((k, v) for k, v in spec.options if k in SUFFIX_DEFAULTS))
    inner = SpeculativeConfig(method="suffix", num_speculative_tokens=spec.num_speculative_tokens, options=options)
    return SuffixDrafter.configure(inner)


def _r_keys() -> frozenset[str]:
    from agentspec_sim.drafters.suffix.rule import DEFAULTS as SUFFIX_DEFAULTS

    return frozenset(SUFFIX_DEFAULTS) | frozenset(BUDGET_DEFAULTS) | ENGINE_KEYS


AgentSpecRDrafter.config_keys = _r_keys()


# --------------------------------------------------------------------------------------------
# Engine context.

AGENTSPEC_METHODS = ("agentspec", "agentspec-s", "agentspec-n", "agentspec-r", "agentspec+", "agentspec-paper")


def bind_engine_context(spec: SpeculativeConfig, *, hardware: str | None = None, model: str | None = None,
                        tensor_parallel_size: int | None = None, calibration: str | None = None,
                        tokenizer: str | None = _UNSET) -> SpeculativeConfig:
    """Fill what an engine run knows into an AgentSpec-family config, unless the config sets it:
    the cost-model identity (`hardware`, `model`, `tensor_parallel_size`, `calibration`: M(b) for
    `budget: token_budget`) and the trace's `tokenizer` (None for an ids-only trace: no structure
    is read). Configs of other methods are returned unchanged."""
    if spec.method not in AGENTSPEC_METHODS:
        return spec
    from agentspec_sim.drafters.registry import drafter_class

    accepted = drafter_class(spec.method).config_keys
    options = dict(spec.options)
    for key, value in (("hardware", hardware), ("model", model), ("tensor_parallel_size", tensor_parallel_size),
                       ("calibration", calibration)):
        if value is not None and key in accepted:
            options.setdefault(key, value)
    if tokenizer is not _UNSET and "tokenizer" in accepted and "tokenizer" not in spec.raw:
        options["tokenizer"] = tokenizer  # the trace's tokenizer, unless the user's config names one
    return replace(spec, options=tuple(sorted(options.items())))


__all__ = [
    "AGENTSPEC_METHODS", "DEFAULTS", "DEFAULT_K", "DEFAULT_K_S", "PAPER_PRESET", "AgentSpecDrafter",
    "AgentSpecNDrafter", "AgentSpecPaperDrafter", "AgentSpecRDrafter", "AgentSpecSDrafter", "Candidates", "History",
    "allocate", "batch_budget", "bind_engine_context", "break_even_depth", "capped_lengths", "redundancy_score",
    "saturation",
]
