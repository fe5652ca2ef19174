"""`agentspec-sim plan [TRACE]`: the max_num_seqs and drafter that maximise goodput under SLOs and the KV
cache, with the vLLM flags to deploy them; from a sweep's results (--results) or a sweep it runs itself."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli import sweep as sweep_cli
from agentspec_sim.cli.app import app
from agentspec_sim.cli.common import trace_argument
from agentspec_sim.cli.errors import UsageError


@app.command()
def plan(
    trace: Path | None = trace_argument(),
    results: Path | None = typer.Option(None, "--results", help="Plan from this sweep results parquet instead of "
                                        "running a sweep."),
    slo_p99_latency: float | None = typer.Option(None, "--slo-p99-latency", help="Most seconds for a query's "
                                                 "latency at p99."),
    slo_ttft: float | None = typer.Option(None, "--slo-ttft", help="Most seconds to first token at p99."),
    slo_tpot: float | None = typer.Option(None, "--slo-tpot", help="Most seconds per output token at p99."),
    min_goodput: float | None = typer.Option(None, "--min-goodput", help="Least goodput, output tokens/s."),
    allow_preemption: bool = typer.Option(False, "--allow-preemption", help="Accept batch sizes at which the KV "
                                          "cache fills and vLLM preempts."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the tables."),
    drafter: str = sweep_cli.drafter_option(),
    speculative_config: list[str] = sweep_cli.speculative_config_option(),
    grid: list[str] = sweep_cli.grid_option(),
    max_num_seqs: str = sweep_cli.max_num_seqs_option(),
    hardware: str = sweep_cli.hardware_option(),
    model: str = sweep_cli.model_option(),
    seeds: int = sweep_cli.seeds_option(),
    jobs: int | None = sweep_cli.jobs_option(),
    executor: str = sweep_cli.executor_option(),
    address: str | None = sweep_cli.address_option(),
    output: Path | None = typer.Option(None, "--output", "-o", help="Keep the sweep plan runs as this results "
                                       "parquet (resumable with --resume)."),
    resume: bool = typer.Option(False, "--resume", help="Resume the sweep in --output."),
    num_kv_blocks: int | None = typer.Option(None, "--num-kv-blocks", help="KV blocks (default: from GPU memory)."),
    rate: float | None = typer.Option(None, "--rate", help="Poisson arrivals, queries per second."),
    replicate: int = typer.Option(1, "--replicate", help="Run N independent copies of every query."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip malformed trace lines."),
) -> None:
    """Pick the max batch size and drafter (and k) with the highest goodput that meets the SLOs and fits the
    KV cache; print the vLLM flags that deploy it."""
    from agentspec_sim.sweep import SweepError, read_results
    from agentspec_sim.sweep.plan import SLO
    from agentspec_sim.sweep.plan import plan as make_plan

    for name, value in (("--slo-p99-latency", slo_p99_latency), ("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot),
                        ("--min-goodput", min_goodput)):
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be > 0, got {value}")
    slo = SLO(slo_p99_latency, slo_ttft, slo_tpot, min_goodput, allow_preemption)
    if results is not None:
        if trace is not None or output is not None:
            raise UsageError("--results plans from a finished sweep: give no TRACE and no --output")
        try:
            frame = read_results(results)
        except SweepError as exc:
            raise UsageError(str(exc)) from None
    else:
        engine = sweep_cli.engine_config(num_kv_blocks=num_kv_blocks, rate=rate, replicate=replicate)
        frame = sweep_cli.run_sweep_cli(trace, drafter=drafter, speculative_config=speculative_config, grid=grid,
                                        max_num_seqs=max_num_seqs, hardware=hardware, model=model, seeds=seeds,
                                        engine=engine, output=output, resume=resume, jobs=jobs, executor=executor,
                                        address=address, skip_bad_lines=skip_bad_lines, show_progress=not as_json)
    try:
        plans = make_plan(frame, slo)
    except SweepError as exc:
        raise UsageError(str(exc)) from None
    if as_json:
        typer.echo(json.dumps([p.to_dict() for p in plans], indent=2))
        return
    for p in plans:
        _render(p)


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:{spec}}"


def _render(p) -> None:
    console = Console()
    table = Table(title=f"plan · {Path(p.trace).name} · {p.hardware} · {p.model}", box=box.SIMPLE_HEAD,
                  pad_edge=False, caption="batch: the max_num_seqs of highest goodput meeting the objectives · "
                                          "p99 latencies: query in s, TTFT and TPOT in ms")
    # Short headers keep the table inside 80 columns; what stops each drafter is listed below it.
    for name in ("drafter", "batch", "goodput", "speedup", "query p99", "TTFT", "TPOT"):
        table.add_column(name, justify="left" if name == "drafter" else "right", no_wrap=True)
    for d in p.drafters:
        b = d.best
        if b is None:
            table.add_row(d.drafter, "none", "—", "—", "—", "—", "—")
            continue
        table.add_row(d.drafter, str(b.max_num_seqs), f"{b.goodput_tok_s:,.0f}", _fmt(b.speedup, ".2f") + "×",
                      _fmt(b.query_latency_p99_s, ",.1f"), _fmt(b.ttft_p99_s, ",.0f", 1000),
                      _fmt(b.tpot_p99_s, ".1f", 1000))
    console.print(table)
    for d in p.drafters:
        console.print(f"  {d.drafter}: {'larger: ' if d.best is not None else ''}{d.why}", highlight=False)
    console.print(f"[bold]best:[/] {p.reason}")
    if p.best is not None:
        env = "".join(f"{k}={v} " for k, v in p.vllm_env.items())
        console.print(f"{env}vllm serve … " + " ".join(_quote(a) for a in p.vllm_args), soft_wrap=True,
                      highlight=False)
    if p.vllm_note:
        console.print(f"note: {p.vllm_note}", highlight=False)


def _quote(arg: str) -> str:
    return f"'{arg}'" if arg.startswith("{") else arg
