"""The `agentspec-sim` command line: one Typer app (cli/root.py), one small module per command.

Commands parse arguments, call the library and render with rich; no simulation logic lives here.
Bad input (a TraceError, ConvertError, UsageError…) becomes one line on stderr and exit code 2;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import sys

from agentspec_sim.cli.errors import run_guarded
from agentspec_sim.cli.root import app


def _register() -> None:
    # Each command module adds itself to `app`; imported here so `--help` lists them all.
    from agentspec_sim.cli import (  # noqa: F401
        analyze,
        bench,
        calibrate,
        check,
        convert,
        cost,
        inspect,
        plan,
        proxy,
        record,
        replay,
        report,
        sweep,
        synth,
        validate,
    )
    from agentspec_sim.cli.preflight import guard_commands

    guard_commands(app)  # every command: no NaN/inf option, valid AGENTSPEC_SIM_* numbers


_register()


def main() -> None:
    """Console-script entry point."""
    sys.exit(run_guarded(app))
