"""Turning expected failures into one clear line and an exit code.

Exit codes: 2 bad input (a TraceError, ConvertError, UsageError, a resource guard's ResourceError with
the settings it names written as options, a file that cannot be read or written…), 130 interrupted by
Ctrl-C (SIGINT), 143 terminated (SIGTERM). `--debug` (or AGENTSPEC_SIM_DEBUG=1) prints the traceback
instead of the one line.

Signals: `run_guarded` turns SIGINT and SIGTERM into `Interrupted` (a KeyboardInterrupt), raised
wherever the program is, so every `finally` and every atomic write (agentspec_sim/io/atomic.py)
removes its temporary file; a command may catch it to write what is complete and re-raise it
with a `note` saying what it wrote. Further signals are ignored while that cleanup runs.

Outputs: each command runs in an output scope (agentspec_sim/io/outputs.py), so an output that would
destroy an input, or that cannot be written, is one line naming the file and its option. Standard
output is guarded the same way: a write or flush that fails (a full disk, an I/O error) is one line
`error: standard output: <reason>`, exit 2; a closed pipe (`| head`) ends the command quietly with
exit code 1, as Python's documentation advises (signal module, "Note on SIGPIPE") and as rich does for
the tables it prints. Either way fd 1 is then pointed at /dev/null, so the interpreter's last flush
does not fail again.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import sys
import traceback
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STDOUT = "standard output"  # the file name an OSError from writing sys.stdout carries


class UsageError(ValueError):
    """A bad command-line value the library cannot catch itself (names the option)."""


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM delivered while a command ran; `note` says what was written before exiting."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.note: str | None = None


def _expected_errors() -> tuple[type[BaseException], ...]:
    from agentspec_sim.host.env import EnvironmentSettingError
    from agentspec_sim.host.resources import ResourceError
    from agentspec_sim.trace.convert.base import ConvertError
    from agentspec_sim.trace.schema import TraceError

    return (TraceError, ConvertError, UsageError, EnvironmentSettingError, ResourceError, FileNotFoundError,
            IsADirectoryError, NotADirectoryError, PermissionError)


def _is_expected(exc: BaseException) -> bool:
    # Any OSError about a named file (disk full, read-only file system…) is the user's to fix; so is a file
    # that is not text where text was expected (a command that reads it should name the file itself).
    return (isinstance(exc, (*_expected_errors(), UnicodeDecodeError))
            or (isinstance(exc, OSError) and exc.filename is not None))


def debug_enabled() -> bool:
    return "--debug" in sys.argv or os.environ.get("AGENTSPEC_SIM_DEBUG") == "1"


class _Signals:
    """The handler SIGINT and SIGTERM get inside `interrupt_signals`; keeps the `Interrupted` it raised,
    since Typer turns a KeyboardInterrupt into a plain exit code 130 and drops the exception."""

    def __init__(self) -> None:
        self.raised: Interrupted | None = None

    def __call__(self, signum: int, frame: object) -> None:
        # Once: the cleanup that follows (atomic writes, partial results) must not be cut short.
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        self.raised = Interrupted(signum)
        raise self.raised


@contextlib.contextmanager
def interrupt_signals() -> Iterator[_Signals]:
    """Within the block SIGINT and SIGTERM raise `Interrupted`; the previous handlers come back after.
    Outside the main thread (only it may set handlers) nothing is installed."""
    handler = _Signals()
    try:
        previous = {sig: signal.signal(sig, handler) for sig in HANDLED_SIGNALS}
    except ValueError:  # not the main thread
        yield handler
        return
    try:
        yield handler
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_code_for_signal(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class _GuardedStdout:
    """sys.stdout while a command runs: an OSError writing or flushing it is raised again with the file
    name `STDOUT`, so that it is reported as standard output's (rich and click write through this)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, STDOUT) from exc  # EPIPE makes a BrokenPipeError

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, STDOUT) from exc

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _ClosedStdout(io.TextIOBase):
    """Standard output when fd 1 was closed before the start (`>&-`): writing fails as it would on the
    descriptor (EBADF), so a command that has something to print says it could not, as `ls >&-` does."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


@contextlib.contextmanager
def _guarded_stdout() -> Iterator[None]:
    original = sys.stdout
    sys.stdout = _GuardedStdout(original if original is not None else _ClosedStdout())  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = original


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so what is still buffered, and the interpreter's flush at exit, go nowhere."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


def _stdout_failed(exc: OSError) -> int:
    _silence_stdout()
    if isinstance(exc, BrokenPipeError):  # the reader went away (`| head`): not an error to report
        return 1
    if debug_enabled():
        traceback.print_exc()
    stderr.print(f"[bold red]error:[/] {escape(_message(exc))}", markup=True)
    return 2


def run_guarded(app: typer.Typer) -> int:
    """Run the Typer app: expected failures print `error: …` and return 2; SIGINT/SIGTERM print one line
    (with what the command wrote before exiting) and return 130/143; a failing standard output is one
    line and 2, a closed pipe 1 and quiet (see the module docstring)."""
    from agentspec_sim.io.outputs import command_scope

    args = [a for a in sys.argv[1:] if a != "--debug"]
    interrupt: BaseException | None = None
    try:
        with interrupt_signals() as signals, _guarded_stdout(), command_scope():
            code = _run(app, args)
            code = _flush_stdout(code)
        interrupt = signals.raised
    except KeyboardInterrupt as exc:  # raised outside the command (e.g. while loading the app)
        interrupt = exc
    if interrupt is None:
        return code
    signum = getattr(interrupt, "signum", signal.SIGINT)
    what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    note = getattr(interrupt, "note", None)
    stderr.print(f"{what}; {note}" if note else what, markup=False)
    return exit_code_for_signal(signum)


def _flush_stdout(code: int) -> int:
    """Flush standard output inside the guard: a failure to deliver the last of it is the command's too."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        if exc.filename != STDOUT:
            raise
        if code != 0:  # the command failed already and said so: keep its code
            _silence_stdout()
            return code
        return _stdout_failed(exc)
    return code


def _run(app: typer.Typer, args: list[str]) -> int:
    try:
        # standalone_mode=False: click returns a command's typer.Exit code instead of raising it.
        code = app(args=args, prog_name="agentspec-sim", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except SystemExit as exc:  # rich ends a command this way when standard output's pipe closed (exit 1)
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        raise
    except MemoryError:
        if debug_enabled():
            traceback.print_exc()
        stderr.print("[bold red]error:[/] out of memory (the trace or run is too large for this machine)", markup=True)
        return 2
    except Exception as exc:
        if isinstance(exc, OSError) and exc.filename == STDOUT:
            return _stdout_failed(exc)
        if _is_expected(exc):
            if debug_enabled():
                traceback.print_exc()
            stderr.print(f"[bold red]error:[/] {escape(_message(exc))}", markup=True)
            return 2
        usage, abort = _click_exceptions()
        if isinstance(exc, usage):  # a bad option value, an unknown option…: click's own message
            exc.show()
            return exc.exit_code
        if isinstance(exc, abort):
            stderr.print("aborted")
            return 130
        raise
    return code if isinstance(code, int) else 0


def _click_exceptions() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(usage errors, aborts) of click and of the copy of click that Typer ≥ 0.20 vendors as typer._click."""
    usage: list[type[BaseException]] = []
    abort: list[type[BaseException]] = [typer.Abort]
    with contextlib.suppress(ImportError):
        import click

        usage.append(click.exceptions.ClickException)
        abort.append(click.exceptions.Abort)
    with contextlib.suppress(ImportError):
        from typer._click.exceptions import ClickException  # type: ignore[import-not-found]

        usage.append(ClickException)
    return tuple(usage), tuple(abort)


# Library keywords whose option is spelled otherwise (run_sweep's lists are singular options).
_OPTION_OF = {"drafters": "--drafter", "models": "--model", "speculative_configs": "--speculative-config",
              "num_speculative_tokens": "--speculative-config num_speculative_tokens"}


def option_name(knob: str) -> str:
    """The command-line option of a library keyword / config field: `max_num_seqs` → `--max-num-seqs`."""
    return _OPTION_OF.get(knob, "--" + knob.replace("_", "-"))


def _message(exc: BaseException) -> str:
    from agentspec_sim.host.resources import ResourceError

    if isinstance(exc, ResourceError):  # a resource guard (agentspec_sim/host/resources.py): settings as options
        return exc.render(option_name)
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, UnicodeDecodeError):
        return f"an input file is not {exc.encoding.upper()} text ({exc.reason} at byte {exc.start})"
    return str(exc)
