"""Sweep cells: one simulation each (drafter configuration × engine config), the grid that expands
them, their stable ids, and the order to start them in.

A cell is fully described by the trace path, the drafter configuration (resolved, as vLLM would
read it) and the frozen `EngineConfig` (max_num_seqs, hardware, model, seed and every other engine
knob). Its `cell_id` hashes exactly those, so a resumed sweep recognises finished cells and a sweep
with other engine settings never reuses them. The `normal` cell of each (trace, engine config)
group is the baseline every cell of the group divides its goodput by.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from agentspec_sim.cost.layout import TP_SIZES, Layout, LayoutSearch
from agentspec_sim.drafters.registry import drafter_class, parse_drafter, speculative_config
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.engine.drafting import COMMON_KEYS, SpecConfigError, SpeculativeConfig

# Figure 1 of the AgentSpec paper: every drafter against max batch sizes 1 … 256.
FIGURE1_DRAFTERS = ("normal", "ngram", "ngram-v2", "suffix", "eagle3", "agentspec")
FIGURE1_MAX_NUM_SEQS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# CPU seconds per million output tokens by method, for ordering only (slowest first): measured on
# the default trace at max_num_seqs 256 (a sweep's cells; only the ratios matter; the workload tables
# cached, drafters/common/table_cache.py). At max_num_seqs 1 per-step work adds (1 + factor)×. Unknown methods
# (agspec, the ablations, agentspec+): between agentspec and suffix.
_SECONDS_PER_MTOK = {"normal": 0.27, "ngram": 0.32, "ngram-v2": 0.31, "eagle3": 0.27, "mtp": 0.27, "suffix": 2.6,
                     "agentspec": 0.35}
_DEFAULT_SECONDS_PER_MTOK = 1.5
_SMALL_BATCH_FACTOR = {"normal": 0.75, "ngram": 0.8, "ngram-v2": 0.8, "eagle3": 0.3, "mtp": 0.3, "suffix": 0.5,
                       "agentspec": 0.3}


# EngineConfig fields that vary per cell (key columns of their own) or do not change results.
_PER_CELL_ENGINE_FIELDS = frozenset({"max_num_seqs", "hardware", "model", "seed", "check_invariants"})

# The most cells a sweep runs unless its caller raises the limit (`max_cells`; `sweep --max-cells`): a
# cell of the default trace takes ~1–10 CPU s, so 10,000 cells are hours of CPU on a workstation; a
# sweep past it is refused before anything is expanded or started (`check_sweep_size`).
MAX_CELLS = 10_000


class SweepError(ValueError):
    """A sweep that cannot run as asked (bad grid, failed cell, results file of another schema)."""


@dataclass(frozen=True)
class Cell:
    """One simulation of a sweep: `trace` (the path as given), the drafter `spec` (labelled), the engine."""

    trace: str
    spec: SpeculativeConfig
    config: EngineConfig
    search: str | None = None  # a capacity search's settings (JSON, agentspec_sim/capacity.py); None: one run

    @property
    def label(self) -> str:
        return self.spec.name

    @property
    def speculative_config(self) -> str:
        """The configuration as `vllm serve --speculative-config` JSON, sorted keys."""
        return json.dumps(self.spec.to_json(), sort_keys=True)

    @property
    def cell_id(self) -> str:
        """A stable hash of everything that determines the cell's results (16 hex digits)."""
        params = {"trace": self.trace, "drafter": self.label, "speculative_config": self.spec.to_json(),
                  "engine": asdict(self.config)}
        if self.search is not None:
            params["capacity_search"] = self.search
        text = json.dumps(params, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def group(self) -> tuple[str, EngineConfig]:
        """The cells that share one `normal` baseline: same trace, same engine config."""
        return self.trace, self.config

    @property
    def engine_config(self) -> str:
        """The engine settings the cell shares with the rest of its sweep (every `EngineConfig` field but the
        per-cell max_num_seqs, hardware, model and seed, and the test-only check_invariants), as JSON with
        sorted keys: the results keep it so `plan --results` can print the `vllm serve` flags that deploy
        what was simulated."""
        shared = {k: v for k, v in asdict(self.config).items() if k not in _PER_CELL_ENGINE_FIELDS}
        return json.dumps(shared, sort_keys=True)

    def key_columns(self) -> dict[str, Any]:
        return {"cell_id": self.cell_id, "trace": self.trace, "drafter": self.label,
                "speculative_config": self.speculative_config, "max_num_seqs": self.config.max_num_seqs,
                "hardware": self.config.hardware, "model": self.config.model, "seed": self.config.seed}


def parse_int_list(text: str, what: str) -> list[int]:
    """`1,2,4` → [1, 2, 4]; each a positive integer, no repeats."""
    values: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise SweepError(f"{what}: {item!r} is not an integer") from None
        if value < 1:
            raise SweepError(f"{what}: values must be ≥ 1, got {value}")
        if value in values:
            raise SweepError(f"{what}: {value} is listed twice")
        values.append(value)
    if not values:
        raise SweepError(f"{what}: no values given")
    return values


def parse_name_list(text: str, what: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise SweepError(f"{what}: no values given")
    if len(set(names)) != len(names):
        raise SweepError(f"{what}: a value is listed twice in {text!r}")
    return names


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """`['num_speculative_tokens=1,3,5']` → [('num_speculative_tokens', [1, 3, 5])]. Values are JSON
    where they parse as JSON (numbers, true/false), else strings."""
    grid: list[tuple[str, list[Any]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise SweepError(f"--grid {item!r}: expected KEY=V1,V2,… (e.g. num_speculative_tokens=1,3,5,8)")
        if key == "method":
            raise SweepError("--grid method=…: list drafters with --drafter instead")
        if any(key == k for k, _ in grid):
            raise SweepError(f"--grid: key {key!r} given twice")
        parsed = [_grid_value(v.strip()) for v in values.split(",") if v.strip()]
        grid.append((key, parsed))
    return grid


def _grid_value(text: str) -> Any:
    from agentspec_sim.io import strict_json

    try:
        return strict_json.loads(text)  # NaN, Infinity stay text: the config's own check names them
    except ValueError:  # StrictJSONError
        return text


def _accepts(spec: SpeculativeConfig, key: str) -> bool:
    return key in COMMON_KEYS or key in drafter_class(spec.method).config_keys


def _short(key: str, value: Any) -> str:
    return f"k={value}" if key == "num_speculative_tokens" else f"{key}={json.dumps(value)}"


def drafter_configs(drafters: Sequence[str], speculative_configs: Sequence[str] = (),
                    grid: Sequence[tuple[str, list[Any]]] = ()) -> list[SpeculativeConfig]:
    """Every drafter configuration of a sweep, labelled: `normal` first (always), then each drafter
    (shorthand name) and each `--speculative-config` JSON crossed with the grid keys it accepts.

    A grid key applies to the configurations whose method accepts it (`num_speculative_tokens`
    applies to all but `normal`); a key no configuration accepts is an error. Labels are unique.
    """
    # (configuration, given by name): a named drafter's grid variants are labelled `name k=3`, a JSON
    # configuration's are described in full (its name alone would not tell them apart).
    bases: list[tuple[SpeculativeConfig, bool]] = [(parse_drafter(name, "--drafter"), True) for name in drafters]
    for text in speculative_configs:
        spec = parse_drafter(text, "--speculative-config")
        bases.append((replace(spec, label=spec.label or _describe_json(spec)), False))
    for key, _ in grid:
        if not any(s.method != "normal" and _accepts(s, key) for s, _ in bases):
            raise SweepError(f"--grid {key}: no drafter in the sweep accepts this key")
    out = [parse_drafter("normal")]
    for base, by_name in bases:
        if base.method == "normal":
            continue
        keys = [(k, vs) for k, vs in grid if _accepts(base, k)]
        for values in itertools.product(*(vs for _, vs in keys)):
            if not keys:
                out.append(base)
                continue
            # The keys the drafter was given (not its resolved defaults), so vLLM's rules apply to the
            # grid value as to a hand-written config (e.g. a prompt_lookup_max alone sets the min too).
            data = {**(dict(base.raw) or base.to_json()), **{k: v for (k, _), v in zip(keys, values, strict=True)}}
            parts = [_short(k, v) for (k, _), v in zip(keys, values, strict=True)]
            try:
                spec = speculative_config(data)
            except SpecConfigError as exc:
                raise SweepError(f"--grid: {base.name} {' '.join(parts)}: {exc}") from None
            out.append(replace(spec, label=" ".join([base.name, *parts]) if by_name else _describe_json(spec)))
    seen: set[str] = set()
    distinct = []
    for spec in out:  # the same configuration twice (e.g. ngram and its JSON) runs once
        key = json.dumps(spec.to_json(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            distinct.append(spec)
    labels: dict[str, int] = {}
    result = []
    for spec in distinct:
        labels[spec.name] = labels.get(spec.name, 0) + 1
        result.append(spec if labels[spec.name] == 1 else replace(spec, label=f"{spec.name} #{labels[spec.name]}"))
    return result


def count_configs(drafters: Sequence[str], speculative_configs: Sequence[str] = (),
                  grid: Sequence[tuple[str, Sequence[Any]]] = ()) -> tuple[int, int]:
    """(how many configurations `drafter_configs` makes, at most — `normal` plus each drafter crossed with
    the grid values it accepts, a configuration listed twice counted twice —, how many drafters and
    configurations were given), without making them: a grid's product can be astronomically large."""
    bases = [parse_drafter(name) for name in drafters] + [parse_drafter(text) for text in speculative_configs]
    total = 1
    for base in bases:
        if base.method != "normal":
            total += math.prod(len(values) for key, values in grid if _accepts(base, key))
    return total, len(bases)


def _count(values: Sequence[Any]) -> int:
    """len(values), also for a range longer than `len` can report (sys.maxsize)."""
    if isinstance(values, range):
        return max(0, -((values.start - values.stop) // values.step))
    return len(values)


def check_sweep_size(configs: int, given: int, grid: bool, max_num_seqs: Sequence[int], hardware: Sequence[str],
                     models: Sequence[str], seeds: Sequence[int], max_cells: int | None, layouts: int = 1) -> int:
    """The number of cells (`configs` drafter configurations, of which `given` were listed and the rest come
    from the `grid`, × max_num_seqs × hardware × models × seeds × at most `layouts` parallel layouts a pair);
    `ResourceError` over `max_cells`, blaming the largest factor (None: no limit)."""
    from agentspec_sim.host.resources import require_count

    factors = {"grid" if grid and configs > given + 1 else "drafters": configs, "max_num_seqs": _count(max_num_seqs),
               "hardware": _count(hardware), "models": _count(models), "seeds": _count(seeds), "layouts": layouts}
    cells = math.prod(factors.values())
    blamed = max(factors, key=lambda k: factors[k])
    counts = list(factors.values())
    names = ("drafter configuration", "max_num_seqs value", "hardware profile", "model", "seed", "parallel layout")
    detail = " × ".join(f"{n:,} {name}{'' if n == 1 else 's'}" for n, name in zip(counts, names, strict=True))
    require_count(blamed, cells, "cells", "the sweep", max_cells, "max_cells", value=factors[blamed], detail=detail,
                  lower="use fewer {grid} values" if blamed == "grid" else None)
    return cells


def _describe_json(spec: SpeculativeConfig) -> str:
    from agentspec_sim.drafters.registry import describe

    return describe(spec)


def expand_cells(trace: str, specs: Sequence[SpeculativeConfig], max_num_seqs: Sequence[int],
                 hardware: Sequence[str], models: Sequence[str], seeds: Sequence[int],
                 base: EngineConfig | None = None, search: str | None = None,
                 layouts: LayoutSearch | None = None) -> list[Cell]:
    """The cartesian product, in a fixed order (hardware, model, layout, max_num_seqs, seed, drafter): the
    order of the results file. `search`: each cell is a capacity search with these settings. `layouts`: the
    parallel layouts each (hardware, model) pair is run at (`LayoutSearch.layouts`; None: `base`'s own)."""
    base = base or EngineConfig()
    cells = []
    for hw, model in itertools.product(hardware, models):
        if layouts is None:
            pair_layouts = [Layout(base.tensor_parallel_size, base.enable_expert_parallel, base.data_parallel_size)]
        else:
            pair_layouts = layouts.layouts(hw, model, base.max_model_len, base.gpu_memory_utilization)
            if not pair_layouts:
                raise SweepError(f"no parallel layout of {model} fits {hw} (tensor-parallel sizes "
                                 f"{', '.join(map(str, layouts.sizes or TP_SIZES))}: the heads must split evenly and "
                                 "the KV cache beside the weights hold one max_model_len sequence; lower "
                                 "--max-model-len or give larger sizes)")
        for layout, b, seed in itertools.product(pair_layouts, max_num_seqs, seeds):
            config = replace(base, hardware=hw, model=model, max_num_seqs=b, seed=seed,
                             tensor_parallel_size=layout.tensor_parallel_size,
                             enable_expert_parallel=layout.expert_parallel,
                             data_parallel_size=layout.data_parallel_size)
            cells.extend(Cell(trace, spec, config, search) for spec in specs)
    return cells


# Methods whose runs first build a workload table (drafters/agentspec/tables.py, suffix_tables.py,
# ngram_tables.py; eagle3/mtp's code(n) segments), shared by the cells of one drafter configuration, trace
# and model through the disk cache.
TABLE_METHODS = frozenset({"suffix", "agentspec", "agentspec-s", "agentspec-n", "agentspec-paper", "ngram", "ngram-v2",
                           "eagle3", "mtp"})


def start_order(cells: Sequence[Cell], output_tokens: int, num_queries: int) -> list[Cell]:
    """The order to start `cells` in: slowest first (`estimated_cost`; ties keep the given order), except
    that the first cell of each configuration that builds a workload table comes before the second cell
    of any — workers starting at once then build different tables instead of waiting for one."""
    ranked = sorted(cells, key=lambda c: -estimated_cost(c, output_tokens, num_queries))
    seen: set[tuple[str, str, str]] = set()
    builders: list[int] = []  # positions in `ranked` of each table group's first cell
    for i, cell in enumerate(ranked):
        group = (cell.trace, cell.speculative_config, cell.config.model)
        if cell.spec.method in TABLE_METHODS and group not in seen:
            seen.add(group)
            builders.append(i)
    if not builders:
        return ranked
    moved = set(builders)
    first = builders[0]  # the cells before it stay first; the other builders move up behind it
    return (ranked[:first] + [ranked[i] for i in builders]
            + [cell for i, cell in enumerate(ranked) if i > first and i not in moved])


def estimated_cost(cell: Cell, output_tokens: int, num_queries: int) -> float:
    """A relative wall-time estimate, only to start the slowest cells first: the method's cost per
    output token, times (1 + a per-method factor ÷ the calls decoding at once, ≤ max_num_seqs), three times
    over for a drafter with an acceptance band (`run.band.has_band`: its cell runs, or searches, again at the
    band's two bounds; the last cells of a default-trace capacity plan were its eagle3 searches, three each)."""
    from agentspec_sim.run.band import has_band

    method = cell.spec.method
    concurrency = max(1, min(cell.config.max_num_seqs or 256, num_queries * cell.config.tenants))
    per_token = _SECONDS_PER_MTOK.get(method, _DEFAULT_SECONDS_PER_MTOK) * (8 if cell.search else 1)
    per_token *= 3 if has_band(cell.spec, cell.config.model) else 1
    return per_token * output_tokens * cell.config.tenants * (1 + _SMALL_BATCH_FACTOR.get(method, 0.7) / concurrency)
