"""`agentspec-sim validate …`: check the simulator against real execution (`timing`: torch forward passes,
`vllm`: the trace through real vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import UsageError

# What validation/timing.py's write_outputs puts in the -o folder.
TIMING_FILES = ("timing.parquet", "timing_calls.parquet", "hardware.json", "model.json", "calibration.json",
                "summary.json", "scatter.png")

validate_app = typer.Typer(name="validate", help="Check the simulator against real execution.", no_args_is_help=True)
app.add_typer(validate_app, name="validate")


def _need_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise UsageError("validate timing needs torch: pip install 'agentspec-sim[validate]'")


@validate_app.command("timing")
def timing(
    steps: Path = typer.Argument(..., help="A step log (`replay --steps`, parquet/CSV) or a schedule sample "
                                 "(validation/schedules/*.json.gz).", show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="Output folder (timing.parquet, timing_calls.parquet, "
                                "scatter.png, calibration.json, summary.json).", show_default=False),
    model: str = typer.Option("qwen3-8b", "--model", help="Model profile whose architecture runs."),
    drafter: str | None = typer.Option(None, "--drafter", help="Which run of a multi-run step log (default: the "
                                       "last one)."),
    sample: int | None = typer.Option(None, "--sample", help="Time a stratified sample of this many steps "
                                      "(batch-size bucket × decode/verify/prefill)."),
    device: str | None = typer.Option(None, "--device", help="cuda or cpu (default: cuda when available)."),
    tiny: bool | None = typer.Option(None, "--tiny/--full-size", help="Run the tiny configuration (default: on "
                                     "CPU only)."),
    hardware: str | None = typer.Option(None, "--hardware", help="Hardware profile to predict with (default: this "
                                        "GPU's bundled profile, else one measured here)."),
    calibration: Path | None = typer.Option(None, "--calibration", help="Calibration the predictions start from."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs per step."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed runs per step before timing."),
    holdout: float = typer.Option(0.25, "--holdout", help="Share of steps held out of the calibration fit."),
    seed: int = typer.Option(0, "--seed", help="Seed for weights, token ids, sampling and the hold-out split."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    max_passes: int = typer.Option(1_000_000, "--max-passes", help="Refuse a run of more forward passes than "
                                   "this (steps × (warmup + repeats)) before the model is built; raise it for more."),
) -> None:
    """Execute each step's batch as a real forward pass (torch), compare with the cost model, fit a calibration."""
    from agentspec_sim.cost.calibrate import CalibrationFitError
    from agentspec_sim.cost.profiles import ProfileError
    from agentspec_sim.resources import ResourceError
    from agentspec_sim.validation.schedule import ScheduleError, load_shapes, stratified_sample
    from agentspec_sim.validation.timing import (
        TimingConfig,
        check_timing_work,
        run_timing,
        summary_dict,
        write_outputs,
    )

    if repeats < 1 or warmup < 0:
        raise UsageError("--repeats must be ≥ 1 and --warmup ≥ 0")
    if max_passes < 1:
        raise UsageError(f"--max-passes must be ≥ 1, got {max_passes}")
    if not 0 <= holdout < 1:
        raise UsageError("--holdout must be in [0, 1)")
    if sample is not None and sample < 1:
        raise UsageError("--sample must be ≥ 1")
    from agentspec_sim.outputs import Output, check_outputs

    check_outputs(Output("--output", output, folder=True, names=TIMING_FILES),
                  inputs={"STEPS": steps, "--calibration": calibration, "--hardware": hardware, "--model": model})
    try:
        shapes = load_shapes(steps, drafter)
        if sample is not None:
            shapes = stratified_sample(shapes, sample, seed=seed)
        config = TimingConfig(model=model, tiny=tiny, device=device, hardware=hardware,
                              calibration=str(calibration) if calibration else None, warmup=warmup,
                              repeats=repeats, seed=seed)
        check_timing_work(len(shapes), config, max_passes)
        # Only now: a bad argument, step log or size is named the same way with or without torch installed.
        _need_torch()
        result = run_timing(shapes, config, holdout=holdout, max_passes=max_passes)
    except (ScheduleError, ProfileError, CalibrationFitError) as exc:
        raise UsageError(str(exc)) from None
    except ResourceError:
        raise  # run_guarded writes its settings as options
    except ValueError as exc:  # a device or dtype torch cannot use
        raise UsageError(str(exc)) from None
    paths = write_outputs(result, output)
    summary = summary_dict(result)
    if as_json:
        typer.echo(json.dumps(summary | {"files": {k: str(v) for k, v in paths.items()}}, indent=2))
        return
    _render_timing(summary, output)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}%"


def _render_timing(summary: dict, output: Path) -> None:
    console = Console()
    table = Table(title=f"validate timing: {summary['model']} on {summary['hardware']} ({summary['device']})",
                  box=box.SIMPLE_HEAD, caption="MAPE of the predicted forward time per step; measured: median ms")
    for col in ("batch size", "steps", "measured", "MAPE", "calibrated"):
        table.add_column(col, justify="right")
    for row in summary["per_batch_size"]:
        table.add_row(row["batch_size"], str(row["steps"]), f"{row['measured_ms']:.2f}", _pct(row["mape"]),
                      _pct(row.get("mape_calibrated")))
    console.print(table)
    fit = summary["fit"]
    line = f"{summary['steps']} steps ({summary['cuda_graph_steps']} as CUDA graphs): MAPE {summary['mape']:.1f}%"
    if fit:
        line += (f"; calibration fitted on {fit['num_train']} steps: {_pct(fit['mape_before_train'])} → "
                 f"{_pct(fit['mape_after_train'])}, held out ({fit['num_holdout']}): "
                 f"{_pct(fit['mape_before_holdout'])} → {_pct(fit['mape_after_holdout'])}")
    console.print(line)
    console.print(f"wrote {output}/")


def _need_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("this command needs vLLM and model weights: pip install 'agentspec-sim[vllm]' (vllm==0.33.0)")


@validate_app.command("vllm")
def vllm_cmd(
    trace: Path = typer.Argument(..., help="The trace whose calls vLLM serves.", show_default=False),
    model: str = typer.Option(..., "--model", help="Model weights for vLLM (a local folder or hub id).",
                              show_default=False),
    method: str = typer.Option("normal,ngram,ngram-v2,suffix", "--method", help="Comma-separated: normal, ngram (V1 "
                               "runner), ngram-v2 (default runner), suffix, eagle3 (needs --eagle3-model)."),
    eagle3_model: str | None = typer.Option(None, "--eagle3-model", help="EAGLE-3 draft weights for eagle3."),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", help="Same limit in vLLM and in the simulation."),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", help="Per-step token budget "
                                                      "(default: vLLM's)."),
    queries: int | None = typer.Option(None, "--queries", help="Serve only the first N queries."),
    hardware: str = typer.Option("h100-80g", "--hardware", help="Hardware profile the simulation prices steps with."),
    sim_model: str = typer.Option("qwen3-8b", "--sim-model", help="Model profile of the simulation."),
    calibration: Path | None = typer.Option(None, "--calibration", help="Cost calibration for the simulation."),
    record_dir: Path | None = typer.Option(None, "--record-dir", help="Write each method's re-generated trace here."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the comparison as JSON (.json, or "
                                       ".json.gz/.xz/.zst)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Serve the trace's calls through vLLM with each spec method, then simulate the same calls (with vLLM's
    outputs) and compare acceptance per step, rejection rate and goodput."""
    from dataclasses import replace

    from agentspec_sim.engine import EngineConfig, EngineConfigError
    from agentspec_sim.trace.io import load_trace, write_trace
    from agentspec_sim.validation.torch_model import free_gpu_memory
    from agentspec_sim.validation.vllm_runner import (
        build_llm,
        compare,
        engine_limits,
        methods,
        run_vllm,
        workload_with_outputs,
    )

    known = methods(eagle3_model=eagle3_model)
    names = [m.strip() for m in method.split(",") if m.strip()]
    for name in names:
        if name not in known:
            hint = " (eagle3 needs --eagle3-model)" if name == "eagle3" else ""
            raise UsageError(f"--method {name}: unknown{hint}; known: {', '.join(known)}")
    if max_num_seqs < 1 or (queries is not None and queries < 1):
        raise UsageError("--max-num-seqs and --queries must be ≥ 1")
    from agentspec_sim.outputs import JSON_DOCUMENT_SUFFIXES, Output, check_outputs

    check_outputs(Output("--output", output, JSON_DOCUMENT_SUFFIXES),
                  Output("--record-dir", record_dir, folder=True, names=tuple(f"{n}.jsonl" for n in names)),
                  inputs={"TRACE": trace, "--model": model, "--eagle3-model": eagle3_model,
                          "--calibration": calibration})
    _need_vllm()
    workload = load_trace(trace)
    if queries is not None:
        workload = replace(workload, queries=workload.queries[:queries])
    try:
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              hardware=hardware, model=sim_model,
                              calibration=str(calibration) if calibration else None)
    except EngineConfigError as exc:
        raise UsageError(str(exc)) from None
    llm_kwargs = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    results = []
    for name in names:
        m = known[name]
        llm = build_llm(model, m, max_num_seqs=max_num_seqs, **llm_kwargs)
        # The simulator gets the KV blocks and context vLLM actually profiled, not its own estimate.
        run_config = replace(config, **engine_limits(llm))
        run = run_vllm(workload, llm, name)
        del llm  # the engine's last reference: its GPU memory can go before the next one is built
        free_gpu_memory()
        if record_dir is not None:
            record_dir.mkdir(parents=True, exist_ok=True)
            write_trace(workload_with_outputs(workload, run, model=model), record_dir / f"{name}.jsonl")
        limits = {"num_kv_blocks": run_config.num_kv_blocks, "max_model_len": run_config.max_model_len}
        results.append({**compare(workload, run, m, run_config).to_dict(), "engine_limits": limits})
    document = {"trace": str(trace), "model": model, "max_num_seqs": max_num_seqs, "methods": results}
    if output is not None:
        from agentspec_sim.atomic import write_json_atomic

        write_json_atomic(output, document)
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    _render_vllm(document)


def _num(value, spec: str = ".3f") -> str:
    return "—" if value is None else f"{value:{spec}}"


def _render_vllm(document: dict) -> None:
    table = Table(title=f"validate vllm: {Path(document['trace']).name}, max_num_seqs {document['max_num_seqs']}",
                  box=box.SIMPLE_HEAD, caption="meas = vLLM's own metrics; sim = the simulator on vLLM's outputs; "
                  "identical = calls whose per-step drafted/accepted sequences match")
    # rej.tok: rejected / drafted tokens = 1 − vLLM's draft acceptance rate, on both sides (as replay names it).
    for col in ("method", "acc.len meas", "sim", "rej.tok meas", "sim", "goodput meas", "sim", "identical"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in document["methods"]:
        m, s = r["measured"], r["simulated"]
        table.add_row(r["method"], _num(m["mean_acceptance_length"], ".2f"), _num(s["mean_acceptance_length"], ".2f"),
                      _num(m["rejection_rate_tokens"]), _num(s["rejection_rate_tokens"]),
                      _num(m["goodput_tok_s"], ",.0f"), _num(s["goodput_tok_s"], ",.0f"),
                      f"{r['calls_with_identical_steps']}/{r['calls']}")
    Console().print(table)
