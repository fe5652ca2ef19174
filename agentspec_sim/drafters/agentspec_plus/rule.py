"""`agentspec+`: AgentSpec's structure-isolated drafting and redundancy-aware budget, extended with
AgSpec's workspace indexing, its three corpora and its per-call cap controller (ours; the parts are
the AgentSpec paper §4 and the AgSpec article, docs/agentspec.md §10 has the rules and the ablation).

Per draft, for a call of (agent, query) whose automaton is in block β:

1. **Corpora, in priority order** (`corpora`, default session → workspace → global); the first one
   with a match drafts:
   - *session*: H(agent, query, β), AgentSpec's block history (prompt by block + every emitted
     token of the query; `agentspec.History`): n candidate continuations → P, CT*, c;
   - *workspace*: the call's workspace files in the representations its emission needs (raw;
     + ' '/'-' prefixed lines for diff harnesses; + JSON-escaped for JSON tool calls; all four when
     the trace gives no emission: `agspec.forms_for`), longest suffix match (`corpus_index`): one
     candidate, n = c = 1;
   - *global*: H(*, *, β) over the **outputs of the calls this drafter has finished** (every query
     of this tenant; causal, like SuffixDecoding's global tree: nothing is drafted from text not yet
     generated), a `History` keyed by the block's delimiters, so a python block drafts only from
     earlier python blocks of other queries: P, CT*, c as for the session.
   `structure: false` puts every token of a query (session) and of all queries (global) in one block.
2. **Budget**: L_i = max(|CT_i*|, B·g_i/Σg) over the step's drafting calls (AgentSpec's Algorithm 2,
   `agentspec.allocate`), with B = M(b) = ⌊AI − b⌋, the paper's available token budget, from the
   engine's cost model (`budget: "token_budget"`, default), or B = ⌊α/b⌋ (`"alpha"`, AgentSpec), or
   no allocation: L_i = k (`"none"`). b is the whole step's drafting batch (`begin_step`).
3. **Caps**: each call starts at its role's cap (`role_caps`, a file from `agentspec-sim analyze
   roles`; none: k) and AgSpec's online controller halves it after two rejected drafts and grows
   it by one after a fully accepted one (`controller`, `agspec.CapController`); a call at cap 0
   takes no share of B. The draft is P[:L_i], capped by the call's cap, k and the engine's limit.

Config keys: AgentSpec's (`num_speculative_tokens` k = 32, `min_match_len`, `max_match_len`,
`max_candidates`, `alpha`, `g_min`, `budget`, `tokenizer`, the engine context) and the switches
`structure`, `corpora`, `forms`, `forms_when_absent`, `role_caps`, `controller`. The workspace index
matches from `min_match_len` tokens like the block histories.

State per drafter (one tenant): the session `History` (bounded as agentspec's), the global
`History` (every finished output of the tenant, unbounded: ≈ 150 B per token), the tokenized
workspace representations and their indexes (LRU-bounded). Per call: cursor, workspace index, cap
controller, and the length of the draft awaiting verification.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from agentspec_sim.drafters.agentspec.allocation import Candidates, allocate, redundancy_score
from agentspec_sim.drafters.agentspec.block_index import META_C, META_CT, META_FIELDS, META_MATCH, META_N, META_P
from agentspec_sim.drafters.agentspec.history import History
from agentspec_sim.drafters.agentspec.rule import BUDGET_DEFAULTS, DEFAULT_K, ENGINE_KEYS, MATCH_DEFAULTS, BatchBudget
from agentspec_sim.drafters.agspec.corpus_index import NGramIndex, continuation_len, lookup
from agentspec_sim.drafters.agspec.rule import (
    FORMS,
    AgSpecSettings,
    CapController,
    RepresentationCache,
    RoleCaps,
    check_forms,
    check_role_caps,
    forms_for,
    read_cap_file,
)
from agentspec_sim.drafters.common.structure import token_bytes_of
from agentspec_sim.drafters.registry import is_int, register_drafter
from agentspec_sim.engine.drafting import MAX_SPECULATIVE_TOKENS, BaseDrafter, SpecConfigError, SpeculativeConfig

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState
    from agentspec_sim.trace.schema import Call

CORPORA = ("session", "workspace", "global")
SESSION, WORKSPACE, GLOBAL = range(3)
BUDGET_MODES = ("token_budget", "alpha", "none")
SELECT_MODES = ("priority", "redundancy")
PARTS_DEFAULTS: dict[str, Any] = {
    "structure": True,
    "corpora": CORPORA,
    "forms": "emission",
    "forms_when_absent": "all",
    "select": "redundancy",
    "role_caps": None,
    "controller": True,
}
# min_match_len 2 with CT* only after 3-token matches (ct_min_match): short matches draft from M(b)'s
# shares at small batches and not at large ones (docs/agentspec.md §10 has the measurements).
DEFAULTS: dict[str, Any] = {**MATCH_DEFAULTS, "min_match_len": 2, "ct_min_match": 3, **BUDGET_DEFAULTS,
                            "budget": "token_budget", "tokenizer": "qwen3", **PARTS_DEFAULTS}
WORKSPACE_CANDIDATES = 256  # occurrences a workspace lookup examines (agspec's max_candidates)
GLOBAL_KEY = ("*", "*")  # the global history's one store: every query of the tenant
MAX_WORKSPACES = 64  # built workspace indexes kept, by file list

_EMPTY = np.zeros(0, dtype=np.int32)


def validate(opts: dict[str, Any]) -> dict[str, Any]:
    """Check every agentspec+ key (SpecConfigError naming the key and the rule); lists become tuples."""
    out = dict(opts)
    lo, hi, cand = out["min_match_len"], out["max_match_len"], out["max_candidates"]
    if not is_int(lo) or not is_int(hi) or not 1 <= lo <= hi:
        raise SpecConfigError(f"need integers 1 ≤ min_match_len ≤ max_match_len, got {lo!r}, {hi!r}")
    ct_min = out["ct_min_match"]
    if ct_min is not None and (not is_int(ct_min) or ct_min < 1):
        raise SpecConfigError(f"ct_min_match={ct_min!r} must be an integer ≥ 1 or null (= min_match_len)")
    if not is_int(cand) or not 1 <= cand <= MAX_SPECULATIVE_TOKENS:  # per-lookup buffers are sized by it
        raise SpecConfigError(f"max_candidates={cand!r} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
    alpha, g_min = out["alpha"], out["g_min"]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha < 0:
        raise SpecConfigError(f"alpha={alpha!r} must be a number ≥ 0")
    if isinstance(g_min, bool) or not isinstance(g_min, int | float) or not 0 <= g_min <= 1:
        raise SpecConfigError(f"g_min={g_min!r} must be a number in [0, 1]")
    if out["select"] not in SELECT_MODES:
        raise SpecConfigError(f"select={out['select']!r} must be one of {', '.join(SELECT_MODES)}")
    if out["budget"] not in BUDGET_MODES:
        raise SpecConfigError(f"budget={out['budget']!r} must be one of {', '.join(BUDGET_MODES)}")
    corpora = out["corpora"]
    if (not isinstance(corpora, list | tuple) or not corpora or any(c not in CORPORA for c in corpora)
            or len(set(corpora)) != len(corpora)):
        raise SpecConfigError(f"corpora={corpora!r}: a non-empty list of distinct names from {', '.join(CORPORA)}")
    out["corpora"] = tuple(corpora)
    out["forms"] = check_forms("forms", out["forms"], ("emission",))
    out["forms_when_absent"] = check_forms("forms_when_absent", out["forms_when_absent"], ("all", *FORMS))
    for key in ("structure", "controller"):
        if not isinstance(out[key], bool):
            raise SpecConfigError(f"{key}={out[key]!r} must be true or false")
    if out["tokenizer"] is not None and not isinstance(out["tokenizer"], str):
        raise SpecConfigError(f"tokenizer={out['tokenizer']!r} must be a tokenizer name, a path, or null")
    check_role_caps(out["role_caps"])
    return out


class _Workspaces:
    """Workspace indexes: a call's files in its representations, tokenized once per (content, form)
    and indexed once per file list (the workspace is cumulative, so consecutive calls often share it)."""

    def __init__(self, tokenizer: str, n: int, forms: Any, when_absent: Any) -> None:
        self.reps = RepresentationCache(tokenizer, ensure_ascii=False)
        self.n, self.forms, self.when_absent = n, forms, when_absent
        self.indexes: OrderedDict[tuple, NGramIndex] = OrderedDict()

    def index_of(self, call: Call) -> NGramIndex | None:
        forms = forms_for(call.emission, self.forms, self.when_absent)
        items = [(RepresentationCache.digest(f.content), form, f.content) for f in call.workspace if f.content
                 for form in forms]
        if not items:
            return None
        key = tuple((d, form) for d, form, _ in items)
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = NGramIndex.from_docs(self.reps.get(items), self.n)
            while len(self.indexes) > MAX_WORKSPACES:
                self.indexes.popitem(last=False)
        else:
            self.indexes.move_to_end(key)
        return index


class _PlusCall:
    """One call's drafting state: session cursor, global blocks (label → block), workspace index,
    cap controller, pending draft length."""

    __slots__ = ("ctl", "cursor", "global_blocks", "pending", "workspace")

    def __init__(self, cursor: Any, global_blocks: list[int] | None, workspace: NGramIndex | None,
                 ctl: CapController) -> None:
        self.cursor, self.global_blocks, self.workspace, self.ctl = cursor, global_blocks, workspace, ctl
        self.pending = 0


@register_drafter("agentspec+")
class AgentSpecPlusDrafter(BatchBudget, BaseDrafter):
    """AgentSpec + AgSpec (module docstring); one instance per run and tenant."""

    # `--drafter agentspec+`: AgentSpec's k=32 (the cap: M(b) and the controller size drafts).
    shorthand: ClassVar[dict] = {"method": "agentspec+", "num_speculative_tokens": 32}

    config_keys: ClassVar[frozenset[str]] = frozenset(DEFAULTS) | ENGINE_KEYS
    supports_batch_size_schedule: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        opts = {**DEFAULTS, **dict(spec.options)}
        self.k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else DEFAULT_K
        self.budgeted = opts["budget"] != "none"
        self._init_budget({**opts, "budget": opts["budget"] if self.budgeted else "alpha"})
        tokenizer = opts.get("tokenizer")
        table = None
        if tokenizer is not None:
            table = token_bytes_of(str(tokenizer))
        lo, hi, cand = int(opts["min_match_len"]), int(opts["max_match_len"]), int(opts["max_candidates"])
        structured = bool(opts["structure"])
        self.order = tuple(CORPORA.index(c) for c in opts["corpora"])
        self.by_redundancy = opts["select"] == "redundancy"
        self.history = History(lo, hi, max(self.k, 1), cand, table, structured=structured)
        self.global_history = (History(lo, hi, max(self.k, 1), cand, table, structured=structured)
                               if GLOBAL in self.order else None)
        self.workspaces = (_Workspaces(str(tokenizer), lo, opts["forms"], opts["forms_when_absent"])
                           if WORKSPACE in self.order and tokenizer is not None else None)
        self.min_n, self.max_n = lo, hi
        self.ct_min = int(opts["ct_min_match"] or lo)
        self.caps = read_cap_file(opts["role_caps"]) if opts["role_caps"] else RoleCaps({}, None)
        self.ctl_settings = AgSpecSettings(k=self.k, controller=bool(opts["controller"]))
        self.source_counts = [0, 0, 0]  # drafts proposed from session, workspace, global (diagnostics)
        self.last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (meta, lengths, source) for tools

    def evictions(self) -> int:
        return self.history.evicted

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        given = dict(spec.options)
        opts = validate({**DEFAULTS, **given})
        k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else DEFAULT_K
        return replace(spec, num_speculative_tokens=k, options=tuple(sorted(opts.items())))

    # -- the engine's hooks ----------------------------------------------------------------------
    def start_call(self, state: CallState) -> None:
        """Index the prompt into the session history; attach global blocks, workspace, controller."""
        call = state.call
        cursor = self.history.start(call, state.history[:state.prompt_len])
        global_blocks = (self.global_history.blocks_for(GLOBAL_KEY, call.structure)
                         if self.global_history is not None else None)
        workspace = self.workspaces.index_of(call) if self.workspaces is not None and call.workspace else None
        ctl = CapController(self.caps.cap_for(call.role, self.k), self.ctl_settings)
        state.drafter_state = _PlusCall(cursor, global_blocks, workspace, ctl)

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        """Feed the emitted tokens to the session history; the pending draft's verification to the controller."""
        slot: _PlusCall | None = state.drafter_state
        if slot is None:
            self.start_call(state)
            slot = state.drafter_state
        end = state.prompt_len + state.num_emitted
        self.history.emit(slot.cursor, state.history, end - emitted.shape[0], emitted.shape[0])
        if slot.pending:
            slot.ctl.update(slot.pending, min(int(emitted.shape[0]) - 1, slot.pending))
            slot.pending = 0

    def finish_call(self, state: CallState) -> None:
        """Close the session cursor; the call's output joins the global history (by block)."""
        slot: _PlusCall | None = state.drafter_state
        if slot is not None:
            tokens = state.tokens
            self.history.finish(slot.cursor, tokens)
            if self.global_history is not None:
                self.global_history.add_text(GLOBAL_KEY, state.call.structure, tokens[state.prompt_len:])
            state.drafter_state = None
        if state.last_in_query:
            self.history.end_query(state.call.query_id)
        self.history.evict()

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Session lookups (one compiled call), then workspace and global for the rows without
        candidates, then the budget over all rows and the caps."""
        num = len(rows)
        max_n = self.max_n
        caps = np.empty(num, dtype=np.int64)
        contexts = []
        for i, row in enumerate(rows):
            caps[i] = row.drafter_state.ctl.allowance()
            end = row.prompt_len + row.num_emitted
            contexts.append(row.history[max(0, end - max_n):end])
        out = np.zeros((num, max(self.k, 1)), dtype=np.int32)
        meta = np.zeros((num, META_FIELDS), dtype=np.int64)
        source = np.full(num, -1, dtype=np.int64)
        score = np.zeros(num)  # g of the chosen corpus's candidates (select: redundancy)
        for src in self.order:
            # priority: a row drafts from the first corpus with candidates; redundancy: every corpus
            # is asked and the one whose candidates score the highest g wins (ties: the earlier).
            todo = [i for i in range(num) if caps[i] > 0 and (self.by_redundancy or source[i] < 0)]
            if not todo:
                break
            if src == WORKSPACE:
                self._workspace_drafts(rows, contexts, todo, out, meta, source, score)
                continue
            history = self.history if src == SESSION else self.global_history
            if src == SESSION:
                requests = [(history.block_of(rows[i].drafter_state.cursor), contexts[i]) for i in todo]
            else:
                requests = [(self._global_block(rows[i].drafter_state), contexts[i]) for i in todo]
            paths, found = history.lookup(requests)
            g = redundancy_score(found[:, META_C], found[:, META_N], self.g_min)
            for j, i in enumerate(todo):
                if found[j, META_N] > 0 and (source[i] < 0 or g[j] > score[i]):
                    out[i], meta[i], source[i], score[i] = paths[j], found[j], src, g[j]
        lengths = self.lengths(meta, np.asarray(max_lens, dtype=np.int64), caps)
        for i in range(num):
            rows[i].drafter_state.pending = int(lengths[i])
            if lengths[i] > 0:
                self.source_counts[source[i]] += 1
        self.last = (meta, lengths, source)
        return [out[i, :lengths[i]] for i in range(num)]

    def lengths(self, meta: np.ndarray, max_lens: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Draft lengths: the budget's L_i (or k), then the plurality path's length, the caps and k."""
        if self.budgeted:
            n = np.where(caps > 0, meta[:, META_N], 0)  # a call at cap 0 takes no share of B
            # CT* drafts beyond the budget only after a match of ≥ ct_min_match tokens; shorter matches
            # draft from their budget share alone (which vanishes at large batches, where M(b) → 0).
            ct = np.where(meta[:, META_MATCH] >= self.ct_min, meta[:, META_CT], 0)
            wanted = allocate(Candidates.of(n, meta[:, META_C], ct), self.batch_share(meta.shape[0])[0], self.g_min)
        else:
            self._step_rows = None  # the step's batch size only sizes B
            wanted = np.full(meta.shape[0], self.k, dtype=np.int64)
        return np.minimum(np.minimum(wanted, meta[:, META_P]), np.minimum(np.minimum(max_lens, caps), self.k))

    # -- internals ------------------------------------------------------------------------------
    def _global_block(self, slot: _PlusCall) -> int:
        auto = slot.cursor.automaton
        return slot.global_blocks[auto.block_index if auto is not None else 0]

    def _workspace_drafts(self, rows, contexts, todo, out, meta, source, score) -> None:
        """The longest workspace match's continuation, as one candidate (n = c = 1, CT* = ∅)."""
        k = self.k
        g_one = float(redundancy_score(1, 1, self.g_min))
        for i in todo:
            index = rows[i].drafter_state.workspace
            if index is None:
                continue
            ctx = np.ascontiguousarray(contexts[i], dtype=np.int32)
            corpus = index.tokens
            if source[i] >= 0 and score[i] >= g_one:
                continue
            start, _ = lookup(ctx, ctx.shape[0], corpus, corpus.shape[0], index.tkey, index.tval, index.prev,
                              index.owner, -1, self.min_n, self.max_n, WORKSPACE_CANDIDATES)
            if start < 0:
                continue
            m = continuation_len(corpus, start, corpus.shape[0], k)
            if m <= 0:
                continue
            out[i, :m] = corpus[start:start + m]
            meta[i, META_N], meta[i, META_C], meta[i, META_CT], meta[i, META_P] = 1, 1, 0, m
            source[i], score[i] = WORKSPACE, g_one


__all__ = ["CORPORA", "DEFAULTS", "AgentSpecPlusDrafter", "validate"]
