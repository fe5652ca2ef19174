"""`agentspec-sim sweep [TRACE] -o results.parquet`: every drafter configuration × max_num_seqs × hardware
× model × seed, in parallel workers, resumable (the options and run loop it shares with `plan`:
cli/sweep_options.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli import sweep_options as shared
from agentspec_sim.cli.common import caption_below, trace_argument
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app


@app.command()
def sweep(
    trace: Path | None = trace_argument(),
    output: Path = typer.Option(..., "--output", "-o", help="Results parquet (.parquet, one row per cell); one "
                                "sweep at a time writes it."),
    drafter: str = shared.drafter_option(),
    speculative_config: list[str] = shared.speculative_config_option(),
    grid: list[str] = shared.grid_option(),
    max_num_seqs: str = shared.max_num_seqs_option(),
    hardware: str = shared.hardware_option(),
    model: str = shared.model_option(),
    seeds: int = shared.seeds_option(),
    max_cells: int = shared.max_cells_option(),
    jobs: int | None = shared.jobs_option(),
    executor: str = shared.executor_option(),
    address: str | None = shared.address_option(),
    resume: bool = typer.Option(False, "--resume", help="Keep the cells an earlier (interrupted) run of this "
                                "output finished; run only the rest."),
    max_num_batched_tokens: int | None = shared.max_num_batched_tokens_option(),
    gpu_memory_utilization: float = shared.gpu_memory_utilization_option(),
    max_model_len: int | None = shared.max_model_len_option(),
    num_kv_blocks: int | None = shared.num_kv_blocks_option(),
    tensor_parallel_size: str = shared.tensor_parallel_size_option(),
    expert_parallel: bool = shared.expert_parallel_option(),
    data_parallel_size: str = shared.data_parallel_size_option(),
    calibration: Path | None = shared.calibration_option(),
    rate: float | None = shared.rate_option(),
    request_rate: float | None = shared.request_rate_option(),
    burstiness: float | None = shared.burstiness_option(),
    max_concurrency: int | None = shared.max_concurrency_option(),
    copies: int | None = shared.copies_option(),
    capacity: bool = typer.Option(False, "--capacity", help="Each cell is a capacity search: the highest request "
                                  "rate at which --slo-attainment of calls and queries meet the --slo-* options "
                                  "(docs/sweep-and-plan.md)."),
    slo_ttft: float | None = shared.slo_ttft_option(),
    slo_tpot: float | None = shared.slo_tpot_option(),
    slo_query_latency: float | None = shared.slo_query_latency_option(),
    slo_itl: float | None = shared.slo_itl_option(),
    slo_attainment: float = shared.slo_attainment_option(),
    capacity_tolerance: float = shared.capacity_tolerance_option(),
    capacity_seeds: int = shared.capacity_seeds_option(),
    capacity_criterion: str = shared.capacity_criterion_option(),
    capacity_max_tenants: int = shared.capacity_max_tenants_option(),
    disable_shuffle: bool = shared.disable_shuffle_option(),
    replicate: int = shared.replicate_option(),
    think_time: float | None = shared.think_time_option(),
    no_prefix_caching: bool = shared.no_prefix_caching_option(),
    kv_cache_dtype: str = shared.kv_cache_dtype_option(),
    skip_bad_lines: bool = shared.skip_bad_lines_option(),
    no_band: bool = shared.no_band_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no speedup table."),
) -> None:
    """Simulate every drafter configuration at every max batch size (× hardware × model × seed); write a
    results parquet cell by cell (resumable with --resume)."""
    load = shared.load_settings(rate, request_rate, burstiness, max_concurrency, copies, disable_shuffle,
                                varied_rate=capacity)
    engine = shared.engine_config(max_num_batched_tokens, gpu_memory_utilization, max_model_len, num_kv_blocks,
                                  tensor_parallel_size, expert_parallel, calibration, replicate, think_time,
                                  no_prefix_caching,
                                  load, data_parallel_size=data_parallel_size, kv_cache_dtype=kv_cache_dtype)
    slo = shared.latency_slo(slo_ttft, slo_tpot, slo_query_latency, slo_itl)
    search = (shared.capacity_search(slo, slo_attainment, capacity_tolerance, burstiness, engine,
                                     shared.capacity_options(capacity_seeds, capacity_criterion, capacity_max_tenants))
              if capacity else None)
    if search is None and slo.any:
        raise UsageError("the --slo-* options are for --capacity (a sweep's rows otherwise hold one run each)")
    frame = shared.run_sweep_cli(trace, drafter=drafter, speculative_config=speculative_config, grid=grid,
                          max_num_seqs=max_num_seqs, hardware=hardware, model=model, seeds=seeds, engine=engine,
                          output=output, resume=resume, jobs=jobs, executor=executor, address=address,
                          skip_bad_lines=skip_bad_lines, show_progress=not quiet, max_cells=max_cells,
                          band=not no_band, capacity=search,
                          layouts=shared.layout_choice(tensor_parallel_size, expert_parallel, data_parallel_size)[2])
    if not quiet:
        if search is not None:
            from agentspec_sim.cli.plan import render_capacity_grid

            render_capacity_grid(frame, output)
        else:
            _render(frame, output)


def _render(frame, output: Path) -> None:
    import polars as pl

    console = Console()
    sizes = sorted(frame["max_num_seqs"].unique().to_list())
    for (hardware, model), part in frame.group_by(["hardware", "model"], maintain_order=True):
        banded = "speedup_low" in part.columns and part["speedup_low"].null_count() < part.height
        table = Table(title=f"speedup · {hardware} · {model}", box=box.SIMPLE_HEAD, pad_edge=False,
                      caption="vs normal, by max_num_seqs; mean over seeds"
                      + (f" · load: {part['protocol'][0]}" if "protocol" in part.columns else "")
                      + (" · pooled (all tokens ÷ all time); the per-query mean of --copies is the results' "
                         "speedup_mean_per_query column" if "speedup_mean_per_query" in part.columns else "")
                      + ("\n* an acceptance-model uncertainty band: its low/high-bound runs are the results' "
                         "*_low / *_high columns (`report` shows the interval)" if banded else ""))
        table.add_column("drafter", no_wrap=True)
        for size in sizes:
            table.add_column(str(size), justify="right", no_wrap=True)
        means = part.group_by(["drafter", "max_num_seqs"], maintain_order=True).agg(pl.col("speedup").mean())
        lookup = {(r["drafter"], r["max_num_seqs"]): r["speedup"] for r in means.to_dicts()}
        with_band = (set(part.filter(pl.col("speedup_low").is_not_null())["drafter"].to_list()) if banded
                     else set())
        for label in dict.fromkeys(part["drafter"].to_list()):
            cells = [lookup.get((label, size)) for size in sizes]
            table.add_row(label + (" *" if label in with_band else ""),
                          *("—" if v is None else f"{v:.2f}" for v in cells))
        console.print(caption_below(table))
    console.print(f"{frame.height} cells in {output}")
