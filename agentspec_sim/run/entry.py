"""The library's entry point to a replay (`replay`, what `agentspec-sim replay` runs): the runs, their bands,
one cost model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentspec_sim.cost import cost_model_for
from agentspec_sim.cost.base import StepCostModel
from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import EngineConfig, resolve
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.engine.result import RunResult
from agentspec_sim.run.band import Band, run_band
from agentspec_sim.run.simulation import bind_engine_context, check_draft_networks, compare
from agentspec_sim.trace.schema import Workload

if TYPE_CHECKING:
    from agentspec_sim.metrics import RunSummary
    from agentspec_sim.slo import LatencySLO


@dataclass(frozen=True)
class Replay:
    """What `replay` ran: `runs` ((result, summary), `normal` first), `bands` (the acceptance model's band of
    each run, agentspec_sim/run/band.py; None where it has none or bands were not asked for), and the one cost model
    every run priced its steps with."""

    runs: list[tuple[RunResult, RunSummary]]
    bands: list[Band | None]
    cost_model: StepCostModel


def replay(workload: Workload, drafters: Sequence[str | SpeculativeConfig | Mapping[str, Any]],
           config: EngineConfig | None = None, *, slo: LatencySLO | None = None, band: bool = True,
           cost_model: StepCostModel | None = None, progress: Callable[[str, int, int], None] | None = None,
           on_result: Callable[[RunResult, RunSummary], None] | None = None,
           on_band: Callable[[RunSummary], None] | None = None) -> Replay:
    """`agentspec-sim replay` as a library call: `compare`'s runs (normal first; attainment of `slo`), then, with
    `band`, each banded configuration's runs at the low and high bound of its acceptance model (speedups
    against the same `normal` run) — all on one cost model (`cost_model_for(config)` unless given), built
    once. `progress(name, done, total)` and `on_result` as in `compare`; `on_band(summary)` sees each bound
    run as it completes. What a drafter needs from the run (the engine's limits, its draft network, the
    trace's tokenizer) is checked before the first run starts: `SpecConfigError` / `EngineConfigError`."""
    config = config or EngineConfig()
    specs = [parse_drafter(d) for d in drafters]
    resolve(config)  # settings vLLM refuses (e.g. a tensor parallel size the heads do not split over) first
    for spec in specs:
        bind_engine_context(spec, config, workload)
    cost = cost_model if cost_model is not None else cost_model_for(config)
    check_draft_networks(specs, config, cost)
    runs = compare(workload, drafters, config, cost_model=cost, progress=progress, on_result=on_result, slo=slo)
    bands = []
    for result, _ in runs:
        got = run_band(workload, result.spec, config, runs[0][0], cost_model=cost, progress=progress) if band \
            else None
        if got is not None and on_band is not None:
            on_band(got.low)
            on_band(got.high)
        bands.append(got)
    return Replay(runs, bands, cost)
