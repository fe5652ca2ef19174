"""`normal`: no speculation (plain autoregressive decoding), the baseline every speedup divides by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from agentspec_sim.drafters.registry import register_drafter
from agentspec_sim.engine.drafting import BaseDrafter, SpecConfigError, SpeculativeConfig

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState


@register_drafter("normal")
class NormalDrafter(BaseDrafter):
    # Memory per token of the trace (its workload table, one tenant; its live state, per tenant).
    bytes_per_token = (0.0, 0.0)
    shorthand: ClassVar[dict] = {"method": "normal"}
    async_scheduling = True  # no proposer: Model Runner V2 and async scheduling, vLLM 0.33's defaults

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        if spec.num_speculative_tokens > 0:
            raise SpecConfigError("method 'normal' drafts nothing; num_speculative_tokens must be 0 or absent")
        return replace(spec, num_speculative_tokens=0)

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        return [np.zeros(0, dtype=np.int32) for _ in rows]
