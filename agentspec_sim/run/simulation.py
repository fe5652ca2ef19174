"""`simulate`: one run of a workload through the engine with one drafter configuration; `compare`: several."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentspec_sim.cost import cost_model_for, roofline
from agentspec_sim.cost.base import StepCostModel
from agentspec_sim.drafters.registry import bind_engine_context as bind_drafter_context
from agentspec_sim.drafters.registry import drafter_class, parse_drafter, unique_labels
from agentspec_sim.engine import scheduler
from agentspec_sim.engine.config import EngineConfig, resolve
from agentspec_sim.engine.data_parallel import DataParallelSimulator
from agentspec_sim.engine.drafting import SpecConfigError, SpeculativeConfig
from agentspec_sim.engine.footprint import check_run_memory
from agentspec_sim.engine.result import RunResult
from agentspec_sim.engine.simulator import Simulator
from agentspec_sim.engine.watch import RunWatch
from agentspec_sim.host.kernel_cache import is_compiled
from agentspec_sim.metrics import summarize
from agentspec_sim.trace.schema import Workload

if TYPE_CHECKING:
    from agentspec_sim.metrics import RunSummary
    from agentspec_sim.slo import LatencySLO


def simulate(workload: Workload, drafter: str | SpeculativeConfig | Mapping[str, Any] = "ngram",
             config: EngineConfig | None = None, cost_model: StepCostModel | None = None,
             progress: Callable[[int, int], None] | None = None, watch: RunWatch | None = None) -> RunResult:
    """Replay `workload` on the engine `config` describes, drafting with `drafter`.

    `drafter`: a shorthand name (`"normal"`, `"ngram"`), a `--speculative-config` dict or JSON
    text, or a `SpeculativeConfig`. `cost_model`: prices steps (default: `build_cost_model` for
    the config's hardware, model, tensor parallelism and calibration). `progress(done, total)` is
    called as calls complete. Deterministic: the same inputs and seed give identical results.
    Raises `ResourceError` before the run when its estimated memory (engine/footprint.py) exceeds what is
    available. `watch` (engine/watch.py) may end the run early; the result then says when (`stopped_s`).
    """
    config = config or EngineConfig()
    spec = bind_engine_context(parse_drafter(drafter), config, workload)
    limits = resolve(config)
    check_run_memory(workload, spec, config, limits)  # before anything of the run is allocated
    cost_model = cost_model if cost_model is not None else cost_model_for(config)
    if config.data_parallel_size > 1:
        from agentspec_sim.cost import load_model

        return DataParallelSimulator(workload, spec, config, limits, cost_model, progress,
                                     moe=load_model(config.model).is_moe).run(watch)
    return Simulator(workload, spec, config, limits, cost_model, progress).run(watch)


def bind_engine_context(spec: SpeculativeConfig, config: EngineConfig, workload: Workload) -> SpeculativeConfig:
    """Fill in what the run knows (target model, hardware, seed, the trace's tokenizer) for drafters
    whose config takes it, unless the user's config sets it; other configs come back unchanged."""
    from pathlib import Path

    tokenizer = workload.meta.tokenizer
    if tokenizer is not None and tokenizer not in ("qwen3",) and Path(tokenizer).exists():
        tokenizer = str(Path(tokenizer).resolve())
    return bind_drafter_context(spec, hardware=config.hardware, model=config.model,
                                tensor_parallel_size=config.tensor_parallel_size, calibration=config.calibration,
                                seed=config.seed, tokenizer=tokenizer)


def compare(workload: Workload, drafters: Sequence[str | SpeculativeConfig | Mapping[str, Any]],
            config: EngineConfig | None = None, cost_model: StepCostModel | None = None,
            progress: Callable[[str, int, int], None] | None = None,
            on_result: Callable[[RunResult, RunSummary], None] | None = None,
            slo: LatencySLO | None = None) -> list[tuple[RunResult, RunSummary]]:
    """Run `normal` first, then each drafter configuration (duplicates of normal dropped), on the same
    workload and engine; each summary's speedup is against that `normal` run, its attainment of `slo`
    (agentspec_sim/slo.py) where given. `on_result` sees each run
    as it completes (so an interrupted caller keeps the finished ones). A setting vLLM refuses and a run
    that would not fit in memory fail before the first run (and the cost model) starts."""
    config = config or EngineConfig()
    specs = [parse_drafter("normal")] + [s for s in map(parse_drafter, drafters) if s.method != "normal"]
    specs = unique_labels(specs)
    limits = resolve(config)
    for spec in specs:  # every run's memory, before the first starts
        check_run_memory(workload, spec, config, limits)
    cost_model = cost_model if cost_model is not None else cost_model_for(config)
    out: list[tuple[RunResult, RunSummary]] = []
    baseline: RunResult | None = None
    for spec in specs:
        report = None if progress is None else (lambda done, total, name=spec.name: progress(name, done, total))
        result = simulate(workload, spec, config, cost_model, report)
        baseline = baseline or result
        out.append((result, summarize(result, baseline, slo)))
        if on_result is not None:
            on_result(*out[-1])
    return out


def check_draft_networks(specs: Sequence[SpeculativeConfig], config: EngineConfig,
                         cost_model: StepCostModel | None = None) -> None:
    """A model-based drafter (eagle3, mtp) needs its draft network in the target model's profile (mtp: MTP
    layers): `SpecConfigError` naming the method before any run starts, not at its first run."""
    import numpy as np

    needy = [s for s in specs if drafter_class(s.method).uses_draft_network]
    if not needy:
        return
    cost_model = cost_model if cost_model is not None else cost_model_for(config)
    for spec in needy:
        try:
            kind = drafter_class(spec.method).draft_network(spec, config.model)
            cost_model.draft_model_time(1, max(1, spec.num_speculative_tokens), np.ones(1, dtype=np.int64),
                                        kind=kind)
        except TypeError:  # a cost model without draft kinds prices every method alike
            return
        except ValueError as exc:  # the target model has no such draft network
            raise SpecConfigError(f"method {spec.method!r} on {config.model}: {exc}") from None


def kernels_compiled() -> bool:
    """False when the next run in this environment compiles the engine's kernels first (numba's cache
    is empty or stale: a fresh install, an edited source file). The command line says so before it
    starts, since that first compile takes minutes on a small machine and shows no progress.
    True when the cache is current, or when it cannot be told."""
    return all(is_compiled(kernel) is not False
               for kernel in (scheduler.run_steps, roofline._step_parts))
