"""The converter registry: one module per source format, each registered under its CLI name.

A converter turns raw agent logs into trace records (plain dicts in the trace format of
docs/trace-format.md): first the meta record, then one record per LLM call. It never tokenizes;
the loader does, so a converted trace is checked by exactly the code that will read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class ConvertError(ValueError):
    """Input that is not in the converter's format (or is unreadable). Names the file."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path, self.message = str(path), message
        super().__init__(f"{path}: {message}")


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    """What every converter needs to know about the target tokenizer, and how it treats bad lines.

    `eot_text` is the end-of-turn string the model emits at the end of each output (Qwen3:
    `<|im_end|>`); converters append it to every recorded output. `skip_bad_lines`: a line-oriented
    converter skips a line it cannot read (a truncated last line, a stray log line) instead of refusing
    the file, and records why in `skipped` (`skip_or_raise`).
    """

    tokenizer: str = "qwen3"
    eot_text: str = "<|im_end|>"
    skip_bad_lines: bool = False
    skipped: list[ConvertError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the converter decided that the user should hear

    def skip_or_raise(self, error: ConvertError) -> None:
        """Record `error` as a skipped line with `skip_bad_lines`, else raise it."""
        if not self.skip_bad_lines:
            raise error
        self.skipped.append(error)


ConvertFn = Callable[[Sequence[Path], ConvertOptions], Iterator[dict]]


@dataclass(frozen=True, slots=True)
class Converter:
    name: str
    summary: str
    convert: ConvertFn


CONVERTERS: dict[str, Converter] = {}


def register(name: str, summary: str) -> Callable[[ConvertFn], ConvertFn]:
    """Register `fn` as the converter for source format `name`."""

    def wrap(fn: ConvertFn) -> ConvertFn:
        if name in CONVERTERS:
            raise ValueError(f"converter {name!r} registered twice")
        CONVERTERS[name] = Converter(name, summary, fn)
        return fn

    return wrap


def expand_inputs(paths: Sequence[Path], pattern: str) -> list[Path]:
    """Files named directly plus files under named directories matching `pattern`, sorted."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob(pattern) if f.is_file())
            if not found:
                raise ConvertError(p, f"no files matching {pattern!r} in this directory")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ConvertError(p, "no such file or directory")
    return files


@dataclass(frozen=True, slots=True)
class ChatCall:
    """One recorded chat-completion call: the messages sent and the text the model returned."""

    messages: list[dict]
    response: str
    role: str | None = None
    structure: list | None = None
    workspace: list[dict] | None = None
    emission: str | None = None
    think_s: float | None = None
    arrival_s: float | None = None
    extra: dict | None = None


def _same_message(a: dict, b: dict) -> bool:
    return a.get("role") == b.get("role") and a.get("content") == b.get("content")


def chat_call_records(
    agent_id: int | str, query_id: int | str, calls: Sequence[ChatCall], opts: ConvertOptions,
    id_prefix: str | None = None,
) -> Iterator[dict]:
    """Trace records for one query's chat calls, in order, using the delta form where it applies.

    A call whose messages start with the previous call's messages followed by that call's response
    (as an assistant message) is written as `prompt_extends` + `messages_append`; any other call
    carries its full `messages`. Outputs get the end-of-turn text appended.
    """
    prefix = id_prefix if id_prefix is not None else f"{agent_id}/{query_id}"
    previous: tuple[str, list[dict]] | None = None  # (id, messages + [assistant response])
    for seq, call in enumerate(calls):
        call_id = f"{prefix}/{seq}"
        record: dict = {"type": "call", "id": call_id, "agent_id": agent_id, "query_id": query_id, "seq": seq}
        if call.role is not None:
            record["role"] = call.role
        msgs = [{"role": m["role"], "content": m["content"]} for m in call.messages]
        if (
            previous is not None
            and len(msgs) > len(previous[1])
            and all(_same_message(a, b) for a, b in zip(previous[1], msgs, strict=False))
        ):
            record["prompt_extends"] = previous[0]
            record["messages_append"] = msgs[len(previous[1]):]
        else:
            record["messages"] = msgs
        record["output"] = call.response + opts.eot_text
        for name in ("structure", "workspace", "emission", "think_s", "arrival_s", "extra"):
            value = getattr(call, name)
            if value is not None:
                record[name] = value
        yield record
        previous = (call_id, [*msgs, {"role": "assistant", "content": call.response}])
