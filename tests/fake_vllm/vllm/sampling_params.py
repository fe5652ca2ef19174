from dataclasses import dataclass


@dataclass
class SamplingParams:
    """The fields the runner sets (vLLM 0.33 defaults: temperature 1.0, max_tokens 16)."""

    temperature: float = 1.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    detokenize: bool = True
    seed: int | None = None
