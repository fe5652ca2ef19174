"""Tables of a drafter's answers made once per workload (drafters/agentspec/tables.py, suffix_tables.py):
the disk cache they share and the token pool their drafts are stored in.

A table is a dict of numpy arrays stored as one `.npz` under `cache_root()/<kind>/<key>.npz`, written
atomically; processes that ask for the same key at once build it once (the others wait on the key's
lock, then read it). A missing, unreadable or malformed entry is built again; a cache that cannot be
written (read-only, full, a path under a file) only costs the rebuild. Keys hash everything the
table depends on, the code that makes it included (`code_digest`), so a stale entry is never read.
Each kind keeps at most `AGENTSPEC_SIM_TABLE_CACHE_MB` (default 2048) MB: after a store the least
recently used entries go (a read counts as a use).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from agentspec_sim.host.env import TABLE_CACHE_MB
from agentspec_sim.trace.cache import cache_root

Arrays = dict[str, np.ndarray]
LIMIT_ENV = TABLE_CACHE_MB.name
DEFAULT_LIMIT_MB = int(TABLE_CACHE_MB.default)  # type: ignore[arg-type]


@functools.cache
def code_digest(*files: str) -> bytes:
    """A digest of source files' bytes (part of a table's key: new code, new tables); read once per process."""
    h = hashlib.blake2b(digest_size=16)
    for name in files:
        h.update(Path(name).read_bytes())
    return h.digest()


def key_hash(name: str, fmt: int, code: Sequence[str], options: dict, *arrays: np.ndarray | bytes) -> Any:
    """A table key's hash (blake2b) begun with what every table depends on: its name and format, the code
    that makes it (`code_digest`), its options (as JSON) and the arrays that give the calls' tokens (or
    a digest of one, as bytes: the engine's token arena, `CallLayout.tokens_digest`); the caller adds
    what else its table depends on and takes `hexdigest()`."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"agentspec-sim {name} {fmt}\n".encode())
    h.update(code_digest(*code))
    h.update(json.dumps(options, sort_keys=True).encode())
    for array in arrays:
        h.update(array if isinstance(array, bytes) else np.ascontiguousarray(array).tobytes())
        h.update(b"|")
    return h


# Within `held_in_memory()`: the tables read or built there, by (kind, key), for the next run that asks.
_held: dict[tuple[str, str], Arrays] | None = None


@contextlib.contextmanager
def held_in_memory() -> Iterator[None]:
    """Within the block, a table read or built once stays in memory for every later run that asks for it (a
    capacity search's probes: one workload, one drafter, its tables every probe) instead of being read from
    disk again; released when the outermost block ends. Runs read tables and never write them
    (tests/test_capacity.py checks the tables a search held are unchanged by its probes)."""
    global _held
    outermost = _held is None
    if outermost:
        _held = {}
    try:
        yield
    finally:
        if outermost:
            _held = None


def held_tables() -> dict[tuple[str, str], Arrays]:
    """What `held_in_memory` holds now (empty outside it)."""
    return dict(_held or {})


def cached_arrays(kind: str, key: str, build: Callable[[], Arrays], valid: Callable[[Arrays], bool]) -> Arrays:
    """The arrays stored under (`kind`, `key`) if `valid` accepts them, else `build()`'s, stored."""
    if _held is not None and (kind, key) in _held:
        return _held[(kind, key)]
    arrays = _read_or_build(kind, key, build, valid)
    if _held is not None:
        _held[(kind, key)] = arrays
    return arrays


def read_note(kind: str, key: str) -> Arrays | None:
    """Small arrays a run noted under (`kind`, `key`) for the next run of the same workload (`write_note`), or
    None: a hint, never an answer (a missing or unreadable note only costs what it would have saved)."""
    return _load(cache_root() / kind / f"{key}.npz", lambda arrays: True)


def write_note(kind: str, key: str, arrays: Arrays) -> None:
    """Keep `arrays` under (`kind`, `key`) for `read_note` (atomically; a cache that cannot be written is skipped)."""
    _store(cache_root() / kind / f"{key}.npz", arrays)


def _store(path: Path, arrays: Arrays) -> None:
    """`arrays` as the .npz at `path`, atomically, then the kind's size limit kept (`_trim`); a cache that cannot
    be written is skipped."""
    from agentspec_sim.io.atomic import write_bytes_atomic

    with contextlib.suppress(OSError):
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_bytes_atomic(path, buffer.getvalue(), sync=False)
        _trim(path.parent, keep=path)


def _read_or_build(kind: str, key: str, build: Callable[[], Arrays], valid: Callable[[Arrays], bool]) -> Arrays:
    path = cache_root() / kind / f"{key}.npz"
    hit = _load(path, valid)
    if hit is not None:
        return hit
    with _locked(path.with_suffix(".lock")):
        hit = _load(path, valid)
        if hit is not None:
            return hit
        arrays = build()
        _store(path, arrays)
        return arrays


def _limit_bytes() -> int:
    # A finite number ≥ 0 (agentspec_sim/host/env.py refuses "nan", "inf", "-1"… naming the variable).
    return int(TABLE_CACHE_MB.read() * (1 << 20))  # type: ignore[operator]


def _trim(directory: Path, keep: Path) -> None:
    """Drop the least recently used entries of `directory` (and their locks) beyond the size limit."""
    entries = []
    for entry in directory.glob("*.npz"):
        with contextlib.suppress(OSError):
            st = entry.stat()
            entries.append((st.st_mtime_ns, st.st_size, entry))
    total = sum(size for _, size, _ in entries)
    limit = _limit_bytes()
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if entry == keep:
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            entry.with_suffix(".lock").unlink(missing_ok=True)
            total -= size


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (a no-op where it cannot be taken)."""
    handle = None
    with contextlib.suppress(OSError, ImportError):
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 (held until the block ends)
        fcntl.flock(handle, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def _load(path: Path, valid: Callable[[Arrays], bool]) -> Arrays | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # (a cut-short .npz is a bad zip)
        return None
    try:
        if not valid(arrays):
            return None
    except (KeyError, IndexError, ValueError):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now (the size limit drops the least recently used)
    return arrays


@njit(cache=True, nogil=True)
def pack_paths(out, lengths, pool, top, path):
    """Lay each position's draft out[t, :lengths[t]] into pool from `top`, path[t] = its start: where the
    tokens after the previous draft's start agree with it (the next position of a match that goes on),
    the window starts one further on and only the tokens past the pool's end are added. Returns the new
    top (pool must have room for lengths.sum() more tokens)."""
    prev = -1
    for t in range(out.shape[0]):
        n = lengths[t]
        placed = False
        if n > 0 and prev >= 0:
            start = prev + 1
            m = min(top - start, n)
            placed = True
            for i in range(m):
                if pool[start + i] != out[t, i]:
                    placed = False
                    break
            if placed:
                for i in range(m, n):
                    pool[top] = out[t, i]
                    top += 1
                path[t] = start
                prev = start
        if not placed:
            path[t] = top
            for i in range(n):
                pool[top + i] = out[t, i]
            prev = top if n > 0 else -1
            top += n
    return top


class PathPool:
    """A growing token pool that drafts are packed into (`pack_paths`)."""

    def __init__(self) -> None:
        self.pool = np.zeros(1 << 16, dtype=np.int32)
        self.top = 0

    def add(self, out: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Pack rows out[t, :lengths[t]]; returns each row's start."""
        need = self.top + int(lengths.sum())
        if need > self.pool.shape[0]:
            grown = np.zeros(max(need, 2 * self.pool.shape[0]), dtype=np.int32)
            grown[:self.top] = self.pool[:self.top]
            self.pool = grown
        path = np.zeros(out.shape[0], dtype=np.int64)
        self.top = pack_paths(out, lengths, self.pool, self.top, path)
        return path

    def tokens(self) -> np.ndarray:
        return self.pool[:self.top].copy()


__all__ = ["Arrays", "PathPool", "cached_arrays", "code_digest", "key_hash", "pack_paths"]
