from typing import Any

from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.reader import Metric


class LLM:
    """vllm.LLM's constructor keywords the runner passes; the engine behind it is the fake's."""

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.92, enforce_eager: bool = False, **kwargs: Any) -> None:
        if "disable_log_stats" not in kwargs:
            kwargs["disable_log_stats"] = True
        self.model = model
        self.kwargs = kwargs
        detailed = kwargs.get("per_request_spec_decode_metrics", "none") == "detailed"
        if detailed and not kwargs.get("speculative_config"):  # VllmConfig's check (config/vllm.py, 0.32 and 0.33)
            raise ValueError("--per-request-spec-decode-metrics requires speculative decoding to be enabled")
        self.llm_engine = LLMEngine(int(kwargs.get("max_num_seqs", 256)), kwargs.get("speculative_config"), detailed,
                                    log_stats=not kwargs["disable_log_stats"])

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()
