"""Atomic output files: write to a temporary file beside the target, then rename.

A crash or an interrupt never leaves a half-written result under the target's name.
Compression follows the target's suffix (.gz, .xz, .zst). Which targets are replaced, which are
written through and which are refused is the output policy of agentspec_sim/io/outputs.py.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import lzma
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from agentspec_sim.io import outputs
from agentspec_sim.io.outputs import OutputError


def compression_of(path: str | Path) -> str | None:
    name = str(path)
    for suffix in (".gz", ".xz", ".zst"):
        if name.endswith(suffix):
            return suffix[1:]
    return None


def _compressing(raw: BinaryIO, kind: str | None) -> BinaryIO:
    if kind == "gz":
        # mtime=0 and no file name in the header: identical input gives byte-identical output (determinism).
        return gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=6)  # type: ignore[return-value]
    if kind == "xz":
        return lzma.LZMAFile(raw, mode="wb", preset=6)  # type: ignore[return-value]
    if kind == "zst":
        import zstandard

        return zstandard.ZstdCompressor(level=10).stream_writer(raw, closefd=False)  # type: ignore[return-value]
    return raw


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def remove_stale_temporaries(target: Path) -> int:
    """Remove the temporary files of `target` that writers killed mid-write (SIGKILL, power loss) left beside
    it — `.NAME.PID.<random suffix>.tmp` whose process PID no longer exists; a live writer's are kept. Returns
    how many it removed."""
    import glob

    removed = 0
    prefix = f".{target.name}."
    for leftover in target.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = leftover.name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            leftover.unlink()
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or a pid this system cannot signal: keep its file
    return True


class _Sink(io.RawIOBase):
    """The raw layer under every output stream: writes to a descriptor it does not hand out (no fileno(),
    so a library that would write to the descriptor itself, like polars, goes through `write`), and keeps
    the first OSError a write met, which such a library may report as an exception of its own (polars: a
    ComputeError). Once `discard` is set, writes are dropped: an abandoned stream closes quietly.
    `name` is the output's path as given (not the temporary file's)."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self.fd = fd
        self.name = name
        self.error: OSError | None = None
        self.discard = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        if self.discard:
            return len(data)
        try:
            return os.write(self.fd, data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def seekable(self) -> bool:
        try:
            os.lseek(self.fd, 0, os.SEEK_CUR)
        except OSError:
            return False
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self.fd, offset, whence)


def _mode_for(target: Path) -> int:
    """A replaced file keeps its permissions; a new one gets what the umask allows (mkstemp makes 0600)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _abandon(stream: BinaryIO, raw: io.BufferedWriter, sink: _Sink) -> None:
    """Close every layer without writing more and without an error (nothing left for the garbage collector)."""
    sink.discard = True
    for layer in (stream, raw):
        with contextlib.suppress(Exception):
            layer.close()


@contextlib.contextmanager
def atomic_binary(path: str | Path, compress: bool = True, sync: bool = True) -> Iterator[BinaryIO]:
    """A binary stream whose content appears at `path` only if the block completes.

    The output policy (agentspec_sim/io/outputs.py): a symlink is followed (the file it points to is replaced,
    the link stays); a device, FIFO or /dev/stdout is written through, never replaced; a declared input of
    the command is refused; an OSError while writing (also one a library reports as its own exception)
    becomes an `OutputError` naming `path`, after the temporary file is removed. `sync`: fsync the file
    before it replaces the target, so that a late I/O error is reported rather than lost (caches skip it).
    """
    given = Path(outputs.stdout_alias(path))
    outputs.check_writable(given)
    target = Path(os.path.realpath(given))
    outputs.refuse_input(given)
    through = outputs.is_special(given)
    tmp_name: str | None = None
    try:
        if through:
            fd = os.open(given, os.O_WRONLY | os.O_TRUNC)  # the device or FIFO itself (O_TRUNC is ignored there)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(target)
            # The writer's pid in the name: a later writer can tell a killed writer's leftover from a live one's.
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
            os.chmod(tmp_name, _mode_for(target))
    except OSError as exc:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
        raise outputs.write_error(given, exc) from exc
    sink = _Sink(fd, str(given))
    raw = io.BufferedWriter(sink)
    named = given if Path(given).suffix else target  # a symlink without a suffix: its target's format
    stream = _compressing(raw, compression_of(named) if compress else None)
    open_fd: int | None = fd
    try:
        yield stream
        if stream is not raw:
            stream.close()
        raw.flush()
        if sync and not through:
            os.fsync(fd)
        raw.close()
        open_fd = None
        os.close(fd)
        if tmp_name is not None:
            os.replace(tmp_name, target)
    except BaseException as exc:
        _abandon(stream, raw, sink)
        if open_fd is not None:
            with contextlib.suppress(OSError):
                os.close(open_fd)
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
        if isinstance(exc, Exception):
            error = sink.error or (exc if _ours(exc, tmp_name) else None)
            if error is not None:
                raise outputs.write_error(given, error, through) from exc
        raise


def _ours(exc: BaseException, tmp_name: str | None) -> bool:
    """An OSError of the write itself (no file name, or the temporary file's), not one about another file
    the block happened to open."""
    return (isinstance(exc, OSError) and not isinstance(exc, OutputError)
            and exc.filename in (None, tmp_name))


@contextlib.contextmanager
def atomic_text(path: str | Path) -> Iterator[io.TextIOWrapper]:
    """A UTF-8 text stream (newline '\\n') written atomically, compressed by suffix."""
    with atomic_binary(path) as binary:
        text = io.TextIOWrapper(binary, encoding="utf-8", newline="\n")  # type: ignore[arg-type]
        yield text
        text.flush()
        text.detach()


def write_bytes_atomic(path: str | Path, data: bytes, sync: bool = True) -> None:
    with atomic_binary(path, compress=False, sync=sync) as out:
        out.write(data)


def write_json_atomic(path: str | Path, value: object) -> None:
    """`value` as indented JSON text (with a final newline), written atomically."""
    with atomic_text(path) as out:
        out.write(json.dumps(value, indent=2) + "\n")
