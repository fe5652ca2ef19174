"""The workload model: what a trace holds once loaded.

A `Workload` is a tuple of `Query`s, each an ordered tuple of `Call`s (one LLM call of an agent).
Token arrays are int32 numpy views into one buffer per workload: an agent call re-sends the
previous call's prompt + output, so calls of one chain share storage instead of copying it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

TRACE_VERSION = 1
EMISSIONS = ("raw", "diff", "json")
Emission = Literal["raw", "diff", "json"]

# A structure is a tuple of groups; a group is a tuple of (open, close) delimiter pairs.
DelimiterPair = tuple[str, str]
Structure = tuple[tuple[DelimiterPair, ...], ...]


class TraceError(ValueError):
    """A malformed trace: names the file, the line (1-based, 0 when none) and the field."""

    def __init__(self, path: str, line: int, field: str, message: str) -> None:
        self.path, self.line, self.field, self.message = str(path), line, field, message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.field}: {self.message}"


@dataclass(frozen=True, slots=True)
class WorkspaceFile:
    """A file the agent had opened before a call (AgSpec indexes it). Never read from disk."""

    path: str
    content: str


@dataclass(frozen=True, slots=True)
class TraceMeta:
    """The trace's first line."""

    version: int = TRACE_VERSION
    tokenizer: str | None = "qwen3"
    model: str | None = None
    workload: str | None = None
    source: str | None = None
    vocab_size: int | None = None
    extra: dict | None = None  # free-form data about the whole trace (e.g. a converter's counts)

    def to_record(self) -> dict:
        record: dict = {"type": "meta", "version": self.version, "tokenizer": self.tokenizer}
        for name in ("model", "workload", "source", "vocab_size", "extra"):
            value = getattr(self, name)
            if value is not None:
                record[name] = value
        return record


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """One LLM call: the prompt the agent sent and the output the model emitted (end-of-turn included).

    `prompt_extends` names the call whose prompt + output this prompt starts with (delta form).
    `workspace` is cumulative: every file opened in the query up to this call (latest content).
    """

    id: str
    agent_id: int | str
    query_id: int | str
    seq: int
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    role: str | None = None
    structure: Structure = ()
    workspace: tuple[WorkspaceFile, ...] = ()
    emission: Emission | None = None
    arrival_s: float | None = None
    think_s: float = 0.0
    prompt_extends: str | None = None
    extra: dict | None = field(default=None)

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_tokens.shape[0])

    @property
    def output_len(self) -> int:
        return int(self.output_tokens.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Call):
            return NotImplemented
        scalar_fields = (
            "id", "agent_id", "query_id", "seq", "role", "structure", "workspace", "emission",
            "arrival_s", "think_s", "prompt_extends", "extra",
        )
        return all(getattr(self, f) == getattr(other, f) for f in scalar_fields) and (
            np.array_equal(self.prompt_tokens, other.prompt_tokens)
            and np.array_equal(self.output_tokens, other.output_tokens)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Query:
    """One user query of one agent application: its calls in `seq` order."""

    agent_id: int | str
    query_id: int | str
    calls: tuple[Call, ...]

    @property
    def output_tokens(self) -> int:
        return sum(c.output_len for c in self.calls)


@dataclass(frozen=True, slots=True)
class Workload:
    """A loaded trace: meta plus queries (in order of first appearance in the file).

    `skipped` holds the messages of lines skipped as bad (only with skip_bad_lines).
    """

    meta: TraceMeta
    queries: tuple[Query, ...]
    skipped: tuple[str, ...] = ()

    @property
    def calls(self) -> tuple[Call, ...]:
        return tuple(c for q in self.queries for c in q.calls)

    @property
    def num_calls(self) -> int:
        return sum(len(q.calls) for q in self.queries)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_len for q in self.queries for c in q.calls)

    @property
    def output_tokens(self) -> int:
        return sum(q.output_tokens for q in self.queries)

    def call_by_id(self) -> dict[str, Call]:
        return {c.id: c for q in self.queries for c in q.calls}
