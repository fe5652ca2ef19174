"""Converters from real agent-log formats to the trace format (registered by name).

Importing this package registers every converter module listed below.
"""

from agentspec_sim.trace.convert import (  # noqa: F401  (imported to register)
    mini_swe_agent,
    openai_chat,
    otel_genai,
    reflexion,
    spec_bench,
    storm,
    swe_agent,
    tapeagents,
)
from agentspec_sim.trace.convert.base import (
    CONVERTERS,
    ChatCall,
    ConvertError,
    ConvertOptions,
    chat_call_records,
    register,
)

__all__ = ["CONVERTERS", "ChatCall", "ConvertError", "ConvertOptions", "chat_call_records", "register"]
