"""`run_sweep`: every cell of a grid (drafter configuration × max_num_seqs × hardware × model × seed),
in parallel workers, written cell by cell, resumable; `run_cell`: one cell's simulation and row.

One `normal` cell per (trace, engine config) group is the baseline of the whole group: a drafter
never re-runs it. Cells start slowest first (estimated from the trace's size and the method), so the
long ones do not end up alone at the end. The rows come out in the grid's order, whatever order the
workers finish in, so `-j 2` writes what `-j 1` writes (only `wall_s` is a wall-clock measurement).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl

from agentspec_sim.capacity import CapacitySearch
from agentspec_sim.cost.layout import LayoutSearch
from agentspec_sim.engine.config import EngineConfig, ResolvedLimits
from agentspec_sim.sweep.cells import (
    FIGURE1_DRAFTERS,
    FIGURE1_MAX_NUM_SEQS,
    MAX_CELLS,
    Cell,
    SweepError,
    check_sweep_size,
    count_configs,
    drafter_configs,
    expand_cells,
    start_order,
)
from agentspec_sim.sweep.executors import WorkloadSource, make_executor
from agentspec_sim.sweep.results import (
    BATCH_TIMES,
    ENGINE_CONFIG,
    LATENCIES,
    PROBE_COLUMNS,
    TRACE_FILE,
    ResultStore,
    Row,
    fill_speedups,
    to_frame,
    trace_file,
)
from agentspec_sim.trace.schema import Workload

Progress = Callable[[int, int, Row | None], None]


def run_cell(workload: Workload, cell: Cell, band: bool = True) -> Row:
    """Simulate one cell; its row: key columns, `RunSummary.to_row()` (speedup left to the sweep,
    which knows the group's `normal` goodput), the band columns (`agentspec_sim.run.band.COLUMNS`: with `band`, a
    banded eagle3/mtp cell's runs at its acceptance model's low and high bound — two more simulations —,
    else null), the shared engine settings, then every completed query's latency."""
    from agentspec_sim.cost import cost_model_for
    from agentspec_sim.metrics import completed_latencies, summarize
    from agentspec_sim.run.band import empty_columns, run_band
    from agentspec_sim.run.simulation import simulate

    config = cell.config
    # One cost model for the cell's runs (its memo of linear-layer times is filled once, not per bound).
    cost = cost_model_for(config)
    result = simulate(workload, cell.spec, config, cost)
    row = cell.key_columns()
    for key, value in summarize(result).to_row().items():
        row.setdefault(key, value)  # drafter, speculative_config: the cell's (as given to vLLM, unbound)
    # speedups: filled in by the sweep
    bounds = run_band(workload, cell.spec, config, cost_model=cost) if band else None
    row.update(empty_columns() if bounds is None else bounds.columns())
    row[ENGINE_CONFIG] = cell.engine_config
    row[TRACE_FILE] = trace_file(cell.trace)
    if config.copies_protocol:  # each query's batch time: the sweep divides normal's by it (speedup_mean_per_query)
        from agentspec_sim.metrics import per_query_batch_s

        row[BATCH_TIMES] = [None if x != x else float(x) for x in per_query_batch_s(result)]
    row[LATENCIES] = completed_latencies(result)
    return row


def run_capacity_cell(workload: Workload, cell: Cell, search: CapacitySearch, band: bool = True) -> Row:
    """One cell's capacity search (agentspec_sim/capacity), all its probes in this worker on one cost model;
    its row: key columns, the capacity columns (the steady-state rate, its interval, each seed's, whether it is
    inconclusive), `RunSummary.to_row()` of the run at capacity (of the isolated probe where no rate passes),
    the engine settings, every probe as list columns (`probe_rate` 0.0: each query alone), and the latencies
    of the queries of the run at capacity. With `band`, an eagle3/mtp cell whose acceptance model has an
    uncertainty band is searched again at the band's low and high bound (`capacity_band_low` / `_high`: the
    model's own uncertainty carried into capacity, which the plan weighs when it tells drafters apart)."""
    from agentspec_sim.capacity import find_capacity
    from agentspec_sim.cost import cost_model_for
    from agentspec_sim.run.band import bound_configs

    config = cell.config
    cost = cost_model_for(config)
    reference = functools.partial(_normal_reference, workload, config, search, cost)
    cap = find_capacity(workload, cell.spec, config, search, cost, normal_reference=reference)
    bounds = bound_configs(cell.spec, config.model) if band and cap.conclusive and cap.rate > 0 else None
    edges = {bound: find_capacity(workload, spec, config, search, cost, normal_reference=reference)
             for bound, spec in (bounds or {}).items()}
    row = cell.key_columns()
    gpus = config.tensor_parallel_size * config.data_parallel_size
    rate = cap.rate if cap.conclusive else None
    row.update({"capacity_rate": rate, "capacity_low": cap.low if cap.conclusive else None,
                "capacity_high": cap.high if cap.conclusive else None,
                "capacity_at_least": None if cap.conclusive else cap.rate,
                "capacity_inconclusive": cap.inconclusive,
                "capacity_per_gpu": None if rate is None else rate / gpus,
                "capacity_output_tok_s": cap.output_tok_s if cap.conclusive else None,
                "capacity_output_tokens_per_query": cap.output_tokens_per_query,
                "capacity_request_throughput": cap.request_throughput,
                "capacity_bracket_low": _finite(cap.bracket[0]), "capacity_bracket_high": _finite(cap.bracket[1]),
                "capacity_seed_rates": [s.rate for s in cap.seeds], "capacity_tenants": cap.tenants,
                **{f"capacity_band_{bound}": edge.rate if edge.conclusive else None for bound, edge in edges.items()},
                "capacity_stopped": cap.stopped, "capacity_probes": len(cap.probes),
                "capacity_search": cell.search})
    summary = cap.at_capacity if cap.at_capacity is not None else cap.isolated
    for key, value in summary.to_row().items():
        row.setdefault(key, value)
    row[ENGINE_CONFIG] = cell.engine_config
    probes = cap.probes
    row["probe_rate"] = [0.0 if p.rate is None else p.rate for p in probes]
    for column, attr in zip(PROBE_COLUMNS[1:], ("met", "output_throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50",
                                                "tpot_p99", "query_latency_p50", "query_latency_p99", "seed",
                                                "tenants", "served_share", "stopped_s"), strict=True):
        row[column] = [None if getattr(p, attr) is None else float(getattr(p, attr)) for p in probes]
    row["probe_stable"] = [p.stable for p in probes]
    row[TRACE_FILE] = trace_file(cell.trace)
    row[LATENCIES] = list(cap.latencies)
    return row


# The last workload's `normal` isolated p90 per engine config (capacity/search.py `isolated_p90`): the lengthening
# reference every drafter's search on that config shares, run once per worker instead of once per cell.
_REFERENCES: dict[str, Any] = {"workload": None, "by_config": {}}


def _normal_reference(workload: Workload, config: EngineConfig, search: CapacitySearch, cost: Any) -> float | None:
    from agentspec_sim.capacity.search import isolated_p90

    if _REFERENCES["workload"] is not workload:
        _REFERENCES["workload"], _REFERENCES["by_config"] = workload, {}
    key = (config, search.burstiness)  # the cost model is the config's own (`cost_model_for`)
    memo = _REFERENCES["by_config"]
    if key not in memo:
        memo[key] = isolated_p90(workload, config, search, cost)
    return memo[key]


def _finite(value: float) -> float | None:
    import math

    return value if math.isfinite(value) else None


def sweep_cells(trace: str, drafters: Sequence[str] = FIGURE1_DRAFTERS, speculative_configs: Sequence[str] = (),
                grid: Mapping[str, Sequence[Any]] | None = None,
                max_num_seqs: Sequence[int] = FIGURE1_MAX_NUM_SEQS, hardware: Sequence[str] = ("a100-80g",),
                models: Sequence[str] = ("qwen3-8b",), seeds: Sequence[int] = (0,),
                engine: EngineConfig | None = None, max_cells: int | None = MAX_CELLS,
                search: CapacitySearch | None = None, layouts: LayoutSearch | None = None) -> list[Cell]:
    """The cells of a sweep in results order (see `drafter_configs` and `expand_cells`); a sweep of more
    than `max_cells` cells (None: no limit) is refused (`ResourceError`) before any is made. `search`: each
    cell is a capacity search. `layouts`: the parallel layouts crossed with the cells (None: the engine's)."""
    grid_items = list((grid or {}).items())
    configs, given = count_configs(drafters, speculative_configs, grid_items)
    check_sweep_size(configs, given, bool(grid_items), max_num_seqs, hardware, models, seeds, max_cells,
                     1 if layouts is None else layouts.most)
    specs = drafter_configs(drafters, speculative_configs, grid_items)
    text = None if search is None else json.dumps(search.to_dict(), sort_keys=True)
    return expand_cells(trace, specs, max_num_seqs, hardware, models, seeds, engine, text, layouts)


def run_sweep(trace: str | Path | None = None, drafters: Sequence[str] = FIGURE1_DRAFTERS, *,
              speculative_configs: Sequence[str] = (), grid: Mapping[str, Sequence[Any]] | None = None,
              max_num_seqs: Sequence[int] = FIGURE1_MAX_NUM_SEQS, hardware: Sequence[str] = ("a100-80g",),
              models: Sequence[str] = ("qwen3-8b",), seeds: Sequence[int] = (0,), engine: EngineConfig | None = None,
              output: str | Path | None = None, resume: bool = False, jobs: int | None = 1,
              executor: str = "process", address: str | None = None, workload: Workload | None = None,
              skip_bad_lines: bool = False, progress: Progress | None = None,
              max_cells: int | None = MAX_CELLS, band: bool = True,
              capacity: CapacitySearch | None = None, notify: Callable[[str], None] | None = None,
              layouts: LayoutSearch | None = None) -> pl.DataFrame:
    """Run every cell of the sweep and return the results (schema: agentspec_sim.sweep.results).

    `trace`: a trace path (`-`: standard input; default: the bundled coding-agent trace); `workload`: the
    trace already loaded (then workers get it pickled; else each loads the file once, a cache read).
    `drafters`: shorthand names; `speculative_configs`: vLLM `--speculative-config` JSON texts; `grid`:
    speculative-config keys → values, crossed with every drafter configuration that accepts the key;
    `normal` always runs.
    `engine`: every other engine setting (its max_num_seqs, hardware, model and seed are replaced per
    cell). `output`: the parquet to write; finished cells go to its journal as they complete, and
    the parquet is written at the end, or with whatever finished when the sweep is interrupted or a
    cell fails (then the exception propagates). `resume`: keep the finished cells an earlier run of
    the same `output` left and run only the others. `jobs`, `executor` ("process", "ray", "inline"),
    `address` (a Ray cluster): where cells run; local workers are spawned processes, so a script that
    calls this with `jobs` > 1 needs Python's `if __name__ == "__main__":` guard around it.
    `progress(done, total, row)` is called once when the workers are up (row None) and after every cell.
    Refused before any cell starts (`ResourceError`): more than `max_cells` cells (None: no limit), or a
    cell whose run, times the local workers running at once, needs more memory than is available.
    `band`: an eagle3/mtp cell whose acceptance parameters have an uncertainty band also runs at the band's low
    and high bound (three simulations instead of one), recorded in its `<metric>_low` / `<metric>_high`
    columns (`agentspec_sim.run.band`); False leaves those columns null. A resumed banded cell whose earlier row
    lacks them (a file from before bands, or a run with band=False) runs again.
    `notify(text)` hears what the sweep does that the caller did not ask for in so many words (a resume that
    drops finished cells no longer in the grid).
    `capacity`: each cell is a capacity search under that SLO (`run_capacity_cell`: its probes run one after
    another in the cell's worker; no band runs) instead of one run.
    `layouts`: every (hardware, model) pair also at these parallel layouts (`cost.layout.LayoutSearch`: tensor-
    parallel sizes, expert parallelism, or every layout that fits); None: the engine's own.
    """
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import STDIN_NAME, is_stdin

    if resume and output is None:
        raise SweepError("resume needs an output file")
    if output is not None:
        from agentspec_sim.io.outputs import PARQUET_SUFFIXES, Output, check_outputs

        # Before any work: a directory or a file in the way, an unknown suffix, a folder not writable.
        check_outputs(Output("output", output, PARQUET_SUFFIXES),
                      inputs={"trace": None if is_stdin(trace) else trace or default_trace_path()})
    stdin = workload is None and is_stdin(trace)
    trace_text = STDIN_NAME if stdin else str(trace) if trace is not None else str(default_trace_path())
    if layouts is not None and notify is not None:
        base = engine or EngineConfig()
        for hw, model in itertools.product(hardware, models):
            for layout in layouts.left_out(hw, model, base.max_model_len, base.gpu_memory_utilization):
                notify(f"{layout.label} left out for {model} on {hw}: its weights leave no room for one "
                       "max_model_len sequence in the KV cache (the other layouts of the list do)")
    cells = sweep_cells(trace_text, drafters, speculative_configs, grid, max_num_seqs, hardware, models, seeds, engine,
                        max_cells, capacity, layouts)
    limits = _check_configs(cells)
    source = (WorkloadSource.from_stdin(skip_bad_lines) if stdin else
              WorkloadSource(trace_text, skip_bad_lines, workload, given=workload is not None))
    order = {cell.cell_id: i for i, cell in enumerate(cells)}
    if len(order) != len(cells):
        raise SweepError("two cells of the sweep have the same parameters")
    baseline_of = _baselines(cells)

    store = ResultStore(output) if output is not None else None
    done: dict[str, Row] = {}
    if store is not None:
        if resume and not store.journaled:
            raise SweepError(f"{output}: --resume: not a regular file, so there is no earlier run to resume")
        store.lock()  # a second sweep of this output is refused here, before it reads or runs anything
        try:
            if resume:
                previous = store.previous()
                done = ({c.cell_id: previous[c.cell_id] for c in cells if c.cell_id in previous}
                        if capacity is not None else _kept_rows(previous, cells, band))  # searches have no band
                grid = {cell.cell_id for cell in cells}
                dropped = sum(1 for cell_id in previous if cell_id not in grid)
                if dropped and notify is not None:
                    notify(f"--resume: {dropped} finished cell(s) of {output} are not in this sweep's grid (other "
                           "drafters, sizes, engine settings or search) and are dropped from it")
            store.open(done[c.cell_id] for c in cells if c.cell_id in done)
        except BaseException:
            store.release()  # an earlier run's parquet and journal stay as they were
            raise
    todo = [cell for cell in cells if cell.cell_id not in done]

    def ordered() -> list[Row]:
        rows = sorted(done.values(), key=lambda row: order[row["cell_id"]])
        return fill_speedups(rows, baseline_of)

    if executor == "process":
        import os

        jobs = min(jobs or os.cpu_count() or 1, max(1, len(todo)))  # no idle workers to start
    try:
        task = (functools.partial(run_cell, band=band) if capacity is None else
                functools.partial(run_capacity_cell, search=capacity, band=band))
        with make_executor(executor, jobs, source, task, address) as pool:
            # Loaded here, not before: local workers start (~1 s each, imports and their own load) meanwhile.
            loaded = source.load()
            _check_fits(loaded, todo, limits)
            _check_memory(loaded, todo, limits, jobs if executor == "process" else 1)
            todo = start_order(todo, loaded.output_tokens, len(loaded.queries))
            if progress is not None:
                progress(len(done), len(cells), None)
            for _, row in pool.run(todo):
                done[row["cell_id"]] = row
                if store is not None:
                    store.append(row)
                if progress is not None:
                    progress(len(done), len(cells), row)
    except BaseException as exc:
        if store is not None:
            store.abort(ordered(), exc)  # what is complete, atomically; the journal goes (kept if that fails)
        raise
    if store is not None:
        return store.close(ordered())
    return to_frame(ordered())


def _kept_rows(previous: Mapping[str, Row], cells: Sequence[Cell], band: bool) -> dict[str, Row]:
    """The finished rows of an earlier run that a resumed sweep keeps, by cell_id: those of the current grid,
    except a banded cell's row without its band (it runs again); with `band` off, their band columns null, as
    a fresh run would leave them."""
    from agentspec_sim.run.band import COLUMNS, empty_columns, has_band

    kept = {}
    for cell in cells:
        row = previous.get(cell.cell_id)
        if row is None:
            continue
        if band and any(row.get(c) is None for c in COLUMNS if not c.startswith("speedup_")) \
                and has_band(cell.spec, cell.config.model):
            continue
        # The band columns where `run_cell` puts them (before the engine settings), so a resumed sweep's
        # columns come in a fresh one's order.
        values = {c: row.get(c) for c in COLUMNS} if band else empty_columns()
        rest = [k for k in row if k not in COLUMNS]
        at = next((i for i, k in enumerate(rest) if k in (ENGINE_CONFIG, LATENCIES)), len(rest))
        kept[cell.cell_id] = {**{k: row[k] for k in rest[:at]}, **values, **{k: row[k] for k in rest[at:]}}
    return kept


def _check_configs(cells: Sequence[Cell]) -> dict[EngineConfig, ResolvedLimits]:
    """Resolve every distinct engine config here, so a bad profile name or limit, a calibration fitted on
    other hardware or another model, or a draft network the model lacks fails before any worker starts
    (EngineConfigError, ProfileError, ResourceError, SpecConfigError); their limits, by config."""
    from agentspec_sim.cost import cost_model_for
    from agentspec_sim.engine.config import resolve
    from agentspec_sim.run.simulation import check_draft_networks

    limits = {}
    for config in dict.fromkeys(cell.config for cell in cells):
        limits[config] = resolve(config)
        if config.calibration is not None:
            cost_model_for(config)
    # A draft network the model lacks (mtp on a model without MTP layers) fails here, not at its first cell.
    seen: set[tuple[str, str, int, str | None, str]] = set()
    for cell in cells:
        key = (cell.config.hardware, cell.config.model, cell.config.tensor_parallel_size, cell.config.calibration,
               cell.spec.method)
        if key not in seen:
            seen.add(key)
            check_draft_networks([cell.spec], cell.config)
    return limits


def _check_fits(workload: Workload, cells: Sequence[Cell], limits: Mapping[EngineConfig, ResolvedLimits]) -> None:
    """A max_model_len no call of the trace fits under is refused before any cell runs: every call would be
    refused, and a capacity search would read the empty runs as an SLO no load meets."""
    shortest = min((c.prompt_len for q in workload.queries for c in q.calls), default=None)
    if shortest is None:
        return
    for config in dict.fromkeys(cell.config for cell in cells):
        cap = limits[config].max_model_len
        if shortest >= cap:  # vLLM needs room for the prompt and at least one output token
            raise SweepError(f"--max-model-len {cap:,}: no call of the trace fits (its shortest prompt is "
                             f"{shortest:,} tokens; vLLM refuses a prompt of max_model_len tokens or more)")


def _check_memory(workload: Workload, cells: Sequence[Cell], limits: Mapping[EngineConfig, ResolvedLimits],
                  workers: int) -> None:
    """Every cell's run must fit in memory, `workers` of the largest at once (`engine.footprint`); cells that
    differ only by seed need the same, so each (engine config but the seed, drafter config) is estimated once."""
    from agentspec_sim.engine.footprint import check_run_memory, run_footprint

    largest: tuple[float, Cell, dict] | None = None
    for cell in {(replace(c.config, seed=0), c.speculative_config): c for c in cells}.values():
        terms = run_footprint(workload, cell.spec, cell.config, limits[cell.config])
        if largest is None or sum(terms.values()) > largest[0]:
            largest = (sum(terms.values()), cell, terms)
    if largest is not None:
        _, cell, terms = largest
        check_run_memory(workload, cell.spec, cell.config, limits[cell.config], workers=workers, terms=terms)


def _baselines(cells: Sequence[Cell]) -> dict[str, str]:
    """cell_id → the cell_id of its group's `normal` cell."""
    normal = {cell.group: cell.cell_id for cell in cells if cell.spec.method == "normal"}
    return {cell.cell_id: normal[cell.group] for cell in cells if cell.group in normal}
