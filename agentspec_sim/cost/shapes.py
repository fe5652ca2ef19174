"""Step shapes: the four kinds of forward pass a vLLM engine runs, as `agentspec-sim cost` reads them.

One JSON object per line (docs/cost-model.md, "Pricing shapes"):

  {"kind": "decode",  "batch": b, "context": c}                  b calls, 1 query token each, c cached
  {"kind": "verify",  "batch": b, "context": c, "query_tokens": q} b calls, q = 1 + k tokens each (k drafts)
  {"kind": "prefill", "query_tokens": q, "prefix": p}             one chunk of q tokens after p cached
  {"kind": "mixed",   "batch": b, "context": c, "query_tokens": q, "prefix": p}
                                                                   b decodes beside one prefill chunk, as
                                                                   chunked prefill schedules them

Fields a kind does not use may be omitted; `prefix` defaults to 0, `batch` to 1 for a prefill. A shape
becomes a `BatchShape` (per-call rows) for the cost model, and a dict again for output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentspec_sim.cost.base import BatchShape

KINDS = ("decode", "verify", "prefill", "mixed")
_FIELDS = {
    "decode": ("batch", "context"),
    "verify": ("batch", "context", "query_tokens"),
    "prefill": ("query_tokens",),
    "mixed": ("batch", "context", "query_tokens"),
}
# Larger than any step an engine schedules (vLLM caps a step at max_num_batched_tokens, a context at
# max_model_len): a bound that refuses a typo before it allocates a billion-row batch.
MAX_VALUE = 10_000_000
MAX_SHAPES_BYTES = 64 << 20


class ShapeError(ValueError):
    """A shape line that cannot be priced; the message names the field."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """One forward pass by kind (see the module docstring). query_tokens is 1 for a decode."""

    kind: str
    batch: int = 1
    context: int = 0
    query_tokens: int = 1
    prefix: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ShapeError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("batch", "context", "query_tokens", "prefix"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ShapeError(f"{name}: expected an integer, got {value!r}")
            low = 0 if name in ("context", "prefix") else 1
            if not low <= value <= MAX_VALUE:
                raise ShapeError(f"{name}: expected {low}..{MAX_VALUE:,}, got {value}")
        if self.kind == "decode" and self.query_tokens != 1:
            raise ShapeError(f"query_tokens: a decode computes 1 token per call, got {self.query_tokens}")
        if self.kind == "verify" and self.query_tokens < 2:
            raise ShapeError(f"query_tokens: a verify computes 1 + k tokens per call (k ≥ 1), got {self.query_tokens}")
        if self.kind == "prefill" and self.batch != 1:
            raise ShapeError(f"batch: a prefill shape is one chunk, got {self.batch}")

    @classmethod
    def decode(cls, batch: int, context: int) -> StepShape:
        return cls("decode", batch, context)

    @classmethod
    def verify(cls, batch: int, context: int, draft_tokens: int) -> StepShape:
        return cls("verify", batch, context, 1 + draft_tokens)

    @classmethod
    def prefill(cls, query_tokens: int, prefix: int = 0) -> StepShape:
        return cls("prefill", 1, 0, query_tokens, prefix)

    @classmethod
    def mixed(cls, batch: int, context: int, query_tokens: int, prefix: int = 0) -> StepShape:
        return cls("mixed", batch, context, query_tokens, prefix)

    @classmethod
    def from_dict(cls, record: object) -> StepShape:
        if not isinstance(record, dict):
            raise ShapeError("expected a JSON object")
        kind = record.get("kind")
        if kind not in KINDS:
            raise ShapeError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        unknown = sorted(set(record) - {"kind", "batch", "context", "query_tokens", "prefix"})
        if unknown:
            raise ShapeError(f"{unknown[0]}: unknown field")
        for name in _FIELDS[kind]:
            if name not in record:
                raise ShapeError(f"{name}: missing (a {kind} needs {', '.join(_FIELDS[kind])})")
        return cls(kind, record.get("batch", 1), record.get("context", 0), record.get("query_tokens", 1),
                   record.get("prefix", 0))

    def to_dict(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"kind": self.kind}
        if self.kind != "prefill":
            out.update(batch=self.batch, context=self.context)
        if self.kind != "decode":
            out["query_tokens"] = self.query_tokens
        if self.kind in ("prefill", "mixed"):
            out["prefix"] = self.prefix
        return out

    @property
    def num_calls(self) -> int:
        return {"decode": self.batch, "verify": self.batch, "prefill": 1, "mixed": self.batch + 1}[self.kind]

    @property
    def num_tokens(self) -> int:
        if self.kind == "prefill":
            return self.query_tokens
        if self.kind == "mixed":
            return self.batch + self.query_tokens
        return self.batch * self.query_tokens

    @property
    def kv_tokens(self) -> int:
        """KV cache tokens the step's calls hold once it has run (what must fit in the cache)."""
        if self.kind == "prefill":
            return self.prefix + self.query_tokens
        held = self.batch * (self.context + (1 if self.kind == "mixed" else self.query_tokens))
        return held + (self.prefix + self.query_tokens if self.kind == "mixed" else 0)

    def batch_shape(self) -> BatchShape:
        """The per-call rows the cost model prices."""
        if self.kind == "prefill":
            return BatchShape.of([self.query_tokens], [self.prefix], [True])
        if self.kind == "mixed":
            b = self.batch
            q = np.ones(b + 1, dtype=np.int64)
            q[b] = self.query_tokens
            c = np.full(b + 1, self.context, dtype=np.int64)
            c[b] = self.prefix
            pf = np.zeros(b + 1, dtype=bool)
            pf[b] = True
            return BatchShape(q, c, pf)
        return BatchShape.decode(self.batch, self.context, self.query_tokens)


def read_shapes(path: str | Path) -> list[StepShape]:
    """The shapes of a JSONL file (blank lines skipped; at most `MAX_SHAPES_BYTES` read, so a device or a FIFO
    cannot fill memory). ShapeError names `path:line: field`; OSError as `open` raises it."""
    from agentspec_sim.io import strict_json

    try:
        text = strict_json.read_document(path, MAX_SHAPES_BYTES)
    except strict_json.StrictJSONError as exc:
        raise ShapeError(f"{path}: {exc.message}") from None
    except UnicodeDecodeError:
        raise ShapeError(f"{path}: not UTF-8 text") from None
    shapes = []
    for number, record in strict_json.json_lines(text, lambda n, exc: ShapeError(f"{path}:{n}: {exc.msg}")):
        try:
            shapes.append(StepShape.from_dict(record))
        except ShapeError as exc:
            raise ShapeError(f"{path}:{number}: {exc}") from None
    if not shapes:
        raise ShapeError(f"{path}: no shapes (one JSON object per line)")
    return shapes
