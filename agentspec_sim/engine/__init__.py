"""The engine: KV blocks and prefix cache (`kv`), one vLLM V1 step (`scheduler`), the event loop
(`simulator`), what a run returns (`result`), and `run.simulate` / `run.compare`."""

from agentspec_sim.engine.config import EngineConfig, EngineConfigError, vllm_defaults
from agentspec_sim.engine.result import RunResult
from agentspec_sim.engine.simulator import SimulationError

__all__ = ["EngineConfig", "EngineConfigError", "RunResult", "SimulationError", "vllm_defaults"]
