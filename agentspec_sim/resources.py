"""Resource guards: refuse, before any work, a setting whose value multiplies memory or work past what
this machine (or a documented cap) allows.

Every knob that multiplies the work — `replicate`, `num_kv_blocks`, `max_num_seqs`, `max_model_len`,
a sweep's seeds, grid values and other axes, a synthetic trace's size — is checked by the library
function that would do the work (`simulate`, `run_sweep`, `synthesize`…) from an estimate of what it
will allocate, before it allocates it. A refusal is a `ResourceError`: it names the knob, the
estimate and the limit, and says what to change. The memory limit is the one the trace loader uses
(`trace.io.available_memory`: MemAvailable, the cgroup's memory.max, or AGENTSPEC_SIM_MEMORY_GIB).

Messages name other settings as `{knob}` placeholders, so the Python API reads `max_cells` where
the command line reads `--max-cells` (`ResourceError.render`).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from agentspec_sim.trace.io import MEMORY_ENV, available_memory, format_size

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
