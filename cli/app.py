"""The `agentspec-sim` command line: one Typer app, one small module per command.

Commands parse arguments, call the library and render with rich; no simulation logic lives here.
Bad input (a TraceError, ConvertError, UsageError…) becomes one line on stderr and exit code 2;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import sys

import typer

from agentspec_sim.cli.errors import run_guarded

app = typer.Typer(
    name="agentspec-sim",
    help="Trace-driven simulator of speculative decoding for batched LLM-agent serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"agentspec-sim {version('agentspec-sim')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("agentspec-sim (not installed: no version recorded)")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the installed version and exit.")) -> None:
    """Trace-driven simulator of speculative decoding for batched LLM-agent serving."""


def _register() -> None:
    # Each command module adds itself to `app`; imported here so `--help` lists them all.
    from agentspec_sim.cli import (  # noqa: F401
        analyze,
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
