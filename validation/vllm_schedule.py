"""vLLM's own schedule, step by step, read from its scheduler, and lined up with the simulator's.

`ScheduleRecorder` wraps three methods of an in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
`LLM.llm_engine.engine_core.engine_core`): `Scheduler.schedule` (what each step runs: per request the
tokens scheduled, the tokens computed before the step, the draft token ids scheduled for
verification), `Scheduler._preempt_request` (who is preempted, in order) and the in-process client's `get_output`
(`InprocClient`: one `EngineCore.step_fn` plus `post_step`, which hands the drafts to the scheduler; the
step's wall time). Nothing of vLLM's behaviour changes: each wrapper calls the original and reads
what it returns or the request state it leaves.

vLLM 0.32/0.33 names read (v1/core/sched/output.py, scheduler.py, v1/engine/core.py):
`SchedulerOutput.num_scheduled_tokens` (req id → tokens, in scheduling order: running, then
waiting), `.scheduled_new_reqs[i].num_computed_tokens`, `.scheduled_cached_reqs.req_ids /
.num_computed_tokens` (both before the step: `_update_after_schedule` advances the requests after
the output is built), `.scheduled_spec_decode_tokens` (req id → draft ids), `Scheduler.running /
.waiting / .requests`, `Request.num_tokens / .num_output_tokens / .num_prompt_tokens`.

A schedule call that runs nothing (every running request preempted itself) is not a step, as in the
simulator: its preemptions go with the next step that runs something.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


class EngineNotReachable(RuntimeError):
    """The engine core runs in another process, so its scheduler cannot be read."""


@dataclass(frozen=True)
class ScheduledCall:
    """One request in one step: vLLM's view (the simulator's steps-frame columns in brackets)."""

    call_id: str
    computed: int  # tokens in the KV cache before the step [context_len]
    scheduled: int  # tokens computed in the step [scheduled_tokens]
    draft: tuple[int, ...]  # draft ids scheduled for verification [draft]
    phase: str  # "decode" (computes the last sampled token, maybe with drafts) or "prefill"


@dataclass
class EngineStep:
    """One engine step as vLLM ran it."""

    index: int
    calls: list[ScheduledCall]
    preempted: list[str]  # in preemption order, during this step's scheduling (and empty calls before it)
    running: int  # after scheduling
    waiting: int
    seconds: float = float("nan")  # wall time: schedule + forward + sample + draft + update (+ post_step)

    def key(self) -> tuple:
        """What must match the simulator's step: the calls (as a set) and the preemption order."""
        return tuple(sorted((c.call_id, c.computed, c.scheduled, c.draft) for c in self.calls)), tuple(self.preempted)


@dataclass
class ScheduleRecorder:
    """Records every engine step of `llm` from now on (see the module docstring)."""

    steps: list[EngineStep] = field(default_factory=list)
    _pending_preempted: list[str] = field(default_factory=list)

    @classmethod
    def attach(cls, llm: Any) -> ScheduleRecorder:
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "schedule"):
            raise EngineNotReachable(
                "vLLM's engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before "
                "building the engine to record its schedule")
        recorder = cls()
        recorder._wrap(llm.llm_engine.engine_core, scheduler)
        return recorder

    @property
    def steps_run(self) -> int:
        return len(self.steps)

    def _wrap(self, client: Any, scheduler: Any) -> None:
        schedule, preempt, step = scheduler.schedule, scheduler._preempt_request, client.get_output

        @functools.wraps(preempt)
        def preempt_request(request, *args, **kwargs):
            self._pending_preempted.append(str(request.request_id))
            return preempt(request, *args, **kwargs)

        @functools.wraps(schedule)
        def schedule_step(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._record(scheduler, out)
            return out

        @functools.wraps(step)
        def engine_step(*args, **kwargs):
            before = len(self.steps)
            start = time.perf_counter()
            result = step(*args, **kwargs)
            if len(self.steps) > before:
                self.steps[-1].seconds = time.perf_counter() - start
            return result

        scheduler._preempt_request = preempt_request
        scheduler.schedule = schedule_step
        client.get_output = engine_step

    def _record(self, scheduler: Any, out: Any) -> None:
        if not out.num_scheduled_tokens:
            return
        computed = {r.req_id: int(r.num_computed_tokens) for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update({rid: int(n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True)})
        drafts = out.scheduled_spec_decode_tokens or {}
        calls = []
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            before = computed[rid]
            decode = request.num_output_tokens > 0 and before == request.num_tokens - 1
            calls.append(ScheduledCall(str(rid), before, int(n), tuple(int(t) for t in drafts.get(rid, ())),
                                       "decode" if decode else "prefill"))
        self.steps.append(EngineStep(len(self.steps), calls, self._pending_preempted, len(scheduler.running),
                                     len(scheduler.waiting)))
        self._pending_preempted = []

    def rename(self, external: Callable[[str], str]) -> None:
        """Map vLLM's internal request ids (the caller's id plus a random suffix) back to the caller's."""
        for step in self.steps:
            step.calls = [dataclasses.replace(c, call_id=external(c.call_id)) for c in step.calls]
            step.preempted = [external(r) for r in step.preempted]



def call_steps(steps: Sequence[EngineStep]) -> list[dict[str, Any]]:
    """One row per call per step in the step-log columns `calibrate cost` reads (`step`, `phase`,
    `context_len`, `scheduled_tokens`, `step_time_s`: the whole engine step's wall time)."""
    return [{"step": s.index, "call_id": c.call_id, "phase": c.phase, "context_len": c.computed,
             "scheduled_tokens": c.scheduled, "drafted": len(c.draft), "step_time_s": s.seconds}
            for s in steps for c in s.calls]


@dataclass(frozen=True)
class ScheduleComparison:
    """vLLM's steps against the simulator's, step by step (both in order)."""

    engine_steps_vllm: int
    engine_steps_sim: int
    engine_steps_identical: int  # leading steps whose calls and preemptions match exactly, in order
    verify_steps: int  # call-steps in which vLLM verified a draft
    draft_ids_identical_steps: int  # of those, the ones the simulator scheduled with the same draft ids
    preemptions_vllm: int
    preemptions_sim: int
    first_difference: str | None


def sim_engine_steps(steps_frame: Any, preemption_events: Any) -> list[tuple]:
    """The simulator's steps as `EngineStep.key()` tuples (steps frame: one row per call-step)."""
    frame = steps_frame.sort(["step", "call_id"])
    keys: dict[int, list] = {}
    for step, call_id, context, scheduled, draft in zip(
            frame["step"].to_list(), frame["call_id"].to_list(), frame["context_len"].to_list(),
            frame["scheduled_tokens"].to_list(), frame["draft"].to_list(), strict=True):
        ids = tuple(int(t) for t in draft or ())
        keys.setdefault(int(step), []).append((call_id, int(context), int(scheduled), ids))
    preempted: dict[int, list[str]] = {}
    if preemption_events is not None:
        for step, call_id in zip(preemption_events["step"].to_list(), preemption_events["call_id"].to_list(),
                                 strict=True):
            preempted.setdefault(int(step), []).append(call_id)
    return [(tuple(keys[k]), tuple(preempted.get(k, ()))) for k in sorted(keys)]


def compare_schedules(vllm_steps: Sequence[EngineStep], sim_keys: Sequence[tuple]) -> ScheduleComparison:
    """Line the two step sequences up in order; draft ids are compared per (call, step) wherever vLLM
    verified, on the steps both ran identically up to their drafts."""
    identical, first = 0, None
    verify, same_drafts = 0, 0
    for i, step in enumerate(vllm_steps):
        ours = sim_keys[i] if i < len(sim_keys) else None
        key = step.key()
        if first is None and key == ours:
            identical += 1
        elif first is None:
            first = _describe_difference(i, key, ours)
        sim_drafts = {} if ours is None else {c[0]: c[3] for c in ours[0]}
        for c in step.calls:
            if c.draft:
                verify += 1
                same_drafts += sim_drafts.get(c.call_id) == c.draft
    if first is None and len(sim_keys) > len(vllm_steps):
        first = f"step {len(vllm_steps)}: the simulator ran {len(sim_keys) - len(vllm_steps)} more step(s)"
    return ScheduleComparison(
        engine_steps_vllm=len(vllm_steps), engine_steps_sim=len(sim_keys), engine_steps_identical=identical,
        verify_steps=verify, draft_ids_identical_steps=same_drafts,
        preemptions_vllm=sum(len(s.preempted) for s in vllm_steps),
        preemptions_sim=sum(len(k[1]) for k in sim_keys), first_difference=first)


def _describe_difference(i: int, theirs: tuple, ours: tuple | None) -> str:
    if ours is None:
        return f"step {i}: vLLM ran it, the simulator had finished"
    if theirs[1] != ours[1]:
        return f"step {i}: vLLM preempted {list(theirs[1])}, the simulator {list(ours[1])}"
    a, b = {c[0]: c for c in theirs[0]}, {c[0]: c for c in ours[0]}
    if a.keys() != b.keys():
        return (f"step {i}: vLLM ran {sorted(a)}, the simulator {sorted(b)}")
    for cid in sorted(a):
        if a[cid] != b[cid]:
            (_, c1, n1, d1), (_, c2, n2, d2) = a[cid], b[cid]
            return (f"step {i}, call {cid}: vLLM computed {c1} + scheduled {n1} (draft {list(d1)[:8]}), "
                    f"the simulator {c2} + {n2} (draft {list(d2)[:8]})")
    return f"step {i}: differs"
