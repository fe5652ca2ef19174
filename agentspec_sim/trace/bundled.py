"""The traces that ship with the project (`traces/` in the checkout, installed as agentspec_sim.traces)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from agentspec_sim.trace.schema import TraceError

DEFAULT_TRACE = "default.jsonl.zst"


def bundled_dir() -> Path:
    return Path(str(resources.files("agentspec_sim.traces")))


def bundled_trace(name: str) -> Path:
    """Path of a bundled trace file by name (e.g. 'reflexion.jsonl.zst')."""
    path = bundled_dir() / name
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in bundled_dir().glob("*.jsonl*")))
        raise TraceError(name, 0, "trace", f"no bundled trace of this name (bundled: {known or 'none'})")
    return path


def default_trace_path() -> Path:
    """The quick-start coding-agent trace used when a command is given no trace."""
    return bundled_trace(DEFAULT_TRACE)
