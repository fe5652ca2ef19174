"""The `agentspec-sim` Typer app itself, which each command module adds its command to (cli/app.py loads
them all and runs it)."""

from __future__ import annotations

import typer

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
