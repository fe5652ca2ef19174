"""agentspec-sim: trace-driven simulation of speculative decoding for batched LLM-agent serving."""

from agentspec_sim.trace import Call, Query, TraceError, Workload, load_trace, write_trace

__version__ = "0.1.0"

__all__ = ["Call", "Query", "TraceError", "Workload", "__version__", "load_trace", "write_trace"]
