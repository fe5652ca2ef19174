"""The output policy: no output ever destroys a file.

Every command names its outputs and its inputs to `check_outputs` before any work; the atomic writer
(agentspec_sim/io/atomic.py) applies the same policy while it writes. A refusal or a failed write is an
`OutputError`: one line `<target>: <option>: what is wrong`, exit code 2 from the command line.

Before the work (`check_outputs`), in this order:

1. kind — a file output that is a folder or lies under a file, a folder output that is a file: refused;
2. inputs — an output that resolves to an input of the same command is refused, compared by real path
   (symlinks followed) and by (st_dev, st_ino) (a hard link); an existing file inside an input folder
   counts as an input (the command reads that folder); for a folder output, the files the command
   writes into it (`Output.names`, glob patterns) are compared, not the folder;
3. outputs — two outputs of one command that resolve to the same file: refused;
4. suffix — a name ending the writer does not honour is refused, naming the ones it takes (a device,
   a FIFO or /dev/stdout has no suffix to honour: the writer's default format goes to it);
5. folder — the nearest existing folder above the target must be one this process may write in
   (os.access), and a device or FIFO target must be writable itself.

While writing (agentspec_sim.io.atomic): a symlink is followed (the file it points to is replaced atomically;
the link stays); a target that exists and is not a regular file (a character or block device, a FIFO,
/dev/stdout and the other names of an open descriptor) is opened and written through, never replaced;
an OSError while writing becomes an `OutputError` naming the target and its option — never the temporary
file, which is removed.

`command_scope` (the command line enters one around every command) keeps what `check_outputs` was told
for the rest of the command: the writer then refuses to replace a declared input even when it learns
the target only while writing (the files of a folder output), and names the option in its errors.

`sole_writer` makes an output one process's at a time (a sweep and its journal): a second writer is
refused at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fnmatch
import json
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PathLike = str | os.PathLike
InputValue = PathLike | Iterable[PathLike] | None

# Name endings each writer honours (its format, and the compression io/atomic.py applies by suffix).
TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.zst")
JSON_SUFFIXES = (".json",)  # files the simulator reads back (calibration, parameters, caps, baseline): plain
JSON_DOCUMENT_SUFFIXES = (".json", ".json.gz", ".json.xz", ".json.zst")  # documents for people and tools
PARQUET_SUFFIXES = (".parquet",)
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
JUNIT_SUFFIXES = (".xml",)


class OutputError(OSError):
    """An output that must not or cannot be written. `str()` is the one line: `<target>: <message>`."""

    def __init__(self, target: PathLike, message: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, message, os.fspath(target))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


@dataclass(frozen=True)
class Output:
    """One output of a command: its option (for messages), its path (None: not asked for), the name endings
    its writer honours (empty: any), and for a folder the glob patterns of the files written into it."""

    flag: str
    path: PathLike | None
    suffixes: tuple[str, ...] = ()
    folder: bool = False
    names: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        """The path as a string (only for an output that was asked for); `-` is standard output."""
        assert self.path is not None
        return stdout_alias(self.path)


def stdout_alias(path: PathLike) -> str:
    """`path` as a string, with `-` (the usual name for standard output) as /dev/stdout, which every writer
    writes through like any device (never replaced)."""
    text = os.fspath(path)
    return "/dev/stdout" if text == "-" else text


@dataclass(frozen=True)
class _Identity:
    """What a path is on disk: its real path, and (st_dev, st_ino) when it exists."""

    real: str
    inode: tuple[int, int] | None
    is_dir: bool

    @classmethod
    def of(cls, path: PathLike) -> _Identity:
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except (OSError, ValueError):
            return cls(real, None, False)
        return cls(real, (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode))

    def same(self, other: _Identity) -> bool:
        return self.real == other.real or (self.inode is not None and self.inode == other.inode)

    def inside(self, folder: _Identity) -> bool:
        return folder.is_dir and self.real.startswith(folder.real.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class _Input:
    label: str
    path: str
    identity: _Identity


@dataclass
class _Scope:
    inputs: list[_Input] = field(default_factory=list)
    flags: dict[str, str] = field(default_factory=dict)  # real path of a file output → its option
    folders: dict[str, str] = field(default_factory=dict)  # real path of a folder output → its option


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("agentspec_sim_outputs", default=None)


@contextlib.contextmanager
def command_scope() -> Iterator[None]:
    """Within the block, what `check_outputs` is told holds for every write (see the module docstring)."""
    token = _SCOPE.set(_Scope())
    try:
        yield
    finally:
        _SCOPE.reset(token)


def json_paths(texts: Iterable[str]) -> list[str]:
    """The string values of JSON option texts (a --speculative-config) that name existing files: inputs too."""
    found: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, str):
            if value and os.path.isfile(value):
                found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for text in texts:
        with contextlib.suppress(ValueError, RecursionError):
            walk(json.loads(text))
    return found


def _flatten(inputs: Mapping[str, InputValue]) -> list[_Input]:
    """The inputs that exist (one that does not cannot be overwritten; its command fails on reading it)."""
    out = []
    for label, value in inputs.items():
        if value is None:
            continue
        values = [value] if isinstance(value, str | os.PathLike) else list(value)
        for item in values:
            if item is None or not os.fspath(item):
                continue
            identity = _Identity.of(item)
            if identity.inode is not None:
                out.append(_Input(label, os.fspath(item), identity))
    return out


def _as_input(target: _Identity, inputs: Iterable[_Input]) -> _Input | None:
    """The input `target` would overwrite: the same file, or an existing file inside an input folder."""
    for item in inputs:
        if target.same(item.identity) or (target.inode is not None and target.inside(item.identity)):
            return item
    return None


def _refusal(path: PathLike, flag: str | None, item: _Input) -> OutputError:
    where = "is" if _Identity.of(path).same(item.identity) else "is inside"
    shown = "" if os.path.abspath(path) == os.path.abspath(item.path) else f" {item.path}"
    return OutputError(path, f"{_lead(flag)}{where} the input {item.label}{shown}; writing it would destroy it: "
                             "choose another output")


def _lead(flag: str | None) -> str:
    return f"{flag}: " if flag else ""


def is_special(path: PathLike) -> bool:
    """Whether writing `path` goes through the file itself instead of replacing it: an existing non-regular
    file (device, FIFO, socket), or a name that passes through /proc (/dev/stdout, /dev/fd/N: an open
    descriptor of this process)."""
    if _through_proc(path):
        return True
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _through_proc(path: PathLike) -> bool:
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a chain of symlinks
        if os.path.realpath(os.path.dirname(current)).startswith("/proc/") or current.startswith("/proc/"):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    return False


def _suffix_shown(name: str) -> str:
    return "".join(Path(name).suffixes[-2:]) or "no suffix"


def _check_suffix(out: Output) -> None:
    name = Path(out.target).name
    # A symlink named without a suffix writes the file it points to, in that file's format (io/atomic.py).
    named = [name] if Path(name).suffix or not os.path.islink(out.target) else [Path(os.path.realpath(out.target)).name]
    if not out.suffixes or any(n.endswith(s) for n in named for s in out.suffixes) or is_special(out.target):
        return
    choices = ", ".join(out.suffixes[:-1]) + (" or " if len(out.suffixes) > 1 else "") + out.suffixes[-1]
    raise OutputError(out.target, f"{out.flag}: '{_suffix_shown(named[0])}' is not a format {out.flag} writes; "
                                  f"name it {choices}")


def _check_folder(out: Output) -> None:
    """The folder the output goes in (the real one, for a symlink) must be writable; so must a special file."""
    path = out.target
    if is_special(path):
        if not os.access(path, os.W_OK):
            raise OutputError(path, f"{out.flag}: permission denied", errno.EACCES)
        return
    real = Path(os.path.realpath(path))
    folder = real if out.folder else real.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        read_only = False
        with contextlib.suppress(OSError):
            read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        reason, code = ("a read-only file system", errno.EROFS) if read_only else ("permission denied", errno.EACCES)
        raise OutputError(path, f"{out.flag}: cannot write in {folder} ({reason}): choose another folder", code)


def _check_kind(out: Output) -> None:
    path = Path(out.target)
    if not out.folder:
        check_writable(path)
        return
    if path.exists() and not path.is_dir():
        raise OutputError(path, f"{out.flag}: exists and is not a folder ({out.flag} names the output folder)",
                          errno.ENOTDIR)
    if parent_is_a_file(path):
        raise OutputError(path, f"{out.flag}: a parent of this path is a file, not a folder", errno.ENOTDIR)


def _folder_files(out: Output) -> list[Path]:
    """The existing files of a folder output that the command would replace (those its `names` match)."""
    folder = Path(out.target)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if any(fnmatch.fnmatch(p.name, pattern) for pattern in out.names))


def check_outputs(*outputs: Output, inputs: Mapping[str, InputValue] | None = None) -> None:
    """Refuse, before any work, every output that could not be written or would destroy a file (the module
    docstring's steps 1–5); `inputs` maps a label for messages (an argument or option name) to the paths
    the command reads. Within a `command_scope` the inputs and options are kept for the writer."""
    given = [out for out in outputs if out.path is not None and os.fspath(out.path)]
    declared = _flatten(inputs or {})
    for out in given:
        _check_kind(out)
    for out in given:
        targets = _folder_files(out) if out.folder else [Path(out.target)]
        for target in targets:
            item = _as_input(_Identity.of(target), declared)
            if item is not None:
                raise _refusal(target, out.flag, item)
    files = [(out, _Identity.of(out.target)) for out in given if not out.folder]
    for i, (first, one) in enumerate(files):
        for second, other in files[i + 1:]:
            if one.same(other):
                raise OutputError(first.target, f"{first.flag} and {second.flag} name the same file; give each "
                                                "its own")
    for out in given:
        if not out.folder:
            _check_suffix(out)
        _check_folder(out)
    scope = _SCOPE.get()
    if scope is not None:
        scope.inputs.extend(declared)
        for out in given:
            # setdefault: the command's own option name wins over a library's second check of the same path
            (scope.folders if out.folder else scope.flags).setdefault(os.path.realpath(out.target), out.flag)


def flag_of(path: PathLike) -> str | None:
    """The option that named this output (or the folder output it is written into), within a command."""
    scope = _SCOPE.get()
    if scope is None:
        return None
    real = os.path.realpath(path)
    return scope.flags.get(real) or scope.folders.get(os.path.dirname(real))


def refuse_input(path: PathLike) -> None:
    """Raise the OutputError `check_outputs` would if `path` is (or is inside) an input declared in this
    command: the writer's last check, for targets known only while writing."""
    scope = _SCOPE.get()
    if scope is None or not scope.inputs:
        return
    item = _as_input(_Identity.of(path), scope.inputs)
    if item is not None:
        raise _refusal(path, flag_of(path), item)


def write_error(path: PathLike, exc: OSError, through: bool = False) -> OutputError:
    """The one-line error for an OSError met writing `path` (never naming a temporary file)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    after = "the output is cut short" if through else "nothing was written"
    return OutputError(path, f"{_lead(flag_of(path))}cannot write: {reason}; {after}", exc.errno or errno.EIO)


@contextlib.contextmanager
def sole_writer(path: PathLike, lock: PathLike) -> Iterator[None]:
    """Hold an exclusive lock (fcntl.flock on the file `lock`, made for it and removed after) while one
    process writes `path`; a second writer is refused at once with an OutputError naming `path`. Where
    locks are not supported (no fcntl, a file system without flock) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    lock = os.fspath(lock)
    refuse_input(lock)  # the lock file is made and removed: it must not be a file the command reads
    if os.path.islink(lock) or (os.path.lexists(lock) and not stat.S_ISREG(os.lstat(lock).st_mode)):
        raise OutputError(path, f"{_lead(flag_of(path))}{lock} is in the way of its lock file (a symlink or not a "
                                "regular file): remove it", errno.EEXIST)
    while True:
        try:
            # The output's folder is made as the atomic writer makes it (replay -o 'new dir/r.json' does too).
            os.makedirs(os.path.dirname(lock) or ".", exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputError(path, f"{_lead(flag_of(path))}cannot make its lock file {lock}: "
                                    f"{exc.strerror or exc}", exc.errno or errno.EIO) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(path, f"{_lead(flag_of(path))}another process is writing it now (it holds {lock}); "
                                    "wait for it to finish or choose another output", errno.EBUSY) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            break  # no locks on this file system
        # The holder before us may have removed the file between our open and our lock: lock the file
        # that is at the path now, or two writers would each hold a lock on a different file.
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size == 0:  # nothing is ever written to a lock: a file with content is not ours
                os.unlink(lock)  # while still holding it: a waiting writer then retries on a fresh file
        os.close(fd)


__all__ = [
    "FIGURE_SUFFIXES", "JSON_DOCUMENT_SUFFIXES", "JSON_SUFFIXES", "JUNIT_SUFFIXES", "PARQUET_SUFFIXES",
    "TRACE_SUFFIXES", "Output", "OutputError", "check_outputs", "command_scope", "flag_of", "is_special",
    "json_paths", "refuse_input", "sole_writer", "write_error",
]


def check_writable(path: str | Path) -> None:
    """Raise the OSError a write to `path` would meet, before any work: the target is a directory, or
    a parent is a file. (Permissions and disk space are only known when writing.)"""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", str(target))
    if target.is_symlink():
        try:
            os.stat(target)
        except OSError as exc:  # a dangling link is fine (its file is made); a loop has no file to write
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "a loop of symlinks, not a file to write", str(target)) from None
    if parent_is_a_file(target):
        raise NotADirectoryError(errno.ENOTDIR, "a parent of this path is a file, not a directory", str(target))


def parent_is_a_file(path: str | Path) -> bool:
    """Whether the nearest existing folder above `path` is in fact a file (so nothing can be made there)."""
    for parent in Path(path).parents:
        if parent.exists():
            return not parent.is_dir()
    return False
