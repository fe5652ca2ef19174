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

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from agentspec_sim.cost import build_cost_model
from agentspec_sim.cost.break_even import break_even_at, break_even_grid
from agentspec_sim.drafters.agentspec.allocation import Candidates, allocate, batch_budget, capped_lengths
from agentspec_sim.drafters.agentspec.block_index import (
    META_C,
    META_CT,
    META_FIELDS,
    META_N,
    META_P,
    suffix_batch_meta,
)
from agentspec_sim.drafters.agentspec.history import History
from agentspec_sim.drafters.common.structure import (
    token_bytes_of,
)
from agentspec_sim.drafters.registry import drafter_class, register_drafter
from agentspec_sim.drafters.suffix.rule import DEFAULTS as SUFFIX_DEFAULTS
from agentspec_sim.drafters.suffix.rule import SuffixDrafter
from agentspec_sim.engine.drafting import MAX_SPECULATIVE_TOKENS, BaseDrafter, SpecConfigError, SpeculativeConfig

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.engine.drafting import CallState

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
            self._grid = break_even_grid(self.cost, max(max_batch, BREAK_EVEN_BATCHES))
        return self._grid

    def step_break_even(self, bz: int, mean_context: float) -> float:
        """τ for a step of `bz` drafting calls at `mean_context` (−1: batch-aware drafting is off)."""
        if self.depth_rule != "break_even" or bz <= 0:
            return -1.0

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
    options = tuple(sorted((k, v) for k, v in spec.options if k in SUFFIX_DEFAULTS))
    inner = SpeculativeConfig(method="suffix", num_speculative_tokens=spec.num_speculative_tokens, options=options)
    return SuffixDrafter.configure(inner)


def _r_keys() -> frozenset[str]:
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

    accepted = drafter_class(spec.method).config_keys
    options = dict(spec.options)
    for key, value in (("hardware", hardware), ("model", model), ("tensor_parallel_size", tensor_parallel_size),
                       ("calibration", calibration)):
        if value is not None and key in accepted:
            options.setdefault(key, value)
    if tokenizer is not _UNSET and "tokenizer" in accepted and "tokenizer" not in spec.raw:
        options["tokenizer"] = tokenizer  # the trace's tokenizer, unless the user's config names one
    return replace(spec, options=tuple(sorted(options.items())))


__all__ = ["AGENTSPEC_METHODS", "DEFAULTS", "DEFAULT_K", "DEFAULT_K_S", "PAPER_PRESET", "AgentSpecDrafter",
           "AgentSpecNDrafter", "AgentSpecPaperDrafter", "AgentSpecRDrafter", "AgentSpecSDrafter",
           "bind_engine_context"]
