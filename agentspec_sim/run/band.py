"""The uncertainty band of a model-based result: the same run replayed with each bound of the acceptance model.

An `eagle3` / `mtp` parameter file may carry a band (`AcceptanceParams.band`: a "low" and a "high" parameter
set, docs/model-based-drafters.md); the speculative-config key `acceptance_bound` makes the drafter use one of
them. Replaying a configuration with `acceptance_bound` "low" and "high" — same trace, engine, seed, everything
else — gives, for every metric the run measures, the values at the two ends of the band. `replay`, `sweep`,
`plan` and `report` show three of them: the mean acceptance length, the goodput and the speedup (against the
same `normal` run as the point value). A banded configuration therefore costs three runs instead of one.

Which file a run reads depends on the engine: a run binds `target_model` from the engine's model
(`engine.run.bind_engine_context`), so the band is looked up on the parameters that binding resolves, not on
the config as written. A config that already sets `acceptance_bound` is one end of a band, not a banded
result: it has no band of its own. Configurations of other methods never have one.

The values are kept as the runs gave them, the "low" run's first (`[low, high]`); a higher-acceptance bound
normally gives the higher acceptance length, goodput and speedup, but nothing here reorders them.
`span(values)` is the interval they cover, whichever is larger.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from agentspec_sim.cost import cost_model_for
from agentspec_sim.drafters.registry import drafter_class
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.metrics import summarize
from agentspec_sim.run.simulation import simulate

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.drafters.model.rule import AcceptanceParams
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.engine.result import RunResult
    from agentspec_sim.metrics import RunSummary
    from agentspec_sim.trace.schema import Workload

BOUNDS = ("low", "high")
# The summary fields a band is reported for (their `RunSummary` / results-column names, vLLM's
# "mean acceptance length" included): `<name>_band` = [low, high] in replay's JSON, `<name>_low` /
# `<name>_high` columns in a sweep's results.
METRICS = ("mean_acceptance_length", "goodput_tok_s", "speedup")
COLUMNS = tuple(f"{metric}_{bound}" for metric in METRICS for bound in BOUNDS)


def resolved_params(spec: SpeculativeConfig, model: str | None = None) -> AcceptanceParams | None:
    """The acceptance parameters a run of `spec` on an engine serving `model` resolves (the config's own
    `target_model` / `acceptance_params` win, as in a run); None for a drafter that is not model-based."""
    return drafter_class(spec.method).acceptance_params(spec, model)


def has_band(spec: SpeculativeConfig, model: str | None = None) -> bool:
    """Whether a run of `spec` on `model` has an uncertainty band (a model-based drafter whose resolved
    parameter file has one, and no `acceptance_bound` of its own)."""
    if spec.option("acceptance_bound") is not None:
        return False
    params = resolved_params(spec, model)
    return params is not None and params.has_band


def bound_config(spec: SpeculativeConfig, bound: str) -> SpeculativeConfig:
    """`spec` with `acceptance_bound` = `bound` in its options (its label gains ` (bound bound)`)."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    options = {**dict(spec.options), "acceptance_bound": bound}
    return replace(spec, options=tuple(sorted(options.items())), label=f"{spec.name} ({bound} bound)")


def bound_configs(spec: SpeculativeConfig, model: str | None = None) -> dict[str, SpeculativeConfig] | None:
    """{"low": …, "high": …}: the two configs whose runs bound `spec`'s results; None where it has no band."""
    if not has_band(spec, model):
        return None
    return {bound: bound_config(spec, bound) for bound in BOUNDS}


@dataclass(frozen=True)
class Band:
    """The two bound runs' summaries of one configuration (speedups against the point run's baseline)."""

    low: RunSummary
    high: RunSummary

    def values(self, metric: str) -> list[float | None]:
        """[low, high] of one summary field (`METRICS`); None for a value that is undefined (NaN, inf)."""
        return [_finite(getattr(self.low, metric)), _finite(getattr(self.high, metric))]

    def fields(self) -> dict[str, list[float | None]]:
        """`<metric>_band` = [low, high] for every metric in `METRICS`."""
        return {f"{metric}_band": self.values(metric) for metric in METRICS}

    def columns(self) -> dict[str, float | None]:
        """`<metric>_low`, `<metric>_high` for every metric in `METRICS`."""
        return {f"{metric}_{bound}": value for metric in METRICS
                for bound, value in zip(BOUNDS, self.values(metric), strict=True)}


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def empty_fields() -> dict[str, None]:
    """`Band.fields()` of a configuration without a band: every value null."""
    return {f"{metric}_band": None for metric in METRICS}


def empty_columns() -> dict[str, None]:
    """`Band.columns()` of a configuration without a band: every value null."""
    return dict.fromkeys(COLUMNS)


def run_band(workload: Workload, spec: SpeculativeConfig, config: EngineConfig, baseline: RunResult | None = None,
             cost_model: StepCostModel | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> Band | None:
    """Run `spec`'s two bound configs on `workload` and `config` (the point run's own engine, seed included);
    their summaries' speedups are against `baseline` (the point run's `normal` run; None: no speedup).
    None, running nothing, where `spec` has no band. `progress(name, done, total)` as in `compare`."""
    configs = bound_configs(spec, config.model)
    if configs is None:
        return None
    if cost_model is None:
        cost_model = cost_model_for(config)
    out = {}
    for bound, bounded in configs.items():
        report = None if progress is None else (lambda done, total, name=bounded.name: progress(name, done, total))
        out[bound] = summarize(simulate(workload, bounded, config, cost_model, report), baseline)
    return Band(out["low"], out["high"])


def run_bands(workload: Workload, runs: Sequence[tuple[RunResult, RunSummary]], config: EngineConfig,
              cost_model: StepCostModel | None = None,
              progress: Callable[[str, int, int], None] | None = None) -> list[Band | None]:
    """The band of each run of a `compare` (its first run, `normal`, is every speedup's baseline); None for
    the runs without one."""
    baseline = runs[0][0] if runs else None
    return [run_band(workload, result.spec, config, baseline, cost_model, progress) for result, _ in runs]


def span(values: Sequence[float | None] | None) -> tuple[float, float] | None:
    """(min, max) of a [low, high] pair; None where it is missing or has a null."""
    if values is None or len(values) != 2 or any(v is None for v in values):
        return None
    low, high = float(values[0]), float(values[1])
    return (min(low, high), max(low, high))


def row_values(row: Mapping[str, Any], metric: str) -> list[float] | None:
    """[low, high] of `metric` from a results row's `<metric>_low` / `<metric>_high` columns; None where the row
    has no band (the columns null, or absent: results written before bands were recorded, or with --no-band)."""
    values = [row.get(f"{metric}_{bound}") for bound in BOUNDS]
    return None if any(v is None for v in values) else [float(v) for v in values]


def format_interval(value: float | None, values: Sequence[float | None] | None, spec: str = ".2f",
                    suffix: str = "", sep: str = " ") -> str:
    """`3.12 [2.95–3.30]`: the point value, then (after `sep`) its band, the low bound's run first; the point
    value alone where there is no band, `—` where there is no value. The interval shown always holds the point:
    the bound runs differ from the point run in acceptance only, and where that moves the result less than the
    engine's own scheduling does, the point can fall just outside them (`1.110× [1.110–1.122×]`, not
    `[1.111–1.122×]`: the runs span 1.110 to 1.122)."""
    if value is None:
        return "—"
    text = f"{value:{spec}}{suffix}"
    if values is None or any(v is None for v in values):
        return text
    low, high = float(values[0]), float(values[1])
    if low <= high:
        low, high = min(low, value), max(high, value)
    else:  # a band whose low bound's run came out higher: kept in that order, widened the same way
        low, high = max(low, value), min(high, value)
    return f"{text}{sep}[{low:{spec}}–{high:{spec}}{suffix}]"


__all__ = ["BOUNDS", "COLUMNS", "METRICS", "Band", "bound_config", "bound_configs", "empty_columns", "empty_fields",
           "format_interval", "has_band", "resolved_params", "row_values", "run_band", "run_bands", "span"]
