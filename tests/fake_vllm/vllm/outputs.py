from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.stats import RequestSpecDecodeMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: Any = None
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None
    weight_versions: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, prompt_logprobs: Any,
                 outputs: list[CompletionOutput], finished: bool, metrics: Any = None, lora_request: Any = None,
                 encoder_prompt: str | None = None, encoder_prompt_token_ids: list[int] | None = None,
                 num_cached_tokens: int | None = None, num_cache_creation_tokens: int | None = None,
                 **kwargs: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.num_cached_tokens = num_cached_tokens
