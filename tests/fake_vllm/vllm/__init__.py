"""Fake vLLM 0.33 (tests only): see tests/fake_vllm/README.md."""

from vllm.entrypoints.llm import LLM
from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__version__ = "0.33.0+fake"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "TokensPrompt"]
