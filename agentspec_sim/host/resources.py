"""Resource guards: refuse, before any work, a setting whose value multiplies memory or work past what
this machine (or a documented cap) allows.

Every knob that multiplies the work — `replicate`, `num_kv_blocks`, `max_num_seqs`, `max_model_len`,
a sweep's seeds, grid values and other axes, a synthetic trace's size — is checked by the library
function that would do the work (`simulate`, `run_sweep`, `synthesize`…) from an estimate of what it
will allocate, before it allocates it. A refusal is a `ResourceError`: it names the knob, the
estimate and the limit, and says what to change. The memory limit is the one the trace loader uses
(`available_memory`: MemAvailable, the cgroup's memory.max, or AGENTSPEC_SIM_MEMORY_GIB).

Messages name other settings as `{knob}` placeholders, so the Python API reads `max_cells` where
the command line reads `--max-cells` (`ResourceError.render`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from agentspec_sim.host import env

MEMORY_ENV = env.MEMORY_GIB.name


def available_memory() -> int | None:
    """Bytes a load (or a run: agentspec_sim/host/resources.py) may use: AGENTSPEC_SIM_MEMORY_GIB if set, else
    the kernel's MemAvailable, or less where this process's cgroup limit leaves less (None: unknown)."""
    limit = env.MEMORY_GIB.read()  # a finite number > 0, or None when unset
    if limit is not None:
        return int(limit * 2**30)
    found = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# cgroup v2 and v1 files: (limit, usage, the memory.stat key of reclaimable page cache).
_CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"


def _cgroup_available() -> int | None:
    """Bytes left under this process's cgroup memory limit (a container's), None where none is set.
    Usage counts page cache; its inactive part is reclaimed before the limit bites, so it counts as free."""
    try:
        with open(_PROC_CGROUP) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    left: list[int] = []
    for _, controllers, path in entries:
        if controllers == "":
            kind, mount = "v2", _CGROUP_ROOT
        elif "memory" in controllers.split(","):
            kind, mount = "v1", f"{_CGROUP_ROOT}/memory"
        else:
            continue
        limit_file, usage_file, cache_key = _CGROUP_FILES[kind]
        # Inside a container the hierarchy is often mounted at the process's own cgroup.
        for folder in dict.fromkeys((Path(mount + path.rstrip("/")), Path(mount))):
            try:
                limit_text = (folder / limit_file).read_text().strip()
                usage = int((folder / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if limit_text == "max" or int(limit_text) >= 2**60:  # no limit set (v1 writes a huge number)
                break
            cache = 0
            with contextlib.suppress(OSError, ValueError):
                for line in (folder / "memory.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == cache_key:
                        cache = int(value)
            left.append(max(0, int(limit_text) - usage + cache))
            break
    return min(left) if left else None


def format_size(n: float) -> str:
    """Bytes for a message: `1.5 GiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} bytes"


__all__ = ["ResourceError", "literal", "memory_limit", "require_count", "require_disk", "require_memory"]


class ResourceError(ValueError):
    """A setting whose value needs more memory or work than allowed (or more GPUs than the model's
    attention heads split over), refused before the work starts.

    `knob`: the setting to change (a keyword argument / config field name, e.g. "replicate"; None when
    no single setting is to blame). `template`: the reason, naming settings as `{name}` placeholders.
    """

    def __init__(self, knob: str | None, template: str) -> None:
        self.knob, self.template = knob, template
        super().__init__(self.render(lambda name: name))

    def render(self, name: Callable[[str], str]) -> str:
        """The message with every setting written by `name` (the CLI passes one that makes `--flags`)."""
        text = self.template.format_map(_Names(name))
        return f"{name(self.knob)}: {text}" if self.knob else text


class _Names(dict):
    def __init__(self, name: Callable[[str], str]) -> None:
        super().__init__()
        self.name = name

    def __missing__(self, key: str) -> str:
        return self.name(key)


def literal(text: object) -> str:
    """`text` (a path, a label: anything from the user) safe inside a message template."""
    return str(text).replace("{", "{{").replace("}", "}}")


def memory_limit() -> int | None:
    """Bytes a command may use (None: unknown, nothing is refused); the trace loader's limit."""
    return available_memory()


def require_memory(needed: Mapping[str | None, float], what: str, *, values: Mapping[str, int] | None = None) -> None:
    """Refuse when the estimate `sum(needed.values())` bytes exceeds `memory_limit()`.

    `needed` maps each knob to the bytes its value costs (None: what no knob scales, e.g. the trace
    itself); the largest term is blamed. Where `values` gives that knob's value the term is taken as
    linear in it, and the message says the largest value that would fit. `what` describes the work
    ("the run", "the synthetic trace").
    """
    limit = memory_limit()
    if limit is None:
        return
    total = sum(needed.values())
    if total <= limit:
        return
    knob = max(needed, key=lambda k: needed[k]) if needed else None
    value = (values or {}).get(knob) if knob is not None else None
    advice = ""
    if knob is not None and value:
        rest = total - needed[knob]
        fits = math.floor((limit - rest) / (needed[knob] / value)) if limit > rest else 0
        advice = f"lower {{{knob}}} (about {fits:,} fits), " if fits >= 1 else f"lower {{{knob}}}, "
    at = f"at {value:,}, " if value else ""
    raise ResourceError(knob, f"{at}{what} needs about {format_size(total)} of memory, "
                              f"{format_size(limit)} available; {advice}or set {MEMORY_ENV} to allow more")


def require_disk(path: str | Path, needed: float, knob: str, value: int | None, what: str) -> None:
    """Refuse writing about `needed` bytes to `path` where its file system has less free space, blaming
    `knob` (its `value` taken as linear in the size)."""
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:  # the folders a write would make
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if needed <= free:
        return
    fits = math.floor(free / (needed / value)) if value else 0
    advice = f"lower {{{knob}}} (about {fits:,} fits)" if fits >= 1 else f"lower {{{knob}}}"
    at = f"at {value:,}, " if value else ""
    raise ResourceError(knob, f"{at}{what} takes about {format_size(needed)} of disk, {format_size(free)} free in "
                              f"{literal(folder)}; {advice} or write elsewhere")


def require_count(knob: str, count: int, unit: str, what: str, limit: int | None, limit_knob: str, *,
                  value: int | None = None, detail: str = "", lower: str | None = None) -> None:
    """Refuse `count` units of work (`unit`: "cells", "forward passes"…) of `what` over `limit` (None: no
    limit), blaming `knob`; where its `value` is given (the count is linear in it) say the largest that fits.
    `lower`: the advice instead ("use fewer {grid} values")."""
    if limit is None or count <= limit:
        return
    detail = f" ({detail})" if detail else ""
    advice = f"{lower} or " if lower else ""
    if value and not lower:
        fits = limit * value // count
        advice = f"lower {{{knob}}} (at most {fits:,} fits) or " if fits >= 1 else f"lower {{{knob}}} or "
    raise ResourceError(knob, f"{what} has {count:,} {unit}{detail}, over the limit of {limit:,} "
                              f"({{{limit_knob}}}); {advice}raise {{{limit_knob}}}")
