"""Run the validation from a source tree, without installing the project and without polars.

    python validation/launch.py gpu-check [--quick] [--out DIR]
    python validation/launch.py timing SCHEDULE_OR_STEPLOG [--model qwen3-8b] [--out DIR] [--steps N]
    python validation/launch.py calibrate STEPLOG --hardware H --model M -o calibration.json

`bootstrap()` maps the checkout's folders onto the `agentspec_sim` package (agentspec_sim/ as the
package, validation/ as agentspec_sim.validation) without running agentspec_sim/__init__.py, so only
what the validation imports gets loaded: numpy, scipy, torch, matplotlib and pyarrow (or polars when
present), never the simulator engine. validation/gpu_check.sh calls this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bootstrap(root: Path = ROOT) -> None:
    """Make `agentspec_sim` and `agentspec_sim.validation` importable from `root` (no-op once imported)."""
    if "agentspec_sim" in sys.modules:
        return
    package = types.ModuleType("agentspec_sim")
    package.__path__ = [str(root / "agentspec_sim")]
    package.__file__ = str(root / "agentspec_sim" / "__init__.py")
    sys.modules["agentspec_sim"] = package
    spec = importlib.util.spec_from_file_location("agentspec_sim.validation", root / "validation" / "__init__.py",
                                                  submodule_search_locations=[str(root / "validation")])
    validation = importlib.util.module_from_spec(spec)
    sys.modules["agentspec_sim.validation"] = validation
    spec.loader.exec_module(validation)
    package.validation = validation


def _timing_config(args: argparse.Namespace):
    from agentspec_sim.validation.timing import TimingConfig

    return TimingConfig(model=getattr(args, "model", "qwen3-8b"), tiny=True if args.tiny else None, device=args.device,
                        hardware=args.hardware, calibration=args.calibration,
                        **({"repeats": args.repeats} if args.repeats else {}))


def main(argv: list[str] | None = None) -> int:
    bootstrap()
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("gpu-check", "timing"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=Path("validation-out"))
        p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        p.add_argument("--tiny", action="store_true", help="the tiny configuration (default on CPU)")
        p.add_argument("--hardware", default=None, help="hardware profile to predict with (default: this GPU's)")
        p.add_argument("--calibration", default=None, help="calibration file the predictions start from")
        p.add_argument("--steps", type=int, default=None, help="steps per schedule (stratified sample)")
        p.add_argument("--repeats", type=int, default=None, help="timed runs per step")
    check = sub.choices["gpu-check"]
    check.add_argument("--quick", action="store_true", help="16 steps per schedule, 3 repeats")
    check.add_argument("--model", dest="models", action="append", default=None,
                       help="model profile id (repeatable; default: qwen3-8b and gpt-oss-20b)")
    check.add_argument("--max-num-seqs", action="append", type=int, default=None, help="default: 1, 32, 256")
    timing = sub.choices["timing"]
    timing.add_argument("schedule", type=Path, help="schedule JSON(.gz) or step log (parquet/csv)")
    timing.add_argument("--model", default="qwen3-8b")
    timing.add_argument("--table-format", choices=("parquet", "csv"), default="parquet")
    cal = sub.add_parser("calibrate")
    cal.add_argument("steplog", type=Path)
    cal.add_argument("--hardware", required=True)
    cal.add_argument("--model", required=True)
    cal.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "gpu-check":
        from agentspec_sim.validation.gpu_check import MAX_NUM_SEQS, MODELS, format_table, run_gpu_check

        rows = run_gpu_check(args.out, quick=args.quick, models=tuple(args.models or MODELS),
                             max_num_seqs=tuple(args.max_num_seqs or MAX_NUM_SEQS), config=_timing_config(args),
                             steps=args.steps)
        print(format_table(rows))
        print(f"outputs under {args.out}")
        return 0
    if args.command == "timing":
        from agentspec_sim.validation.schedule import load_shapes, stratified_sample
        from agentspec_sim.validation.timing import run_timing, summary_dict, write_outputs

        shapes = load_shapes(args.schedule)
        if args.steps:
            shapes = stratified_sample(shapes, args.steps)
        result = run_timing(shapes, _timing_config(args))
        write_outputs(result, args.out, table_suffix=".csv" if args.table_format == "csv" else ".parquet")
        summary = summary_dict(result)
        print(f"{summary['model']}: {summary['steps']} steps, MAPE {summary['mape']:.1f}% → {args.out}")
        return 0
    from agentspec_sim.cost.calibrate import fit_calibration
    from agentspec_sim.cost.profiles import load_hardware, load_model, profile_name
    from agentspec_sim.validation.calibration_input import timings_from_table

    timings = timings_from_table(args.steplog)
    hw, model = load_hardware(args.hardware), load_model(args.model)
    fit = fit_calibration(timings, hw, model)  # refuses timings that record other hardware or another model
    # The names runs match their own profiles against (agentspec_sim.cost.profiles.check_calibration).
    fit.calibration.to_file(args.output, hardware=profile_name(hw), model=profile_name(model), fit=fit.to_dict())
    print(f"MAPE {fit.mape_before_train:.1f}% → {fit.mape_after_train:.1f}% (held out: "
          f"{fit.mape_before_holdout}→{fit.mape_after_holdout}); wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
