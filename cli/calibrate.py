"""`agentspec-sim calibrate …`: fit model parameters from measurements (`calibrate acceptance`, `calibrate cost`,
`calibrate aic`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentspec_sim.cli.common import caption_below
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app
from agentspec_sim.io.outputs import JSON_SUFFIXES, Output, check_outputs

calibrate_app = typer.Typer(name="calibrate", help="Fit simulator parameters from measurements.",
                            no_args_is_help=True)
app.add_typer(calibrate_app, name="calibrate")


@calibrate_app.command("acceptance")
def acceptance(
    files: list[Path] = typer.Argument(..., help="vLLM per-request spec_decode_metrics JSONL ({\"per_step_drafted\": "
                                       "[…], \"per_step_accepted\": […]} per request, optional id / category), a "
                                       "Spec-Bench model_answer JSONL (accept_lengths per turn), or one or more "
                                       "SpecDecode-Bench request files (prompt/generated token ids and acc_<proposer>."
                                       "acc_len per output position; one dataset per file, named by the file).",
                                       show_default=False),
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
    no_features: bool = typer.Option(False, "--no-features", help="Hold every feature coefficient at 0: fit the "
                                     "per-position intercepts alone."),
    limit: int | None = typer.Option(None, "--limit", help="SpecDecode-Bench files: read only each file's first N "
                                     "requests."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the parameter file (.json, atomically).",
                                show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print the fit report as JSON instead of a table."),
) -> None:
    """Fit the acceptance model's per-position intercepts (and feature coefficients) by maximum likelihood
    on per-step accepted lengths; report observed vs fitted acceptance per category."""
    from agentspec_sim.drafters.model.calibrate import calibrate_file, calibrate_specdecode_bench
    from agentspec_sim.drafters.model.observations import CalibrationError, looks_like_specdecode_bench
    from agentspec_sim.drafters.model.rule import FEATURES, ModelBasedDrafter, load_params_file
    from agentspec_sim.drafters.registry import drafter_class
    from agentspec_sim.engine.drafting import SpecConfigError
    from agentspec_sim.io.atomic import write_json_atomic

    try:
        if not issubclass(drafter_class(method), ModelBasedDrafter):
            raise UsageError(f"--method {method}: not a model-based drafter (eagle3, mtp)")
    except SpecConfigError as exc:
        raise UsageError(f"--method: {exc}") from None
    if k is not None and k < 1:
        raise UsageError("--k must be ≥ 1")
    if limit is not None and limit < 1:
        raise UsageError("--limit must be ≥ 1")
    if no_features and coefficients_from is not None:
        raise UsageError("--no-features and --coefficients-from: give one")
    check_outputs(Output("--output", output, JSON_SUFFIXES),
                  inputs={**{f"FILE {i + 1}": f for i, f in enumerate(files)}, "--features": features,
                          "--coefficients-from": coefficients_from})
    for file in files:
        if not file.exists():
            raise FileNotFoundError(2, "no such file", str(file))
        if file.is_dir():
            raise IsADirectoryError(21, "is a directory, not a metrics file", str(file))
    file = files[0]
    specdecode = [looks_like_specdecode_bench(f) for f in files]
    if len(files) > 1 and not all(specdecode):
        bad = files[specdecode.index(False)] if False in specdecode else files[0]
        raise UsageError(f"{bad}: several FILEs must all be SpecDecode-Bench request files")
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
    if no_features:
        coefficients = dict.fromkeys(FEATURES, 0.0)
    train = [c.strip() for c in train_categories.split(",") if c.strip()] if train_categories else None
    try:
        if specdecode[0]:
            result, rows, _ = calibrate_specdecode_bench(files, method=method, model=model, k=k, train=train,
                                                         limit=limit, coefficients=coefficients)
        else:
            result, rows = calibrate_file(file, method=method, model=model, k=k, train_categories=train,
                                          features=workload, coefficients=coefficients)
    except (CalibrationError, json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
        message = str(exc)  # CalibrationError names the file (and line) itself
        raise UsageError(message if any(message.startswith(str(f)) for f in files) else f"{file}: {message}") \
            from None
    document = result.params.to_json()
    document["calibration"]["report"] = [r.to_json() for r in rows]
    write_json_atomic(output, document)
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
    console.print(caption_below(table))
    console.print(f"wrote {output}")


def _rates(values, shown: int = 8) -> str:
    text = " ".join(f"{x:.2f}".removeprefix("0") for x in values[:shown])
    return text + (" …" if len(values) > shown else "")


@calibrate_app.command("cost")
def cost(
    file: Path = typer.Argument(..., help="Measured step timings, one row per call per step (parquet or CSV): step, "
                                "phase, context_len, scheduled_tokens and measured_s (`validate timing`'s "
                                "timing_calls.parquet), forward_s (a step log or a vLLM export) or step_time_s "
                                "(minus draft_s when given).", show_default=False),
    hardware: str = typer.Option("a100-80g", "--hardware", help="Hardware profile the times were measured on (id or "
                                 "JSON, e.g. a timing run's hardware.json)."),
    model: str = typer.Option("qwen3-8b", "--model", help="Model profile (id, profile JSON or config.json, e.g. a "
                              "timing run's model.json)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="GPUs per model replica."),
    start: Path | None = typer.Option(None, "--calibration", help="Calibration to start from (and keep for the "
                                      "factors not fitted); default: the documented defaults."),
    time_column: str | None = typer.Option(None, "--time-column", help="measured_s, forward_s or step_time_s "
                                           "(default: the first present, in that order)."),
    drafter: str | None = typer.Option(None, "--drafter", help="Which run of a multi-run step log "
                                       "(default: the last)."),
    holdout: float = typer.Option(0.25, "--holdout", help="Share of steps held out of the fit and only evaluated."),
    seed: int = typer.Option(0, "--seed", help="Seed of the hold-out split."),
    output: Path = typer.Option(..., "--output", "-o", help="Calibration file to write (.json: what `replay "
                                "--calibration` reads).", show_default=False),
    allow_profile_mismatch: bool = typer.Option(False, "--allow-profile-mismatch", help="Fit timings that record "
                                                "other hardware or another model than --hardware / --model anyway "
                                                "(refused by default: the factors would describe neither)."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit report as JSON."),
) -> None:
    """Fit the cost model's efficiency factors and overheads (and the drafting cost, given draft_s) to measured
    step times by bounded least squares; report the error before/after on fitted and held-out steps."""
    from agentspec_sim.cost.calibrate import CalibrationFitError, ProfileMismatchError, fit_calibration
    from agentspec_sim.cost.profiles import ProfileError, load_hardware, load_model, profile_name
    from agentspec_sim.cost.roofline import Calibration
    from agentspec_sim.validation.calibration_input import timings_from_table
    from agentspec_sim.validation.schedule import ScheduleError

    if not 0 <= holdout < 1:
        raise UsageError("--holdout must be in [0, 1)")
    check_outputs(Output("--output", output, JSON_SUFFIXES),
                  inputs={"FILE": file, "--calibration": start, "--hardware": hardware, "--model": model})
    try:
        timings = timings_from_table(file, time_column, drafter)
        hw, m = load_hardware(hardware), load_model(model)
        begin = Calibration.from_file(start) if start else None
        fit = fit_calibration(timings, hw, m, start=begin, holdout=holdout, seed=seed,
                              tensor_parallel_size=tensor_parallel_size, source=f"calibrate cost {file.name}",
                              allow_profile_mismatch=allow_profile_mismatch)
    except ProfileMismatchError as exc:
        raise UsageError(f"{file}: {exc}, e.g. --hardware DIR/hardware.json --model DIR/model.json; or "
                         "--allow-profile-mismatch to fit them anyway") from None
    except (ScheduleError, ProfileError, CalibrationFitError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # e.g. heads that do not split over --tensor-parallel-size
        raise UsageError(str(exc)) from None
    # What the factors were fitted against, as names a run's profiles are matched with (not the paths given).
    fit.calibration.to_file(output, hardware=profile_name(hw), model=profile_name(m),
                            tensor_parallel_size=tensor_parallel_size, fit=fit.to_dict())
    if as_json:
        typer.echo(json.dumps({"output": str(output), **fit.to_dict()}, indent=2))
        return
    _render_cost(fit, output)


def _render_cost(fit, output: Path) -> None:
    console = Console()

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}%"

    table = Table(title="calibrate cost: step-time MAPE")
    for col in ("steps", "count", "before", "after"):
        table.add_column(col, justify="left" if col == "steps" else "right")
    table.add_row("fitted", str(fit.num_train), pct(fit.mape_before_train), pct(fit.mape_after_train))
    table.add_row("held out", str(fit.num_holdout), pct(fit.mape_before_holdout), pct(fit.mape_after_holdout))
    if fit.draft_mape_after is not None:
        table.add_row("drafting", "", pct(fit.draft_mape_before), pct(fit.draft_mape_after))
    console.print(caption_below(table))
    console.print("; ".join(f"{name} {getattr(fit.start, name):.4g} → {getattr(fit.calibration, name):.4g}"
                            for name in fit.fitted))
    console.print(f"wrote {output}")


@calibrate_app.command("aic")
def aic(
    hardware: str | None = typer.Option(None, "--hardware", help="Hardware profile id (any AIConfigurator system: "
                                        "a100-80g, h100-80g, h200, b200, b300, gb200, gb300, l40s, rtx-pro-6000)."),
    model: str | None = typer.Option(None, "--model", help="Model profile id."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="GPUs per model replica."),
    expert_parallel: bool = typer.Option(False, "--enable-expert-parallel", help="vLLM's expert parallelism "
                                         "(a MoE model's experts placed whole over the tensor-parallel GPUs)."),
    data_parallel_size: int = typer.Option(1, "--data-parallel-size", help="vLLM's data-parallel ranks (attention "
                                           "data parallelism for a MoE model: its experts over all ranks' GPUs)."),
    all_pairs: bool = typer.Option(False, "--all", help="Every bundled fit (`aic.bundled_fits`: what ships)."),
    out_dir: Path = typer.Option(..., "--out-dir", help="Folder for the calibration files (<hardware>--<model>.json, "
                                 "<hardware>--<model>--tp8-ep.json for a parallel layout; the bundled ones: "
                                 "agentspec_sim/cost/profiles/calibrations).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print each fit's error report as JSON."),
) -> None:
    """Fit the cost model to NVIDIA AIConfigurator's measured vLLM kernel tables (extra `aic`): price a grid of
    decode, verify, prefill and mixed steps, fit part by part, report the held-out error."""
    from agentspec_sim.cost.aic import AIC_PACKAGE, AIC_VERSION, AicUnavailable, aic_installed, bundled_fits
    from agentspec_sim.cost.aic_calibration import bundled_path, fit_to_aic, write_fit
    from agentspec_sim.cost.layout import Layout
    from agentspec_sim.cost.profiles import ProfileError, load_hardware, load_model

    if all_pairs == (hardware is not None or model is not None):
        raise UsageError("give either --all or --hardware and --model")
    if tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size: must be ≥ 1, got {tensor_parallel_size}")
    if data_parallel_size < 1:
        raise UsageError(f"--data-parallel-size: must be ≥ 1, got {data_parallel_size}")
    try:
        if all_pairs:
            pairs = bundled_fits()
        else:
            m = load_model(model or "")
            if data_parallel_size > 1 and not m.is_moe:
                raise UsageError(f"--data-parallel-size: {m.id} is dense; its data-parallel ranks are independent "
                                 "replicas, each priced as the tensor-parallel layout alone")
            layout = Layout(tensor_parallel_size, expert_parallel and m.is_moe, data_parallel_size)
            pairs = [(load_hardware(hardware or "").id, m.id, layout)]
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    if not aic_installed():
        raise UsageError(f"calibrate aic needs AIConfigurator: pip install '{AIC_PACKAGE}=={AIC_VERSION}' (or the "
                         "extra: pip install -e '.[aic]')")
    check_outputs(Output("--out-dir", out_dir, folder=True, names=tuple(bundled_path(h, m, Path(), layout).name
                                                                        for h, m, layout in pairs)))
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console()
    table = Table(title="calibrate aic: held-out |step time / AIConfigurator − 1|")
    for col in ("hardware", "model", "layout", "shapes", "before median", "before max", "after median", "after max"):
        table.add_column(col, justify="left" if col in ("hardware", "model", "layout") else "right")
    reports = []
    for h, m, layout in pairs:
        try:
            fit = fit_to_aic(h, m, layout)
        except (AicUnavailable, ValueError) as exc:  # ValueError: heads that do not split over the layout
            raise UsageError(f"{h} / {m} / {layout.flags() or 'one GPU'}: {exc}") from None
        path = write_fit(fit, out_dir)
        reports.append({"output": str(path), "hardware": h, "model": m,
                        "tensor_parallel_size": layout.tensor_parallel_size,
                        "expert_parallel": layout.expert_parallel, "data_parallel_size": layout.data_parallel_size,
                        **fit.record()["fit"]})
        table.add_row(h, m, layout.tag or "tp1", str(len(fit.held_idx)), f"{fit.before.median:.1%}",
                      f"{fit.before.max:.1%}", f"{fit.after.median:.1%}", f"{fit.after.max:.1%}")
    if as_json:
        typer.echo(json.dumps({"fits": reports}, indent=2))
        return
    console.print(caption_below(table))
    console.print(f"wrote {len(pairs)} file(s) to {escape(str(out_dir))}")
