"""The fake engine: FIFO scheduling up to max_num_seqs, one-step prefill, greedy draft verification."""

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.metrics import reader
from vllm.v1.metrics.reader import Metric
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

FAKE_NUM_GPU_BLOCKS = 4096  # what the fake's "profiling" finds
FAKE_MAX_MODEL_LEN = 32768
PERIOD = 7  # the toy model mostly repeats the token PERIOD positions back


def next_token(history: list[int]) -> int:
    """Greedy "model": copy the token PERIOD back, except at every 5th position (a mix of recent tokens),
    so n-gram drafts are often but not always right."""
    n = len(history)
    if n < PERIOD:
        return n % 50
    return (history[-1] + history[-3]) % 40 if n % 5 == 0 else history[-PERIOD]


def ngram_v1(history: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Longest n in [n_min, n_max] whose last n tokens occur earlier; earliest occurrence; up to k tokens."""
    length = len(history)
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = history[length - n:]
        for start in range(0, length - n):
            if history[start:start + n] == suffix:
                follow = history[start + n:start + n + k]
                return follow[:max(0, min(k, length - (start + n)))]
    return []


def ngram_v2(history: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Longest n, rightmost occurrence, always k slots padded with the last token."""
    length = len(history)
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = history[length - n:]
        for start in range(length - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                follow = history[start + n:start + n + k]
                return follow + [history[-1]] * (k - len(follow))
    return [history[-1]] * k


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    prefilled: bool = False
    metrics: RequestSpecDecodeMetrics | None = None


class LLMEngine:
    def __init__(self, max_num_seqs: int, speculative_config: dict | None, detailed: bool, log_stats: bool) -> None:
        self.max_num_seqs = max_num_seqs
        self.spec = dict(speculative_config) if speculative_config else None
        self.detailed = detailed
        self.log_stats = log_stats
        self.proposer = None
        if self.spec is not None:
            method = self.spec.get("method")
            if method != "ngram":
                raise NotImplementedError(f"the fake vLLM drafts only with ngram, not {method!r}")
            lo, hi = self.spec.get("prompt_lookup_min"), self.spec.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = lo if lo is not None else hi, hi if hi is not None else lo
            self.k = int(self.spec["num_speculative_tokens"])
            rule = ngram_v1 if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else ngram_v2
            self.proposer = lambda history: rule(history, lo, hi, self.k)
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        # vLLM 0.33's LLMEngine.vllm_config: the profiled KV block count lands in cache_config.num_gpu_blocks.
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=FAKE_NUM_GPU_BLOCKS),
                                           model_config=SimpleNamespace(max_model_len=FAKE_MAX_MODEL_LEN))

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None,
                    **kwargs: Any) -> str:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        tokens = list(prompt["prompt_token_ids"])
        metrics = RequestSpecDecodeMetrics.new(self.k) if self.proposer is not None else None
        self.waiting.append(_Request(request_id, tokens, params, metrics=metrics))
        return request_id

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def step(self) -> list[RequestOutput]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        outputs, still = [], []
        for req in self.running:
            self._advance(req)
            done = len(req.output) >= req.params.max_tokens
            completion = CompletionOutput(0, "", list(req.output), None, None,
                                          finish_reason="length" if done else None,
                                          spec_decode_metrics=req.metrics if done else None)
            outputs.append(RequestOutput(req.request_id, None, req.prompt, None, [completion], done))
            if not done:
                still.append(req)
        self.running = still
        return outputs

    def _advance(self, req: _Request) -> None:
        history = req.prompt + req.output
        remaining = req.params.max_tokens - len(req.output)
        if not req.prefilled:
            req.prefilled = True
            req.output.append(next_token(history))
            self._count("vllm:generation_tokens", 1)
            return
        drafts = self.proposer(history) if self.proposer is not None else []
        accepted, context = 0, list(history)
        while accepted < min(len(drafts), remaining) and drafts[accepted] == next_token(context):
            context.append(drafts[accepted])
            accepted += 1
        emitted = min(accepted + 1, remaining)
        for _ in range(emitted):
            req.output.append(next_token(req.prompt + req.output))
        self._count("vllm:generation_tokens", emitted)
        if drafts:  # a step without drafts is not counted (vLLM: "no match → no draft")
            req.metrics.observe(len(drafts), accepted, detailed=self.detailed)
            self._count("vllm:spec_decode_num_drafts", 1)
            self._count("vllm:spec_decode_num_draft_tokens", len(drafts))
            self._count("vllm:spec_decode_num_accepted_tokens", accepted)
            per_pos = reader.REGISTRY.setdefault("vllm:spec_decode_num_accepted_tokens_per_pos", [0] * self.k)
            for i in range(accepted):
                per_pos[i] += 1

    def _count(self, name: str, value: int) -> None:
        if self.log_stats:
            reader.REGISTRY[name] = int(reader.REGISTRY.get(name, 0)) + value

    def get_metrics(self) -> list[Metric]:
        if not self.log_stats:
            raise AssertionError("Stat logging disabled")
        return reader.get_metrics_snapshot()
