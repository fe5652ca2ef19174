"""What `sweep` and `plan` share: their options (factories), the engine settings every cell shares, and
`run_sweep_cli` (progress, interrupt handling). Not a command: it imports no `app`, so `plan` can read it
while `sweep` is still being imported (whichever of the two is imported first)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from agentspec_sim.cli.common import PlainProgress, say_if_compiling
from agentspec_sim.cli.errors import UsageError

FIGURE1 = "normal,ngram,ngram-v2,suffix,eagle3,agentspec"
SIZES = "1,2,4,8,16,32,64,128,256"


# Options `sweep` and `plan` share (factories: Typer reads each default object once per command).
def drafter_option():
    return typer.Option(FIGURE1, "--drafter", help="Comma-separated drafters by name (the paper's settings). "
                        "`normal` always runs: it is every cell's speedup baseline.")


def speculative_config_option():
    return typer.Option([], "--speculative-config", help="A drafter as vLLM's --speculative-config JSON "
                        "(repeatable).")


def grid_option():
    return typer.Option([], "--grid", help="KEY=V1,V2,… crossed with every drafter that accepts the key, e.g. "
                        "num_speculative_tokens=1,3,5,8 (repeatable: the product).")


def max_num_seqs_option():
    return typer.Option(SIZES, "--max-num-seqs", help="Comma-separated max batch sizes.")


def hardware_option():
    return typer.Option("a100-80g", "--hardware", help="Comma-separated hardware profiles.")


def model_option():
    return typer.Option("qwen3-8b", "--model", help="Comma-separated model profiles (or config.json paths).")


def seeds_option():
    return typer.Option(1, "--seeds", help="Seeds 0 … N-1 for every cell.")


def max_cells_option():
    return typer.Option(10_000, "--max-cells", help="Refuse a sweep of more cells than this (drafter configurations "
                        "× max batch sizes × hardware × models × seeds) before it starts; raise it for a larger one.")


def jobs_option():
    return typer.Option(None, "--jobs", "-j", help="Worker processes (Ray: actors); default: one per CPU.")


def executor_option():
    return typer.Option("process", "--executor", help="Where cells run: process (local workers) or ray.")


def address_option():
    return typer.Option(None, "--address", help="Ray cluster address (ray:// or host:port); default: a local "
                        "Ray instance.")


# The engine knobs `sweep` and `plan` share: every cell of the sweep runs with them (factories, as above).
def max_num_batched_tokens_option():
    return typer.Option(None, "--max-num-batched-tokens", help="Token budget per step (default: vLLM's for the "
                        "GPU: 2048 on A100, 8192 on H100/H200).")


def gpu_memory_utilization_option():
    return typer.Option(0.92, "--gpu-memory-utilization", help="Share of GPU memory vLLM may use (weights + KV "
                        "cache; vLLM 0.33's default).")


def max_model_len_option():
    return typer.Option(None, "--max-model-len", help="Context limit (default: the model's).")


def num_kv_blocks_option():
    return typer.Option(None, "--num-kv-blocks", help="KV blocks (vLLM's num_gpu_blocks_override); default: from "
                        "GPU memory.")


def tensor_parallel_size_option():
    return typer.Option("1", "--tensor-parallel-size", help="GPUs per model replica: a size, comma-separated sizes "
                        "(each its own layout), or auto: every size of 1, 2, 4, 8 whose heads split evenly and whose "
                        "KV cache holds one max_model_len sequence beside the weights, a MoE model at each size with "
                        "and without expert parallelism unless --enable-expert-parallel is given.")


def layout_choice(text: str, expert_parallel: bool, data_parallel: str = "1"):
    """(the engine's tensor-parallel size, its data-parallel size, the `LayoutSearch` to cross the cells with or
    None) of --tensor-parallel-size TEXT [--enable-expert-parallel] [--data-parallel-size SIZES]."""
    from agentspec_sim.cost.layout import LayoutSearch
    from agentspec_sim.sweep.cells import SweepError, parse_int_list

    try:
        sizes = None if str(text).strip().lower() == "auto" else tuple(parse_int_list(str(text),
                                                                                     "--tensor-parallel-size"))
    except SweepError as exc:
        raise UsageError(f"{exc} (sizes like 1,2,4,8, or auto)") from None
    try:
        dp_sizes = None if str(data_parallel).strip().lower() == "auto" else tuple(
            parse_int_list(str(data_parallel), "--data-parallel-size"))
    except SweepError as exc:
        raise UsageError(f"{exc} (sizes like 1,2,8, or auto)") from None
    if sizes is not None and len(sizes) == 1 and dp_sizes is not None and len(dp_sizes) == 1:
        return sizes[0], dp_sizes[0], None
    search = LayoutSearch(sizes, True if expert_parallel else (None if sizes is None else False), dp_sizes)
    return (sizes[0] if sizes else 1), (dp_sizes[0] if dp_sizes else 1), search


def data_parallel_size_option():
    return typer.Option("1", "--data-parallel-size", help="Data-parallel ranks (vLLM's --data-parallel-size): that "
                        "many engines of --tensor-parallel-size GPUs each behind vLLM's load balancer, a MoE model's "
                        "experts sharded over all of them (attention data parallelism); comma-separated sizes are "
                        "each their own layout; auto: for a MoE model every size of 1, 2, 4, 8 that keeps tensor × "
                        "data parallel GPUs within one node of 8 and fits.")


def data_parallel_ranks_option():
    return typer.Option(1, "--data-parallel-size", help="Data-parallel ranks (vLLM's --data-parallel-size): that many "
                        "engines of --tensor-parallel-size GPUs each; a MoE model's experts sharded over all of them "
                        "(attention data parallelism), priced per rank.")


def expert_parallel_option():
    return typer.Option(False, "--enable-expert-parallel", help="vLLM's expert parallelism: a MoE model's experts "
                        "placed whole over the tensor-parallel GPUs (that layout's bundled calibration where there "
                        "is one).")


def calibration_option():
    return typer.Option(None, "--calibration", help="Fitted cost-profile file (`calibrate cost`); refused when it "
                        "was fitted on other hardware or another model.")


def rate_option():
    return typer.Option(None, "--rate", help="The same as --request-rate (its older name).")


def request_rate_option():
    return typer.Option(None, "--request-rate", help="Send queries at this many per second as `vllm bench serve "
                        "--request-rate` does (gamma gaps, Poisson at --burstiness 1; inf: all at once). Default: "
                        "the trace's arrival times, else all at 0.")


def burstiness_option():
    return typer.Option(None, "--burstiness", help="vllm bench serve's --burstiness: the gamma shape of the gaps "
                        "between queries sent at --request-rate or a capacity search's rate (1, the default: "
                        "Poisson; < 1 burstier; inf: evenly spaced).")


def max_concurrency_option():
    return typer.Option(None, "--max-concurrency", help="vllm bench serve's --max-concurrency: at most N queries "
                        "in flight, the next starting when one ends (with no rate: a closed loop of N agents).")


def copies_option():
    return typer.Option(None, "--copies", help="Run each query alone as B identical copies submitted together, the "
                        "next query's when they finish (the offline LLM.generate([prompt] * B) protocol of "
                        "published per-request speedups; B = 1: each query alone).")


def slo_ttft_option():
    return typer.Option(None, "--slo-ttft", help="TTFT SLO, seconds: a call meets it at or below this.")


def slo_tpot_option():
    return typer.Option(None, "--slo-tpot", help="TPOT SLO, seconds per output token after the first.")


def slo_query_latency_option():
    return typer.Option(None, "--slo-query-latency", help="Query latency SLO, seconds: the agent's whole query.")


def slo_itl_option():
    return typer.Option(None, "--slo-itl", help="ITL SLO, seconds: a call meets it when no gap between two of its "
                        "streamed chunks is longer (vllm bench serve's ITL: a speculative step streams its tokens as "
                        "one chunk).")


def slo_attainment_option():
    return typer.Option(0.9, "--slo-attainment", help="Share of calls and of queries that must meet the SLOs at "
                        "capacity (DistServe's 90 %).")


def capacity_tolerance_option():
    return typer.Option(0.05, "--capacity-tolerance", help="Relative precision of a capacity search's rate.")


# CapacitySearch's defaults (agentspec_sim/capacity/search.py; tests/test_capacity_cli.py holds them equal), here so
# the command line's help needs no import of the library.
CAPACITY_DEFAULTS = {"seeds": 5, "criterion": "calls", "max_tenants": 64}


def capacity_seeds_option():
    return typer.Option(CAPACITY_DEFAULTS["seeds"], "--capacity-seeds", help="Seeds a capacity search runs (each its "
                        "own send times and "
                        "order, the same for every drafter): the capacity is their mean, with its 95 % interval.")


def capacity_criterion_option():
    return typer.Option(CAPACITY_DEFAULTS["criterion"], "--capacity-criterion", help="What attainment counts: "
                        "'calls' (pooled calls, "
                        "each by vLLM's good-request rule) or 'queries' (a query is good when every call of it met "
                        "the call SLOs).")


def capacity_max_tenants_option():
    return typer.Option(CAPACITY_DEFAULTS["max_tenants"], "--capacity-max-tenants",
                        help="Most independent tenants a capacity probe may send "
                        "the trace as to reach a steady window; past it the capacity is inconclusive.")


def disable_shuffle_option():
    return typer.Option(False, "--disable-shuffle", help="vllm bench serve's --disable-shuffle: send the queries "
                        "in trace order (default: shuffled with the seed, as vLLM's client does).")


def capacity_options(seeds: int, criterion: str, max_tenants: int) -> dict:
    """CapacitySearch keywords of the --capacity-* options."""
    return {"seeds": seeds, "criterion": criterion, "max_tenants": max_tenants}


def load_settings(rate: float | None, request_rate: float | None, burstiness: float | None,
                  max_concurrency: int | None, copies: int | None, disable_shuffle: bool = False, *,
                  varied_rate: bool = False) -> dict:
    """EngineConfig keywords of the load protocol (engine/load.py); --rate is --request-rate's older name.
    `varied_rate`: a capacity search's, which varies the request rate itself (--burstiness shapes its gaps)."""
    import math

    if rate is not None:
        if request_rate is not None:
            raise UsageError("--rate is --request-rate's older name: give one of them")
        if not (math.isfinite(rate) and rate > 0):
            raise UsageError(f"--rate: must be a finite number of queries per second > 0, got {rate}")
        request_rate = rate
        Console(stderr=True, highlight=False).print(
            f"note: --rate {rate:g} is --request-rate {rate:g}, vllm bench serve's name: queries are sent as it sends "
            "them (Poisson gaps rescaled so the last is sent at N/R; the first after one gap)", markup=False)
    if request_rate is not None and not (request_rate > 0):  # NaN too
        raise UsageError(f"--request-rate: must be > 0 queries per second (inf: all at once), got {request_rate}")
    if request_rate is not None and math.isfinite(request_rate) and not math.isfinite(1.0 / request_rate):
        raise UsageError(f"--request-rate: {request_rate:g} queries per second is too small: the gap between two "
                         "queries would be infinite")
    if burstiness is not None and not burstiness > 0:
        raise UsageError(f"--burstiness: must be > 0 (1 is Poisson), got {burstiness}")
    if burstiness is not None and request_rate is None and not varied_rate:
        raise UsageError("--burstiness shapes the gaps between queries sent at --request-rate (or a capacity search's "
                         "rate): give --request-rate R (--max-concurrency alone sends every query at once)")
    burstiness = 1.0 if burstiness is None else burstiness
    if copies is not None and (request_rate is not None or max_concurrency is not None):
        raise UsageError("--copies runs each query alone: it takes no --request-rate or --max-concurrency")
    if copies is not None and copies < 1:
        raise UsageError(f"--copies: must be ≥ 1, got {copies}")
    if max_concurrency is not None and max_concurrency < 1:
        raise UsageError(f"--max-concurrency: must be ≥ 1, got {max_concurrency}")
    settings: dict = {"burstiness": burstiness, "max_concurrency": max_concurrency, "copies": copies or 1,
                      "disable_shuffle": disable_shuffle}
    if copies is not None:
        settings.update(arrival="copies")  # B = 1 too: each query alone, the protocol's first point
    elif request_rate is not None:
        settings.update(arrival="request-rate", rate=request_rate)
    elif max_concurrency is not None:
        settings.update(arrival="request-rate", rate=math.inf)  # vLLM's default rate: send all, the slots gate them
    return settings


def latency_slo(ttft: float | None, tpot: float | None, query_latency: float | None, itl: float | None = None):
    from agentspec_sim.slo import parse_slo_options

    try:
        return parse_slo_options(ttft, tpot, query_latency, itl)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def capacity_search(slo, attainment: float, tolerance: float, burstiness: float | None, engine,
                    options: dict | None = None):
    """The capacity search the options ask for (agentspec_sim/capacity); its load protocol is the request rate it
    varies, so --request-rate and --copies do not apply, and latency is clocked from each query's send, so
    --max-concurrency does not either."""
    from agentspec_sim.capacity import CapacitySearch

    if engine.copies_protocol or (engine.arrival == "request-rate" and engine.max_concurrency is None):
        raise UsageError("a capacity search varies the request rate itself: give no --request-rate, --rate or "
                         "--copies")
    if engine.max_concurrency is not None:
        raise UsageError("--max-concurrency: a capacity search clocks latency from each query's send, as its users "
                         "see it; under vLLM's client semaphore latency starts at the slot and every rate would "
                         "pass. Give no --max-concurrency (replay --max-concurrency measures one closed loop)")
    if not slo.any:
        raise UsageError("a capacity search needs a latency SLO: --slo-ttft, --slo-tpot, --slo-itl and/or "
                         "--slo-query-latency")
    try:
        return CapacitySearch(slo, target=attainment, tolerance=tolerance,
                              burstiness=1.0 if burstiness is None else burstiness, **(options or {}))
    except ValueError as exc:
        raise UsageError(f"--slo-attainment / --capacity-*: {exc}") from None


def replicate_option():
    return typer.Option(1, "--replicate", help="Run N independent copies of every query.")


def think_time_option():
    return typer.Option(None, "--think-time", help="Seconds between a call's finish and the next call of its query "
                        "(default: the trace's think_s).")


def kv_cache_dtype_option():
    return typer.Option("auto", "--kv-cache-dtype", help="vLLM's --kv-cache-dtype: auto (the model's 16-bit dtype) "
                        "or fp8 (fp8_e4m3, fp8_e5m2): one byte an element, twice the KV cache's tokens and half the "
                        "attention's KV read.")


def no_prefix_caching_option():
    return typer.Option(False, "--no-prefix-caching", help="Disable vLLM's prefix cache.")


def no_band_option():
    return typer.Option(False, "--no-band", help="Skip the two extra runs per eagle3/mtp cell whose acceptance "
                        "parameters have an uncertainty band (its low and high bound; their *_low/*_high columns "
                        "are then null).")


def skip_bad_lines_option():
    return typer.Option(False, "--skip-bad-lines", help="Skip malformed trace lines (and count them).")


def engine_config(max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.92,
                  max_model_len: int | None = None, num_kv_blocks: int | None = None, tensor_parallel_size: str = "1",
                  expert_parallel: bool = False, calibration: Path | None = None, replicate: int = 1,
                  think_time: float | None = None, no_prefix_caching: bool = False, load: dict | None = None,
                  data_parallel_size: str = "1", kv_cache_dtype: str = "auto"):
    """The engine settings every cell shares (max_num_seqs, hardware, model, seed vary per cell); `load`: the
    load protocol's settings (`load_settings`; None: the trace's own arrivals)."""
    import math

    from agentspec_sim.engine import EngineConfig, EngineConfigError

    load = load if load is not None else {}
    tp, dp, layouts = layout_choice(tensor_parallel_size, expert_parallel, data_parallel_size)
    # What EngineConfig lets through (NaN compares false with every bound) but no run can use.
    if think_time is not None and not (math.isfinite(think_time) and think_time >= 0):
        raise UsageError(f"--think-time: must be a finite number of seconds ≥ 0, got {think_time}")
    try:
        return EngineConfig(max_num_batched_tokens=max_num_batched_tokens,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                            num_kv_blocks=num_kv_blocks, tensor_parallel_size=tp, data_parallel_size=dp,
                            enable_expert_parallel=expert_parallel and layouts is None,
                            calibration=str(calibration) if calibration else None, replicate=replicate,
                            think_time=think_time, enable_prefix_caching=not no_prefix_caching,
                            kv_cache_dtype=kv_cache_dtype, **load)
    except EngineConfigError as exc:
        raise UsageError(str(exc)) from None


def run_sweep_cli(trace: Path | None, *, drafter: str, speculative_config: list[str], grid: list[str],
                  max_num_seqs: str, hardware: str, model: str, seeds: int, engine, output: Path | None,
                  resume: bool, jobs: int | None, executor: str, address: str | None, skip_bad_lines: bool,
                  show_progress: bool = True, max_cells: int = 10_000, band: bool = True, capacity=None,
                  layouts=None):
    """`run_sweep` with a progress bar; bad options → UsageError. On Ctrl-C or SIGTERM (`Interrupted`, see
    cli/errors.py) `run_sweep` writes the finished cells; the note says how many, and the exit code is
    130 or 143."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentspec_sim.engine import EngineConfigError, SimulationError
    from agentspec_sim.engine.drafting import SpecConfigError
    from agentspec_sim.sweep import SweepError, run_sweep
    from agentspec_sim.sweep.cells import parse_grid, parse_int_list, parse_name_list

    if seeds < 1:
        raise UsageError(f"--seeds must be ≥ 1, got {seeds}")
    if jobs is not None and jobs < 1:  # 0 would otherwise read as "unset" (one per CPU)
        raise UsageError(f"--jobs must be ≥ 1 (leave it out for one per CPU), got {jobs}")
    if max_cells < 1:
        raise UsageError(f"--max-cells must be ≥ 1, got {max_cells}")
    try:
        options = dict(drafters=parse_name_list(drafter, "--drafter"), speculative_configs=speculative_config,
                       grid=dict(parse_grid(grid)), max_num_seqs=parse_int_list(max_num_seqs, "--max-num-seqs"),
                       hardware=parse_name_list(hardware, "--hardware"), models=parse_name_list(model, "--model"),
                       seeds=range(seeds))  # a range: a million seeds are refused, not listed first
    except SweepError as exc:
        raise UsageError(str(exc)) from None
    _check_output(trace, output, engine, hardware, model, speculative_config)
    console = Console(stderr=True)
    bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                   transient=True, disable=not (show_progress and console.is_terminal))
    lines = PlainProgress("cells") if show_progress and not console.is_terminal else None  # a log or a pipe
    task = bar.add_task("cells", total=None)
    counts = {"done": 0, "total": 0}

    def progress(done: int, total: int, row) -> None:
        if row is None:  # the workers are up, every check passed: the first cells compile the kernels
            if show_progress:
                say_if_compiling()
            bar.start()
        counts.update(done=done, total=total)
        bar.update(task, completed=done, total=total)
        if lines is not None:
            lines.update("sweep", done, total)

    try:
        return run_sweep(trace, engine=engine, output=output, resume=resume, jobs=jobs, executor=executor,
                         address=address, skip_bad_lines=skip_bad_lines, progress=progress, max_cells=max_cells,
                         band=band, capacity=capacity, layouts=layouts, notify=lambda text: console.print(
                             f"note: {text}", highlight=False, markup=False), **options)
    except (SweepError, SpecConfigError, EngineConfigError, SimulationError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # a bad hardware/model profile name or file
        if type(exc).__name__ != "ProfileError":
            raise
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt as exc:  # cli.errors.Interrupted: run_guarded prints the note, exits 130/143
        bar.stop()
        finished = f"{counts['done']} of {counts['total']} cells finished"
        if output is not None and counts["done"]:
            finished += f" and written to {output}; rerun with --resume to finish"
        elif output is not None:
            finished += f"; nothing written to {output}"
        exc.note = finished
        raise
    finally:
        bar.stop()


def _check_output(trace: Path | None, output: Path | None, engine, hardware: str, model: str,
                  speculative_config: list[str]) -> None:
    """The output policy (agentspec_sim/io/outputs.py) for the results parquet, against every file cells read."""
    from agentspec_sim.io.outputs import PARQUET_SUFFIXES, Output, check_outputs, json_paths
    from agentspec_sim.trace.bundled import default_trace_path

    check_outputs(Output("--output", output, PARQUET_SUFFIXES),
                  inputs={"TRACE": trace or default_trace_path(), "--calibration": engine.calibration,
                          "--hardware": hardware.split(","), "--model": model.split(","),
                          "--speculative-config": json_paths(speculative_config)})
