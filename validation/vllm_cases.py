"""The step-for-step cases against a real vLLM, as data, and a command that runs them all and prints the figures.

    VLLM_CPU_KVCACHE_SPACE=1 python -m agentspec_sim.validation.vllm_cases OUT_DIR

tests/test_vllm_real.py runs the same cases (and asserts on them); this prints, per case and method, the
compare.json figures (steps identical / total, draft ids identical / verify steps, calls identical /
identical except the last verify step / total, preemptions) and writes OUT_DIR/summary.json. It needs vLLM
(the CPU build 0.32 or vLLM 0.33), torch and transformers; it makes its tiny models under OUT_DIR.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentspec_sim.trace.schema import Workload

# Every case: eager mode builds an engine in ~20 s instead of ~80 s; 32-token blocks (the CPU build needs a
# multiple of 32; its default 128 would leave few prefix-cache hits on short prompts).
ENGINE = {"enforce_eager": True, "block_size": 32}


@dataclass(frozen=True)
class Workshape:
    """The first queries and calls of a bundled trace, prompts cut to `prompt` tokens and outputs to `output`
    (vLLM regenerates the outputs; only their lengths are served). A query's later prompts extend its earlier
    ones, so they hit the prefix cache. `force_output`: every output exactly `output` long."""

    trace: str
    queries: int
    calls: int
    prompt: int
    output: int
    think: float | None = None
    force_output: bool = False

    def workload(self) -> Workload:
        from agentspec_sim.trace.bundled import bundled_trace
        from agentspec_sim.trace.io import load_trace

        workload = load_trace(bundled_trace(f"{self.trace}.jsonl.zst"))

        def cut(call):
            out = np.resize(call.prompt_tokens, self.output) if self.force_output else call.output_tokens[:self.output]
            return dataclasses.replace(call, prompt_tokens=call.prompt_tokens[:self.prompt], output_tokens=out,
                                       think_s=call.think_s if self.think is None else self.think)

        qs = tuple(dataclasses.replace(q, calls=tuple(cut(c) for c in q.calls[:self.calls]))
                   for q in workload.queries[:self.queries])
        return dataclasses.replace(workload, queries=qs)


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "tied" or "untied" (validation/tiny_models.py)
    methods: tuple[str, ...]
    shape: Workshape
    max_num_seqs: int
    engine: Mapping[str, Any] = field(default_factory=dict)
    prompt_lookup_min: int | None = None


CASES = (
    # One call at a time, n-grams from 1 token; the tied model repeats itself (long drafts, mostly accepted).
    Case("seqs1", "tied", ("normal", "ngram", "suffix"), Workshape("gaia", 2, 2, 600, 40), 1, prompt_lookup_min=1),
    # Four at a time under a 256-token budget (chunked prefill), agent chaining with 2.5 steps of think time,
    # prefix-cache hits; the tied model repeats itself (long accepted drafts).
    Case("seqs4-chunked", "tied", ("normal", "ngram", "suffix"), Workshape("gaia", 3, 3, 1000, 32, think=2.5), 4,
         {"max_num_batched_tokens": 256}),
    # The untied model (near-random text: few drafts, partly rejected), calls arriving and finishing mid-run,
    # four at a time: a new call takes a finished call's row of vLLM's persistent batch, and suffix's shared
    # tree sees the rows' tokens in that order (docs/suffix-decoding.md).
    Case("seqs4-row-order", "untied", ("suffix",), Workshape("gaia", 4, 3, 1500, 40, think=2.5), 4,
         {"max_num_batched_tokens": 256}),
    # KV pressure: 40 blocks of 32 for five ~514-token sequences, four at a time: preemption (recompute).
    Case("kv-pressure", "tied", ("ngram", "suffix"), Workshape("spec-bench", 5, 1, 600, 400, force_output=True), 4,
         {"max_num_batched_tokens": 512, "num_gpu_blocks_override": 40, "max_model_len": 1024}),
)


def run_case(case: Case, method: str, model_dir: Path):
    """(VllmRun, Comparison) of one method of `case` on the model in `model_dir`."""
    from agentspec_sim.engine import EngineConfig
    from agentspec_sim.validation.vllm_runner import compare, methods
    from agentspec_sim.validation.vllm_worker import WorkerRequest, run_in_subprocess

    m = methods(k_ngram=5, k_suffix=16, prompt_lookup_min=case.prompt_lookup_min)[method]
    workload = case.shape.workload()
    run = run_in_subprocess(WorkerRequest(str(model_dir), m, workload, case.max_num_seqs, "steps",
                                          {**ENGINE, **case.engine}))
    return run, compare(workload, run, m, EngineConfig())


FIGURES = ("engine_steps_identical", "engine_steps_vllm", "engine_steps_sim", "draft_ids_identical_steps",
           "verify_steps", "calls_identical", "calls_identical_except_last_verify", "calls",
           "accepted_past_max_tokens", "preemptions_vllm", "preemptions_sim", "acceptance_length",
           "rejection_rate_tokens")


def main(argv: list[str]) -> int:
    from agentspec_sim.validation.tiny_models import make_tiny_qwen3

    out = Path(argv[0] if argv else "vllm-cases")
    models = {"tied": make_tiny_qwen3(out / "models" / "tied", tied=True),
              "untied": make_tiny_qwen3(out / "models" / "untied", tied=False)}
    summary = []
    for case in CASES:
        for method in case.methods:
            _, result = run_case(case, method, models[case.model])
            row = {"case": case.name, "method": method, "runner": result.runner,
                   **{k: getattr(result, k) for k in FIGURES}}
            summary.append(row)
            print(f"{case.name:14} {method:7} steps {row['engine_steps_identical']}/{row['engine_steps_vllm']} "
                  f"(sim {row['engine_steps_sim']})  drafts {row['draft_ids_identical_steps']}/{row['verify_steps']}  "
                  f"calls {row['calls_identical']}/{row['calls_identical_except_last_verify']}/{row['calls']}  "
                  f"preemptions {row['preemptions_vllm']}/{row['preemptions_sim']}  "
                  f"past max_tokens {row['accepted_past_max_tokens']}", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
