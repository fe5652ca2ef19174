"""Planning by capacity: from capacity-search rows (`run_sweep(capacity=…)`), for each drafter configuration the
max_num_seqs that sustains the most load per GPU under the SLOs, the best configuration overall, the replicas
a target rate needs and what a million output tokens cost there.

Rules (docs/sweep-and-plan.md, "Capacity"):
- A capacity is a steady-state rate with its interval (agentspec_sim/capacity); an inconclusive one (a trace
  too short to load the configuration) is shown as "≥ rate" and never ranked, priced or turned into replicas.
- Seeds: the search states its interval over its own seeds; rows of several sweep seeds plan by the least.
- Per drafter configuration: the max_num_seqs of highest capacity per GPU (capacity ÷ the layout's GPUs);
  beside it the smallest max_num_seqs that cannot be told apart from it (less KV memory, shorter latencies).
- Told apart: two capacities differ when their gap exceeds their uncertainties combined (root sum of squares:
  each interval's half-width and, for eagle3/mtp, half the span of the capacities searched at the acceptance
  model's low and high bound) plus the step-cost model's stated error carried into capacity
  (`cost_model_error`: its bundled calibration's held-out median, else 5 %; to first order a step-time error
  e moves a capacity by e). The reason names the runner-up and says when the two are not told apart.
- Overall: the highest capacity per GPU; ties to `normal`, then the smaller batch.
- Replicas for `target_rate`: ⌈target ÷ (capacity's lower bound × `UTILISATION`)⌉ deployments of the layout's
  GPUs each, each replica taking whole queries from a balancer that spreads them evenly (no router is
  simulated here).
- Money from the sustained rate R: $ per query = GPUs × $/GPU-hour ÷ (R × 3600), $ per million output tokens
  = GPUs × $/GPU-hour ÷ (R × output tokens per query × 3600) × 10⁶, prices from the bundled table (its
  source in the file) or a file of the same shape.
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


def cost_model_error(hardware: str, model: str, engine: dict[str, Any] | None = None) -> tuple[float, str]:
    """The step-cost model's stated error for (hardware, model) at the layout of `engine` (its
    tensor_parallel_size, enable_expert_parallel, data_parallel_size; None: one GPU): the held-out median
    |ours / measured − 1| of the bundled AIConfigurator calibration the cost model uses there, else
    `COST_MODEL_ERROR`; and where the figure comes from."""
    from agentspec_sim.cost import load_hardware, load_model
    from agentspec_sim.cost.build import bundled_calibration
    from agentspec_sim.cost.layout import Layout

    try:
        m = load_model(model)
        engine = engine or {}
        layout = Layout(int(engine.get("tensor_parallel_size") or 1),
                        bool(engine.get("enable_expert_parallel")) and m.is_moe,
                        int(engine.get("data_parallel_size") or 1) if m.is_moe else 1)
        path = bundled_calibration(load_hardware(hardware).id, m.id, layout)
        if path is not None:
            error = float(json.loads(path.read_text())["fit"]["held_out_after"]["median_abs_error"])
            return error, "held-out median vs measured kernels"
    except (ValueError, KeyError, TypeError, OSError):
        pass
    return COST_MODEL_ERROR, "assumed: no bundled measured-kernel calibration for this pair"


# A replica is planned to run at this share of its capacity: Knative Serving's default target utilisation
# (config-autoscaler `container-concurrency-target-percentage: 70`), the autoscaler KServe serves vLLM under.
# The capacity already holds the SLO at its attainment target; the headroom absorbs bursts above the mean rate.
UTILISATION = 0.7
ROUTING = "whole queries spread evenly over independent replicas; no router simulated"

# A plan per layout (plan.py).
_GROUP = ("trace", "hardware", "model", "tensor_parallel_size", "expert_parallel", "data_parallel_size")
CAPACITY_COLUMNS = ("drafter", "speculative_config", "max_num_seqs", "capacity_rate", "capacity_low",
                    "capacity_high", "capacity_at_least", "capacity_inconclusive", "capacity_output_tokens_per_query",
                    "capacity_stopped", "capacity_search", "engine_config")


# The dearest a GPU-hour is taken to be (a rack-scale GB300 rents for tens of dollars): past it a price is a typo.
MAX_USD_PER_GPU_HOUR = 10_000.0


@dataclass(frozen=True)
class Prices:
    usd_per_gpu_hour: dict[str, float]
    source: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> Prices:
        """The bundled price table, or a JSON file {"source": …, "usd_per_gpu_hour": {hardware: $}}: every key a
        hardware profile (id or profile file), every price a number of dollars > 0, at most MAX_USD_PER_GPU_HOUR."""
        from agentspec_sim.cost import hardware_ids, load_hardware
        from agentspec_sim.io.strict_json import loads

        if path is None:
            text = resources.files("agentspec_sim.cost").joinpath("profiles/prices.json").read_text()
            where = "the bundled price table"
        else:
            where = str(path)
            try:
                text = Path(path).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise SweepError(f"{where}: not UTF-8 text (a JSON price table is)") from None
        try:
            doc = loads(text)
            table = doc["usd_per_gpu_hour"]
            if not isinstance(table, dict):
                raise TypeError(f"got {type(table).__name__}")
            source = str(doc.get("source", where))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SweepError(f"{where}: usd_per_gpu_hour: expected an object of hardware → $ per GPU-hour "
                             f"({exc})") from None
        prices = {}
        for key, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SweepError(f"{where}: usd_per_gpu_hour: {key}: expected a number of dollars, got "
                                 f"{json.dumps(value)}")
            if not (math.isfinite(value) and 0 < value <= MAX_USD_PER_GPU_HOUR):
                raise SweepError(f"{where}: usd_per_gpu_hour: {key}: must be a price > 0 and at most "
                                 f"${MAX_USD_PER_GPU_HOUR:,.0f} per GPU-hour, got {value:g}")
            try:
                load_hardware(key)
            except ValueError:
                raise SweepError(f"{where}: usd_per_gpu_hour: {key}: no such hardware profile (bundled: "
                                 f"{', '.join(hardware_ids())})") from None
            prices[str(key)] = float(value)
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
    capacity_rate: float | None  # steady-state queries/s at ≥ target attainment; None: inconclusive
    capacity_low: float | None  # its interval
    capacity_high: float | None
    at_least: float | None  # inconclusive: the highest rate that passed
    inconclusive: str | None
    capacity_per_gpu: float | None
    output_tok_s: float | None  # sustained: capacity × output tokens per query
    output_tokens_per_query: float
    gpus: int
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    query_latency_p99_s: float | None
    attainment: float | None
    stopped: str
    usd_per_million_tokens: float | None = None
    usd_per_query: float | None = None
    replicas: int | None = None  # for the target rate
    band: tuple[float, float] | None = None  # eagle3/mtp: the capacity at the acceptance model's low and high bound
    bound_by: str | None = None  # what kept calls waiting in the run at capacity (max_num_seqs, kv_cache, …)

    @property
    def k(self) -> int:
        return int(self.speculative_config.get("num_speculative_tokens", 0))

    @property
    def feasible(self) -> bool:
        """A conclusive capacity above 0: something to plan with."""
        return self.inconclusive is None and (self.capacity_rate or 0.0) > 0

    @property
    def relative_half_width(self) -> float:
        """Half the interval over the capacity (0 without an interval), combined (root sum of squares) with half
        the acceptance band's span where the drafter has one."""
        if not self.feasible or self.capacity_low is None or self.capacity_high is None:
            return 0.0
        seeds = (self.capacity_high - self.capacity_low) / 2 / self.capacity_rate
        band = abs(self.band[1] - self.band[0]) / 2 / self.capacity_rate if self.band else 0.0
        return math.hypot(seeds, band)

    def rank_key(self) -> float:
        return self.capacity_per_gpu or 0.0 if self.feasible else -1.0

    def told_apart_from(self, other: CapacityChoice, model_error: float) -> bool:
        """Whether this choice's capacity per GPU is told apart from `other`'s (`told_apart`)."""
        return told_apart(self, other, model_error)


@dataclass(frozen=True)
class DrafterCapacity:
    drafter: str
    by_batch: dict[int, float | None]  # max_num_seqs → capacity (queries/s; None: inconclusive)
    best: CapacityChoice | None
    why: str
    smaller: CapacityChoice | None = None  # the smallest max_num_seqs not told apart from `best`
    intervals: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)  # max_num_seqs → interval
    at_least: dict[int, float] = field(default_factory=dict)  # max_num_seqs → lower bound where inconclusive


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
    model_error: float = COST_MODEL_ERROR
    model_error_source: str = ""
    utilisation: float = UTILISATION
    routing: str = ROUTING
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
            for key in ("by_batch", "intervals", "at_least"):
                d[key] = {str(k): v for k, v in d[key].items()}
        return doc


# The capacity columns read as numbers (a file edited or written by something else may hold text).
_CAPACITY_NUMBERS = ("max_num_seqs", "capacity_rate", "capacity_low", "capacity_high", "capacity_at_least",
                     "capacity_output_tokens_per_query")
# Columns only a capacity search writes: a file with any of them holds capacity rows.
_CAPACITY_MARKS = ("capacity_rate", "capacity_search")


def column_kind_error(results: pl.DataFrame, numbers: tuple[str, ...] = (), lists: tuple[str, ...] = ()) -> str | None:
    """Where a capacity file edited or written by something else holds another kind than its readers need: the
    first of `numbers` (numeric columns) or `lists` (a list of numbers a row) that is not, in words; None if all
    are (missing columns are the caller's to name)."""
    for name in numbers:
        dtype = results.schema[name]
        if not (dtype.is_numeric() or dtype == pl.Null):
            return f"capacity results: column {name}: expected numbers, got {dtype}"
    for name in lists:
        dtype = results.schema[name]
        if not (isinstance(dtype, pl.List) and (dtype.inner.is_numeric() or dtype.inner == pl.Null)):
            return f"capacity results: column {name}: expected a list of numbers a row, got {dtype}"
    return None


def is_capacity_results(results: pl.DataFrame) -> bool:
    """Whether `results` are capacity-search rows (SweepError when they mix with goodput rows: a capacity row has its
    search's settings, `capacity_search`; a goodput row, concatenated in, has none)."""
    marks = [c for c in _CAPACITY_MARKS if c in results.columns]
    if not marks:
        return False
    if "capacity_search" in results.columns and results.height:
        searched = int(results["capacity_search"].is_not_null().sum())
        if 0 < searched < results.height:
            raise SweepError(f"these results mix {searched} capacity row(s) (sweep --capacity) with "
                             f"{results.height - searched} goodput row(s) (no capacity_search): plan or report "
                             "each kind from its own file")
        if searched == 0:
            return False  # every row a goodput row, read with another file's capacity columns (all null)
    return True


def plan_capacity(results: pl.DataFrame, target_rate: float | None = None,
                  prices: Prices | None = None) -> list[CapacityPlan]:
    """A capacity plan per (trace, hardware, model) of capacity-search results."""
    if not is_capacity_results(results):
        raise SweepError("these results hold no capacity search (sweep --capacity with --slo-* options)")
    if results.height == 0:
        raise SweepError("no sweep results to plan from")
    missing = [c for c in CAPACITY_COLUMNS if c not in results.columns]
    if missing and "capacity_unbounded" in results.columns:
        raise SweepError("these capacity results were searched on the finite trace (capacity_unbounded, no "
                         "interval), before capacities were steady-state rates with intervals: run sweep --capacity "
                         "again to plan from them")
    if missing:
        raise SweepError(f"capacity results lack column(s) {', '.join(missing)} (written by sweep --capacity)")
    why = column_kind_error(results, _CAPACITY_NUMBERS)
    if why:
        raise SweepError(why)
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
    """One choice per (drafter configuration, max_num_seqs), the worst sweep seed's (an inconclusive one first:
    nothing may be planned from it)."""
    out = []
    keys = ["drafter", "speculative_config", "max_num_seqs"]
    for _, cell in group.group_by(keys, maintain_order=True):
        rows = cell.to_dicts()
        worst = min(rows, key=lambda r: (r["capacity_inconclusive"] is None, r["capacity_rate"] or 0.0))
        engine = json.loads(worst["engine_config"]) if worst.get("engine_config") else {}
        gpus = int(engine.get("tensor_parallel_size") or 1) * int(engine.get("data_parallel_size") or 1)
        inconclusive = worst["capacity_inconclusive"]
        rate = None if inconclusive else float(worst["capacity_rate"] or 0.0)
        per_query = float(worst["capacity_output_tokens_per_query"] or 0.0)
        out.append(CapacityChoice(
            drafter=worst["drafter"], speculative_config=json.loads(worst["speculative_config"]),
            max_num_seqs=int(worst["max_num_seqs"]), capacity_rate=rate,
            capacity_low=None if inconclusive else worst["capacity_low"],
            capacity_high=None if inconclusive else worst["capacity_high"],
            at_least=worst["capacity_at_least"] if inconclusive else None, inconclusive=inconclusive,
            capacity_per_gpu=None if rate is None else rate / gpus,
            output_tok_s=None if rate is None else rate * per_query, output_tokens_per_query=per_query, gpus=gpus,
            ttft_p99_s=worst.get("ttft_p99"), tpot_p99_s=worst.get("tpot_p99"),
            query_latency_p99_s=worst.get("query_latency_p99"), attainment=worst.get("attainment_met"),
            stopped=worst["capacity_stopped"], bound_by=worst.get("bound_by"),
            band=(None if worst.get("capacity_band_low") is None or worst.get("capacity_band_high") is None
                  else (float(worst["capacity_band_low"]), float(worst["capacity_band_high"])))))
    return out


def _describe_rate(choice: CapacityChoice) -> str:
    if choice.inconclusive is not None:
        return f"inconclusive (≥ {choice.at_least or 0.0:.4g} queries/s; the trace is too short to load it)"
    text = f"{choice.capacity_rate:.4g} queries/s"
    if choice.capacity_low is not None and choice.capacity_high is not None and choice.capacity_rate:
        text += f" [{choice.capacity_low:.4g}, {choice.capacity_high:.4g}]"
    return text + f" ({choice.output_tok_s or 0.0:,.0f} tok/s)"


def told_apart(a: CapacityChoice, b: CapacityChoice, model_error: float) -> bool:
    """Whether a's capacity per GPU differs from b's by more than their uncertainty (module docstring)."""
    if not (a.feasible and b.feasible):
        return a.feasible != b.feasible
    gap = abs(math.log(a.capacity_per_gpu / b.capacity_per_gpu))
    return gap > math.hypot(a.relative_half_width, b.relative_half_width) + model_error


def _plan_group(trace: str, hardware: str, model: str, group: pl.DataFrame, target_rate: float | None,
                prices: Prices, engine: dict[str, Any] | None) -> CapacityPlan:
    from dataclasses import replace

    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.engine.load import protocol

    search = json.loads(group["capacity_search"][0])
    choices = _choices(group)
    price = prices.of(hardware)
    step_error, step_source = cost_model_error(hardware, model, engine)

    def priced(c: CapacityChoice) -> CapacityChoice:
        if not c.feasible:
            return c
        usd_query = c.gpus * price / (c.capacity_rate * 3600) if price else None
        usd_mtok = usd_query / c.output_tokens_per_query * 1e6 if usd_query and c.output_tokens_per_query > 0 else None
        replicas = None
        if target_rate is not None:
            floor = c.capacity_low if c.capacity_low else c.capacity_rate
            replicas = math.ceil(target_rate / (floor * UTILISATION) - 1e-9)
        return replace(c, usd_per_million_tokens=usd_mtok, usd_per_query=usd_query, replicas=replicas)

    choices = [priced(c) for c in choices]
    labels = list(dict.fromkeys(c.drafter for c in choices))
    drafters = []
    for label in labels:
        mine = [c for c in choices if c.drafter == label]
        by_batch = {c.max_num_seqs: c.capacity_rate for c in mine}
        intervals = {c.max_num_seqs: (c.capacity_low, c.capacity_high) for c in mine}
        floors = {c.max_num_seqs: c.at_least or 0.0 for c in mine if c.inconclusive is not None}
        feasible = [c for c in mine if c.feasible]
        if not feasible:
            lost = next((c for c in mine if c.inconclusive is not None), mine[0])
            why = (f"max_num_seqs {lost.max_num_seqs}: {lost.inconclusive}" if lost.inconclusive is not None else
                   f"no swept max_num_seqs meets the SLO at any load (max_num_seqs {lost.max_num_seqs}: "
                   f"{lost.stopped})")
            drafters.append(DrafterCapacity(label, by_batch, None, why, None, intervals, floors))
            continue
        best = max(feasible, key=lambda c: (c.rank_key(), -c.max_num_seqs))
        # A smaller batch the search cannot tell apart from the best sustains as much: less KV memory, shorter
        # latencies. Shown beside the best, not picked over it.
        smaller = min((c for c in feasible if c.max_num_seqs < best.max_num_seqs
                       and not told_apart(c, best, step_error)), key=lambda c: c.max_num_seqs, default=None)
        larger = [c for c in mine if c.max_num_seqs > best.max_num_seqs]
        why = ("the largest batch size swept" if not larger else
               f"max_num_seqs {larger[0].max_num_seqs} sustains {_describe_rate(larger[0])}")
        if not larger and best.bound_by == "max_num_seqs":
            why += (" — and at capacity calls waited mostly for a seat (max_num_seqs binds): a larger batch may "
                    "sustain more")
        if smaller is not None:
            why += (f"; max_num_seqs {smaller.max_num_seqs} sustains {_describe_rate(smaller)}, not told apart "
                    "from it")
        drafters.append(DrafterCapacity(label, by_batch, best, why, smaller, intervals, floors))
    ranked = sorted((d for d in drafters if d.best is not None),
                    key=lambda d: (-d.best.rank_key(), d.best.speculative_config["method"] != "normal",
                                   d.best.max_num_seqs))
    shared = {k: v for k, v in (engine or {}).items() if k in EngineConfig.__dataclass_fields__}
    try:
        shown = protocol(replace(EngineConfig(**shared), burstiness=search["burstiness"]), varied_rate=True)
    except (TypeError, ValueError):  # settings this version does not know
        shown = "request rate R"
    plan_base = dict(trace=trace, hardware=hardware, model=model, search=search, protocol=shown, drafters=drafters,
                     target_rate=target_rate, price_source=prices.source if price else None, usd_per_gpu_hour=price,
                     engine=engine, model_error=step_error, model_error_source=step_source)
    if not ranked:
        lost = [d for d in drafters if any(c.inconclusive for c in choices if c.drafter == d.drafter)]
        why = ("no capacity can be stated: the trace is too short to load " + ", ".join(d.drafter for d in lost)
               + " (a longer trace, --replicate or --capacity-max-tenants lengthens it)" if lost else
               "no drafter meets the SLO at any load and swept max_num_seqs; relax an SLO or --slo-attainment")
        return CapacityPlan(**plan_base, best=None, reason=why)
    winner = ranked[0].best
    reason = (f"{winner.drafter} at max_num_seqs {winner.max_num_seqs} sustains the most load per GPU meeting "
              f"the SLO at ≥ {search['target']:.0%} attainment: {_describe_rate(winner)}; larger: "
              f"{ranked[0].why}")
    within = False
    if len(ranked) > 1:
        second = ranked[1].best
        margin = winner.capacity_per_gpu / second.capacity_per_gpu - 1
        within = not told_apart(winner, second, step_error)
        reason += (f"; runner-up: {second.drafter} at max_num_seqs {second.max_num_seqs}, {_describe_rate(second)}, "
                   f"{margin:+.0%} behind")  # whole percent: the search resolves its rates to ±5 %
        if within:
            reason += (f" — not told apart (their intervals ±{winner.relative_half_width:.1%} and "
                       f"±{second.relative_half_width:.1%} with the step cost's ±{step_error:.1%}, {step_source})")
    if target_rate is not None and winner.replicas is not None:
        reason += (f"; {target_rate:g} queries/s needs {winner.replicas} replica(s) × {winner.gpus} GPU at "
                   f"{UTILISATION:.0%} of the capacity's lower bound ({ROUTING})")
    from agentspec_sim.sweep.plan import serve_flags

    config, args, env, note, served = serve_flags(winner, model, engine,
                                                  [{**r, "goodput_tok_s": _capacity_value(r)}
                                                   for r in group.to_dicts()])
    return CapacityPlan(**plan_base, best=winner, reason=reason, within_error=within, vllm_speculative_config=config,
                        vllm_args=args, vllm_env=env, vllm_note=note, vllm_model=served)


def _capacity_value(row: dict[str, Any]) -> float:
    """A row's capacity as one comparable number (inconclusive: below every stated one)."""
    if row.get("capacity_inconclusive"):
        return -1.0
    return float(row["capacity_rate"] or 0.0)
