"""Reading and writing traces (JSONL, optionally .gz/.xz/.zst): strict validation, delta form, cache.

Loading runs in four passes, each reporting `file:line: field: what is wrong`:
  1. parse each line and check every field's type and range (`_parse_call`);
  2. group calls into queries, order them by `seq`, check ids, gaps and `prompt_extends` links;
  3. render chat messages and tokenize every text piece in one batch;
  4. lay each chain of calls (a call extending the previous one) into one token buffer, so a call's
     prompt and output are numpy views and a 40-call agent session stores its history once.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import lzma
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from agentspec_sim.host.resources import MEMORY_ENV, available_memory, format_size
from agentspec_sim.io import strict_json
from agentspec_sim.io.atomic import atomic_binary, atomic_text, compression_of
from agentspec_sim.trace.schema import (
    EMISSIONS,
    TRACE_VERSION,
    Call,
    Query,
    Structure,
    TraceError,
    TraceMeta,
    Workload,
    WorkspaceFile,
)
from agentspec_sim.trace.tokenizer import TraceTokenizer, UnknownTokenizerError, load_tokenizer

INT32_MAX = 2**31 - 1
CACHE_FORMAT = 1  # bump when the cached layout or the loader's semantics change

CALL_FIELDS = frozenset({
    "type", "id", "agent_id", "query_id", "seq", "role", "structure", "workspace", "emission",
    "arrival_s", "think_s", "extra",
    "prompt_tokens", "prompt", "messages",
    "prompt_extends", "prompt_append_tokens", "prompt_append", "messages_append",
    "output_tokens", "output",
})
META_FIELDS = frozenset({"type", "version", "tokenizer", "model", "workload", "source", "vocab_size", "extra"})
FULL_PROMPT_FORMS = ("prompt_tokens", "prompt", "messages")
APPEND_FORMS = ("prompt_append_tokens", "prompt_append", "messages_append")


# --------------------------------------------------------------------------------------------
# Reading raw lines


def _open_binary(path: Path) -> io.BufferedIOBase:
    kind = compression_of(path)
    if kind == "gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if kind == "xz":
        return lzma.open(path, "rb")  # type: ignore[return-value]
    if kind == "zst":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # type: ignore[return-value]
    return open(path, "rb")


def zstd_frames(raw: bytes) -> tuple[bytes, int]:
    """(the text of every whole zstd frame of `raw`, how many bytes of `raw` those frames take): less than
    len(raw) when the last frame ends early (a file cut off, or still being written). Corrupt data raises
    zstandard.ZstdError."""
    import zstandard

    parts, dctx, rest = [], zstandard.ZstdDecompressor(), raw
    while rest:
        frame = dctx.decompressobj()
        text = frame.decompress(rest)
        if not frame.eof:
            break
        parts.append(text)
        rest = frame.unused_data
    return b"".join(parts), len(raw) - len(rest)


def _zstd_decompress(raw: bytes) -> bytes:
    """Every frame of a .zst file; a stream reader would return a truncated file's prefix silently."""
    text, used = zstd_frames(raw)
    if used < len(raw):
        raise EOFError("truncated: the last zstd frame ends early")
    return text


# Loading peaks at about this many bytes of memory per byte of (decompressed) trace text: the text,
# the parsed lines and the token buffer (measured on the bundled default trace: 6.6×).
LOAD_BYTES_PER_TEXT_BYTE = 7
# The most a trace's text is larger than its compressed file (token-id JSON compresses up to ~25×).
MAX_COMPRESSION_RATIO = 50


def _text_size(path: Path, available: int) -> int:
    """The decompressed size of a trace file, or a lower bound when finding it exactly is not worth a pass."""
    size = path.stat().st_size
    kind = compression_of(path)
    if kind is None:
        return size
    if kind == "zst":
        import zstandard

        with open(path, "rb") as f:
            declared = zstandard.frame_content_size(f.read(18))
        if declared > 0:
            return declared
    if size * MAX_COMPRESSION_RATIO * LOAD_BYTES_PER_TEXT_BYTE <= available:
        return size  # fits even at the highest ratio: skip the counting pass
    total = 0
    with _open_binary(path) as f:  # one streaming pass, constant memory
        while chunk := f.read(1 << 22):
            total += len(chunk)
    return total


def check_memory(path: str | Path) -> None:
    """Refuse, before reading it, a trace whose load needs more memory than is available."""
    p = Path(path)
    available = available_memory()
    if available is None or not p.is_file():  # a pipe or device: read_trace_bytes bounds it as it reads
        return
    try:
        text = _text_size(p, available)
    except Exception:  # a corrupt file: reading it reports what is wrong
        return
    needed = text * LOAD_BYTES_PER_TEXT_BYTE
    if needed > available:
        raise TraceError(str(p), 0, "file", f"too large for this machine: loading {format_size(text)} of trace text "
                         f"needs about {format_size(needed)} of memory, {format_size(available)} available; split it "
                         f"by query, or set {MEMORY_ENV} to allow more")


def _missing(p: Path) -> str:
    """Why an existing-looking path does not resolve to a file: a symlink loop, a dangling symlink, or nothing."""
    import errno
    import os

    if os.path.islink(p):
        try:
            os.stat(p)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "a symlink loop (it never resolves to a file)"
            return f"a symlink to {os.readlink(p)}, which does not exist"
    return "no such file"


def read_trace_bytes(path: str | Path) -> bytes:
    """The decompressed content of a trace file; unreadable, corrupt or truncated files raise TraceError,
    and so does a file too large to load in the memory available (`check_memory`). `-`: standard input."""
    if is_stdin(path):
        return read_stdin_bytes()
    p = Path(path)
    if p.is_dir():
        raise TraceError(str(p), 0, "file", "is a directory, not a trace file")
    if not p.exists():
        raise TraceError(str(p), 0, "file", _missing(p))
    check_memory(p)
    try:
        if not p.is_file():  # a device or FIFO has no size to check first (/dev/zero would fill memory)
            with open(p, "rb") as f:
                return _decompressed(_read_limited(f, str(p)), compression_of(p), str(p))
        if compression_of(p) == "zst":
            with open(p, "rb") as f:
                return _zstd_decompress(f.read())
        with _open_binary(p) as f:
            return f.read()
    except TraceError:
        raise
    except PermissionError:
        raise TraceError(str(p), 0, "file", "permission denied") from None
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise TraceError(str(p), 0, "file", f"cannot decompress ({exc or type(exc).__name__})") from None
    except Exception as exc:  # zstandard.ZstdError and friends
        raise TraceError(str(p), 0, "file", f"cannot read ({exc})") from None


# `-` for a trace path reads standard input; errors name it `<stdin>`.
STDIN = "-"
STDIN_NAME = "<stdin>"
# How a compressed stream starts (stdin has no file name to take the compression from).
_MAGIC = ((b"\x1f\x8b", "gz"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zst"))
_stdin_data: bytes | None = None


def is_stdin(path: str | Path | None) -> bool:
    """Whether `path` is `-`, the trace path that means standard input."""
    return path is not None and str(path) == STDIN


def read_stdin_bytes() -> bytes:
    """The decompressed trace on standard input (gzip, xz or zstd found by their magic bytes). Read once per
    process: a second call (a command that loads the trace twice) gets the same bytes, not an empty stream."""
    global _stdin_data
    if _stdin_data is not None:
        return _stdin_data
    stream = sys.stdin
    if stream is None or stream.closed or stream.isatty():
        raise TraceError(STDIN_NAME, 0, "file", "standard input is a terminal, not a trace: pipe one in "
                         "(e.g. zstdcat trace.jsonl.zst | agentspec-sim replay -) or give a file")
    raw = _read_limited(stream.buffer, STDIN_NAME)
    kind = next((k for magic, k in _MAGIC if raw.startswith(magic)), None)
    try:
        raw = _decompressed(raw, kind, STDIN_NAME)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise TraceError(STDIN_NAME, 0, "file", f"cannot decompress {kind} ({exc or type(exc).__name__})") from None
    except TraceError:
        raise
    except Exception as exc:  # zstandard.ZstdError and friends
        raise TraceError(STDIN_NAME, 0, "file", f"cannot decompress {kind} ({exc})") from None
    _stdin_data = raw
    return raw


def _read_limited(f: BinaryIO, name: str) -> bytes:
    """All of `f`, refused (TraceError) as soon as it holds more trace text than the memory available can
    load: a pipe or a device has no size to check before reading, and an endless one (/dev/zero, `yes |`)
    would otherwise fill memory until the kernel kills the process."""
    available = available_memory()
    limit = None if available is None else available // LOAD_BYTES_PER_TEXT_BYTE
    chunks, total = [], 0
    while chunk := f.read(1 << 24):
        total += len(chunk)
        if limit is not None and total > limit:
            raise TraceError(name, 0, "file", f"too large for this machine: more than {format_size(limit)} of trace "
                             f"text, which needs more than the {format_size(available)} of memory available; split "
                             f"it by query, or set {MEMORY_ENV} to allow more")
        chunks.append(chunk)
    return b"".join(chunks)


def _decompressed(raw: bytes, kind: str | None, name: str) -> bytes:
    """`raw` decompressed (`kind`: gz, xz, zst or None), refused past the memory limit as it expands (a small
    compressed stream can hold an endless text)."""
    if kind is None:
        return raw
    if kind == "zst":
        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True) as f:
            _read_limited(f, name)  # the size, within the limit (a stream reader returns a cut file's prefix)
        return _zstd_decompress(raw)  # every frame, or EOFError for a truncated one
    if kind == "gz":
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            return _read_limited(f, name)  # type: ignore[arg-type]
    with lzma.LZMAFile(io.BytesIO(raw)) as f:
        return _read_limited(f, name)  # type: ignore[arg-type]


def iter_lines(data: bytes, source: str) -> Iterator[tuple[int, dict | TraceError]]:
    """(line number, parsed JSON object or the error for that line), skipping blank lines."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = strict_json.loads(raw)
        except UnicodeDecodeError:
            yield number, TraceError(source, number, "line", "not UTF-8 text")
            continue
        except strict_json.StrictJSONError as exc:  # duplicate keys, NaN, lone surrogates, deep nesting too
            yield number, TraceError(source, number, exc.field or "line", exc.message)
            continue
        if not isinstance(record, dict):
            yield number, TraceError(source, number, "line", f"expected a JSON object, got {_kind(record)}")
            continue
        yield number, record


# --------------------------------------------------------------------------------------------
# Pass 1: one record's fields


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


@dataclass(slots=True)
class _Piece:
    """A prompt-append or output part: token ids, or text to tokenize (index into the batch)."""

    tokens: np.ndarray | None = None
    text: str | None = None
    text_index: int = -1


@dataclass(slots=True)
class _RawCall:
    line: int
    id: str
    agent_id: int | str
    query_id: int | str
    seq: int
    role: str | None
    structure: Structure
    workspace_delta: tuple[WorkspaceFile, ...]
    emission: str | None
    arrival_s: float | None
    think_s: float
    extra: dict | None
    prompt_form: str  # one of FULL_PROMPT_FORMS or APPEND_FORMS
    prompt_value: object
    prompt_extends: str | None
    output_form: str
    output_value: object
    # filled in by later passes
    prompt_piece: _Piece = field(default_factory=_Piece)
    output_piece: _Piece = field(default_factory=_Piece)
    chat: list[dict] | None = None  # messages so far (messages forms), for messages_append
    rendered_prompt: str | None = None
    extends_ok: bool = True


class _Checker:
    """Field checks for one record; each failure is a TraceError naming the line and field."""

    def __init__(self, source: str, line: int, record: dict) -> None:
        self.source, self.line, self.record = source, line, record

    def fail(self, name: str, message: str) -> TraceError:
        return TraceError(self.source, self.line, name, message)

    def get(self, name: str, types: tuple[type, ...], what: str, required: bool = False):
        if name not in self.record or (self.record[name] is None and not required):
            if required:
                raise self.fail(name, "missing")
            return None
        value = self.record[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise self.fail(name, f"expected {what}, got {_kind(value)}")
        return value

    def ident(self, name: str, required: bool = True) -> int | str | None:
        value = self.get(name, (int, str), "an integer or a string", required)
        if isinstance(value, str) and not value:
            raise self.fail(name, "empty string")
        return value

    def seconds(self, name: str) -> float | None:
        value = self.get(name, (int, float), "a number of seconds")
        if value is not None and (not math.isfinite(value) or value < 0):
            raise self.fail(name, f"must be a finite number ≥ 0, got {value}")
        return None if value is None else float(value)

    def token_ids(self, name: str, vocab_size: int | None) -> np.ndarray:
        value = self.record[name]
        if not isinstance(value, list):
            raise self.fail(name, f"expected a list of token ids, got {_kind(value)}")
        try:
            ids = np.asarray(value, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            ids = None
        if ids is None or ids.ndim != 1 or not all(type(v) is int for v in value[:1]) or (
            ids.size and not all(type(v) is int for v in value)
        ):
            raise self.fail(name, "expected a list of integer token ids")
        self.check_vocab(name, ids, vocab_size)
        return ids.astype(np.int32)

    def check_vocab(self, name: str, ids: np.ndarray, vocab_size: int | None) -> None:
        if ids.size and ids.min() < 0:
            bad = int(ids[ids < 0][0])
            raise self.fail(name, f"negative token id {bad}")
        if ids.size and ids.max() > INT32_MAX:  # tokens are stored as int32: never wrap silently
            bad = int(ids[ids > INT32_MAX][0])
            raise self.fail(name, f"token id {bad} does not fit in 32 bits (largest: {INT32_MAX})")
        if vocab_size is not None and ids.size and ids.max() >= vocab_size:
            bad = int(ids[ids >= vocab_size][0])
            raise self.fail(name, f"token id {bad} is out of the vocabulary (size {vocab_size})")

    def messages(self, name: str) -> list[dict]:
        value = self.record[name]
        if not isinstance(value, list) or not value:
            raise self.fail(name, "expected a non-empty list of chat messages")
        out = []
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise self.fail(name, f"message {i}: expected an object with a string 'role'")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise self.fail(name, f"message {i}: 'content' must be a string")
            out.append({"role": m["role"], "content": content})
        return out


def parse_structure(value: object) -> Structure:
    """Normalise a structure value: groups of [open, close] pairs, a flat list of pairs, or the
    paper's string form (a Python-literal list of tuples). Raises ValueError with what is wrong."""
    if isinstance(value, str):
        if len(value) > 100_000:
            raise ValueError("string form is too long")
        try:
            value = ast.literal_eval(value.strip())  # literals only: never evaluates code
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise ValueError("string form is not a list of (open, close) pairs") from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of groups of [open, close] pairs, got {_kind(value)}")
    if value and isinstance(value[0], (list, tuple)) and value[0] and isinstance(value[0][0], str):
        value = [value]  # a flat list of pairs is one group
    groups = []
    for gi, group in enumerate(value, start=1):
        if not isinstance(group, (list, tuple)) or not group:
            raise ValueError(f"group {gi}: expected a non-empty list of [open, close] pairs")
        pairs = []
        for pi, pair in enumerate(group, start=1):
            if (
                not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(s, str) and s for s in pair)
            ):
                raise ValueError(
                    f"group {gi} pair {pi}: unbalanced or empty delimiter pair {pair!r}; "
                    "expected [open, close], two non-empty strings"
                )
            pairs.append((pair[0], pair[1]))
        groups.append(tuple(pairs))
    return tuple(groups)


def _parse_call(chk: _Checker, vocab_size: int | None) -> _RawCall:
    rec = chk.record
    unknown = sorted(set(rec) - CALL_FIELDS)
    if unknown:
        raise chk.fail(unknown[0], "unknown field (put free-form data under 'extra')")
    call_id = chk.get("id", (str,), "a string", required=True)
    if not call_id:
        raise chk.fail("id", "empty string")
    agent_id, query_id = chk.ident("agent_id"), chk.ident("query_id")
    seq = chk.get("seq", (int,), "an integer", required=True)
    if seq < 0:
        raise chk.fail("seq", f"must be ≥ 0, got {seq}")
    role = chk.get("role", (str,), "a string")

    structure: Structure = ()
    if rec.get("structure") is not None:
        try:
            structure = parse_structure(rec["structure"])
        except ValueError as exc:
            raise chk.fail("structure", str(exc)) from None

    workspace: list[WorkspaceFile] = []
    for i, f in enumerate(chk.get("workspace", (list,), "a list of {path, content}") or []):
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("content"), str):
            raise chk.fail("workspace", f"entry {i}: expected {{\"path\": string, \"content\": string}}")
        workspace.append(WorkspaceFile(f["path"], f["content"]))

    emission = chk.get("emission", (str,), "a string")
    if emission is not None and emission not in EMISSIONS:
        raise chk.fail("emission", f"must be one of {', '.join(EMISSIONS)}, got {emission!r}")
    arrival_s, think_s = chk.seconds("arrival_s"), chk.seconds("think_s")
    extra = chk.get("extra", (dict,), "an object")

    full = [f for f in FULL_PROMPT_FORMS if rec.get(f) is not None]
    append = [f for f in APPEND_FORMS if rec.get(f) is not None]
    extends = chk.get("prompt_extends", (str,), "a call id (string)")
    if extends is not None:
        if full:
            raise chk.fail(full[0], "cannot be combined with prompt_extends (use an append form)")
        if len(append) != 1:
            raise chk.fail("prompt_extends", "needs exactly one of " + ", ".join(APPEND_FORMS))
        prompt_form = append[0]
    else:
        if append:
            raise chk.fail(append[0], "needs prompt_extends naming the call it appends to")
        if len(full) != 1:
            what = "missing: give one of" if not full else "give only one of"
            raise chk.fail("prompt", what + " " + ", ".join(FULL_PROMPT_FORMS) + " (or prompt_extends)")
        prompt_form = full[0]

    if prompt_form.endswith("tokens"):
        prompt_value: object = chk.token_ids(prompt_form, vocab_size)
        if prompt_form == "prompt_tokens" and not len(prompt_value):  # type: ignore[arg-type]
            raise chk.fail(prompt_form, "empty prompt")
    elif prompt_form.startswith("messages"):
        prompt_value = chk.messages(prompt_form)
    else:
        prompt_value = chk.get(prompt_form, (str,), "a string", required=True)
        if prompt_form == "prompt" and not prompt_value:
            raise chk.fail(prompt_form, "empty prompt")

    outs = [f for f in ("output_tokens", "output") if rec.get(f) is not None]
    if len(outs) != 1:
        raise chk.fail("output", "missing: give output_tokens or output" if not outs else "give only one of "
                       "output_tokens, output")
    if outs[0] == "output_tokens":
        output_value: object = chk.token_ids("output_tokens", vocab_size)
        if not len(output_value):  # type: ignore[arg-type]
            raise chk.fail("output_tokens", "empty output (a call emits at least one token)")
    else:
        output_value = chk.get("output", (str,), "a string", required=True)
        if not output_value:
            raise chk.fail("output", "empty output (a call emits at least one token)")

    return _RawCall(
        line=chk.line, id=call_id, agent_id=agent_id, query_id=query_id, seq=seq, role=role,  # type: ignore[arg-type]
        structure=structure, workspace_delta=tuple(workspace), emission=emission, arrival_s=arrival_s,
        think_s=think_s or 0.0, extra=extra, prompt_form=prompt_form, prompt_value=prompt_value,
        prompt_extends=extends, output_form=outs[0], output_value=output_value,
    )


def _parse_meta(source: str, line: int, record: dict) -> TraceMeta:
    chk = _Checker(source, line, record)
    unknown = sorted(set(record) - META_FIELDS)
    if unknown:
        raise chk.fail(unknown[0], "unknown field in the meta line")
    version = chk.get("version", (int,), "an integer", required=True)
    if version != TRACE_VERSION:
        raise chk.fail("version", f"unsupported trace version {version} (this build reads {TRACE_VERSION})")
    tokenizer = chk.get("tokenizer", (str,), "a tokenizer name or path, or null")
    vocab = chk.get("vocab_size", (int,), "an integer")
    if vocab is not None and vocab <= 0:
        raise chk.fail("vocab_size", f"must be > 0, got {vocab}")
    return TraceMeta(
        version=version, tokenizer=tokenizer, vocab_size=vocab,
        model=chk.get("model", (str,), "a string"), workload=chk.get("workload", (str,), "a string"),
        source=chk.get("source", (str,), "a string"), extra=chk.get("extra", (dict,), "an object"),
    )


# --------------------------------------------------------------------------------------------
# Passes 2-4


class _Errors:
    """Collects errors: raise the first at once, or (skipping bad lines) record and go on."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.skipped: list[TraceError] = []

    def report(self, err: TraceError) -> None:
        if not self.skip:
            raise err
        self.skipped.append(err)


def _order_queries(raw: list[_RawCall], source: str, errors: _Errors) -> list[list[_RawCall]]:
    """Group calls into queries (first-appearance order), sort by seq; check ids, seq, links."""
    by_id: dict[str, _RawCall] = {}
    kept: list[_RawCall] = []
    for c in raw:
        if c.id in by_id:
            errors.report(TraceError(source, c.line, "id", f"duplicate call id {c.id!r} (first on line "
                                     f"{by_id[c.id].line})"))
            continue
        by_id[c.id] = c
        kept.append(c)
    groups: dict[tuple, list[_RawCall]] = {}
    for c in kept:
        groups.setdefault((type(c.agent_id).__name__, c.agent_id, type(c.query_id).__name__, c.query_id),
                          []).append(c)
    valid_ids: set[str] = set()
    queries = []
    for calls in groups.values():
        calls.sort(key=lambda c: (c.seq, c.line))
        good: list[_RawCall] = []
        for c in calls:
            expected = len(good)
            if c.seq != expected:
                what = (f"duplicate seq {c.seq} in query {c.query_id!r}" if c.seq < expected else
                        f"gap in query {c.query_id!r}: expected seq {expected}, got {c.seq}")
                errors.report(TraceError(source, c.line, "seq", what))
                if c.seq < expected:
                    continue
                break  # with --skip-bad-lines, the rest of this query cannot run in order
            if c.prompt_extends is not None:
                parent = by_id.get(c.prompt_extends)
                problem = None
                if parent is None:
                    problem = f"names unknown call {c.prompt_extends!r}"
                elif (parent.agent_id, parent.query_id) != (c.agent_id, c.query_id):
                    problem = f"names call {c.prompt_extends!r} of another query"
                elif parent.seq >= c.seq:
                    problem = f"names call {c.prompt_extends!r} which is not earlier (seq {parent.seq} ≥ {c.seq})"
                elif parent.id not in valid_ids:
                    problem = f"names call {c.prompt_extends!r} which was skipped as bad"
                if problem:
                    errors.report(TraceError(source, c.line, "prompt_extends", problem))
                    break
            if c.arrival_s is not None:
                # A query's calls run one after another: a recorded arrival before an earlier call's is not a
                # timeline (DESIGN: a call never arrives before its predecessor ends).
                earlier = [g for g in good if g.arrival_s is not None]
                if earlier and c.arrival_s < earlier[-1].arrival_s:
                    errors.report(TraceError(source, c.line, "arrival_s",
                                             f"{c.arrival_s:g} is before the arrival of call {earlier[-1].id!r} "
                                             f"(seq {earlier[-1].seq}, {earlier[-1].arrival_s:g}) of the same query"))
                    break
            good.append(c)
            valid_ids.add(c.id)
        if good:
            queries.append(good)
    return queries


def _strip_eot(text: str, eot: str | None) -> str:
    return text[: -len(eot)] if eot and text.endswith(eot) else text


def _tokenize(queries: list[list[_RawCall]], tok: TraceTokenizer | None, source: str, errors: _Errors,
              ) -> list[list[_RawCall]]:
    """Render messages, then encode every text piece in one batch and check vocabulary."""
    by_id: dict[str, _RawCall] = {}
    texts: list[str] = []

    def want_text(piece: _Piece, text: str) -> None:
        piece.text, piece.text_index = text, len(texts)
        texts.append(text)

    result = []
    for calls in queries:
        good = []
        for c in calls:
            try:
                if c.prompt_form.endswith("tokens"):
                    c.prompt_piece.tokens = c.prompt_value  # type: ignore[assignment]
                else:
                    if tok is None:
                        raise TraceError(source, c.line, c.prompt_form,
                                         "text needs a tokenizer, but the meta line's tokenizer is null")
                    if c.prompt_form == "prompt" or c.prompt_form == "prompt_append":
                        want_text(c.prompt_piece, c.prompt_value)  # type: ignore[arg-type]
                    else:
                        _render_messages(c, by_id, tok, source)
                        want_text(c.prompt_piece, c.prompt_piece.text)  # type: ignore[arg-type]
                if c.output_form == "output_tokens":
                    c.output_piece.tokens = c.output_value  # type: ignore[assignment]
                else:
                    if tok is None:
                        raise TraceError(source, c.line, "output",
                                         "text needs a tokenizer, but the meta line's tokenizer is null")
                    want_text(c.output_piece, c.output_value)  # type: ignore[arg-type]
            except TraceError as err:
                errors.report(err)
                break
            by_id[c.id] = c
            good.append(c)
        if good:
            result.append(good)

    encoded = tok.encode_batch(texts) if tok is not None and texts else []
    vocab = tok.vocab_size if tok is not None else None
    final = []
    for calls in result:
        good = []
        for c in calls:
            try:
                for piece, name in ((c.prompt_piece, c.prompt_form), (c.output_piece, c.output_form)):
                    if piece.tokens is None:
                        piece.tokens = encoded[piece.text_index]
                        _Checker(source, c.line, {}).check_vocab(name, piece.tokens, vocab)
                if not len(c.output_piece.tokens):  # type: ignore[arg-type]
                    raise TraceError(source, c.line, c.output_form, "output tokenizes to nothing")
                if c.prompt_extends is None and not len(c.prompt_piece.tokens):  # type: ignore[arg-type]
                    raise TraceError(source, c.line, c.prompt_form, "prompt tokenizes to nothing")
            except TraceError as err:
                errors.report(err)
                break
            good.append(c)
        if good:
            final.append(good)
    return final


def _render_messages(c: _RawCall, by_id: dict[str, _RawCall], tok: TraceTokenizer, source: str) -> None:
    """Set c.prompt_piece.text to the rendered prompt (messages) or appended part (messages_append)."""
    try:
        if c.prompt_form == "messages":
            c.chat = list(c.prompt_value)  # type: ignore[arg-type]
            c.rendered_prompt = tok.render_chat(c.chat)
            c.prompt_piece.text = c.rendered_prompt
            return
        parent = by_id[c.prompt_extends]  # type: ignore[index]
        if parent.chat is None or parent.rendered_prompt is None:
            raise TraceError(source, c.line, "messages_append",
                             f"call {parent.id!r} has no chat messages to append to (use prompt_append)")
        parent_out = parent.output_value if parent.output_form == "output" else tok.decode(parent.output_value)  # type: ignore[arg-type]
        c.chat = [*parent.chat, {"role": "assistant", "content": _strip_eot(parent_out, tok.eot_text)},
                  *c.prompt_value]  # type: ignore[misc]
        full = tok.render_chat(c.chat)
    except UnknownTokenizerError as exc:
        raise TraceError(source, c.line, c.prompt_form, str(exc)) from None
    except Exception as exc:  # a chat template may raise anything
        raise TraceError(source, c.line, c.prompt_form, f"chat template failed: {exc}") from None
    c.rendered_prompt = full
    shared = parent.rendered_prompt + parent_out
    if full.startswith(shared):
        c.prompt_piece.text = full[len(shared):]
    else:
        # The template re-renders history differently (e.g. it drops old reasoning): the prompt
        # vLLM would get is the full rendering, which does not extend the earlier call.
        c.prompt_piece.text = full
        c.extends_ok = False


def _assemble(queries: list[list[_RawCall]], meta: TraceMeta, skipped: list[TraceError]) -> Workload:
    """Lay chains into one int32 buffer; every call's prompt/output become views into it."""
    chunks: list[np.ndarray] = []
    total = 0
    # call id -> (start offset, prompt_len, output_len); chain_end[id] is True while that call is
    # the last thing in the buffer, so a child can extend it in place.
    spans: dict[str, tuple[int, int, int]] = {}
    tail_id: str | None = None
    buffer_cache: np.ndarray | None = None

    def span_tokens(start: int, length: int) -> np.ndarray:
        nonlocal buffer_cache
        buffer_cache = np.concatenate(chunks) if len(chunks) != 1 else chunks[0]
        chunks[:] = [buffer_cache]
        return buffer_cache[start:start + length]

    for calls in queries:
        for c in calls:
            prompt_body = c.prompt_piece.tokens
            output = c.output_piece.tokens
            if c.prompt_extends is not None and c.extends_ok:
                p_start, p_plen, p_olen = spans[c.prompt_extends]
                if tail_id == c.prompt_extends:
                    start = p_start  # extend in place: the parent is the buffer's tail
                else:
                    start = total
                    prefix = span_tokens(p_start, p_plen + p_olen).copy()
                    chunks.append(prefix)
                    total += len(prefix)
                plen = p_plen + p_olen + len(prompt_body)  # type: ignore[arg-type]
            else:
                start, plen = total, len(prompt_body)  # type: ignore[arg-type]
            chunks.append(prompt_body)  # type: ignore[arg-type]
            chunks.append(output)  # type: ignore[arg-type]
            total += len(prompt_body) + len(output)  # type: ignore[arg-type]
            spans[c.id] = (start, plen, len(output))  # type: ignore[arg-type]
            tail_id = c.id
    buffer = np.concatenate(chunks).astype(np.int32, copy=False) if chunks else np.zeros(0, np.int32)
    return _build_workload(meta, queries, spans, buffer, tuple(str(e) for e in skipped))


def _build_workload(meta: TraceMeta, queries: list[list[_RawCall]], spans: dict[str, tuple[int, int, int]],
                    buffer: np.ndarray, skipped: tuple[str, ...]) -> Workload:
    out = []
    for calls in queries:
        built: list[Call] = []
        workspace: dict[str, WorkspaceFile] = {}
        for c in calls:
            for f in c.workspace_delta:  # incremental in the file, cumulative on the Call
                if f.path in workspace and workspace[f.path].content == f.content:
                    continue
                workspace.pop(f.path, None)
                workspace[f.path] = f
            start, plen, olen = spans[c.id]
            built.append(Call(
                id=c.id, agent_id=c.agent_id, query_id=c.query_id, seq=c.seq,
                prompt_tokens=buffer[start:start + plen], output_tokens=buffer[start + plen:start + plen + olen],
                role=c.role, structure=c.structure, workspace=tuple(workspace.values()),
                emission=c.emission, arrival_s=c.arrival_s, think_s=c.think_s,  # type: ignore[arg-type]
                prompt_extends=c.prompt_extends if c.extends_ok else None, extra=c.extra,
            ))
        out.append(Query(agent_id=calls[0].agent_id, query_id=calls[0].query_id, calls=tuple(built)))
    return Workload(meta=meta, queries=tuple(out), skipped=skipped)


# --------------------------------------------------------------------------------------------
# Public API


def parse_records(records: Iterable[tuple[int, dict | TraceError]], source: str = "<records>",
                  base_dir: Path | None = None, skip_bad_lines: bool = False) -> Workload:
    """Build a Workload from (line number, record) pairs: the meta record first, then calls."""
    errors = _Errors(skip_bad_lines)
    it = iter(records)
    first = next(it, None)
    if first is None:
        raise TraceError(source, 0, "file", "empty trace (expected a meta line first)")
    line, meta_rec = first
    if isinstance(meta_rec, TraceError):
        raise meta_rec
    if meta_rec.get("type") != "meta":
        raise TraceError(source, line, "type", 'the first line must be the meta line {"type": "meta", ...}')
    meta = _parse_meta(source, line, meta_rec)
    tok: TraceTokenizer | None = None
    if meta.tokenizer is not None:
        try:
            tok = load_tokenizer(meta.tokenizer, base_dir)
        except UnknownTokenizerError as exc:
            raise TraceError(source, line, "tokenizer", str(exc)) from None
    vocab = meta.vocab_size or (tok.vocab_size if tok else None)

    raw: list[_RawCall] = []
    for line, rec in it:
        try:
            if isinstance(rec, TraceError):
                raise rec
            kind = rec.get("type")
            if kind != "call":
                what = "a second meta line" if kind == "meta" else f"unknown record type {kind!r}"
                raise TraceError(source, line, "type", f"{what}; expected \"call\"")
            raw.append(_parse_call(_Checker(source, line, rec), vocab))
        except TraceError as err:
            errors.report(err)
    queries = _order_queries(raw, source, errors)
    queries = _tokenize(queries, tok, source, errors)
    if not queries:
        raise TraceError(source, 0, "file", "no valid calls in the trace")
    errors.skipped.sort(key=lambda e: e.line)
    return _assemble(queries, meta, errors.skipped)


def load_trace(path: str | Path, skip_bad_lines: bool = False, cache: bool = True) -> Workload:
    """Load and validate a trace file (`-`: standard input, see `read_stdin_bytes`). Tokenized results are
    cached by content hash, so a second load of the same file (same tokenizer) skips tokenization; standard
    input is never cached (errors and skipped lines name `<stdin>`). Raises TraceError on bad input."""
    if is_stdin(path):
        return parse_trace_bytes(read_stdin_bytes(), skip_bad_lines=skip_bad_lines)
    p = Path(path)
    data = read_trace_bytes(p)
    key = None
    if cache:
        from agentspec_sim.trace import cache as trace_cache

        key = trace_cache.cache_key(data, skip_bad_lines, p.parent)
        hit = trace_cache.load(trace_cache.cache_root(), key)
        if hit is not None:
            return hit
    workload = parse_records(iter_lines(data, str(p)), str(p), p.parent, skip_bad_lines)
    if key is not None:
        trace_cache.store(trace_cache.cache_root(), key, workload)
    return workload


def parse_trace_bytes(data: bytes, source: str = STDIN_NAME, base_dir: Path | None = None,
                      skip_bad_lines: bool = False) -> Workload:
    """A trace from its (decompressed) bytes, uncached; errors name `source`, a tokenizer path is relative
    to `base_dir` (default: the working directory)."""
    return parse_records(iter_lines(data, source), source, base_dir or Path.cwd(), skip_bad_lines)


# --------------------------------------------------------------------------------------------
# Writing


def call_record(call: Call, previous: Call | None, parent: Call | None) -> dict:
    """The token-form record of `call`, with the delta form where its prompt extends `parent`."""
    rec: dict = {"type": "call", "id": call.id, "agent_id": call.agent_id, "query_id": call.query_id,
                 "seq": call.seq}
    if call.role is not None:
        rec["role"] = call.role
    if parent is not None:
        shared = parent.prompt_len + parent.output_len
        rec["prompt_extends"] = parent.id
        rec["prompt_append_tokens"] = call.prompt_tokens[shared:].tolist()
    else:
        rec["prompt_tokens"] = call.prompt_tokens.tolist()
    rec["output_tokens"] = call.output_tokens.tolist()
    if call.structure:
        rec["structure"] = [[list(p) for p in g] for g in call.structure]
    before = {f.path: f.content for f in previous.workspace} if previous is not None else {}
    delta = [{"path": f.path, "content": f.content} for f in call.workspace if before.get(f.path) != f.content]
    if delta:
        rec["workspace"] = delta
    for name in ("emission", "arrival_s"):
        if getattr(call, name) is not None:
            rec[name] = getattr(call, name)
    if call.think_s:
        rec["think_s"] = call.think_s
    if call.extra is not None:
        rec["extra"] = call.extra
    return rec


def workload_records(workload: Workload) -> Iterator[dict]:
    """The meta record, then every call in token form (delta form where the prompt extends)."""
    yield workload.meta.to_record()
    for q in workload.queries:
        by_id = {c.id: c for c in q.calls}
        previous = None
        for c in q.calls:
            yield call_record(c, previous, by_id.get(c.prompt_extends) if c.prompt_extends else None)
            previous = c


def write_records(records: Iterable[dict], path: str | Path) -> int:
    """Write records as JSONL atomically (compressed by suffix); returns the number written."""
    n = 0
    with atomic_text(path) as out:
        for rec in records:
            out.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")))
            out.write("\n")
            n += 1
    return n


def write_trace(workload: Workload, path: str | Path) -> int:
    """Write a workload in token form (no tokenizer needed to read it back)."""
    return write_records(workload_records(workload), path)


__all__ = [
    "STDIN", "STDIN_NAME", "atomic_binary", "is_stdin", "iter_lines", "load_trace", "parse_records",
    "parse_structure", "parse_trace_bytes", "read_stdin_bytes", "read_trace_bytes",
    "workload_records", "write_records", "write_trace",
]
