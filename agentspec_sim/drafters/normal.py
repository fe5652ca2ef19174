"""`normal`: no speculation (plain autoregressive decoding), the baseline every speedup divides by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from agentspec_sim.drafters.base import BaseDrafter, SpecConfigError, SpeculativeConfig, register_drafter

if TYPE_CHECKING:
    from agentspec_sim.engine.request import CallState


@register_drafter("normal")
class NormalDrafter(BaseDrafter):
    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        if spec.num_speculative_tokens > 0:
            raise SpecConfigError("method 'normal' drafts nothing; num_speculative_tokens must be 0 or absent")
        return replace(spec, num_speculative_tokens=0)

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        return [np.zeros(0, dtype=np.int32) for _ in rows]
