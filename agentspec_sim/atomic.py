"""Atomic output files: write to a temporary file beside the target, then rename.

A crash or an interrupt never leaves a half-written result under the target's name.
Compression follows the target's suffix (.gz, .xz, .zst).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import lzma
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def compression_of(path: str | Path) -> str | None:
    name = str(path)
    for suffix in (".gz", ".xz", ".zst"):
        if name.endswith(suffix):
            return suffix[1:]
    return None


def _compressing(raw: BinaryIO, kind: str | None) -> BinaryIO:
    if kind == "gz":
        # mtime=0: identical input gives byte-identical output (determinism).
        return gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6)  # type: ignore[return-value]
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


def check_writable(path: str | Path) -> None:
    """Raise the OSError a write to `path` would meet, before any work: the target is a directory, or
    a parent is a file. (Permissions and disk space are only known when writing.)"""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", str(target))
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a parent of this path is a file, not a directory",
                                         str(target))
            break


@contextlib.contextmanager
def atomic_binary(path: str | Path, compress: bool = True) -> Iterator[BinaryIO]:
    """A binary stream whose content appears at `path` only if the block completes."""
    target = Path(path)
    check_writable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes 0600; results should read like any file
    try:
        with os.fdopen(fd, "wb") as raw:
            stream = _compressing(raw, compression_of(target) if compress else None)
            yield stream
            if stream is not raw:
                stream.close()
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


@contextlib.contextmanager
def atomic_text(path: str | Path) -> Iterator[io.TextIOWrapper]:
    """A UTF-8 text stream (newline '\\n') written atomically, compressed by suffix."""
    with atomic_binary(path) as binary:
        text = io.TextIOWrapper(binary, encoding="utf-8", newline="\n")  # type: ignore[arg-type]
        yield text
        text.flush()
        text.detach()


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_binary(path, compress=False) as out:
        out.write(data)


def write_json_atomic(path: str | Path, value: object) -> None:
    """`value` as indented JSON text (with a final newline), written atomically."""
    with atomic_text(path) as out:
        out.write(json.dumps(value, indent=2) + "\n")
