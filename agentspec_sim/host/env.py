"""The AGENTSPEC_SIM_* environment variables that hold numbers, read and checked in one place.

`float()` takes "nan", "inf" and "-1" as readily as "2048"; a limit of NaN or a negative size then
turns into a silent default, a traceback (int(inf)) or a cache that deletes everything. Each setting
here refuses what it cannot mean with one `EnvironmentSettingError` naming the variable; the command
line checks them all before a command starts (agentspec_sim/cli/preflight.py), so a bad value fails
at once rather than deep inside a run or a sweep worker.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


class EnvironmentSettingError(ValueError):
    """A bad environment variable: `NAME: environment: what is wrong` (one of the command line's expected
    errors). Not a TraceError: reading a setting must not import the trace package (validation/launch.py
    runs the timing leg on machines without polars)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: environment: {message}")
        self.name, self.message = name, message


@dataclass(frozen=True)
class NumberSetting:
    """An environment variable holding a finite number ≥ `minimum` (> it when `exclusive`) of `unit`;
    unset or empty means `default`."""

    name: str
    unit: str
    default: float | None
    minimum: float = 0.0
    exclusive: bool = False

    def read(self) -> float | None:
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        bound = f"{'>' if self.exclusive else '≥'} {self.minimum:g}"
        try:
            value = float(text)
        except ValueError:
            raise EnvironmentSettingError(self.name, f"expected a number of {self.unit}, got {text!r}; "
                                          "unset it for the default") from None
        if not math.isfinite(value) or value < self.minimum or (self.exclusive and value == self.minimum):
            raise EnvironmentSettingError(self.name, f"must be a finite number of {self.unit} {bound}, got "
                                          f"{text!r}; unset it for the default")
        return value


# How much memory a trace load may use (default: what the kernel says is available).
MEMORY_GIB = NumberSetting("AGENTSPEC_SIM_MEMORY_GIB", "GiB", None, exclusive=True)
# The most disk each kind of drafter table keeps (0: keep only the table just made).
TABLE_CACHE_MB = NumberSetting("AGENTSPEC_SIM_TABLE_CACHE_MB", "MB", 2048)
NUMBER_SETTINGS = (MEMORY_GIB, TABLE_CACHE_MB)


def check_environment() -> None:
    """Raise EnvironmentSettingError for the first numeric AGENTSPEC_SIM_* variable that is set badly."""
    for setting in NUMBER_SETTINGS:
        setting.read()


__all__ = ["MEMORY_GIB", "NUMBER_SETTINGS", "TABLE_CACHE_MB", "EnvironmentSettingError", "NumberSetting",
           "check_environment"]
