"""`agentspec-sim calibrate …`: fit model parameters from measurements (`calibrate acceptance`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import UsageError

calibrate_app = typer.Typer(name="calibrate", help="Fit simulator parameters from measurements.",
                            no_args_is_help=True)
app.add_typer(calibrate_app, name="calibrate")


@calibrate_app.command("acceptance")
def acceptance(
    file: Path = typer.Argument(..., help="vLLM per-request spec_decode_metrics JSONL ({\"per_step_drafted\": […], "
                                "\"per_step_accepted\": […]} per request, optional id / category), or a Spec-Bench "
                                "model_answer JSONL (accept_lengths per turn).", show_default=False),
    method: str = typer.Option("eagle3", "--method", help="The model-based drafter the parameters are for "
                               "(eagle3 or mtp)."),
    model: str = typer.Option("custom", "--model", help="Target model name written into the parameter file."),
    k: int | None = typer.Option(None, "--k", help="Draft positions to fit (default: the most drafted in a step)."),
    train_categories: str | None = typer.Option(None, "--train-categories", help="Comma-separated categories to fit "
                                                "on; the others are held out and only evaluated."),
    features: Path | None = typer.Option(None, "--features", help="The trace whose calls produced the metrics "
                                         "(requests matched by call id); default: the bundled spec-bench trace for "
                                         "Spec-Bench files, else the MT-Bench reference stream."),
    coefficients_from: Path | None = typer.Option(None, "--coefficients-from", help="Hold the feature coefficients "
                                                  "at those of this parameter file (default: fit them when requests "
                                                  "match trace calls, else the method's bundled default)."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the parameter JSON (atomically).",
                                show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print the fit report as JSON instead of a table."),
) -> None:
    """Fit the acceptance model's per-position intercepts (and feature coefficients) by maximum likelihood
    on per-step accepted lengths; report observed vs fitted acceptance per category."""
    from agentspec_sim.atomic import atomic_text
    from agentspec_sim.calibrate_acceptance import CalibrationError, calibrate_file
    from agentspec_sim.drafters.base import SpecConfigError, drafter_class
    from agentspec_sim.drafters.model_based import ModelBasedDrafter, load_params_file

    try:
        if not issubclass(drafter_class(method), ModelBasedDrafter):
            raise UsageError(f"--method {method}: not a model-based drafter (eagle3, mtp)")
    except SpecConfigError as exc:
        raise UsageError(f"--method: {exc}") from None
    if k is not None and k < 1:
        raise UsageError("--k must be ≥ 1")
    if not file.is_file():
        raise FileNotFoundError(2, "no such file", str(file))
    workload = None
    if features is not None:
        from agentspec_sim.trace.io import load_trace

        workload = load_trace(features)
    coefficients = None
    if coefficients_from is not None:
        try:
            coefficients = dict(load_params_file(coefficients_from).coefficients)
        except ValueError as exc:
            raise UsageError(f"--coefficients-from: {exc}") from None
    train = [c.strip() for c in train_categories.split(",") if c.strip()] if train_categories else None
    try:
        result, rows = calibrate_file(file, method=method, model=model, k=k, train_categories=train,
                                      features=workload, coefficients=coefficients)
    except (CalibrationError, json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
        raise UsageError(f"{file}: {exc}") from None
    document = result.params.to_json()
    document["calibration"]["report"] = [r.to_json() for r in rows]
    with atomic_text(output) as out:
        out.write(json.dumps(document, indent=2) + "\n")
    if as_json:
        typer.echo(json.dumps({"output": str(output), "params": result.params.to_json(),
                               "report": [r.to_json() for r in rows]}, indent=2))
        return
    _render(file, output, result, rows)


def _render(file: Path, output: Path, result, rows) -> None:
    console = Console()
    p = result.params
    coef = ", ".join(f"{name} {value:+.3f}" for name, value in sorted(p.coefficients.items()))
    console.print(f"{p.method} · {p.model}: a = [{', '.join(f'{a:+.3f}' for a in p.positions)}]; {coef} "
                  f"({result.num_steps:,} steps; free: {', '.join(result.fitted)})")
    table = Table(title=f"acceptance per draft position (P(≥ i+1 accepted) per draft), {file.name}")
    for col in ("category", "split", "steps", "acc. len obs", "fit", "max |err|", "observed", "fitted"):
        table.add_column(col, justify="left" if col in ("category", "split", "observed", "fitted") else "right",
                         no_wrap=col in ("observed", "fitted"))
    for r in rows:
        table.add_row(escape(r.group), r.split, f"{r.steps:,}", f"{r.observed_length:.2f}", f"{r.predicted_length:.2f}",
                      f"{r.max_abs_error:.3f}", _rates(r.observed), _rates(r.predicted))
    console.print(table)
    console.print(f"wrote {output}")


def _rates(values) -> str:
    return " ".join(f"{x:.2f}".removeprefix("0") for x in values)
