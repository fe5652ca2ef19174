"""agentspec-sim: trace-driven simulation of speculative decoding for batched LLM-agent serving."""

from agentspec_sim.host import kernel_cache

kernel_cache.install_locator()  # before numba reads its configuration: an install's kernels live per user

from agentspec_sim.trace import Call, Query, TraceError, Workload, load_trace, write_trace  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Call", "EngineConfig", "Query", "TraceError", "Workload", "__version__", "load_trace", "replay", "simulate",
    "write_trace",
]


def __getattr__(name: str):
    # The engine (polars, the cost model) loads only when `simulate` or `EngineConfig` is asked for.
    if name in ("simulate", "replay"):
        from agentspec_sim import run

        return getattr(run, name)
    if name == "EngineConfig":
        from agentspec_sim.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'agentspec_sim' has no attribute {name!r}")
