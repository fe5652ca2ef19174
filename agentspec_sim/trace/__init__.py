"""Traces: the workload model, reading/writing the JSONL format, tokenizers, converters."""

from agentspec_sim.trace.io import load_trace, parse_records, write_records, write_trace
from agentspec_sim.trace.schema import Call, Query, TraceError, TraceMeta, Workload, WorkspaceFile

__all__ = [
    "Call", "Query", "TraceError", "TraceMeta", "Workload", "WorkspaceFile",
    "load_trace", "parse_records", "write_records", "write_trace",
]
