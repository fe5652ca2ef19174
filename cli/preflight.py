"""What every command checks before its body runs: no option holds NaN or infinity, and the numeric
AGENTSPEC_SIM_* environment variables are valid (agentspec_sim/host/env.py).

Click parses `--slo-ttft nan` and `--rate inf` as floats, and a comparison with NaN is always false, so
a range check such as `value <= 0` lets NaN through and the SLO is silently ignored. Rather than each
command remembering `math.isfinite` for each of its float options, `guard_commands` wraps every
registered command (sub-apps included) once, so options added later are covered too.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import typer

from agentspec_sim.cli.errors import UsageError


def guard_commands(app: typer.Typer) -> None:
    """Wrap the callback of every command of `app` and of its sub-apps with `_preflight` (idempotent)."""
    for info in app.registered_commands:
        if info.callback is not None and not getattr(info.callback, "_preflighted", False):
            info.callback = _preflight(info.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            guard_commands(group.typer_instance)


def _flag(name: str, default: Any) -> str:
    """How the user wrote parameter `name`: its long option (`--slo-ttft`), or the argument's metavar."""
    decls = getattr(default, "param_decls", None) or ()
    long = [d for d in decls if d.startswith("--")]
    if long:
        return long[0]
    if isinstance(default, typer.models.ArgumentInfo):
        return default.metavar or name.upper()
    return "--" + name.replace("_", "-")


# Options where infinity means something, as in `vllm bench serve`: `--request-rate inf` sends every query at
# once (vLLM's default), `--burstiness inf` spaces them evenly. NaN is refused there too.
INFINITY_ALLOWED = frozenset({"request_rate", "burstiness"})


def _preflight(command: Callable[..., Any]) -> Callable[..., Any]:
    flags = {name: _flag(name, p.default) for name, p in inspect.signature(command).parameters.items()}

    @functools.wraps(command)  # Typer reads the options from the wrapped signature (__wrapped__)
    def run(*args: Any, **kwargs: Any) -> Any:
        from agentspec_sim.host.env import check_environment

        check_environment()
        for name, value in kwargs.items():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, float) and not math.isfinite(item):
                    if name in INFINITY_ALLOWED and item == math.inf:
                        continue
                    raise UsageError(f"{flags.get(name, name)}: must be a finite number"
                                     + (" or inf" if name in INFINITY_ALLOWED else "") + f", got {item}")
        return command(*args, **kwargs)

    run._preflighted = True  # type: ignore[attr-defined]
    return run
