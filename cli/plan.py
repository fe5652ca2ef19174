"""`agentspec-sim plan [TRACE]`: the drafter and max_num_seqs that carry the most load per GPU under latency SLOs
(a capacity search), or with --goodput the most batch-job goodput under p99 SLOs and the KV cache, with the vLLM
flags to deploy them; from a sweep's results (--results) or a sweep it runs itself."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli import sweep_options as sweep_cli
from agentspec_sim.cli.common import caption_below, seconds, trace_argument
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app

# plan's own options; every other one shapes the sweep it runs, so with --results (a finished sweep) it is refused
# rather than silently ignored.
_PLAN_OPTIONS = frozenset({"results", "slo_p99_latency", "slo_ttft", "slo_tpot", "min_goodput", "allow_preemption",
                           "as_json", "target_rate", "prices", "capacity", "pareto"})


@app.command()
def plan(
    ctx: typer.Context,
    trace: Path | None = trace_argument(),
    results: list[Path] | None = typer.Option(None, "--results", help="Plan from this sweep results parquet "
                                              "instead of running a sweep (repeatable: sweeps run apart, e.g. one "
                                              "layout each, ranked together)."),
    slo_p99_latency: float | None = typer.Option(None, "--slo-p99-latency", help="Most seconds for a query's "
                                                 "latency at p99."),
    slo_ttft: float | None = typer.Option(None, "--slo-ttft", help="Most seconds to first token: each call's, met "
                                          "by --slo-attainment of them at capacity; with --goodput, the p99."),
    slo_tpot: float | None = typer.Option(None, "--slo-tpot", help="Most seconds per output token after the first: "
                                          "each call's, met by --slo-attainment of them at capacity; with "
                                          "--goodput, the p99."),
    min_goodput: float | None = typer.Option(None, "--min-goodput", help="Least goodput, output tokens/s."),
    allow_preemption: bool = typer.Option(False, "--allow-preemption", help="Accept batch sizes at which the KV "
                                          "cache fills and vLLM preempts."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the tables."),
    pareto: bool = typer.Option(False, "--pareto", help="Also the Pareto frontier of output tok/s per GPU against "
                                "tok/s per user (1 / mean TPOT) across drafters, batch sizes, layouts and GPUs "
                                "(AIConfigurator's first view); with --json under the key \"pareto\"."),
    capacity: bool | None = typer.Option(None, "--capacity/--goodput", help="--capacity: rank by capacity, the "
                                         "highest request rate at which --slo-attainment of calls and queries meet "
                                         "the SLOs (--slo-ttft, --slo-tpot per call, --slo-query-latency per query), "
                                         "per GPU — the default when a TRACE is planned with one of those SLOs. "
                                         "--goodput: the batch job's plan (every query at once, p99 SLOs). With "
                                         "--results the file decides."),
    slo_query_latency: float | None = sweep_cli.slo_query_latency_option(),
    slo_itl: float | None = sweep_cli.slo_itl_option(),
    slo_attainment: float = sweep_cli.slo_attainment_option(),
    capacity_tolerance: float = sweep_cli.capacity_tolerance_option(),
    capacity_seeds: int = sweep_cli.capacity_seeds_option(),
    capacity_criterion: str = sweep_cli.capacity_criterion_option(),
    capacity_max_tenants: int = sweep_cli.capacity_max_tenants_option(),
    disable_shuffle: bool = sweep_cli.disable_shuffle_option(),
    request_rate: float | None = sweep_cli.request_rate_option(),
    burstiness: float | None = sweep_cli.burstiness_option(),
    max_concurrency: int | None = sweep_cli.max_concurrency_option(),
    copies: int | None = sweep_cli.copies_option(),
    target_rate: float | None = typer.Option(None, "--target-rate", help="Queries/s to serve: the plan adds the "
                                             "replicas that carry it."),
    prices: Path | None = typer.Option(None, "--prices", help="$ per GPU-hour by hardware (JSON: {\"source\": …, "
                                       "\"usd_per_gpu_hour\": {\"h100-80g\": 3.0}}); default: the bundled table."),
    drafter: str = sweep_cli.drafter_option(),
    speculative_config: list[str] = sweep_cli.speculative_config_option(),
    grid: list[str] = sweep_cli.grid_option(),
    max_num_seqs: str = sweep_cli.max_num_seqs_option(),
    hardware: str = sweep_cli.hardware_option(),
    model: str = sweep_cli.model_option(),
    seeds: int = sweep_cli.seeds_option(),
    max_cells: int = sweep_cli.max_cells_option(),
    jobs: int | None = sweep_cli.jobs_option(),
    executor: str = sweep_cli.executor_option(),
    address: str | None = sweep_cli.address_option(),
    output: Path | None = typer.Option(None, "--output", "-o", help="Keep the sweep plan runs as this results "
                                       "parquet (resumable with --resume)."),
    resume: bool = typer.Option(False, "--resume", help="Resume the sweep in --output."),
    max_num_batched_tokens: int | None = sweep_cli.max_num_batched_tokens_option(),
    gpu_memory_utilization: float = sweep_cli.gpu_memory_utilization_option(),
    max_model_len: int | None = sweep_cli.max_model_len_option(),
    num_kv_blocks: int | None = sweep_cli.num_kv_blocks_option(),
    tensor_parallel_size: str = sweep_cli.tensor_parallel_size_option(),
    expert_parallel: bool = sweep_cli.expert_parallel_option(),
    data_parallel_size: str = sweep_cli.data_parallel_size_option(),
    calibration: Path | None = sweep_cli.calibration_option(),
    rate: float | None = sweep_cli.rate_option(),
    replicate: int = sweep_cli.replicate_option(),
    think_time: float | None = sweep_cli.think_time_option(),
    no_prefix_caching: bool = sweep_cli.no_prefix_caching_option(),
    kv_cache_dtype: str = sweep_cli.kv_cache_dtype_option(),
    skip_bad_lines: bool = sweep_cli.skip_bad_lines_option(),
    no_band: bool = sweep_cli.no_band_option(),
) -> None:
    """Pick the drafter (and k) and max batch size that serve the most load per GPU under the SLOs (a capacity
    search: --slo-ttft / --slo-tpot / --slo-query-latency), or with --goodput the most goodput of the batch job
    under p99 SLOs; print the vLLM flags that deploy it."""
    from agentspec_sim.sweep import SweepError
    from agentspec_sim.sweep.capacity_plan import Prices, is_capacity_results, plan_capacity
    from agentspec_sim.sweep.plan import SLO, hardware_summary, layout_summary
    from agentspec_sim.sweep.plan import plan as make_plan

    _check_positive({"--slo-p99-latency": slo_p99_latency, "--slo-ttft": slo_ttft, "--slo-tpot": slo_tpot,
                     "--min-goodput": min_goodput})
    _check_positive({"--target-rate": target_rate}, " queries/s")
    slo = SLO(slo_p99_latency, slo_ttft, slo_tpot, min_goodput, allow_preemption)
    if capacity is False and prices is not None:
        raise UsageError("--prices: a goodput plan prices nothing (it ranks goodput, not capacities): plan "
                         "--capacity, or capacity results (sweep --capacity)")
    try:
        price_table = Prices.load(prices)  # a bad price file fails before any sweep runs
    except SweepError as exc:
        raise UsageError(str(exc)) from None
    engine_options = (max_num_batched_tokens, gpu_memory_utilization, max_model_len, num_kv_blocks,
                      tensor_parallel_size, expert_parallel, calibration, replicate, think_time, no_prefix_caching,
                      data_parallel_size, kv_cache_dtype)
    results = results or None
    named_file = results[0] if results is not None and len(results) == 1 else None
    if results is not None:
        frame = _results_frame(ctx, results, trace)
    else:
        search = _capacity_search(capacity, slo_p99_latency, min_goodput, slo_ttft, slo_tpot, slo_query_latency,
                                  slo_itl, slo_attainment, capacity_tolerance, burstiness, max_concurrency, target_rate,
                                  rate, request_rate, copies, engine_options,
                                  sweep_cli.capacity_options(capacity_seeds, capacity_criterion, capacity_max_tenants))
        load = sweep_cli.load_settings(*((None, None) if search else (rate, request_rate)), burstiness,
                                       max_concurrency, None if search else copies, disable_shuffle,
                                       varied_rate=search is not None)
        frame = sweep_cli.run_sweep_cli(trace, drafter=drafter, speculative_config=speculative_config, grid=grid,
                                        max_num_seqs=max_num_seqs, hardware=hardware, model=model, seeds=seeds,
                                        engine=_engine_config(engine_options, load), output=output,
                                        resume=resume, jobs=jobs, executor=executor, address=address,
                                        skip_bad_lines=skip_bad_lines, show_progress=not as_json,
                                        max_cells=max_cells, band=not no_band, capacity=search,
                                        layouts=sweep_cli.layout_choice(tensor_parallel_size, expert_parallel,
                                                                        data_parallel_size)[2])
    try:
        by_capacity = is_capacity_results(frame)
    except SweepError as exc:
        raise UsageError(f"{named_file}: {exc}" if named_file is not None else str(exc)) from None
    if not by_capacity and prices is not None:
        raise UsageError("--prices: a goodput plan prices nothing (it ranks goodput, not capacities): plan "
                         "--capacity, or capacity results (sweep --capacity)")
    if not by_capacity and (target_rate is not None or slo_query_latency is not None or slo_itl is not None):
        raise UsageError("--target-rate, --slo-query-latency, --slo-itl: these results hold no capacity search (sweep "
                         "--capacity writes them)")
    if by_capacity and results is not None and any(v is not None for v in (slo_ttft, slo_tpot, slo_p99_latency,
                                                                           min_goodput)):
        raise UsageError("--slo-*: these capacity results were searched under their own SLO (their "
                         "capacity_search column); run the search again to change it")
    try:
        plans = plan_capacity(frame, target_rate, price_table) if by_capacity else make_plan(frame, slo)
    except SweepError as exc:
        named = named_file is not None and not str(exc).startswith(str(named_file))
        raise UsageError(f"{named_file}: {exc}" if named else str(exc)) from None
    summary, gpus = layout_summary(plans), hardware_summary(plans)
    frontier = None
    if pareto:
        from agentspec_sim.sweep.pareto import pareto_points

        try:
            frontier = pareto_points(frame)
        except SweepError as exc:
            raise UsageError(str(exc)) from None
    if as_json:
        documents = [{**p.to_dict(), "acceptance_models": acceptance_notes(p)} for p in plans]
        document: Any = ({"plans": documents, "layouts": summary, "hardware": gpus} if summary or gpus or frontier
                         is not None else documents)
        if frontier is not None:
            document["pareto"] = [point.to_dict() for point in frontier]
        typer.echo(json.dumps(document, indent=2))
        return
    for p in plans:
        (_render_capacity if by_capacity else _render)(p)
    for pair in summary:
        _render_layouts(pair)
    for model in gpus:
        _render_hardware(model)
    if frontier is not None:
        _render_pareto(frontier)


def _render_pareto(points) -> None:
    """The frontier of each (trace, model): the configurations no other beats on both throughput per GPU and
    speed per user, most throughput per GPU first."""
    console = Console()
    groups: dict[tuple[str, str], list] = {}
    for point in points:
        groups.setdefault((point.trace, point.model), []).append(point)
    for (trace, model), group in groups.items():
        on = [p for p in group if p.on_frontier]
        table = Table(title=f"Pareto frontier · {Path(trace).name} · {model}", box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, padding=(0, 1, 0, 0),
                      caption=f"{len(on)} of {len(group)} configurations on the frontier: none beats them on both "
                              "output tok/s per GPU and tok/s per user (1 / mean TPOT, vllm bench serve's TPOT)")
        for name in ("GPU", "layout", "drafter", "batch", "tok/s/GPU", "tok/s/user"):
            table.add_column(name, justify="right" if name in ("batch", "tok/s/GPU", "tok/s/user") else "left",
                             no_wrap=True)
        for p in on:
            table.add_row(p.hardware, p.layout, p.drafter, str(p.max_num_seqs), f"{p.tok_s_per_gpu:,.1f}",
                          f"{p.tok_s_per_user:,.1f}")
        console.print(caption_below(table))


def _check_positive(values: dict[str, float | None], unit: str = "") -> None:
    import math

    for name, value in values.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{name} must be > 0{unit} (a finite number), got {value}")


def _capacity_search(capacity: bool | None, slo_p99_latency, min_goodput, slo_ttft, slo_tpot, slo_query_latency,
                     slo_itl, slo_attainment, capacity_tolerance, burstiness, max_concurrency, target_rate, rate,
                     request_rate, copies, engine_options: tuple, options: dict):
    """The capacity search a plan of a TRACE runs, or None for the batch job's plan (--goodput): by capacity when
    the trace is planned under per-request SLOs and nothing says otherwise."""
    if capacity is None:
        capacity = (slo_p99_latency is None and min_goodput is None
                    and any(v is not None for v in (slo_ttft, slo_tpot, slo_query_latency, slo_itl)))
    if not capacity:
        if slo_query_latency is not None or slo_itl is not None or target_rate is not None:
            raise UsageError("--slo-query-latency, --slo-itl and --target-rate plan by capacity: not with --goodput")
        if options != sweep_cli.CAPACITY_DEFAULTS:
            raise UsageError("--capacity-seeds, --capacity-criterion, --capacity-max-tenants: settings of a capacity "
                             "search, not of the batch job's plan (--goodput)")
        return None
    if slo_p99_latency is not None or min_goodput is not None:
        raise UsageError("--capacity takes per-request SLOs: --slo-ttft, --slo-tpot, --slo-query-latency "
                         "(not --slo-p99-latency or --min-goodput)")
    latency = sweep_cli.latency_slo(slo_ttft, slo_tpot, slo_query_latency, slo_itl)
    engine = _engine_config(engine_options, sweep_cli.load_settings(None, None, burstiness, max_concurrency, None,
                                                                    varied_rate=True))
    search = sweep_cli.capacity_search(latency, slo_attainment, capacity_tolerance, burstiness, engine, options)
    if rate is not None or request_rate is not None or copies is not None:
        raise UsageError("--request-rate, --rate, --copies: a capacity search varies the request rate itself")
    return search


def _engine_config(engine_options: tuple, load: dict):
    """`engine_config` of the plan's engine options (the last one its --data-parallel-size) and load settings."""
    *options, data_parallel_size, kv_cache_dtype = engine_options
    return sweep_cli.engine_config(*options, load, data_parallel_size=data_parallel_size,
                                   kv_cache_dtype=kv_cache_dtype)


def _results_frame(ctx: typer.Context, results: list[Path], trace: Path | None):
    """`plan --results`: the finished sweeps' rows (several files: their cells together, a cell given twice once,
    one with different results in two files refused); no option that would have changed those sweeps."""
    from agentspec_sim.report.results import ResultsError, load_results
    from agentspec_sim.sweep import SweepError, read_results

    if ctx.get_parameter_source("capacity").name not in ("DEFAULT", "DEFAULT_MAP"):
        raise UsageError("--capacity/--goodput: with --results the plan follows the file (capacity results plan "
                         "by capacity)")
    if trace is not None:
        raise UsageError("--results plans from a finished sweep: give no TRACE")
    _refuse_sweep_options(ctx)
    try:
        if len(results) == 1:
            return read_results(results[0])
        for path in results:  # each a results file (its schema checked), then together
            read_results(path)
        return load_results(results)
    except (SweepError, ResultsError) as exc:
        raise UsageError(str(exc)) from None


def _refuse_sweep_options(ctx: typer.Context) -> None:
    """With --results the sweep has run: an option that would change it (an engine knob, a drafter, -o…) is
    an error, not a setting the printed plan quietly lacks."""
    for param in ctx.command.params:
        if param.name in _PLAN_OPTIONS or param.name == "trace":
            continue
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            flag = max(param.opts, key=len)
            raise UsageError(f"{flag}: applies to the sweep plan runs; with --results the sweep has run with its "
                             "own settings (re-run it to change them, or give a TRACE instead of --results)")


def _render(p) -> None:
    from agentspec_sim.run.band import format_interval

    console = Console()
    table = Table(title=f"plan · {Path(p.trace).name} · {p.hardware} · {p.model}{_layout_title(p)}",
                  box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption="batch: the max_num_seqs of highest goodput meeting the objectives · goodput in tok/s · "
                          "p99 latencies in seconds, as the --slo-* options and --json take them"
                          + ("\n\\[low–high] under a value: the runs at the low and high bound of the acceptance "
                             "model's uncertainty band" if any(d.best is not None and d.best.goodput_tok_s_band
                                                               for d in p.drafters) else ""))
    # Short headers keep the table inside 80 columns; what stops each drafter is listed below it.
    for name in ("drafter", "batch", "goodput", "speedup", "query p99 s", "TTFT p99 s", "TPOT p99 s"):
        table.add_column(name, justify="left" if name == "drafter" else "right", no_wrap=True)
    for d in p.drafters:
        b = d.best
        if b is None:
            table.add_row(d.drafter, "none", "—", "—", "—", "—", "—")
            continue
        # A band (agentspec_sim.run.band) on a second line of its cell.
        table.add_row(d.drafter, str(b.max_num_seqs), format_interval(b.goodput_tok_s, b.goodput_tok_s_band, ",.0f",
                                                                      sep="\n"),
                      format_interval(b.speedup, b.speedup_band, ".2f", "×", sep="\n") if b.speedup is not None
                      else "—×", seconds(b.query_latency_p99_s), seconds(b.ttft_p99_s), seconds(b.tpot_p99_s))
    console.print(caption_below(table))
    for d in p.drafters:
        console.print(f"  {d.drafter}: {'larger: ' if d.best is not None else ''}{d.why}", highlight=False)
    console.print(f"[bold]best:[/] {p.reason}")
    if p.band_note:
        console.print(f"uncertain: {p.band_note}", highlight=False, markup=False)
    _print_acceptance(console, p)
    _print_serve_line(console, p)


def acceptance_notes(p) -> dict[str, str]:
    """What each model-based drafter's simulated acceptance rests on (its parameter file's source: measured, borrowed
    or assumed), by drafter label, as `replay` prints it: the drafters of a plan with a pick."""
    from agentspec_sim.drafters.registry import parse_drafter
    from agentspec_sim.run.band import resolved_params

    notes = {}
    for d in p.drafters:
        if d.best is None or not d.best.speculative_config:
            continue
        try:
            spec = parse_drafter(json.dumps(d.best.speculative_config), "speculative_config")
            params = resolved_params(spec, p.model)
        except ValueError:  # a results file from elsewhere: its config is not ours to resolve
            continue
        if params is not None:
            notes[d.drafter] = f"{Path(params.path).name if params.path else params.model}: {params.source}"
    return notes


def _print_acceptance(console: Console, p) -> None:
    for drafter, note in acceptance_notes(p).items():
        console.print(f"acceptance of {drafter}: {note}", highlight=False, markup=False)


def _print_serve_line(console: Console, p) -> None:
    """The `vllm serve` line of a plan's pick (quoted for a POSIX shell, so it pastes as it is) and its note."""
    if p.best is not None:
        env = "".join(f"{k}={v} " for k, v in p.vllm_env.items())
        command = " ".join(shlex.quote(a) for a in ["vllm", "serve", p.vllm_model, *p.vllm_args])
        console.print(env + command, soft_wrap=True, highlight=False, markup=False)
    if p.vllm_note:
        console.print(f"note: {p.vllm_note}", highlight=False, markup=False)


def _rate(value: float | None) -> str:
    return "—" if value is None else ("0" if value == 0 else f"{value:.3g}")


def _rate_cell(d, size: int) -> str:
    """A drafter's capacity at one max_num_seqs: rate ±half its interval, or ≥ its floor where inconclusive."""
    if size in d.at_least:
        return f"≥{d.at_least[size]:.3g}?"
    rate = d.by_batch[size]
    low, high = d.intervals.get(size, (None, None))
    if not rate or low is None or high is None:
        return _rate(rate)
    return f"{rate:.3g}±{(high - low) / 2:.2g}"


def _layout_title(p) -> str:
    from agentspec_sim.cost.layout import Layout

    layout = Layout.of(p.engine)
    return f" · {layout.label}" if layout.tag else ""


def _render_layouts(pair: dict) -> None:
    """The parallel layouts a plan searched for one (trace, hardware, model), best first (`layout_summary`)."""
    console = Console()
    rows = pair["layouts"]
    table = Table(title=f"layouts · {Path(pair['trace']).name} · {pair['hardware']} · {pair['model']}",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption=f"each layout's best drafter and max_num_seqs · {rows[0]['unit']}"
                          + (" · ≈: not told apart from the best layout (intervals and the step cost's error overlap)"
                             if any(r.get("told_apart_from_best") is False for r in rows) else ""))
    for name in ("layout", "GPUs", "drafter", "batch", "per GPU"):
        table.add_column(name, justify="left" if name in ("layout", "drafter") else "right", no_wrap=True)
    for r in rows:
        value = r["per_gpu"]
        shown = "—" if value is None else f"{value:.4g}" + (" ≈" if r.get("told_apart_from_best") is False else "")
        table.add_row(r["layout"], str(r["gpus"]), r["drafter"] or "none",
                      "—" if r["max_num_seqs"] is None else str(r["max_num_seqs"]), shown)
    console.print(caption_below(table))
    top = rows[0]
    if top["per_gpu"] is not None:
        console.print(f"[bold]best layout:[/] {top['layout']} ({top['flags'] or 'one GPU'}) with {top['drafter']} at "
                      f"max_num_seqs {top['max_num_seqs']}: its plan's serve line above", highlight=False)


def _render_hardware(model: dict) -> None:
    """The GPUs a plan searched for one (trace, model), best first (`hardware_summary`)."""
    console = Console()
    rows = model["hardware"]
    table = Table(title=f"GPUs · {Path(model['trace']).name} · {model['model']}", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption=f"each GPU's best layout, drafter and max_num_seqs · {rows[0]['unit']} · $/Mtok and $ per "
                          "thousand queries where the GPU has a price (--prices); least $ per query first when every "
                          "GPU has one")
    for name in ("GPU", "layout", "drafter", "batch", "per GPU", "$/Mtok", "$/kq"):
        table.add_column(name, justify="left" if name in ("GPU", "layout", "drafter") else "right", no_wrap=True)
    for r in rows:
        value, usd, per_query = r["per_gpu"], r["usd_per_million_tokens"], r.get("usd_per_query")
        shown = "—" if value is None else f"{value:.4g}"
        table.add_row(r["hardware"], r["layout"], r["drafter"] or "none",
                      "—" if r["max_num_seqs"] is None else str(r["max_num_seqs"]), shown,
                      "—" if usd is None else f"{usd:.3f}", "—" if per_query is None else f"{1000 * per_query:.3g}")
    console.print(caption_below(table))
    top = rows[0]
    if top["per_gpu"] is not None:
        console.print(f"[bold]best GPU:[/] {top['hardware']} at {top['layout']} with {top['drafter']} at max_num_seqs "
                      f"{top['max_num_seqs']}: its plan's serve line above", highlight=False)


def _render_capacity(p) -> None:
    """The capacity plan: each drafter's capacity at each max_num_seqs, its best, the pick and the serve line."""
    console = Console()
    sizes = sorted({size for d in p.drafters for size in d.by_batch})
    search = p.search
    slo = search["slo"]
    slo_text = ", ".join(f"{name} ≤ {slo[key]:g} s" for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"),
                                                                      ("ITL", "itl_s"), ("query", "query_latency_s"))
                         if slo.get(key))
    table = Table(title=f"capacity · {Path(p.trace).name} · {p.hardware} · {p.model}{_layout_title(p)}",
                  box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption=f"steady-state queries/s at ≥ {search['target']:.0%} SLO attainment ({slo_text}) ± half "
                          f"its {search.get('confidence', 0.95):.0%} interval over {search.get('seeds', 1)} seed(s) · "
                          f"≥x?: inconclusive, the trace too short to load it · load: {p.protocol} · by "
                          f"max_num_seqs; * each drafter's best per GPU, + a smaller one not told apart from it")
    table.add_column("drafter", no_wrap=True)
    for size in sizes:
        table.add_column(str(size), justify="right", no_wrap=True)
    for d in p.drafters:
        best = d.best.max_num_seqs if d.best else None
        smaller = d.smaller.max_num_seqs if d.smaller else None
        table.add_row(d.drafter, *((_rate_cell(d, s) + ("*" if s == best else "+" if s == smaller else ""))
                                   if s in d.by_batch else "—" for s in sizes))
    console.print(caption_below(table))
    detail = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                   caption="at each drafter's best max_num_seqs · tok/s: sustained output tokens/s (capacity × "
                           "output tokens per query) · $ at " + (f"${p.usd_per_gpu_hour:g}/GPU-hour"
                                                                  if p.usd_per_gpu_hour else
                                                                  "(no price for this hardware)")
                           + " · $/kq: $ per thousand queries · p99 latencies at capacity, seconds"
                           + (f" · repl.: replicas for {p.target_rate:g} queries/s at {p.utilisation:.0%} of the "
                              "capacity's lower bound" if p.target_rate else ""))
    for name in ("drafter", "batch", "q/s/GPU", "tok/s", "$/Mtok", "$/kq", "TTFT p99", "TPOT p99", "query p99"):
        detail.add_column(name, justify="left" if name == "drafter" else "right", no_wrap=True)
    if p.target_rate is not None:
        detail.add_column("repl.", justify="right")
    for d in p.drafters:
        b = d.best
        if b is None:
            detail.add_row(d.drafter, "none", *("—" for _ in range(7 + (p.target_rate is not None))))
            continue
        row = [d.drafter, str(b.max_num_seqs), _rate(b.capacity_per_gpu), f"{b.output_tok_s or 0.0:,.0f}",
               "—" if b.usd_per_million_tokens is None else f"{b.usd_per_million_tokens:.3f}",
               "—" if b.usd_per_query is None else f"{1000 * b.usd_per_query:.3g}",
               seconds(b.ttft_p99_s), seconds(b.tpot_p99_s), seconds(b.query_latency_p99_s)]
        if p.target_rate is not None:
            row.append("—" if b.replicas is None else str(b.replicas))
        detail.add_row(*row)
    console.print(caption_below(detail))
    console.print(f"[bold]best:[/] {p.reason}", highlight=False)
    _print_acceptance(console, p)
    _print_serve_line(console, p)
    if p.price_source:
        console.print(f"prices: {p.price_source}", highlight=False, markup=False)


def render_capacity_grid(frame, output: Path) -> None:
    """`sweep --capacity`'s table: every plan's capacities (no price, no target)."""
    from agentspec_sim.sweep.capacity_plan import plan_capacity

    for p in plan_capacity(frame):
        _render_capacity(p)
    Console().print(f"{frame.height} cells in {output}")
