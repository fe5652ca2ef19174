"""The engine's API for drafters: everything a drafter family may import from the engine, and all the
engine knows of drafters. Arrows go one way: families import this module; the engine imports no family.

A drafter has two sides.

The Python side is `BaseDrafter`: hooks for each call (`start_call`, `observe`, `finish_call`), `propose`
for given rows and draft limits, `draft_time`, and the run hooks the engine calls on every drafter
(`bind_workload`, `bind_cost_model`, `begin_step`, `skip_tokens`, `evictions`), each declared below with
a default that does nothing. Class attributes say how vLLM drives the drafter (`driven_per_step`,
`v1_runner`) and what it costs in memory (`bytes_per_token`). The engine drives it from its event loop;
any drafter works with this side alone — the slow path.

A drafter may add a *fast path* for one run: a function `(drafter, RunView) -> EngineDrafting | None`
registered with `@fast_path_for(DrafterClass)`, kept in the module `fastpath` of the drafter's package
(loaded the first time a run of that drafter asks: `BaseDrafter.engine_drafting`). The `EngineDrafting`
it returns owns the family's workload tables and its compiled state and does, for that run, what the hooks
and `propose` would do — with exactly their results (each family's tests compare the two). The engine
calls it at three places only:

- `EngineDrafting.propose(rows, calls, max_lens)`: the event loop's proposal for the calls that sampled
  (their `CallState`s and table rows; limits ≥ 1 after the engine's budget and max_model_len clip). It
  sets the drafts itself (the draft-slot helpers below) and returns the drafting seconds, or None to leave
  the step to the drafter's `propose` (the engine then sets what that returns).
- `EngineDrafting.after_step(n_rows)`: after the last step of a run, before any hook: the drafting the
  event loop owes that step (observe and propose in one compiled call) — seconds, or None when the
  engine must run the hooks and `propose` itself (the fast path changed nothing then).
- `EngineDrafting.run_state()`: the compiled state for the next run of steps, or None (the run stops
  at every step that emitted, for the event loop). Between two steps of a run, the engine's compiled
  loop calls `draft_between_steps(c, sb, pb, state, max_model_len)`: the state's own kernel, found
  by the state's class (`compiled_step`) when the loop is compiled, so that a run compiles only the
  drafter it uses (a `normal` run none).

The compiled side's contract (`draft_between_steps`), pre: the step in `sb` (the scheduler's step buffer,
its counters by name: `SC_*`) was scheduled and updated — its rows' emitted tokens are in the call table
`c` (columns by name: `CALL_FIELDS`), its sampled calls listed; `pb` is vLLM's persistent batch (its row
order; off unless a drafter asked the scheduler to track it). Post: either the drafts of every call that
sampled and goes on are set and verified (`set_verified`, `drafts_from`…) and the drafting seconds returned
(≥ 0), or −1.0 is returned with nothing changed (the event loop then does this step: `after_step`, hooks,
`propose`). The kernel owns its state tuple; the engine owns `c`, `sb` and `pb` and only reads the tuple's
identity (a new tuple per changed array: compiled calls key on it).

Who owns what: the drafter its rule and state (Python objects and the arrays behind its state tuple);
`EngineDrafting` the tables it builds for the run; the engine the call table, the step buffer, the
batch order, the budget policy and when drafting happens. docs/adding-a-drafter.md walks through
writing one.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np
from numba import njit
from numba.extending import overload

from agentspec_sim.engine import counters as _counters
from agentspec_sim.engine import drafts as _drafts
from agentspec_sim.engine import kv as _kv
from agentspec_sim.engine.counters import DS_K_MAX, PB_ON, SC_ROWS, SC_SAMPLED, SC_TOP
from agentspec_sim.engine.drafts import (
    DraftSlots,
    batch_k,
    drafting_calls,
    drafts_from,
    drafts_from_out,
    proposer_skipped,
    sampled_calls,
    set_verified,
    verify,
)
from agentspec_sim.engine.fastcall import FastCall
from agentspec_sim.engine.kv import kernel
from agentspec_sim.engine.request import S_FINISHED, CallState, CallTable
from agentspec_sim.host.kernel_cache import clear_if_changed, package_sources

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.trace.schema import Workload

# The engine sources whose compiled functions a drafter's kernel calls (the draft-slot helpers, the kernel
# decorators): a family's `clear_if_changed` lists them beside its own.
ENGINE_KERNEL_SOURCES = (_drafts.__file__, _kv.__file__, _counters.__file__)

# Everything a drafter family may use of the engine (docs/architecture.md).
__all__ = [
    "COMMON_KEYS", "DS_K_MAX", "ENGINE_KERNEL_SOURCES", "MAX_SPECULATIVE_TOKENS", "NO_EFFECT_KEYS", "PB_ON",
    "SC_ROWS", "SC_SAMPLED", "SC_TOP", "S_FINISHED", "BaseDrafter", "CallState", "CallTable", "DraftSlots",
    "Drafter", "EngineDrafting", "FastCall", "NoDrafting", "RunView", "SchedulerView", "SpecConfigError",
    "SpeculativeConfig", "batch_k", "caches_loop", "compiled_step", "draft_between_steps", "draft_now",
    "draft_now_for", "drafting_calls", "drafts_every_step", "drafts_from", "drafts_from_out", "fast_path_for",
    "grown", "kernel", "new_drafter", "proposer_skipped", "refreshed", "sampled_calls", "set_verified", "verify"
]


class SpecConfigError(ValueError):
    """A speculative config (JSON or `--drafter` name) that vLLM would reject, with the reason."""


# Keys every method accepts (vLLM SpeculativeConfig fields the simulator models).
# `budget_policy` (simulator-only) picks a registered budget policy, e.g. "adaspec" (agentspec_sim.budget).
COMMON_KEYS = frozenset({"method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "budget_policy"})
# vLLM fields that select weights, kernels or parallelism of a draft model: accepted, no effect here.
NO_EFFECT_KEYS = frozenset({"model", "draft_tensor_parallel_size", "quantization", "revision", "code_revision"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculative-decoding configuration, resolved (defaults filled, vLLM's rules applied).

    `num_speculative_tokens` is k, the most tokens a call drafts per step (0 for `normal`).
    `num_speculative_tokens_per_batch_size` holds `(start, end, k)` inclusive ranges of the number
    of requests scheduled in a step. `options` holds the method's own keys (sorted (key, value) pairs),
    `label` the name shown in tables (default: the method); `drafter_class` the class that drafts it.
    """

    method: str
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    options: tuple[tuple[str, Any], ...] = ()
    label: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The drafter class the method names, resolved when the config is parsed (drafters/registry.py): the engine
    # makes its drafters from it without knowing any family.
    drafter_class: type[BaseDrafter] | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.label or self.method

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    def to_json(self) -> dict[str, Any]:
        """The resolved config as `--speculative-config` JSON (defaults made explicit). The vLLM keys that
        have no effect here (`NO_EFFECT_KEYS`: the draft `model`…) are kept as given, so a configuration
        printed for `vllm serve` still names the draft weights the user chose."""
        out: dict[str, Any] = {"method": self.method}
        if self.method != "normal":
            out["num_speculative_tokens"] = self.num_speculative_tokens
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        if self.num_speculative_tokens_per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.num_speculative_tokens_per_batch_size]
        out.update(dict(self.options))
        for key in sorted(NO_EFFECT_KEYS & set(self.raw)):
            out.setdefault(key, self.raw[key])
        return out


# The longest draft the simulator takes: per-call draft buffers are sized by k, and no context is long
# enough for more to matter (vLLM itself sets no upper bound).
MAX_SPECULATIVE_TOKENS = 4096


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for running calls. One instance per run and tenant (replicate copy).

    The engine drives it in this order for each call: `start_call` once, when the call's prompt is
    fully prefilled and its first output token has been sampled; then, after every engine step in
    which the call emitted tokens, `observe` with exactly those tokens, and (if the call goes on)
    `propose` for the next step; `finish_call` once, after the call's last `observe`. A preempted
    call keeps its state and is not started again. Exceptions the V1 runner imposes: in a step whose
    batch has a request within k tokens of max_model_len nobody is proposed for (the engine hands out
    k token-0 drafts), and a drafter with `driven_per_step` (suffix) is driven as vLLM drives it:
    `propose` after every step, no `observe` at max_model_len or in such skipped steps.

    What a drafter may read of a `CallState`: `call` (the trace `Call`: agent_id, query_id, role,
    structure, workspace — never `output_tokens`), `tokens` (prompt + tokens emitted so far; the
    buffer behind it is larger, and reading past `num_tokens` is reading the answer), `num_tokens`,
    `prompt_len`, `num_emitted`, and `drafter_state`, a slot the drafter owns. It must not assume
    where the recorded output ends.
    """

    name: ClassVar[str]

    def start_call(self, state: CallState) -> None:
        """Pre: `state.num_emitted == 1`. Post: the drafter may keep per-call state in `state.drafter_state`."""

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Draft for the next step, one call per row.

        Pre:  every row is started, not finished, and sampled a token in the step just ended;
              `max_lens[i] ≥ 1` (rows whose budget is 0 are not passed).
        Post: returns `len(rows)` int32 arrays, the i-th of length ≤ `max_lens[i]` (empty: no
              draft); proposals depend only on what the drafter has been shown (determinism).
        """
        ...

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        """Pre: `emitted` (≥ 1 token) is already appended to `state.tokens`. Post: state updated."""

    def finish_call(self, state: CallState) -> None:
        """The call emitted its last token; release per-call state (shared history may keep it)."""

    def draft_time(self, cost: StepCostModel, rows: Sequence[CallState], max_lens: np.ndarray) -> float:
        """Seconds of drafting for one `propose` over `rows` (before the step that verifies them); ≥ 0."""
        ...


def new_drafter(spec: SpeculativeConfig) -> BaseDrafter:
    """A fresh drafter for `spec` (no state shared with any other instance)."""
    if spec.drafter_class is None:
        raise SpecConfigError(f"speculative config for {spec.method!r} names no drafter class: parse it with "
                              "agentspec_sim.drafters.registry.parse_drafter")
    return spec.drafter_class(spec)


class BaseDrafter(ABC):
    """Default no-op hooks and model-free drafting cost; drafters subclass it and override `propose`.

    Class attributes a drafter sets: `name` (registry key, set by `register_drafter`), `config_keys` (its
    own speculative-config keys), `supports_batch_size_schedule` (vLLM allows
    `num_speculative_tokens_per_batch_size`), `shorthand` (the config `--drafter NAME` stands for; None:
    `{"method": NAME}`), `budget_policy` (the policy it drafts under when the config names none; None:
    vLLM's rule), `driven_per_step` (vLLM's V1 runner drives the proposer after every step, emitting or
    not, as its suffix proposer), `v1_runner` (False: a Model Runner V2 drafter, which does not skip the
    proposer for a batch near max_model_len), `bytes_per_token` (the memory its state takes per token
    of the trace: (its workload table, one tenant; its live state, per tenant), for the run's memory
    guard) and `uses_draft_network` (it drafts with a draft network's forward passes, eagle3/mtp: the
    target model's profile must have one, checked before any run). `configure` applies the method's
    defaults and vLLM's validation to a parsed config.
    """

    name: ClassVar[str] = ""
    config_keys: ClassVar[frozenset[str]] = frozenset()
    supports_batch_size_schedule: ClassVar[bool] = False
    shorthand: ClassVar[Mapping[str, Any] | None] = None
    budget_policy: ClassVar[str | None] = None
    driven_per_step: ClassVar[bool] = False
    v1_runner: ClassVar[bool] = True
    async_scheduling: ClassVar[bool] = False
    bytes_per_token: ClassVar[tuple[float, float]] = (170.0, 170.0)
    uses_draft_network: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec

    @classmethod
    def draft_network(cls, spec: SpeculativeConfig, model: str | None = None) -> str:
        """The cost model's draft network a drafter of `spec` runs for target `model` (`draft_model_time(kind=…)`):
        its method's (eagle3, mtp); vLLM's draft_model method names its draft model."""
        return cls.name

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        return spec

    @classmethod
    def bind_context(cls, spec: SpeculativeConfig, **context: Any) -> SpeculativeConfig:
        """`spec` with what an engine run knows filled in where the drafter's config takes it and does not
        set it (`bind_engine_context`: hardware, model, tensor_parallel_size, calibration, seed, tokenizer)."""
        return spec

    @classmethod
    def acceptance_params(cls, spec: SpeculativeConfig, model: str | None = None) -> Any | None:
        """The acceptance model's parameters a run of `spec` on an engine serving `model` resolves (a
        model-based drafter's, with their source and any uncertainty band: run/band.py); None for a drafter
        whose drafts are its rule's own."""
        return None

    def engine_drafting(self, run: RunView) -> EngineDrafting | None:
        """This drafter's fast path for a run (`EngineDrafting`, given a `RunView`), or None: the engine drives
        the hooks and `propose`. The default asks the function registered for the nearest class of this
        drafter (`fast_path_for`), loading the `fastpath` module of the drafter's package the first time."""
        make = _fast_path_of(type(self))
        return None if make is None else make(self, run)

    # -- run hooks: the engine calls each on every drafter; the defaults do nothing ------------------------
    def bind_workload(self, workload: Workload) -> None:
        """Before the run: the whole workload (drafters that index other queries, agspec)."""
        return None  # optional hook: most drafters need nothing here

    def bind_cost_model(self, cost: StepCostModel) -> None:
        """Before the run: the engine's cost model (drafters that size drafts by M(b), agentspec)."""
        return None  # optional hook: most drafters need nothing here

    def begin_step(self, num_drafting: int) -> None:
        """Before `propose` when copies of a workload share the batch (each its own drafter): how many calls
        draft in the step in all (drafters that size drafts by the batch, agentspec's B_t)."""
        return None  # optional hook: most drafters need nothing here

    def skip_tokens(self, state: CallState, n: int) -> None:
        """A `driven_per_step` drafter only: `state`'s last `n` tokens were emitted in a step whose proposer
        vLLM skipped (a batch near max_model_len), so no `observe` sees them."""
        return None  # optional hook: most drafters need nothing here

    def evictions(self) -> int:
        """Histories the drafter dropped over its memory bound before their query ended (the run reports
        them: its drafts are then an approximation)."""
        return 0

    def start_call(self, state: CallState) -> None:
        return None

    @abstractmethod
    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """The drafter's rule (`Drafter.propose` has the contract): every drafter defines it (a class without one
        cannot be instantiated)."""

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        return None

    def finish_call(self, state: CallState) -> None:
        return None

    def draft_time(self, cost: StepCostModel, rows: Sequence[CallState], max_lens: np.ndarray) -> float:
        # Model-free proposers (n-gram lookup, suffix trees) run on the CPU between steps.
        return float(cost.model_free_draft_time(len(rows))) if len(rows) else 0.0

    def draft_time_bound(self, cost: StepCostModel, num_calls: int, draft_len: int,
                         context_lens: np.ndarray) -> float | None:
        """The most seconds one proposal over at most `num_calls` rows, drafts of at most `draft_len` tokens and
        contexts of at most `context_lens`, can take (`draft_time` is non-decreasing in each): the event loop's
        horizon (engine/simulator.py `_step_bound`). None for a drafter that prices drafting its own way and
        states no bound."""
        if type(self).draft_time is not BaseDrafter.draft_time:
            return None
        return float(cost.model_free_draft_time(num_calls)) if num_calls else 0.0


def grown(array: np.ndarray, rows: int, fill: int) -> np.ndarray:
    """`array` if it has ≥ `rows` rows, else a copy with at least twice as many, the new rows `fill`
    (per-row state that drafters share with the engine's compiled loop grows this way)."""
    if rows <= array.shape[0]:
        return array
    out = np.full((max(2 * array.shape[0], rows), *array.shape[1:]), fill, dtype=array.dtype)
    out[:array.shape[0]] = array
    return out


class SchedulerView(Protocol):
    """What a fast path uses of the engine's scheduler (engine/scheduler.py `Scheduler`)."""

    sb: Any  # the step buffer: the step's rows, its lists (`sampled`…) and counters (`SC_*`)
    pb: Any  # vLLM's persistent batch (row order), when a drafter asked for it

    def set_drafts_from_tokens(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Set each row's draft to `lengths` tokens of the token arena from `starts`."""


@dataclass(frozen=True)
class RunView:
    """What a run shows a drafter's fast path when it is made (`BaseDrafter.engine_drafting`)."""

    drafters: Sequence[BaseDrafter]  # one per tenant (replicate copy); [0] is the one being asked
    spec: SpeculativeConfig
    states: Sequence[CallState]  # every call of the run, by table row
    table: CallTable  # the engine's call table: token arena, columns, draft slots
    scheduler: SchedulerView  # its step buffer (`sb`) and persistent batch (`pb`)
    cost: StepCostModel
    max_num_seqs: int
    max_model_len: int
    tokens_digest: str  # the token arena's content digest (keys of the workload tables' disk caches)
    k_of_batch: np.ndarray | None  # int64 [max_num_seqs + 1]: the draft length at that many scheduled calls
    #                                 (None: the budget policy decides per call, not by batch size alone)
    fixed_k: bool  # the policy is one k for every step (FixedK)
    skips_unfit_batches: bool  # the V1 runner's proposer skip near max_model_len applies
    use_tables: bool  # workload tables may stand in for live drafter state (tests turn it off to compare)
    sees_every_call: bool  # this engine runs every call (False: a data-parallel rank, its share of them); a table
    #                        of drafter state carried from call to call holds only then, one per request always
    drafter_hooks: Callable[[Sequence[CallState], np.ndarray, np.ndarray], None]
    # ↑ the engine's start_call / observe / finish_call for a step's rows (their emitted counts, started flags)
    runnable: Callable[[], tuple[list[np.ndarray], list[np.ndarray | None], np.ndarray]]
    # ↑ every call's prompt, the output it emits in this run (None: never runs) and those lengths (−1)

    def model_free_draft_s(self) -> np.ndarray:
        """The drafter's CPU drafting seconds for 0…max_num_seqs drafting calls."""
        drafter = self.drafters[0]
        return np.array([drafter.draft_time(self.cost, [None] * n, np.zeros(n, dtype=np.int64))
                         for n in range(self.max_num_seqs + 1)], dtype=np.float64)


class EngineDrafting:
    """One run's fast path of a drafter family (see the module docstring). The defaults do nothing: every
    proposal goes to the drafter's `propose` and every run stops where a drafter must see the tokens."""

    # Drafting reads the family's workload tables, not per-call drafter state: the engine skips the hooks.
    replaces_hooks: bool = False
    # `after_step` stands in for the hooks after a run's last step (it runs them itself where it must).
    observes_steps: bool = False

    def run_state(self) -> NamedTuple | None:
        return None

    def propose(self, rows: Sequence[CallState], calls: np.ndarray, max_lens: np.ndarray) -> float | None:
        return None

    def after_step(self, n_rows: int) -> float | None:
        return None

    def finish_run(self) -> None:
        """The run has ended (its last step drafted, nothing left to simulate): what the fast path keeps for the
        next run of the workload, if anything (suffix notes its forest's size)."""

    # A drafter driven after every step (`driven_per_step`, vLLM's suffix proposer; the engine's
    # `Simulator._per_step_drafts` is the V1 runner's part):
    def sync(self) -> None:
        """Apply to the drafter's Python state what the compiled steps changed, before the event loop drives it."""

    def per_step_drafts(self, rows: Sequence[CallState], calls: np.ndarray, emitted: np.ndarray,
                        num_tokens: np.ndarray) -> float | None:
        """The step's appends and drafts for the batch rows `rows` (vLLM's persistent-batch order; their table
        rows, emitted counts and token counts), the proposer known to run: seconds, or None — then the
        engine calls `observe` (which starts a call it has no state for: not `start_call`), `finish_call`
        and `propose`."""
        return None


_FAST_PATHS: dict[type, Callable[[Any, RunView], EngineDrafting | None]] = {}
_SEARCHED: set[str] = set()  # packages whose `fastpath` module was looked for


def fast_path_for(*drafter_classes: type[BaseDrafter]) -> Callable[[Callable], Callable]:
    """Register `make(drafter, run) -> EngineDrafting | None` as the fast path of these drafter classes and
    their subclasses (the nearest registered class wins; `make` may return None for a subclass it does
    not cover)."""

    def register(make: Callable[[Any, RunView], EngineDrafting | None]) -> Callable:
        for cls in drafter_classes:
            _FAST_PATHS[cls] = make
        return make

    return register


def _fast_path_of(cls: type) -> Callable[[Any, RunView], EngineDrafting | None] | None:
    for klass in cls.__mro__:
        package = klass.__module__.rpartition(".")[0]
        if package and package not in _SEARCHED:
            _SEARCHED.add(package)  # a family's compiled path lives in its package's `fastpath` module
            if importlib.util.find_spec(f"{package}.fastpath") is not None:
                importlib.import_module(f"{package}.fastpath")
        if klass in _FAST_PATHS:
            return _FAST_PATHS[klass]
    return None


def refreshed(held: Any, current: dict[str, np.ndarray]) -> Any:
    """`held` (a state tuple) if it holds exactly `current`'s arrays (compared by identity), else a copy holding
    them: a run's state is a new tuple only when an array was replaced, since compiled calls key on it."""
    if all(getattr(held, name) is array for name, array in current.items()):
        return held
    return held._replace(**current)


# -- the compiled side -------------------------------------------------------------------------------
# The dispatch below compiles (and caches, here) whichever drafter's step a run uses, naming its state class;
# so does the scheduler's compiled loop. Numba keys neither cache on the step's source: `compiled_step` does,
# per registered state class (`_stamp_loop_caches`).
clear_if_changed(__file__, package_sources("agentspec_sim.engine"))
LOOP_MODULES = (__file__, str(Path(__file__).with_name("scheduler.py")))  # the modules that compile steps in
_STEP_KERNELS: dict[type, tuple[Any, bool]] = {}
# State classes defined outside the package (a plugin's, a test's): numba's cache index of a loop that compiled
# one would name its module, and every later process that reads the index imports it (or fails to, from another
# directory) — so loops over these states compile without the on-disk cache (`caches_loop`).
_UNCACHED_STATES: set[type] = set()
STEP_PARAMETERS = ("c", "sb", "pb", "state", "max_model_len")  # the compiled loop compiles the kernel's own code
# As the engine's kernels (engine/kv.py `kernel`): no reference counting of the arrays a step touches (it would
# cost two atomic operations per array per call) — so a step allocates nothing.
STEP_JIT = {"cache": True, "nogil": True, "_nrt": False}


def compiled_step(state_class: type, every_step: bool = False,
                  depends_on: Sequence[str] = ()) -> Callable[[Any], Any]:
    """Register `step(c, sb, pb, state, max_model_len) -> seconds | −1.0` (those names; a plain Python function
    in numba's subset, compiled where the loop calls it) as the drafting between two steps for states of
    `state_class` (a NamedTuple of arrays). Python code calls it through `draft_now`. `every_step`: the engine
    calls it after every step of a run, emitting or not (vLLM's suffix proposer runs so); else only
    after a step that emitted. `depends_on`: source files outside the step's package whose compiled functions
    it calls (the package's own files are always counted)."""

    def register(step: Any) -> Any:
        if hasattr(step, "py_func"):
            raise TypeError("register the step's plain Python function: the loop compiles it (`draft_now` from Python)")
        names = tuple(inspect.signature(step).parameters)
        if names != STEP_PARAMETERS:
            raise TypeError(f"a compiled step takes {STEP_PARAMETERS}, not {names}")
        _STEP_KERNELS[state_class] = (step, every_step)
        if state_class.__module__.split(".")[0] == __name__.split(".")[0]:
            _stamp_loop_caches(state_class, [*_package_files(step), *depends_on])
        else:
            _UNCACHED_STATES.add(state_class)
        return step

    return register


def _package_files(step: Callable[..., Any]) -> list[str]:
    """The source files of the package that defines `step` (its own file where it is a top-level module)."""
    module = inspect.getmodule(step)
    package = getattr(module, "__package__", None)
    if package:
        return package_sources(package)
    source = inspect.getsourcefile(step)
    return [source] if source else []


def _stamp_loop_caches(state_class: type, sources: Sequence[str]) -> None:
    """Drop the cached compiled loops (`LOOP_MODULES`) when the sources of `state_class`'s step changed since
    they were compiled: they hold the step's machine code, and numba checks only their own files."""
    stamp = f"{state_class.__module__}.{state_class.__qualname__}"
    for module in LOOP_MODULES:
        clear_if_changed(module, sources, stamp=stamp)


def caches_loop(state: Any) -> bool:
    """Whether a compiled loop drafting with `state` may use the on-disk cache (its step is the package's)."""
    return type(state) not in _UNCACHED_STATES


def draft_between_steps(c: Any, sb: Any, pb: Any, state: Any, max_model_len: int) -> float:
    """Compiled code only: the registered kernel of `state`'s class (`compiled_step`)."""
    raise TypeError("draft_between_steps is called from compiled code")


def drafts_every_step(state: Any) -> bool:
    """Compiled code only: whether `state`'s kernel is called after every step (`compiled_step`)."""
    raise TypeError("drafts_every_step is called from compiled code")


def _registered(state: Any) -> tuple[Any, bool] | None:
    return _STEP_KERNELS.get(getattr(state, "instance_class", None))


@overload(draft_between_steps, jit_options=STEP_JIT)
def _draft_between_steps(c, sb, pb, state, max_model_len):
    found = _registered(state)
    # The step itself is the implementation, compiled here in its caller's context: one compiled copy of
    # the drafter's step (a dispatcher of its own would be a second, and would share this one's cache files).
    return None if found is None else found[0]


# Not cached on disk: the lambda it returns is compiled per state type, steps registered outside the package
# included, and a cache index naming such a type makes every later process that opens it import its module.
@overload(drafts_every_step, jit_options={**STEP_JIT, "cache": False})
def _drafts_every_step(state):
    found = _registered(state)
    if found is None:
        return None
    every = found[1]
    return lambda state: every


@njit(**STEP_JIT)
def draft_now(c, sb, pb, state, max_model_len):
    """`draft_between_steps` called from Python (an event loop drafting the step just run)."""
    return draft_between_steps(c, sb, pb, state, max_model_len)


# `draft_now` for the states of steps registered outside the package (`caches_loop`): no on-disk cache.
draft_now_uncached = njit(**{**STEP_JIT, "cache": False})(draft_now.py_func)


def draft_now_for(state: Any) -> Any:
    """The compiled `draft_now` to call with `state` (wrap it in a `FastCall` to call it step after step)."""
    return draft_now if caches_loop(state) else draft_now_uncached


class NoDrafting(NamedTuple):
    """The state of a run in which nothing drafts between steps (a drafter without a fast path, or
    `normal`): the loop stops at every step that emitted, for the event loop."""

    unused: np.ndarray

    @classmethod
    def make(cls) -> NoDrafting:
        return cls(np.zeros(1, dtype=np.int8))


@compiled_step(NoDrafting)
def _no_drafting(c, sb, pb, state, max_model_len):
    return -1.0
