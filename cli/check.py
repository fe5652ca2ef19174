"""`agentspec-sim check [TRACE]… --baseline FILE`: re-run a baseline's configurations; exit 1 on a regression."""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from agentspec_sim.cli.common import caption_below
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app

_DEFAULT_DRAFTERS = "ngram,suffix,agentspec"
_DEFAULT_SIZES = "4,64"


@app.command()
def check(
    traces: list[Path] | None = typer.Argument(None, metavar="[TRACE]...", help="Traces to check (matched to the "
                                               "baseline's by content hash; default: the traces it records)."),
    baseline: Path = typer.Option(Path("reports/baseline.json"), "--baseline", help="Baseline file (JSON)."),
    tolerance: float = typer.Option(0.01, "--tolerance", help="Largest allowed rise of the rejection rate, absolute "
                                    "(0.01 = one percentage point)."),
    rejection: str = typer.Option("call", "--rejection", metavar="call|token", help="Which rejection rate gates: "
                                  "call (the paper's: the mean over calls of rejected / drafted; what every baseline "
                                  "records) or token (rejected / drafted tokens = 1 − vLLM's draft acceptance rate; "
                                  "baselines recorded before it need --update)."),
    goodput_tolerance: float = typer.Option(0.02, "--goodput-tolerance", help="Largest allowed relative fall of "
                                            "goodput or speedup (0.02 = 2%)."),
    update: bool = typer.Option(False, "--update", help="Re-measure and rewrite the baseline (creates it if absent)."),
    junit: Path | None = typer.Option(None, "--junit", help="Also write the result as JUnit XML (.xml, for CI "
                                        "systems)."),
    drafter: str | None = typer.Option(None, "--drafter", help="With --update: drafters to record (comma-separated "
                                       f"names or JSON; default: the baseline's, else {_DEFAULT_DRAFTERS})."),
    max_num_seqs: str | None = typer.Option(None, "--max-num-seqs", help="With --update: max batch sizes to record "
                                            f"(comma-separated; default: the baseline's, else {_DEFAULT_SIZES})."),
    hardware: str | None = typer.Option(None, "--hardware", help="With --update: hardware profile to record."),
    model: str | None = typer.Option(None, "--model", help="With --update: model profile to record."),
) -> None:
    """Fail (exit 1) when a drafter's rejection rate rises or its goodput/speedup falls past the tolerances."""
    from agentspec_sim.report import check as lib

    if tolerance < 0 or goodput_tolerance < 0:
        raise UsageError("--tolerance and --goodput-tolerance must be ≥ 0")
    if rejection not in lib.REJECTION:
        raise UsageError(f"--rejection: expected {' or '.join(lib.REJECTION)}, got {rejection!r}")
    if not update:
        for name, value in (("--drafter", drafter), ("--max-num-seqs", max_num_seqs), ("--hardware", hardware),
                            ("--model", model)):
            if value is not None:
                raise UsageError(f"{name} applies only with --update (check re-runs what the baseline records)")
    _check_outputs(baseline, junit, traces or [], update)
    console = Console()
    err = Console(stderr=True)
    try:
        if update:
            # One writer at a time: a second `check --update` of the same baseline is refused while this one
            # reads, re-measures and rewrites it (two at once would both report success and lose one update).
            with _sole_writer(baseline):
                old, new = _update(lib, baseline, traces or [], drafter, max_num_seqs, hardware, model, err)
                # An old baseline without the token-level rate is diffed by the call-mean one it does record.
                shown = rejection if old is None or all(lib.REJECTION[rejection] in c for c in old.cells) else "call"
                result = lib.compare_cells(old.cells if old else [], new.cells, tolerance, goodput_tolerance,
                                           rejection=shown)
                if old is not None:
                    _render(console, result, updating=True)
                lib.save_baseline(new, baseline)
            if junit is not None:
                lib.write_junit(lib.compare_cells(new.cells, new.cells, tolerance, goodput_tolerance,
                                                  rejection=rejection), junit)
            console.print(f"wrote {baseline}: {len(new.cells)} cells ({len(new.traces)} trace(s) × "
                          f"{len(new.max_num_seqs)} max batch size(s) × {len(new.drafters) + 1} drafters)")
            return
        recorded = lib.load_baseline(baseline)
        lib.require_rejection(recorded, baseline, rejection)
        pairs = lib.resolve_traces(recorded, baseline, traces or [])
        err.print(f"check: re-running {len(recorded.drafters) + 1} drafters × {len(recorded.max_num_seqs)} max "
                  f"batch size(s) on {len(pairs)} trace(s)…")
        from agentspec_sim.cli.common import say_if_compiling

        say_if_compiling()
        try:
            current = lib.measure(recorded, pairs)
        except ValueError as exc:  # a profile or calibration the recorded engine names that does not load or fit
            if type(exc).__name__ != "ProfileError":
                raise
            raise UsageError(f"{baseline}: engine: {exc}") from None
        result = lib.compare_cells(recorded.cells, current, tolerance, goodput_tolerance,
                                   only_traces=[r.path for r, _ in pairs], rejection=rejection)
    except lib.BaselineError as exc:
        raise UsageError(str(exc)) from None
    _render(console, result)
    if junit is not None:
        lib.write_junit(result, junit)
    if result.failed:
        console.print(f"[bold red]regression[/]: {len(result.failed)} of {len(result.diffs)} cells "
                      f"(tolerances: {lib.REJECTION_LABEL[rejection]} +{tolerance * 100:g} pp, goodput/speedup "
                      f"−{goodput_tolerance * 100:g}%)")
        raise typer.Exit(1)
    console.print(f"ok: {len(result.diffs)} cells within tolerance ({lib.REJECTION_LABEL[rejection]} "
                  f"+{tolerance * 100:g} pp, goodput/speedup −{goodput_tolerance * 100:g}%)")


def _sole_writer(baseline: Path):
    """The baseline's writer lock (`outputs.sole_writer`, `<baseline>.lock` beside the file a symlink points
    to); none for a device or FIFO, which is written through once."""
    import contextlib
    import os

    from agentspec_sim.io.outputs import is_special, sole_writer

    if is_special(baseline):
        return contextlib.nullcontext()
    real = Path(os.path.realpath(baseline))
    real.parent.mkdir(parents=True, exist_ok=True)  # as saving the baseline would (its lock goes beside it)
    return sole_writer(baseline, real.with_name(real.name + ".lock"))


def _check_outputs(baseline: Path, junit: Path | None, traces: list[Path], update: bool) -> None:
    """The output policy (agentspec_sim/io/outputs.py): --junit, and with --update the baseline, are none of the
    files the check reads. (--update rewrites the baseline it reads: that is its purpose.)"""
    from agentspec_sim.io.outputs import JSON_SUFFIXES, JUNIT_SUFFIXES, Output, check_outputs
    from agentspec_sim.trace.bundled import default_trace_path

    inputs: dict = {"TRACE": traces or ([default_trace_path()] if update else [])}
    if not update:
        inputs["--baseline"] = baseline
    check_outputs(Output("--baseline", baseline if update else None, JSON_SUFFIXES),
                  Output("--junit", junit, JUNIT_SUFFIXES), inputs=inputs)


def _update(lib, baseline: Path, traces: list[Path], drafter, max_num_seqs, hardware, model, err):
    from dataclasses import asdict

    from agentspec_sim.drafters.registry import parse_drafter_list
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.engine.drafting import SpecConfigError

    old = lib.load_baseline(baseline) if baseline.exists() else None
    if traces:
        paths = traces
    elif old is not None:
        paths = [baseline.parent / t.path for t in old.traces]
    else:
        from agentspec_sim.trace.bundled import default_trace_path

        paths = [default_trace_path()]
    try:
        if drafter is not None:
            specs = parse_drafter_list(drafter)
        elif old is not None:
            specs = lib.baseline_specs(old)
        else:
            specs = parse_drafter_list(_DEFAULT_DRAFTERS)
    except SpecConfigError as exc:
        raise UsageError(f"--drafter: {exc}") from None
    sizes = _sizes(max_num_seqs) if max_num_seqs is not None else (
        list(old.max_num_seqs) if old is not None else _sizes(_DEFAULT_SIZES))
    engine = dict(old.engine) if old is not None else {
        k: v for k, v in asdict(EngineConfig()).items() if k != "max_num_seqs"}
    engine.update({k: v for k, v in (("hardware", hardware), ("model", model)) if v is not None})
    err.print(f"check --update: measuring {len(specs) + 1} drafters × {len(sizes)} max batch size(s) on "
              f"{len(paths)} trace(s)…")
    try:
        new = lib.record_baseline(paths, baseline, specs, sizes, engine)
    except ValueError as exc:  # a bad hardware/model profile name
        if type(exc).__name__ != "ProfileError":
            raise
        raise UsageError(str(exc)) from None
    return old, new


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--max-num-seqs: comma-separated positive integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--max-num-seqs: comma-separated positive integers, got {text!r}")
    return sizes


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:{spec}}"


def _render(console: Console, result, updating: bool = False) -> None:
    from agentspec_sim.report.check import REJECTION

    metric = REJECTION[result.rejection]
    legend = {"call": "rej.call: the paper's rejection rate, the mean over calls of rejected / drafted (%)",
              "token": "rej.tok: rejected / drafted tokens = 1 − vLLM's draft acceptance rate (%)"}[result.rejection]
    # Current values with their change from the baseline: fits an 80-column terminal.
    table = Table(title="check: now vs baseline", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), caption=(
        f"{legend}, the one gated (--rejection {result.rejection}); Δpp vs baseline\n"
        "tok/s: goodput · Δ%: relative change"))
    header = "rej.call" if result.rejection == "call" else "rej.tok"
    for name, justify in (("trace", "left"), ("b", "right"), ("drafter", "left"), (header, "right"),
                          ("Δpp", "right"), ("tok/s", "right"), ("Δ%", "right"), ("speedup", "right"),
                          ("Δ%", "right"), ("status", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for d in result.diffs:
        b, c = d.baseline, d.current
        d_rej = (_num(c[metric] - b[metric], "+.2f", 100) if None not in (b[metric], c[metric]) else "—")
        style, status = {"REGRESSION": ("bold red", "FAIL"), "improved": ("green", "better")}.get(d.status, ("", "ok"))
        table.add_row(Path(d.trace).name.split(".")[0], str(d.max_num_seqs), d.drafter,
                      _num(c[metric], ".1f", 100), d_rej, _num(c["goodput_tok_s"], ",.0f"),
                      _rel(b["goodput_tok_s"], c["goodput_tok_s"]), _num(c["speedup"], ".3f"),
                      _rel(b["speedup"], c["speedup"]), f"[{style}]{status}[/]" if style else status)
    console.print(caption_below(table))
    for d in result.failed:
        console.print(f"  {d.trace} · max_num_seqs {d.max_num_seqs} · {d.drafter}: {'; '.join(d.regressions)}",
                      soft_wrap=True)
    for line in [] if updating else result.unexpected:
        console.print(f"  not in the baseline (run --update to record): {line}", soft_wrap=True)


def _rel(old: float | None, new: float | None) -> str:
    if old in (None, 0) or new is None:
        return "—"
    return f"{(new - old) / old * 100:+.2f}"
