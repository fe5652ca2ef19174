"""Turning expected failures into one clear line and an exit code (2: bad input; 130: interrupted)."""

from __future__ import annotations

import os
import sys
import traceback

import typer
from rich.console import Console

stderr = Console(stderr=True, highlight=False, soft_wrap=True)


class UsageError(ValueError):
    """A bad command-line value the library cannot catch itself (names the option)."""


def _expected_errors() -> tuple[type[BaseException], ...]:
    from agentspec_sim.trace.convert.base import ConvertError
    from agentspec_sim.trace.schema import TraceError

    return (TraceError, ConvertError, UsageError, FileNotFoundError, IsADirectoryError, PermissionError)


def debug_enabled() -> bool:
    return "--debug" in sys.argv or os.environ.get("AGENTSPEC_SIM_DEBUG") == "1"


def run_guarded(app: typer.Typer) -> int:
    """Run the Typer app; expected failures print `error: …` and return 2, Ctrl-C returns 130."""
    args = [a for a in sys.argv[1:] if a != "--debug"]
    try:
        app(args=args, prog_name="agentspec-sim", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except KeyboardInterrupt:
        stderr.print("interrupted")
        return 130
    except _expected_errors() as exc:
        if debug_enabled():
            traceback.print_exc()
        stderr.print(f"[bold red]error:[/] {_message(exc)}", markup=True)
        return 2
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            stderr.print("aborted")
            return 130
        raise
    return 0


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)
