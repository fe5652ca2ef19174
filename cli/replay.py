"""`agentspec-sim replay [TRACE]`: simulate the trace with `normal` and each drafter configuration, compare."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli import sweep_options
from agentspec_sim.cli.common import (
    REJECTION_LEGEND,
    PlainProgress,
    burst_note,
    caption_below,
    load_workload,
    percent,
    say_if_compiling,
    seconds,
    trace_argument,
)
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app


@app.command()
def replay(
    trace: Path | None = trace_argument(),
    drafter: str = typer.Option("normal,ngram", "--drafter", help="Comma-separated drafters by name (ngram: k=5, "
                                "prompt_lookup_min=max=4, the paper's A.1 settings). `normal` always runs."),
    speculative_config: list[str] = typer.Option([], "--speculative-config", help="A drafter as vLLM's "
                                                 "--speculative-config JSON (repeatable)."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Most running calls (default: vLLM's for "
                                            "the GPU: 256 on A100, 1024 on H100/H200)."),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", help="Token budget per step "
                                                      "(default: vLLM's: 2048 on A100, 8192 on H100/H200)."),
    gpu_memory_utilization: float = typer.Option(0.92, "--gpu-memory-utilization", help="Share of GPU memory vLLM "
                                                 "may use (weights + KV cache)."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context limit (default: the model's)."),
    num_kv_blocks: int | None = typer.Option(None, "--num-kv-blocks", help="KV blocks (vLLM's "
                                             "num_gpu_blocks_override); default: from GPU memory."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="GPUs per model replica."),
    expert_parallel: bool = sweep_options.expert_parallel_option(),
    data_parallel_size: int = sweep_options.data_parallel_ranks_option(),
    hardware: str = typer.Option("a100-80g", "--hardware", help="Hardware profile."),
    model: str = typer.Option("qwen3-8b", "--model", help="Model profile (or a config.json path)."),
    calibration: Path | None = typer.Option(None, "--calibration", help="Fitted cost-profile file."),
    rate: float | None = sweep_options.rate_option(),
    request_rate: float | None = sweep_options.request_rate_option(),
    burstiness: float | None = sweep_options.burstiness_option(),
    max_concurrency: int | None = sweep_options.max_concurrency_option(),
    disable_shuffle: bool = sweep_options.disable_shuffle_option(),
    copies: int | None = sweep_options.copies_option(),
    slo_ttft: float | None = sweep_options.slo_ttft_option(),
    slo_tpot: float | None = sweep_options.slo_tpot_option(),
    slo_query_latency: float | None = sweep_options.slo_query_latency_option(),
    slo_itl: float | None = sweep_options.slo_itl_option(),
    replicate: int = typer.Option(1, "--replicate", help="Run N independent copies of every query."),
    think_time: float | None = typer.Option(None, "--think-time", help="Seconds between a call's finish and the "
                                            "next call of its query (default: the trace's think_s)."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Disable vLLM's prefix cache."),
    kv_cache_dtype: str = sweep_options.kv_cache_dtype_option(),
    seed: int = typer.Option(0, "--seed", help="Seed for arrivals and staggering."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON document to this file "
                                       "(.json, or .json.gz/.xz/.zst compressed)."),
    steps: Path | None = typer.Option(None, "--steps", help="Write every run's per-call-step log (.parquet)."),
    check: bool = typer.Option(False, "--check-invariants", help="Run the engine's invariant checks every step."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip malformed trace lines (and count them)."),
    no_band: bool = typer.Option(False, "--no-band", help="Skip the two extra runs per eagle3/mtp configuration whose "
                                 "acceptance parameters have an uncertainty band (its low and high bound)."),
) -> None:
    """Replay a trace through the simulated engine with each drafter; compare goodput and acceptance."""
    from agentspec_sim.drafters.registry import parse_drafter, parse_drafter_list
    from agentspec_sim.engine import EngineConfig, EngineConfigError, SimulationError
    from agentspec_sim.engine.drafting import SpecConfigError

    _check_options(seed, think_time)
    load = sweep_options.load_settings(rate, request_rate, burstiness, max_concurrency, copies, disable_shuffle)
    slo = sweep_options.latency_slo(slo_ttft, slo_tpot, slo_query_latency, slo_itl)
    _check_outputs(output, steps, trace=trace, calibration=calibration, model=model, hardware=hardware,
                   speculative_config=speculative_config)
    try:
        specs = (parse_drafter_list(drafter, "--drafter")
                 + [parse_drafter(text, "--speculative-config") for text in speculative_config])
        config = EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
            tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=expert_parallel,
            data_parallel_size=data_parallel_size, hardware=hardware,
            model=model,
            calibration=str(calibration) if calibration else None, replicate=replicate, think_time=think_time,
            enable_prefix_caching=not no_prefix_caching, seed=seed, check_invariants=check,
            kv_cache_dtype=kv_cache_dtype, **load,
        )
    except (SpecConfigError, EngineConfigError) as exc:
        raise UsageError(str(exc)) from None
    path, workload = load_workload(trace, skip_bad_lines)
    finished: list = []

    def keep(result, summary) -> None:
        finished.append((result, summary))
        # One line per finished run on stderr: progress that also shows in logs, and with --json (whose
        # document is standard output's alone) a run of minutes is not silent.
        Console(stderr=True, highlight=False).print(
            f"finished {summary.drafter}: {summary.calls:,} calls in {result.wall_s:.1f} s", markup=False)

    try:
        runs, bands, cost = _run(workload, specs, config, show_progress=True, on_result=keep,
                                 band=not no_band, on_band=_say_band_finished, slo=slo)
    except KeyboardInterrupt as exc:
        exc.note = _write_finished(path, config, finished, output, steps)  # type: ignore[attr-defined]
        raise
    except (SpecConfigError, EngineConfigError, SimulationError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # a bad hardware/model profile name or file
        if type(exc).__name__ != "ProfileError":
            raise
        raise UsageError(str(exc)) from None

    from agentspec_sim.cost.build import calibration_note

    document = {"trace": str(path), "config": _config_dict(config), "slo": slo.to_dict(),
                "cost_model": calibration_note(cost),
                "acceptance_models": _acceptance_notes(specs, config),
                "runs": [_run_dict(r, s, b) for (r, s), b in zip(runs, bands, strict=True)]}
    if steps is not None:
        _write_steps(steps, [r for r, _ in runs])
    if output is not None:
        from agentspec_sim.io.atomic import write_json_atomic

        write_json_atomic(output, document)
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    _render(path, runs, burst_note(workload, config), document["cost_model"], bands,
            document["acceptance_models"], slo)


def _acceptance_notes(specs, config) -> dict[str, str]:
    """What each model-based drafter's acceptance rests on: its parameter file's source (MEASURED, or an
    ASSUMPTION, or the published figures it was solved for), keyed by drafter label."""
    from agentspec_sim.run.band import resolved_params

    notes = {}
    for spec in specs:
        params = resolved_params(spec, config.model)
        if params is not None:
            name = Path(params.path).name if params.path else params.model
            notes[spec.name] = f"{name}: {params.source}"
    return notes


def _check_options(seed: int, think_time: float | None) -> None:
    """What EngineConfig does not check, before any work starts."""
    import math

    if seed < 0:
        raise UsageError(f"--seed: must be ≥ 0, got {seed}")
    if think_time is not None and not math.isfinite(think_time):
        raise UsageError(f"--think-time: must be a finite number of seconds ≥ 0, got {think_time}")


def _check_outputs(output: Path | None, steps: Path | None, *, trace: Path | None, calibration: Path | None,
                   model: str, hardware: str, speculative_config: list[str]) -> None:
    """The output policy (agentspec_sim/io/outputs.py) for -o and --steps, against every file the run reads."""
    from agentspec_sim.io.outputs import (
        JSON_DOCUMENT_SUFFIXES,
        PARQUET_SUFFIXES,
        Output,
        check_outputs,
        json_paths,
    )
    from agentspec_sim.trace.bundled import default_trace_path

    check_outputs(Output("--output", output, JSON_DOCUMENT_SUFFIXES), Output("--steps", steps, PARQUET_SUFFIXES),
                  inputs={"TRACE": trace or default_trace_path(), "--calibration": calibration, "--model": model,
                          "--hardware": hardware, "--speculative-config": json_paths(speculative_config)})


def _write_finished(path: Path, config, finished: list, output: Path | None, steps: Path | None) -> str:
    """After an interrupt: write the runs that finished (the JSON marked "interrupted"); say what was written."""
    names = ", ".join(s.drafter for _, s in finished)
    if not finished:
        return "no run had finished; nothing written"
    wrote = []
    if steps is not None:
        _write_steps(steps, [r for r, _ in finished])
        wrote.append(str(steps))
    if output is not None:
        from agentspec_sim.io.atomic import write_json_atomic

        document = {"trace": str(path), "config": _config_dict(config), "interrupted": True,
                    "runs": [_run_dict(r, s) for r, s in finished]}
        write_json_atomic(output, document)
        wrote.append(str(output))
    if not wrote:
        return f"finished runs: {names} (nothing written: no --output or --steps)"
    return f"wrote the {len(finished)} finished run(s) ({names}) to {' and '.join(wrote)}"


def _say_band_finished(summary) -> None:
    Console(stderr=True, highlight=False).print(f"finished {summary.drafter}", markup=False)


def _run(workload, specs, config, show_progress: bool, on_result=None, band: bool = True, on_band=None, slo=None):
    """`engine.run.replay` with progress on stderr (a bar on a terminal, plain lines in a log): (runs, bands, the
    cost model they all priced with)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentspec_sim.run.entry import replay

    console = Console(stderr=True)
    lines = PlainProgress("calls") if show_progress and not console.is_terminal else None  # a log or a pipe
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not (show_progress and lines is None)) as bar:
        tasks: dict[str, int] = {}

        def report(name: str, done: int, total: int) -> None:
            if not tasks:  # the first run starts: past every check, and the first call compiles the kernels
                say_if_compiling()  # stderr even with --json: it explains a wait of a minute
            if name not in tasks:
                tasks[name] = bar.add_task(f"{name} calls", total=total)
            bar.update(tasks[name], completed=done)
            if lines is not None:
                lines.update(name, done, total)

        done = replay(workload, specs, config, slo=slo, band=band, progress=report, on_result=on_result,
                      on_band=on_band)
        return done.runs, done.bands, done.cost_model


def _run_dict(result, summary, band=None) -> dict:
    """A run's summary for the JSON document, without the host's wall-clock time (it is on stderr): the same
    trace, config and seed give a byte-identical document. `history_evictions` only where a live AgentSpec
    history passed the simulator's memory bound (the run's drafts are then an approximation).
    `mean_acceptance_length_band`, `goodput_tok_s_band`, `speedup_band`: [low, high], the values of the runs at
    the acceptance model's low and high bound (`band`, agentspec_sim/run/band.py); null without one."""
    from agentspec_sim.run.band import empty_fields

    return {**{k: v for k, v in summary.to_dict().items() if k != "wall_s"},
            **(empty_fields() if band is None else band.fields()), **result.extra}


def _config_dict(config) -> dict:
    from dataclasses import asdict

    return asdict(config)


def _write_steps(path: Path, results) -> None:
    import polars as pl

    from agentspec_sim.io.atomic import atomic_binary

    frame = pl.concat([r.steps for r in results], how="vertical")
    with atomic_binary(path, compress=False) as out:
        frame.write_parquet(out)


def _render_latencies(console: Console, runs) -> None:
    """Under vLLM's client (a request rate or max concurrency): each latency as `vllm bench serve` prints it."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption="milliseconds, as vllm bench serve prints them · TTFT, TPOT (output tokens after the "
                          "first), ITL (gaps between streamed chunks, pooled), E2EL per call")
    for name in ("drafter", "metric", "mean", "median", "std", "p99"):
        table.add_column(name, justify="left" if name in ("drafter", "metric") else "right", no_wrap=True)
    for _, s in runs:
        for metric, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)):
            table.add_row(s.drafter if metric == "TTFT" else "", metric,
                          *("—" if v is None else f"{1000 * v:,.2f}" for v in (stats.mean, stats.p50, stats.std,
                                                                                stats.p99)))
    console.print(caption_below(table))


def _render(path: Path, runs, note: str | None = None, cost_note: str | None = None, bands=None,
            acceptance_notes: dict[str, str] | None = None, slo=None) -> None:
    from agentspec_sim.run.band import format_interval

    bands = bands or [None] * len(runs)
    banded = any(b is not None for b in bands)
    console = Console()
    first = runs[0][1]
    limits = first.limits
    table = Table(title=f"replay {path.name}", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1, 0, 0), caption=(
        "goodput: output tok/s of simulated time · TTFT, TPOT: p50 · query: p99 latency · times in seconds, "
        f"as in --json\n{REJECTION_LEGEND}\n"
        f"max_num_seqs {limits['max_num_seqs']} · max_num_batched_tokens {limits['max_num_batched_tokens']} · "
        f"max_model_len {limits['max_model_len']:,} · KV blocks {limits['num_kv_blocks']:,}×{limits['block_size']}"
        + ("\n\\[low–high] under a value: the runs at the low and high bound of the acceptance model's "
           "uncertainty band (eagle3/mtp; --no-band skips them)" if banded else "")))
    table.add_column("drafter", no_wrap=True)
    # Short headers keep the table inside an 80-column terminal; the caption defines each.
    for name in ("goodput", "speedup", "rej.tok", "rej.call", "acc.len", "TTFT s", "TPOT s", "query s"):
        table.add_column(name, justify="right", no_wrap=True)
    for (_, s), b in zip(runs, bands, strict=True):
        def band(metric: str, b=b) -> list | None:
            return None if b is None else b.values(metric)

        # A band goes on a second line of its cell, so the table stays about as narrow as without one.
        table.add_row(
            s.drafter, format_interval(s.goodput_tok_s, band("goodput_tok_s"), ",.0f", sep="\n"),
            format_interval(s.speedup, band("speedup"), ".3f", "×", sep="\n"), percent(s.rejection_rate_tokens),
            percent(s.rejection_rate),
            format_interval(s.mean_acceptance_length, band("mean_acceptance_length"), sep="\n"),
            seconds(s.ttft.p50), seconds(s.tpot.p50), seconds(s.query_latency.p99),
        )
    console.print(caption_below(table))
    if runs[0][0].config.arrival == "request-rate" or runs[0][0].config.max_concurrency is not None:
        _render_latencies(console, runs)
    console.print(f"load: {first.protocol}", highlight=False, markup=False)
    for _, s in runs:
        parts = [f"{s.request_throughput:.4g} queries/s", f"{s.output_throughput_tok_s:,.0f} output tok/s over "
                 f"{s.duration_s:,.1f} s (vLLM bench serve's throughputs)"]
        met = s.attainment
        if slo is not None and slo.any:
            shares = [f"{name} {met[key]:.1%}" for name, key in (("calls", "calls"), ("TTFT", "calls_ttft"),
                                                                 ("TPOT", "calls_tpot"), ("ITL", "calls_itl"),
                                                                 ("queries", "queries"))
                      if met.get(key) is not None]
            parts.append(f"SLO attainment ({slo.describe()}): {', '.join(shares)}")
        if s.speedup_mean_per_query is not None:
            parts.append(f"speedup: {s.speedup_mean_per_query:.3f}× per query (mean of batch throughputs), "
                         f"{s.speedup:.3f}× pooled")
        console.print(f"  {s.drafter}: " + "; ".join(parts), highlight=False, markup=False)
    if note:
        console.print(note, highlight=False)
    bound = {"none": "no call ever waited for capacity", "max_num_seqs": "calls waited mostly on max_num_seqs",
             "kv_cache": "calls waited mostly on KV-cache capacity",
             "token_budget": "calls waited mostly on the per-step token budget"}[first.bound_by]
    if cost_note:
        console.print(cost_note, highlight=False, markup=False)
    for label, text in (acceptance_notes or {}).items():
        console.print(f"acceptance model of {label}: {text}", highlight=False, markup=False)
    ranks = runs[0][0].extra.get("calls_per_rank") if runs else None
    per_rank = " per data-parallel rank" if ranks else ""
    console.print(f"batch (normal){per_rank}: mean {first.batch_size_mean:.1f}, max {first.batch_size_max}; {bound}; "
                  f"preemptions {first.preemptions}; refused calls {first.refused_calls} (prompt over "
                  f"max_model_len; {first.skipped_calls} later calls of their queries skipped)")
    if ranks:
        console.print(f"data parallel: {len(ranks)} ranks; calls per rank (normal) "
                      f"{', '.join(f'{n:,}' for n in ranks)} (routed as vLLM's load balancer does)",
                      highlight=False, markup=False)
    if first.truncated_calls:
        console.print(f"[yellow]{first.truncated_calls:,} call(s) cut at max_model_len {limits['max_model_len']:,}: "
                      "vLLM stops a request there, so their recorded output is emitted only up to it (`inspect` "
                      "lists them; --max-model-len raises the limit)[/yellow]", highlight=False)
    for result, s in runs:
        if result.extra.get("history_evictions"):
            console.print(f"[yellow]{s.drafter}: its live history passed the simulator's memory bound and dropped "
                          f"{result.extra['history_evictions']:,} idle queries' histories (AgentSpec keeps them): "
                          "its drafts are an approximation[/yellow]")
