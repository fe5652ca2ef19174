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
) -> None:
    """Execute each step's batch as a real forward pass (torch), compare with the cost model, fit a calibration."""
    _need_torch()
    from agentspec_sim.cost.calibrate import CalibrationFitError
    from agentspec_sim.cost.profiles import ProfileError
    from agentspec_sim.validation.schedule import ScheduleError, load_shapes, stratified_sample
    from agentspec_sim.validation.timing import TimingConfig, run_timing, summary_dict, write_outputs

    if repeats < 1 or warmup < 0:
        raise UsageError("--repeats must be ≥ 1 and --warmup ≥ 0")
    if not 0 <= holdout < 1:
        raise UsageError("--holdout must be in [0, 1)")
    if sample is not None and sample < 1:
        raise UsageError("--sample must be ≥ 1")
    try:
        shapes = load_shapes(steps, drafter)
        if sample is not None:
            shapes = stratified_sample(shapes, sample, seed=seed)
        config = TimingConfig(model=model, tiny=tiny, device=device, hardware=hardware,
                              calibration=str(calibration) if calibration else None, warmup=warmup,
                              repeats=repeats, seed=seed)
        result = run_timing(shapes, config, holdout=holdout)
    except (ScheduleError, ProfileError, CalibrationFitError) as exc:
        raise UsageError(str(exc)) from None
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
