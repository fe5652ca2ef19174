"""`validate vllm` and `record`: the trace's calls through vLLM 0.33's offline engine, then the simulator.

For users with vLLM and model weights (neither is available where this project is built and tested:
this module is tested against a fake at the vLLM API boundary, tests/fake_vllm/, written from the
0.33.0 sources of `vllm.LLM`, `LLMEngine.add_request/step`, `RequestOutput`/`CompletionOutput`,
`RequestSpecDecodeMetrics` and `vllm.v1.metrics.reader`).

One run (`run_vllm`) drives `LLM(...).llm_engine` directly, the way the simulator's event loop drives
its engine: a query's first call is added at its recorded arrival time (wall clock from the start),
each later call when the previous call of its query finishes plus its think time; every call is
greedy (temperature 0) with `max_tokens` = the recorded output length and `ignore_eos`, so each
request's output length is pinned, at the same max_num_seqs. It collects vLLM's own metrics: the
Prometheus counters of `llm.get_metrics()` (spec_decode_num_drafts / num_draft_tokens /
num_accepted_tokens / num_accepted_tokens_per_pos, as deltas over the run) and each request's
`spec_decode_metrics` (per-step drafted and accepted counts; `per_request_spec_decode_metrics=
"detailed"`), and wall-clock goodput.

`workload_with_outputs` records the outputs vLLM produced into a new trace (the `record` command
writes it); `compare` simulates that trace with the matching drafter and lines up simulated and
measured acceptance per step, rejection rate and goodput. Under greedy decoding `ngram` and `suffix`
drafts depend only on the tokens, so their per-step drafted/accepted sequences should be identical
(suffix's global tree also depends on request order, so it may differ where vLLM ordered differently).
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentspec_sim.trace.schema import Call, Workload


@dataclass(frozen=True)
class Method:
    """A spec-decode method as vLLM runs it and as the simulator models it.

    vllm_config: vLLM's speculative_config (None: no speculation); env: environment variables set
    while the engine is built (the runner choice); drafter: the simulator's drafter configuration.
    """

    name: str
    vllm_config: Mapping[str, Any] | None
    env: Mapping[str, str]
    drafter: Mapping[str, Any]


def methods(k_ngram: int = 5, k_suffix: int = 32, k_eagle3: int = 3, eagle3_model: str | None = None
            ) -> dict[str, Method]:
    """The methods `validate vllm` knows, by name (eagle3 only when a draft model is given)."""
    ngram = {"method": "ngram", "num_speculative_tokens": k_ngram, "prompt_lookup_max": 4}
    out = {
        "normal": Method("normal", None, {}, {"method": "normal"}),
        # V1 model runner: the CPU n-gram proposer (longest match, earliest occurrence).
        "ngram": Method("ngram", ngram, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, ngram),
        # vLLM 0.33's default Model Runner V2: the GPU n-gram speculator (rightmost, always k).
        "ngram-v2": Method("ngram-v2", ngram, {}, {**ngram, "method": "ngram-v2"}),
        "suffix": Method("suffix", {"method": "suffix", "num_speculative_tokens": k_suffix}, {},
                         {"method": "suffix", "num_speculative_tokens": k_suffix}),
    }
    if eagle3_model:
        out["eagle3"] = Method("eagle3", {"method": "eagle3", "model": eagle3_model,
                                          "num_speculative_tokens": k_eagle3}, {},
                               {"method": "eagle3", "num_speculative_tokens": k_eagle3})
    return out


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
    """One method's run through vLLM: per-request records, counter deltas, wall time."""

    method: str
    wall_s: float
    calls: dict[str, CallRecord]
    counters: dict[str, int]
    accepted_per_pos: list[int]

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


def build_llm(model: str, method: Method, *, max_num_seqs: int, seed: int = 0, **llm_kwargs: Any):
    """`vllm.LLM` for `method`, with stats and detailed per-request spec-decode metrics on.

    The method's environment (the model-runner choice) is set while the engine is built and restored after.
    """
    import vllm

    saved = {k: os.environ.get(k) for k in method.env}
    os.environ.update(method.env)
    try:
        kwargs = {"max_num_seqs": max_num_seqs, "seed": seed, "disable_log_stats": False,
                  "per_request_spec_decode_metrics": "detailed", **llm_kwargs}
        if method.vllm_config is not None:
            kwargs["speculative_config"] = dict(method.vllm_config)
        return vllm.LLM(model=model, **kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_limits(llm: Any) -> dict[str, int]:
    """The KV capacity and context limit the built engine actually has, for the simulator to use the same
    (as LLMServingSim's validation matches the KV block count): `num_kv_blocks` = vLLM's profiled
    `cache_config.num_gpu_blocks` (null block included, as ours), `max_model_len` from the model config.
    Missing values (an engine that does not report them) are left out."""
    vllm_config = getattr(llm.llm_engine, "vllm_config", None)
    limits: dict[str, int] = {}
    blocks = getattr(getattr(vllm_config, "cache_config", None), "num_gpu_blocks", None)
    if blocks:
        limits["num_kv_blocks"] = int(blocks)
    max_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    if max_len:
        limits["max_model_len"] = int(max_len)
    return limits


def run_vllm(workload: Workload, llm: Any, method: str, *, think_time: float | None = None,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
             progress: Callable[[int, int], None] | None = None) -> VllmRun:
    """Serve every call of `workload` through `llm.llm_engine` (see the module docstring)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    before = read_counters(llm.get_metrics())
    ready: list[tuple[float, int, int, int]] = []  # (time, order, query index, call index)
    for qi, query in enumerate(workload.queries):
        if query.calls:
            heapq.heappush(ready, (float(query.calls[0].arrival_s or 0.0), qi, qi, 0))
    by_id: dict[str, tuple[int, int]] = {}
    records: dict[str, CallRecord] = {}
    total = sum(len(q.calls) for q in workload.queries)
    order = len(workload.queries)
    start = clock()
    while ready or engine.has_unfinished_requests():
        now = clock() - start
        while ready and ready[0][0] <= now:
            _, _, qi, ci = heapq.heappop(ready)
            call = workload.queries[qi].calls[ci]
            params = SamplingParams(temperature=0.0, max_tokens=max(1, int(call.output_tokens.shape[0])),
                                    ignore_eos=True, detokenize=False)
            engine.add_request(call.id, {"prompt_token_ids": call.prompt_tokens.tolist()}, params)
            by_id[call.id] = (qi, ci)
        if not engine.has_unfinished_requests():
            if ready:
                sleep(max(0.0, min(ready[0][0] - (clock() - start), 0.05)))
            continue
        for out in engine.step():
            if not getattr(out, "finished", False):
                continue
            done = clock() - start
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
    wall = clock() - start
    counters, per_pos = _diff(read_counters(llm.get_metrics()), before)
    return VllmRun(method, wall, records, counters, per_pos)


def workload_with_outputs(workload: Workload, run: VllmRun, *, model: str | None = None) -> Workload:
    """The trace with every served call's output replaced by what vLLM produced (prompts unchanged)."""
    missing = [c.id for q in workload.queries for c in q.calls if c.id not in run.calls]
    if missing:
        raise ValueError(f"vLLM returned no output for {len(missing)} call(s), first {missing[0]!r}")

    def swap(call: Call) -> Call:
        return dataclasses.replace(call, output_tokens=run.calls[call.id].output_tokens)

    queries = tuple(dataclasses.replace(q, calls=tuple(swap(c) for c in q.calls)) for q in workload.queries)
    meta = dataclasses.replace(workload.meta, model=model or workload.meta.model,
                               source=f"outputs re-generated by vLLM ({run.method} run)")
    return dataclasses.replace(workload, meta=meta, queries=queries)


@dataclass
class Comparison:
    """Simulated vs measured for one method."""

    method: str
    measured: dict[str, Any]
    simulated: dict[str, Any]
    calls: int
    calls_with_identical_steps: int
    step_mismatches: list[str] = field(default_factory=list)

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


def compare(workload: Workload, run: VllmRun, method: Method, config: Any) -> Comparison:
    """Simulate `workload` (with vLLM's outputs) under `method`'s drafter on engine `config`; line up."""
    from agentspec_sim.engine.run import simulate
    from agentspec_sim.metrics import summarize

    traced = workload_with_outputs(workload, run)
    result = simulate(traced, dict(method.drafter), config)
    summary = summarize(result)
    sim_steps = simulated_steps(result.steps)
    drafted = sum(sum(d) for d, _ in sim_steps.values())
    accepted = sum(sum(a) for _, a in sim_steps.values())
    draft_steps = sum(len(d) for d, _ in sim_steps.values())
    identical, mismatches = 0, []
    for call_id, record in run.calls.items():
        sim = sim_steps.get(call_id, ([], []))
        if (record.per_step_drafted, record.per_step_accepted) == (sim[0], sim[1]):
            identical += 1
        elif len(mismatches) < 5:
            mismatches.append(f"{call_id}: vLLM drafted {record.per_step_drafted[:8]} accepted "
                              f"{record.per_step_accepted[:8]}; simulated {sim[0][:8]} / {sim[1][:8]}")
    simulated = {"drafts": draft_steps, "draft_tokens": drafted, "accepted_tokens": accepted,
                 "mean_acceptance_length": 1 + accepted / draft_steps if draft_steps else None,
                 "rejection_rate_tokens": 1 - accepted / drafted if drafted else None,
                 "goodput_tok_s": summary.goodput_tok_s}
    measured = {**run.acceptance(), "goodput_tok_s": run.goodput_tok_s, "wall_s": run.wall_s,
                "accepted_per_pos": run.accepted_per_pos}
    return Comparison(method.name, measured, simulated, len(run.calls), identical, mismatches)


