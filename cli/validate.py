"""`agentspec-sim validate …`: check the simulator against real execution (`timing`: torch forward passes,
`vllm`: the trace through real vLLM)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli.common import caption_below
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app

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
    from agentspec_sim.host.resources import ResourceError
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
    from agentspec_sim.io.outputs import Output, check_outputs

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
    console.print(caption_below(table))
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
        raise UsageError("this command needs vLLM and model weights: pip install 'agentspec-sim[vllm]' (vllm==0.33.0), "
                         "or vLLM's CPU build (docs/validation.md)")


def vllm_engine_args(max_num_batched_tokens: int | None, block_size: int | None, max_model_len: int | None,
                     num_gpu_blocks: int | None, enforce_eager: bool, enable_prefix_caching: bool) -> dict:
    """`vllm.LLM` keyword arguments for the engine knobs given on the command line (vLLM's own names)."""
    args = {"max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
            "max_model_len": max_model_len, "num_gpu_blocks_override": num_gpu_blocks}
    out = {k: v for k, v in args.items() if v is not None}
    for name, value in (("--max-num-batched-tokens", max_num_batched_tokens), ("--block-size", block_size),
                        ("--max-model-len", max_model_len), ("--num-gpu-blocks", num_gpu_blocks)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be ≥ 1, got {value}")
    if enforce_eager:
        out["enforce_eager"] = True
    if not enable_prefix_caching:
        out["enable_prefix_caching"] = False
    return out


@validate_app.command("vllm")
def vllm_cmd(
    trace: Path = typer.Argument(..., help="The trace whose calls vLLM serves.", show_default=False),
    model: str = typer.Option(..., "--model", help="Model weights for vLLM (a local folder or hub id).",
                              show_default=False),
    method: str = typer.Option("normal,ngram,ngram-v2,suffix", "--method", help="Comma-separated: normal, ngram (V1 "
                               "runner), ngram-v2 (Model Runner V2, GPU only), suffix, eagle3 (needs --eagle3-model)."),
    eagle3_model: str | None = typer.Option(None, "--eagle3-model", help="EAGLE-3 draft weights for eagle3."),
    k_ngram: int = typer.Option(5, "--k-ngram", help="num_speculative_tokens of ngram / ngram-v2."),
    k_suffix: int = typer.Option(32, "--k-suffix", help="num_speculative_tokens of suffix (a maximum)."),
    prompt_lookup_max: int = typer.Option(4, "--prompt-lookup-max", help="ngram: longest n-gram matched."),
    prompt_lookup_min: int | None = typer.Option(None, "--prompt-lookup-min", help="ngram: shortest n-gram matched "
                                                 "(default: vLLM's, = --prompt-lookup-max)."),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", help="Same limit in vLLM and in the simulation."),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", help="Per-step token budget "
                                                      "(default: vLLM's)."),
    block_size: int | None = typer.Option(None, "--block-size", help="KV block size (default: vLLM's; 16 on GPU, "
                                          "128 on CPU, where it must be a multiple of 32)."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context limit (default: the model's)."),
    num_gpu_blocks: int | None = typer.Option(None, "--num-gpu-blocks", help="KV blocks (vLLM's "
                                              "num_gpu_blocks_override; default: what it profiles)."),
    enable_prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                               help="vLLM's prefix caching (the simulation follows)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="No CUDA graphs / torch.compile (an engine "
                                       "builds in ~20 s instead of ~80 s on a CPU)."),
    clock: str = typer.Option("steps", "--clock", help="steps: arrivals and think times count engine steps on both "
                              "sides, so the schedules compare step for step on any machine; wall: the wall clock "
                              "(goodput compares only when the simulation prices the GPU vLLM ran on)."),
    queries: int | None = typer.Option(None, "--queries", help="Serve only the first N queries."),
    hardware: str = typer.Option("h100-80g", "--hardware", help="Hardware profile the simulation prices steps with "
                                 "(--clock wall)."),
    sim_model: str = typer.Option("qwen3-8b", "--sim-model", help="Model profile of the simulation (--clock wall)."),
    calibration: Path | None = typer.Option(None, "--calibration", help="Cost calibration for the simulation."),
    record_dir: Path | None = typer.Option(None, "--record-dir", help="Write each method's re-generated trace here."),
    steps_out: Path | None = typer.Option(None, "--steps-out", help="Write vLLM's per-step log of each method here "
                                          "(METHOD-steps.parquet: `calibrate cost` reads it) and hardware.json (the "
                                          "machine vLLM ran on)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the comparison as JSON (.json, or "
                                       ".json.gz/.xz/.zst)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Serve the trace's calls through vLLM with each spec method (a fresh process per method), then simulate the
    same calls with vLLM's outputs and limits and compare them step for step: the engine steps, the draft ids at
    every verify step, each call's drafted/accepted sequence, preemptions, acceptance and goodput."""
    from dataclasses import replace

    from agentspec_sim.engine import EngineConfig, EngineConfigError
    from agentspec_sim.trace.io import load_trace, write_trace
    from agentspec_sim.validation.vllm_runner import MethodUnavailable, compare, methods, workload_with_outputs
    from agentspec_sim.validation.vllm_worker import VllmRunError, WorkerRequest, run_in_subprocess

    for name, value in (("--k-ngram", k_ngram), ("--k-suffix", k_suffix), ("--prompt-lookup-max", prompt_lookup_max),
                        ("--prompt-lookup-min", prompt_lookup_min)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be ≥ 1, got {value}")
    if prompt_lookup_min is not None and prompt_lookup_min > prompt_lookup_max:
        raise UsageError(f"--prompt-lookup-min {prompt_lookup_min} is above --prompt-lookup-max {prompt_lookup_max}")
    known = methods(k_ngram=k_ngram, k_suffix=k_suffix, eagle3_model=eagle3_model,
                    prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min)
    names = list(dict.fromkeys(m.strip() for m in method.split(",") if m.strip()))
    if not names:
        raise UsageError("--method: name at least one method")
    for name in names:
        if name not in known:
            hint = " (eagle3 needs --eagle3-model)" if name == "eagle3" else ""
            raise UsageError(f"--method {name}: unknown{hint}; known: {', '.join(known)}")
    if clock not in ("steps", "wall"):
        raise UsageError(f"--clock {clock}: expected steps or wall")
    if max_num_seqs < 1 or (queries is not None and queries < 1):
        raise UsageError("--max-num-seqs and --queries must be ≥ 1")
    llm_kwargs = vllm_engine_args(max_num_batched_tokens, block_size, max_model_len, num_gpu_blocks, enforce_eager,
                                  enable_prefix_caching)
    from agentspec_sim.io.outputs import JSON_DOCUMENT_SUFFIXES, Output, check_outputs

    check_outputs(Output("--output", output, JSON_DOCUMENT_SUFFIXES),
                  Output("--record-dir", record_dir, folder=True, names=tuple(f"{n}.jsonl" for n in names)),
                  Output("--steps-out", steps_out, folder=True,
                         names=(*(f"{n}-steps.parquet" for n in names), "hardware.json")),
                  inputs={"TRACE": trace, "--model": model, "--eagle3-model": eagle3_model,
                          "--calibration": calibration})
    workload = load_trace(trace)
    _need_vllm()
    if queries is not None:
        workload = replace(workload, queries=workload.queries[:queries])
    try:
        config = EngineConfig(max_num_seqs=max_num_seqs, hardware=hardware, model=sim_model,
                              calibration=str(calibration) if calibration else None)
    except EngineConfigError as exc:
        raise UsageError(str(exc)) from None
    err = Console(stderr=True)
    results: list[dict] = []
    for name in names:
        m = known[name]
        err.print(f"vLLM · {name}: building the engine and serving {sum(len(q.calls) for q in workload.queries)} "
                  f"calls …", highlight=False)
        request = WorkerRequest(model, m, workload, max_num_seqs, clock, llm_kwargs,  # type: ignore[arg-type]
                                probe_hardware=steps_out is not None)
        try:
            run = run_in_subprocess(request)
        except MethodUnavailable as exc:
            err.print(f"vLLM · {name}: skipped: {exc}", highlight=False)
            results.append({"method": name, "skipped": str(exc)})
            continue
        except VllmRunError as exc:
            raise UsageError(str(exc)) from None
        if record_dir is not None:
            record_dir.mkdir(parents=True, exist_ok=True)
            write_trace(workload_with_outputs(workload, run, model=model), record_dir / f"{name}.jsonl")
        if steps_out is not None:
            _write_steps(steps_out, name, run, model)
        try:
            results.append(compare(workload, run, m, config).to_dict())
        except EngineConfigError as exc:
            raise UsageError(f"the simulation cannot take vLLM's limits: {exc}") from None
    if all("skipped" in r for r in results):
        raise UsageError("no method could run on this vLLM: " + "; ".join(r["skipped"] for r in results))
    document = {"trace": str(trace), "model": model, "max_num_seqs": max_num_seqs, "clock": clock,
                "methods": results}
    if output is not None:
        from agentspec_sim.io.atomic import write_json_atomic

        write_json_atomic(output, document)
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    _render_vllm(document)


def _write_steps(folder: Path, name: str, run, model: str) -> None:
    """vLLM's per-call-step log (`calibrate cost` input) and the profile of the machine it ran on."""
    import numpy as np

    from agentspec_sim.cost.profiles import ProfileError, load_model, profile_name
    from agentspec_sim.io.atomic import write_json_atomic
    from agentspec_sim.validation.schedule import write_table

    folder.mkdir(parents=True, exist_ok=True)
    rows = run.call_steps()
    columns = {key: np.asarray([r[key] for r in rows]) for key in
               ("step", "call_id", "phase", "context_len", "scheduled_tokens", "drafted", "step_time_s")}
    if run.hardware_profile is not None:
        write_json_atomic(folder / "hardware.json", run.hardware_profile)
        columns["hardware"] = np.asarray([run.hardware_profile["id"]] * len(rows))
    config = Path(model) / "config.json"
    if config.is_file():
        with contextlib.suppress(ProfileError):
            columns["model"] = np.asarray([profile_name(load_model(str(config)))] * len(rows))
    write_table(folder / f"{name}-steps.parquet", columns)


def _num(value, spec: str = ".3f") -> str:
    return "—" if value is None else f"{value:{spec}}"


def _render_vllm(document: dict) -> None:
    steps_clock = document.get("clock") == "steps"
    table = Table(title=f"validate vllm: {Path(document['trace']).name}, max_num_seqs {document['max_num_seqs']}",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    legend = ("vLLM = its own metrics and schedule; sim = the simulator on vLLM's outputs and limits; pairs read "
              "vLLM/sim. steps: identical engine steps / vLLM's; drafts: verify steps with identical draft ids / "
              "vLLM's; calls: identical per-step drafted/accepted (+ those differing only in the last verify step's "
              "accepted count, which vLLM counts past max_tokens) / calls"
              + ("; goodput: tokens per engine step" if steps_clock else "; goodput: tokens per second"))
    # rej.tok: rejected / drafted tokens = 1 − vLLM's draft acceptance rate, on both sides (as replay names it).
    for col in ("method", "steps", "drafts", "calls", "preempt", "acc.len", "rej.tok", "goodput"):
        table.add_column(col, justify="left" if col == "method" else "right")
    skipped = []
    for r in document["methods"]:
        if "skipped" in r:
            skipped.append(f"{r['method']}: {r['skipped']}")
            continue
        g = r["goodput"]
        spec = ".2f" if g.get("unit") == "tokens per engine step" else ",.0f"
        steps = "—" if r["engine_steps_vllm"] is None else f"{r['engine_steps_identical']}/{r['engine_steps_vllm']}"
        drafts = "—" if r["verify_steps"] is None else f"{r['draft_ids_identical_steps']}/{r['verify_steps']}"
        extra = r["calls_identical_except_last_verify"] - r["calls_identical"]
        calls = f"{r['calls_identical']}" + (f"+{extra}" if extra else "") + f"/{r['calls']}"

        def pair(a, b, fmt):
            return f"{_num(a, fmt)}/{_num(b, fmt)}"

        runner = f" ({r['runner']})" if r["runner"] else ""
        table.add_row(r["method"] + runner, steps, drafts, calls,
                      pair(r["preemptions_vllm"], r["preemptions_sim"], "d"),
                      pair(r["acceptance_length"]["vllm"], r["acceptance_length"]["sim"], ".2f"),
                      pair(r["rejection_rate_tokens"]["vllm"], r["rejection_rate_tokens"]["sim"], ".1%"),
                      pair(g["vllm"], g.get("sim"), spec))
    console = Console()
    console.print(caption_below(table))
    console.print(legend, style="dim", highlight=False)
    for r in document["methods"]:
        if "skipped" not in r and r.get("first_schedule_difference"):
            console.print(f"{r['method']}: first difference: {r['first_schedule_difference']}", highlight=False)
        if "skipped" not in r and not r["goodput"].get("comparable", True):
            console.print(f"{r['method']}: goodput not compared: {r['goodput']['why_not']}", highlight=False)
    for line in skipped:
        console.print(f"skipped {line}", highlight=False)
