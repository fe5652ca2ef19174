"""The drafting protocol: everything the engine knows about drafters, and all it imports from this package.

A drafter has two sides.

The Python side is `BaseDrafter` (drafters/base.py, the `Drafter` protocol there): hooks for each call
(`start_call`, `observe`, `finish_call`), `propose` for given rows and draft limits, `draft_time`. The
engine drives it from its event loop; any drafter works with this side alone — the slow path.

A drafter may add a *fast path* for one run: `BaseDrafter.engine_drafting(run)` returns an
`EngineDrafting` (or None, the default). It owns the drafter family's workload tables and its compiled
state and does, for that run, what the hooks and `propose` would do — with exactly their results (each
family's tests compare the two). The engine calls it at three places only:

- `EngineDrafting.propose(rows, calls, max_lens)`: the event loop's proposal for the calls that sampled
  (their `CallState`s and table rows; limits ≥ 1 after the engine's budget and max_model_len clip). It
  sets the drafts itself (`engine/drafts.py`) and returns the drafting seconds, or None to leave the
  step to the drafter's `propose` (the engine then sets what that returns).
- `EngineDrafting.after_step(n_rows)`: after the last step of a run, before any hook: the drafting the
  event loop owes that step (observe and propose in one compiled call) — seconds, or None when the
  engine must run the hooks and `propose` itself (the fast path changed nothing then).
- `EngineDrafting.run_state()`: the compiled state for the next run of steps, or None (the run stops
  at every step that emitted, for the event loop). Between two steps of a run, the engine's compiled
  loop calls `draft_between_steps(c, sb, pb, state, max_model_len)`: the state's own kernel, found
  by the state's class (`compiled_step`) when the loop is compiled, so that a run compiles only the
  drafter it uses (a `normal` run none).

The compiled side's contract (`draft_between_steps`), pre: the step in `sb` (engine/scheduler.py
`StepBuf`) was scheduled and updated — its rows' emitted tokens are in the call table `c`, its
sampled calls listed; `pb` is vLLM's persistent batch (its row order; off unless a drafter asked the
scheduler to track it). Post: either the drafts of every call that sampled and goes on are set and
verified (`engine/drafts.py`) and the drafting seconds returned (≥ 0), or −1.0 is returned with
nothing changed (the event loop then does this step: `after_step`, hooks, `propose`). The kernel
owns its state tuple; the engine owns `c`, `sb` and `pb` and only reads the tuple's identity (a new
tuple per changed array: compiled calls key on it).

Who owns what: the drafter its rule and state (Python objects and the arrays behind its state tuple);
`EngineDrafting` the tables it builds for the run; the engine the call table, the step buffer, the
batch order, the budget policy and when drafting happens. docs/adding-a-drafter.md walks through
writing one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numba import njit
from numba.extending import overload

from agentspec_sim.drafters.base import (
    BaseDrafter,
    SpecConfigError,
    SpeculativeConfig,
    bind_engine_context,
    make_drafter,
    parse_drafter,
    unique_labels,
)
from agentspec_sim.kernel_cache import clear_if_changed, package_sources

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.engine.request import CallState, CallTable
    from agentspec_sim.engine.scheduler import Scheduler

__all__ = ["BaseDrafter", "EngineDrafting", "NoDrafting", "RunView", "SpecConfigError", "SpeculativeConfig",
           "bind_engine_context", "compiled_step", "draft_between_steps", "draft_now", "drafts_every_step",
           "make_drafter", "parse_drafter", "refreshed", "unique_labels"]


@dataclass(frozen=True)
class RunView:
    """What a run shows a drafter's fast path when it is made (`BaseDrafter.engine_drafting`)."""

    drafters: Sequence[BaseDrafter]  # one per tenant (replicate copy); [0] is the one being asked
    spec: SpeculativeConfig
    states: Sequence[CallState]  # every call of the run, by table row
    table: CallTable  # the engine's call table: token arena, columns, draft slots
    scheduler: Scheduler  # its step buffer (`sb`) and persistent batch (`pb`)
    cost: StepCostModel
    max_num_seqs: int
    max_model_len: int
    tokens_digest: str  # the token arena's content digest (keys of the workload tables' disk caches)
    k_of_batch: np.ndarray | None  # int64 [max_num_seqs + 1]: the draft length at that many scheduled calls
    #                                 (None: the budget policy decides per call, not by batch size alone)
    fixed_k: bool  # the policy is one k for every step (FixedK)
    skips_unfit_batches: bool  # the V1 runner's proposer skip near max_model_len applies
    use_tables: bool  # workload tables may stand in for live drafter state (tests turn it off to compare)
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


def refreshed(held: Any, current: dict[str, np.ndarray]) -> Any:
    """`held` (a state tuple) if it holds exactly `current`'s arrays (compared by identity), else a copy holding
    them: a run's state is a new tuple only when an array was replaced, since compiled calls key on it."""
    if all(getattr(held, name) is array for name, array in current.items()):
        return held
    return held._replace(**current)


# -- the compiled side -------------------------------------------------------------------------------
# The dispatch below compiles (and caches, here) whichever drafter's step a run uses, naming its state class.
clear_if_changed(__file__, [*package_sources("agentspec_sim.drafters"), *package_sources("agentspec_sim.engine")])
_STEP_KERNELS: dict[type, tuple[Any, bool]] = {}
STEP_PARAMETERS = ("c", "sb", "pb", "state", "max_model_len")  # the compiled loop compiles the kernel's own code
# As the engine's kernels (engine/kv.py `kernel`): no reference counting of the arrays a step touches (it would
# cost two atomic operations per array per call) — so a step allocates nothing.
STEP_JIT = {"cache": True, "nogil": True, "_nrt": False}


def compiled_step(state_class: type, every_step: bool = False) -> Callable[[Any], Any]:
    """Register `step(c, sb, pb, state, max_model_len) -> seconds | −1.0` (those names; a plain Python function
    in numba's subset, compiled where the loop calls it) as the drafting between two steps for states of
    `state_class` (a NamedTuple of arrays). Python code calls it through `draft_now`. `every_step`: the engine
    calls it after every step of a run, emitting or not (vLLM's suffix proposer runs so); else only
    after a step that emitted."""

    def register(step: Any) -> Any:
        if hasattr(step, "py_func"):
            raise TypeError("register the step's plain Python function: the loop compiles it (`draft_now` from Python)")
        names = tuple(inspect.signature(step).parameters)
        if names != STEP_PARAMETERS:
            raise TypeError(f"a compiled step takes {STEP_PARAMETERS}, not {names}")
        _STEP_KERNELS[state_class] = (step, every_step)
        return step

    return register


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


@overload(drafts_every_step, jit_options=STEP_JIT)
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
