"""`agentspec-sim validate bench` and `calibrate bench`: a user's own `vllm bench serve` result files, replayed
(validation/bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentspec_sim.cli.calibrate import calibrate_app
from agentspec_sim.cli.common import caption_below
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.validate import validate_app

RESULTS_HELP = "`vllm bench serve --save-result --save-detailed` result file(s) (vLLM 0.33's format)."

# The server's flags (`vllm serve`'s), which a result file does not record: the same options for both commands.
def _hardware():
    return typer.Option("h100-80g", "--hardware", help="Hardware profile of the GPU the server ran on.")


def _model():
    return typer.Option("qwen3-8b", "--model", help="Model profile the server served (or a config.json).")


def _tensor_parallel_size():
    return typer.Option(1, "--tensor-parallel-size", help="The server's --tensor-parallel-size.")


def _max_num_seqs():
    return typer.Option(None, "--max-num-seqs", help="The server's --max-num-seqs (default: vLLM's).")


def _max_num_batched_tokens():
    return typer.Option(None, "--max-num-batched-tokens", help="The server's token budget (default: vLLM's).")


def _max_model_len():
    return typer.Option(None, "--max-model-len", help="The server's --max-model-len.")


def _gpu_memory_utilization():
    return typer.Option(0.92, "--gpu-memory-utilization", help="The server's share of GPU memory.")


def _no_prefix_caching():
    return typer.Option(False, "--no-prefix-caching", help="The server ran without prefix caching.")


def _async_scheduling():
    return typer.Option(None, "--async-scheduling/--no-async-scheduling", help="The server's scheduling (default: "
                        "vLLM 0.33's, async).")


def _seed():
    return typer.Option(0, "--seed", help="The client's --seed (vllm bench serve's default 0): its send times.")



def _engine(hardware: str, model: str, tensor_parallel_size: int, max_num_seqs: int | None,
            max_num_batched_tokens: int | None, max_model_len: int | None, gpu_memory_utilization: float,
            no_prefix_caching: bool, async_scheduling: bool | None, calibration: Path | None):
    """The server's engine (`vllm serve`'s flags) as an EngineConfig, and its cost model."""
    from agentspec_sim.cost.build import cost_model_for
    from agentspec_sim.engine import EngineConfig, EngineConfigError

    try:
        config = EngineConfig(hardware=hardware, model=model, tensor_parallel_size=tensor_parallel_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=not no_prefix_caching, async_scheduling=async_scheduling,
                              calibration=str(calibration) if calibration else None)
        return config, cost_model_for(config)
    except EngineConfigError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # a bad hardware/model profile name or calibration file
        if type(exc).__name__ not in ("ProfileError", "CalibrationError"):
            raise
        raise UsageError(str(exc)) from None


def _results(paths: list[Path], index: int | None):
    from agentspec_sim.validation.bench import BenchFileError, read_bench_results

    out = []
    for path in paths:
        try:
            runs = read_bench_results(path)
        except BenchFileError as exc:
            raise UsageError(str(exc)) from None
        if index is not None:
            if not 0 <= index < len(runs):
                raise UsageError(f"{path}: --index {index}: the file holds {len(runs)} result(s)")
            runs = [runs[index]]
        out += runs
    return out


def _replays(results, config, cost, seed: int):
    from agentspec_sim.engine import SimulationError
    from agentspec_sim.validation.bench import BenchFileError, replay_bench

    try:
        return [replay_bench(r, config, cost, seed) for r in results]
    except (BenchFileError, SimulationError) as exc:
        raise UsageError(str(exc)) from None


@validate_app.command("bench")
def validate_bench(
    results: list[Path] = typer.Argument(..., help=RESULTS_HELP, show_default=False),
    hardware: str = _hardware(),
    model: str = _model(),
    tensor_parallel_size: int = _tensor_parallel_size(),
    max_num_seqs: int | None = _max_num_seqs(),
    max_num_batched_tokens: int | None = _max_num_batched_tokens(),
    max_model_len: int | None = _max_model_len(),
    gpu_memory_utilization: float = _gpu_memory_utilization(),
    no_prefix_caching: bool = _no_prefix_caching(),
    async_scheduling: bool | None = _async_scheduling(),
    calibration: Path | None = typer.Option(None, "--calibration", help="Calibration file (e.g. from `calibrate "
                                            "bench`)."),
    seed: int = _seed(),
    index: int | None = typer.Option(None, "--index", help="Which result of an --append-result file (default: "
                                     "all)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the tables."),
) -> None:
    """Replay a `vllm bench serve` run (same requests, send times, concurrency) and compare TTFT, TPOT, ITL, E2EL
    and throughput with what it measured."""
    from agentspec_sim.validation.bench import compare_rows, measured_metrics

    if seed < 0:
        raise UsageError(f"--seed: must be ≥ 0, got {seed}")
    runs = _results(results, index)
    config, cost = _engine(hardware, model, tensor_parallel_size, max_num_seqs, max_num_batched_tokens,
                           max_model_len, gpu_memory_utilization, no_prefix_caching, async_scheduling, calibration)
    replays = _replays(runs, config, cost, seed)
    from agentspec_sim.cost.build import calibration_note

    documents = []
    for run, replay in zip(runs, replays, strict=True):
        rows = compare_rows(replay.metrics(run.output_lens), measured_metrics(run))
        documents.append({"file": str(run.path), "model_id": run.model_id, "requests": run.num_requests,
                          "failed": run.failed, "request_rate": run.request_rate if run.request_rate < float("inf")
                          else "inf", "burstiness": run.burstiness, "max_concurrency": run.max_concurrency,
                          "seed": seed, "rows": rows})
    if as_json:
        typer.echo(json.dumps({"cost_model": calibration_note(cost), "runs": documents}, indent=2))
        return
    console = Console(highlight=False)
    for doc in documents:
        concurrency = "" if doc["max_concurrency"] is None else f", max concurrency {doc['max_concurrency']}"
        title = (f"{escape(doc['file'])}: {doc['requests']} requests at rate {doc['request_rate']}{concurrency}, "
                 f"seed {seed}")
        table = Table(title=title, title_justify="left")
        for name, justify in (("metric", "left"), ("predicted", "right"), ("measured", "right"),
                              ("error", "right")):
            table.add_column(name, justify=justify)
        for row in doc["rows"]:
            table.add_row(row["metric"], _num(row["predicted"]), _num(row["measured"]),
                          "—" if row["error"] is None else f"{row['error']:+.1%}")
        console.print(caption_below(table))
    console.print(escape(calibration_note(cost)))


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.2f}"


@calibrate_app.command("bench")
def calibrate_bench(
    results: list[Path] = typer.Argument(..., help=RESULTS_HELP, show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="Calibration file to write (.json): the cost model's "
                                "calibration with the fitted host terms.", show_default=False),
    hardware: str = _hardware(),
    model: str = _model(),
    tensor_parallel_size: int = _tensor_parallel_size(),
    max_num_seqs: int | None = _max_num_seqs(),
    max_num_batched_tokens: int | None = _max_num_batched_tokens(),
    max_model_len: int | None = _max_model_len(),
    gpu_memory_utilization: float = _gpu_memory_utilization(),
    no_prefix_caching: bool = _no_prefix_caching(),
    async_scheduling: bool | None = _async_scheduling(),
    calibration: Path | None = typer.Option(None, "--calibration", help="Calibration to start from (default: the "
                                            "pair's bundled one)."),
    seed: int = _seed(),
    as_json: bool = typer.Option(False, "--json", help="Print the fit as JSON."),
) -> None:
    """Fit the host terms the kernels leave out to `vllm bench serve` runs on your own server: the front end's time
    (per request and per prompt token) to their TTFTs, then the per-step host time (`step_overhead_s`, or
    `sync_host_step_s` with --no-async-scheduling) to their TPOTs; write the calibration."""
    from agentspec_sim.io.outputs import JSON_SUFFIXES, Output, check_outputs
    from agentspec_sim.validation.bench import fit_frontend, fit_step_host

    if seed < 0:
        raise UsageError(f"--seed: must be ≥ 0, got {seed}")
    check_outputs(Output("--output", output, JSON_SUFFIXES),
                  inputs={**{f"RESULTS {i + 1}": f for i, f in enumerate(results)}, "--calibration": calibration})
    runs = _results(results, None)
    config, cost = _engine(hardware, model, tensor_parallel_size, max_num_seqs, max_num_batched_tokens,
                           max_model_len, gpu_memory_utilization, no_prefix_caching, async_scheduling, calibration)
    replays = _replays(runs, config, cost, seed)
    cal = cost.calibration
    lengths = {int(n) for r in runs for n in r.input_lens.tolist()}
    fit = fit_frontend(runs, replays, cal.frontend_request_s, cal.frontend_prompt_token_s,
                       fit_prompt_term=len(lengths) > 1)
    from agentspec_sim.engine import SimulationError
    from agentspec_sim.validation.bench import BenchFileError

    try:
        step, stepped = fit_step_host(runs, replays, config, cost, seed, synchronous=async_scheduling is False)
    except (BenchFileError, SimulationError) as exc:
        raise UsageError(str(exc)) from None
    fitted = stepped.calibration.replace(
        frontend_request_s=round(fit.request_s, 6), frontend_prompt_token_s=round(fit.prompt_token_s, 9),
        **{step.factor: round(step.value_s, 7)},
        source=f"{cal.source}; host terms fitted on {fit.requests} requests of {len(runs)} vllm bench serve run(s) "
               "(calibrate bench)")
    fitted.to_file(output, hardware=cost.hardware.id, model=cost.model.id)
    doc = {"output": str(output), "requests": fit.requests, "runs": len(runs),
           "frontend_request_s": fitted.frontend_request_s, "frontend_prompt_token_s": fitted.frontend_prompt_token_s,
           "ttft_median_abs_error_before": fit.ttft_error_before, "ttft_median_abs_error_after": fit.ttft_error_after,
           step.factor: getattr(fitted, step.factor), "tpot_median_abs_error_before": step.tpot_error_before,
           "tpot_median_abs_error_after": step.tpot_error_after}
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    Console(highlight=False).print(
        f"wrote {escape(str(output))}: frontend_request_s {fitted.frontend_request_s * 1e3:.2f} ms, "
        f"frontend_prompt_token_s {fitted.frontend_prompt_token_s * 1e6:.2f} us over {fit.requests} requests; "
        f"TTFT median |error| {fit.ttft_error_before:.1%} -> {fit.ttft_error_after:.1%}; {step.factor} "
        f"{getattr(fitted, step.factor) * 1e3:.3f} ms, TPOT median |error| {step.tpot_error_before:.1%} -> "
        f"{step.tpot_error_after:.1%}")
