"""Planning by capacity: from capacity-search rows (`run_sweep(capacity=…)`), for each drafter configuration the
max_num_seqs that sustains the most load per GPU under the SLOs, the best configuration overall, the replicas
a target rate needs and what a million output tokens cost there.

Rules (docs/sweep-and-plan.md, "Capacity"):
- Seeds: a configuration's capacity is its least over seeds (the SLO must hold for every seed).
- Per drafter configuration: the max_num_seqs of highest capacity per GPU (capacity ÷ the layout's GPUs),
  or the smallest one within the search's tolerance of it (a larger batch buys nothing the search can tell
  apart, and costs KV memory and latency). Unbounded (meets the SLO with every query at once) ranks above
  any finite rate, then by output tok/s.
- Overall: the highest capacity per GPU; ties to `normal`, then the smaller batch. The reason names the
  runner-up and the margin, and says when the margin is within the simulator's stated error: the step-cost
  model's held-out error against measured kernels for the pair (`cost_model_error`: its bundled calibration's
  median, else 5 %) or the search's own tolerance, whichever is larger.
- Replicas for `target_rate`: ⌈target ÷ capacity⌉ deployments of the layout's GPUs each.
- Cost per million output tokens at capacity: GPUs × $/GPU-hour ÷ (output tok/s × 3600) × 10⁶, prices from
  the bundled table (its source in the file) or a file of the same shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import polars as pl

from agentspec_sim.sweep.cells import SweepError

# Median |ours / AIConfigurator − 1| of a step's price over held-out shapes, the bundled pairs' worst
# (docs/cost-model.md: 1.6–4.8 % per pair): what the plan assumes for a pair without a bundled calibration.
COST_MODEL_ERROR = 0.05


def cost_model_error(hardware: str, model: str) -> tuple[float, str]:
    """The step-cost model's stated error for (hardware, model): the held-out median |ours / measured − 1| of
    its bundled AIConfigurator calibration, else `COST_MODEL_ERROR`; and where the figure comes from."""
    from agentspec_sim.cost import load_hardware, load_model
    from agentspec_sim.cost.build import bundled_calibration

    try:
        path = bundled_calibration(load_hardware(hardware).id, load_model(model).id)
        if path is not None:
            error = float(json.loads(path.read_text())["fit"]["held_out_after"]["median_abs_error"])
            return error, "held-out median vs measured kernels"
    except (ValueError, KeyError, TypeError, OSError):
        pass
    return COST_MODEL_ERROR, "assumed: no bundled measured-kernel calibration for this pair"


# A plan per layout (plan.py).
_GROUP = ("trace", "hardware", "model", "tensor_parallel_size", "expert_parallel", "data_parallel_size")
CAPACITY_COLUMNS = ("drafter", "speculative_config", "max_num_seqs", "capacity_rate", "capacity_unbounded",
                    "capacity_output_tok_s", "capacity_stopped", "capacity_search", "engine_config")


@dataclass(frozen=True)
class Prices:
    usd_per_gpu_hour: dict[str, float]
    source: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> Prices:
        """The bundled price table, or a JSON file {"source": …, "usd_per_gpu_hour": {hardware: $}}."""
        from agentspec_sim.io.strict_json import loads

        if path is None:
            text = resources.files("agentspec_sim.cost").joinpath("profiles/prices.json").read_text()
            where = "the bundled price table"
        else:
            text, where = Path(path).read_text(), str(path)
        try:
            doc = loads(text)
            prices = {str(k): float(v) for k, v in doc["usd_per_gpu_hour"].items()}
            source = str(doc.get("source", where))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SweepError(f"{where}: usd_per_gpu_hour: expected an object of hardware → $ per GPU-hour "
                             f"({exc})") from None
        bad = [k for k, v in prices.items() if not (math.isfinite(v) and v > 0)]
        if bad:
            raise SweepError(f"{where}: usd_per_gpu_hour: {bad[0]}: must be a price > 0")
        return cls(prices, source)

    def of(self, hardware: str) -> float | None:
        if hardware in self.usd_per_gpu_hour:
            return self.usd_per_gpu_hour[hardware]
        try:
            from agentspec_sim.cost import load_hardware

            return self.usd_per_gpu_hour.get(load_hardware(hardware).id)
        except ValueError:
            return None


@dataclass(frozen=True)
class CapacityChoice:
    drafter: str
    speculative_config: dict[str, Any]
    max_num_seqs: int
    capacity_rate: float | None  # queries/s at ≥ target attainment; None: unbounded on this trace
    capacity_per_gpu: float | None
    output_tok_s: float  # at that rate
    gpus: int
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    query_latency_p99_s: float | None
    attainment: float | None
    stopped: str
    usd_per_million_tokens: float | None = None
    replicas: int | None = None  # for the target rate

    @property
    def k(self) -> int:
        return int(self.speculative_config.get("num_speculative_tokens", 0))

    def rank_key(self) -> tuple[float, float]:
        per_gpu = math.inf if self.capacity_rate is None else (self.capacity_per_gpu or 0.0)
        return per_gpu, self.output_tok_s / self.gpus


@dataclass(frozen=True)
class DrafterCapacity:
    drafter: str
    by_batch: dict[int, float | None]  # max_num_seqs → capacity (queries/s; None: unbounded)
    best: CapacityChoice | None
    why: str


@dataclass(frozen=True)
class CapacityPlan:
    trace: str
    hardware: str
    model: str
    search: dict[str, Any]
    protocol: str
    drafters: list[DrafterCapacity]
    best: CapacityChoice | None
    reason: str
    within_error: bool = False
    target_rate: float | None = None
    price_source: str | None = None
    usd_per_gpu_hour: float | None = None
    vllm_speculative_config: dict[str, Any] | None = None
    vllm_args: list[str] = field(default_factory=list)
    vllm_env: dict[str, str] = field(default_factory=dict)
    vllm_note: str | None = None
    vllm_model: str | None = None
    engine: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        for d in doc["drafters"]:
            d["by_batch"] = {str(k): v for k, v in d["by_batch"].items()}
        return doc


def is_capacity_results(results: pl.DataFrame) -> bool:
    return "capacity_rate" in results.columns


def plan_capacity(results: pl.DataFrame, target_rate: float | None = None,
                  prices: Prices | None = None) -> list[CapacityPlan]:
    """A capacity plan per (trace, hardware, model) of capacity-search results."""
    if not is_capacity_results(results):
        raise SweepError("these results hold no capacity search (sweep --capacity with --slo-* options)")
    if results.height == 0:
        raise SweepError("no sweep results to plan from")
    missing = [c for c in CAPACITY_COLUMNS if c not in results.columns]
    if missing:
        raise SweepError(f"capacity results lack column(s) {', '.join(missing)} (written by sweep --capacity)")
    prices = prices or Prices.load()
    from agentspec_sim.sweep.plan import _engine_settings, with_layout

    engines = _engine_settings(results)
    plans = []
    for key, group in with_layout(results).group_by(list(_GROUP), maintain_order=True):
        trace, hardware, model = (str(v) for v in key[:3])
        try:
            plans.append(_plan_group(trace, hardware, model, group, target_rate, prices, engines.get(tuple(key))))
        except (KeyError, TypeError, ValueError) as exc:  # a file edited or written by something else
            if isinstance(exc, SweepError):
                raise
            raise SweepError(f"capacity results for {trace} on {hardware} / {model} are malformed "
                             f"({type(exc).__name__}: {exc})") from None
    return plans


def _choices(group: pl.DataFrame) -> list[CapacityChoice]:
    """One choice per (drafter configuration, max_num_seqs), the worst seed's."""
    out = []
    keys = ["drafter", "speculative_config", "max_num_seqs"]
    for _, cell in group.group_by(keys, maintain_order=True):
        rows = cell.to_dicts()
        worst = min(rows, key=lambda r: (math.inf if r["capacity_unbounded"] else (r["capacity_rate"] or 0.0),
                                         r["capacity_output_tok_s"] or 0.0))
        engine = json.loads(worst["engine_config"]) if worst.get("engine_config") else {}
        gpus = int(engine.get("tensor_parallel_size") or 1) * int(engine.get("data_parallel_size") or 1)
        rate = None if worst["capacity_unbounded"] else float(worst["capacity_rate"] or 0.0)
        out.append(CapacityChoice(
            drafter=worst["drafter"], speculative_config=json.loads(worst["speculative_config"]),
            max_num_seqs=int(worst["max_num_seqs"]), capacity_rate=rate,
            capacity_per_gpu=None if rate is None else rate / gpus,
            output_tok_s=float(worst["capacity_output_tok_s"] or 0.0), gpus=gpus,
            ttft_p99_s=worst.get("ttft_p99"), tpot_p99_s=worst.get("tpot_p99"),
            query_latency_p99_s=worst.get("query_latency_p99"), attainment=worst.get("attainment_met"),
            stopped=worst["capacity_stopped"]))
    return out


def _describe_rate(choice: CapacityChoice) -> str:
    if choice.capacity_rate is None:
        return f"unbounded (meets the SLO with every query at once; {choice.output_tok_s:,.0f} tok/s)"
    return f"{choice.capacity_rate:.4g} queries/s ({choice.output_tok_s:,.0f} tok/s)"


def _plan_group(trace: str, hardware: str, model: str, group: pl.DataFrame, target_rate: float | None,
                prices: Prices, engine: dict[str, Any] | None) -> CapacityPlan:
    from dataclasses import replace

    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.engine.load import protocol

    search = json.loads(group["capacity_search"][0])
    tolerance = float(search.get("tolerance", 0.0))
    choices = _choices(group)
    price = prices.of(hardware)

    def priced(c: CapacityChoice) -> CapacityChoice:
        cost = (c.gpus * price / (c.output_tok_s * 3600) * 1e6 if price and c.output_tok_s > 0
                and (c.capacity_rate is None or c.capacity_rate > 0) else None)
        replicas = None
        if target_rate is not None and c.capacity_rate != 0:
            replicas = 1 if c.capacity_rate is None else math.ceil(target_rate / c.capacity_rate - 1e-9)
        return replace(c, usd_per_million_tokens=cost, replicas=replicas)

    choices = [priced(c) for c in choices]
    labels = list(dict.fromkeys(c.drafter for c in choices))
    drafters = []
    for label in labels:
        mine = [c for c in choices if c.drafter == label]
        feasible = [c for c in mine if c.capacity_rate is None or c.capacity_rate > 0]
        by_batch = {c.max_num_seqs: c.capacity_rate for c in mine}
        if not feasible:
            drafters.append(DrafterCapacity(label, by_batch, None, f"no swept max_num_seqs meets the SLO at any "
                                            f"load (max_num_seqs {mine[0].max_num_seqs}: {mine[0].stopped})"))
            continue
        top = max(feasible, key=lambda c: (*c.rank_key(), -c.max_num_seqs))
        # A larger batch that sustains no more than the search can tell apart buys nothing: the smallest
        # max_num_seqs within the search's tolerance of the most (less KV memory, shorter latencies).
        best = min((c for c in feasible if _within(c, top, tolerance)), key=lambda c: c.max_num_seqs)
        larger = [c for c in mine if c.max_num_seqs > best.max_num_seqs]
        if not larger:
            why = "the largest batch size swept"
        else:
            why = f"max_num_seqs {larger[0].max_num_seqs} sustains {_describe_rate(larger[0])}"
            if top is larger[0]:
                why += " (within the search's tolerance)"
            elif top is not best:
                why += (f"; the most, {_describe_rate(top)} at max_num_seqs {top.max_num_seqs}, is within the "
                        f"search's ±{tolerance:.0%}")
        drafters.append(DrafterCapacity(label, by_batch, best, why))
    ranked = sorted((d for d in drafters if d.best is not None),
                    key=lambda d: (tuple(-x for x in d.best.rank_key()),
                                   d.best.speculative_config["method"] != "normal", d.best.max_num_seqs))
    shared = {k: v for k, v in (engine or {}).items() if k in EngineConfig.__dataclass_fields__}
    try:
        shown = protocol(replace(EngineConfig(**shared), burstiness=search["burstiness"]), varied_rate=True)
    except (TypeError, ValueError):  # settings this version does not know
        shown = "request rate R"
    plan_base = dict(trace=trace, hardware=hardware, model=model, search=search, protocol=shown, drafters=drafters,
                     target_rate=target_rate, price_source=prices.source if price else None, usd_per_gpu_hour=price,
                     engine=engine)
    if not ranked:
        return CapacityPlan(**plan_base, best=None, reason="no drafter meets the SLO at any load and swept "
                            "max_num_seqs; relax an SLO or --slo-attainment")
    winner = ranked[0].best
    step_error, step_source = cost_model_error(hardware, model)
    error = max(step_error, tolerance)
    reason = (f"{winner.drafter} at max_num_seqs {winner.max_num_seqs} sustains the most load per GPU meeting "
              f"the SLO at ≥ {search['target']:.0%} attainment: {_describe_rate(winner)}; larger: "
              f"{ranked[0].why}")
    within = False
    if len(ranked) > 1:
        second = ranked[1].best
        if winner.capacity_rate is None or second.capacity_rate is None:
            margin = winner.output_tok_s / second.output_tok_s - 1 if second.output_tok_s else math.inf
        else:
            margin = winner.capacity_per_gpu / second.capacity_per_gpu - 1 if second.capacity_per_gpu else math.inf
        within = margin <= error
        reason += (f"; runner-up: {second.drafter} at max_num_seqs {second.max_num_seqs}, {_describe_rate(second)}, "
                   f"{margin:+.1%} behind")
        if within:
            reason += (f" — inside the simulator's stated error (step cost ±{step_error:.1%}, {step_source}; "
                       f"search tolerance ±{tolerance:.0%}): the two are not told apart")
    if target_rate is not None and winner.replicas is not None:
        reason += f"; {target_rate:g} queries/s needs {winner.replicas} replica(s) × {winner.gpus} GPU"
    from agentspec_sim.sweep.plan import serve_flags

    config, args, env, note, served = serve_flags(winner, model, engine,
                                                  [{**r, "goodput_tok_s": _capacity_value(r)}
                                                   for r in group.to_dicts()])
    return CapacityPlan(**plan_base, best=winner, reason=reason, within_error=within, vllm_speculative_config=config,
                        vllm_args=args, vllm_env=env, vllm_note=note, vllm_model=served)


def _within(c: CapacityChoice, top: CapacityChoice, tolerance: float) -> bool:
    """Whether `c` sustains as much load per GPU as `top` to within the search's tolerance."""
    if top.capacity_rate is None:
        return c.capacity_rate is None and c.output_tok_s * (1 + tolerance) >= top.output_tok_s
    if c.capacity_rate is None:
        return True
    return (c.capacity_per_gpu or 0.0) * (1 + tolerance) >= (top.capacity_per_gpu or 0.0)


def _capacity_value(row: dict[str, Any]) -> float:
    """A row's capacity as one comparable number (unbounded: above any rate, ordered by throughput)."""
    if row["capacity_unbounded"]:
        return 1e12 + float(row["capacity_output_tok_s"] or 0.0)
    return float(row["capacity_rate"] or 0.0)
