"""The engine's state of one call instance (one LLM request), as vLLM's `Request` holds it.

Token bookkeeping follows vLLM V1: `num_tokens` = prompt + emitted tokens, `num_computed` = tokens
whose KV is written. A decode request has `num_computed == num_tokens − 1` (the last sampled token is
fed in the next step); a request with `num_computed < num_tokens − 1` is (re)prefilling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentspec_sim.trace.schema import Call

WAITING, RUNNING, FINISHED, REFUSED, SKIPPED = "waiting", "running", "finished", "refused", "skipped"
_EMPTY = np.zeros(0, dtype=np.int32)


class CallState:
    """One call instance: a trace `Call` run by tenant `tenant` (a replicate copy), index `index`.

    `history` is preallocated to prompt + output length and filled as tokens are emitted, so a
    step never concatenates; drafters read `tokens` (the valid prefix) only.
    """

    __slots__ = (
        "accepted",
        "arrival_s",
        "block_hashes",
        "block_ids",
        "call",
        "call_id",
        "decode_steps",
        "decoding",
        "draft_steps",
        "drafted",
        "drafter_state",
        "drafts",
        "finish_s",
        "first_token_s",
        "history",
        "index",
        "num_cached_blocks",
        "num_computed",
        "num_emitted",
        "output_len",
        "preemptions",
        "prefix_hit_tokens",
        "prompt_len",
        "query_index",
        "started",
        "status",
        "target_len",
        "tenant",
    )

    def __init__(self, index: int, call: Call, call_id: str, tenant: int, query_index: int, target_len: int) -> None:
        self.index = index
        self.call = call
        self.call_id = call_id
        self.tenant = tenant
        self.query_index = query_index
        self.prompt_len = call.prompt_len
        self.output_len = call.output_len
        # Tokens vLLM emits: the recording, capped where prompt + output reaches max_model_len.
        self.target_len = target_len
        self.history = np.empty(self.prompt_len + target_len, dtype=np.int32)
        self.history[:self.prompt_len] = call.prompt_tokens
        self.num_emitted = 0
        self.num_computed = 0
        self.drafts: np.ndarray = _EMPTY
        self.status = WAITING
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.arrival_s = float("nan")
        self.first_token_s = float("nan")
        self.finish_s = float("nan")
        self.drafted = 0
        self.accepted = 0
        self.draft_steps = 0
        self.decode_steps = 0
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.started = False  # the drafter's start_call ran
        self.decoding = False  # running and past its (re)prefill: its next step verifies
        self.drafter_state: Any = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_emitted

    @property
    def tokens(self) -> np.ndarray:
        """Prompt + emitted tokens (a view; append-only, so earlier tokens never change)."""
        return self.history[:self.prompt_len + self.num_emitted]

    @property
    def remaining(self) -> int:
        return self.target_len - self.num_emitted

    def __repr__(self) -> str:
        return (f"CallState({self.call_id!r}, {self.status}, emitted={self.num_emitted}/{self.target_len}, "
                f"computed={self.num_computed}/{self.num_tokens})")
