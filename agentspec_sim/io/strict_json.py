"""Parsing user JSON strictly: one parser for every JSON input (trace lines, raw logs, configs, results).

Python's `json` accepts what is not JSON, or not what the writer meant, without a word:
  * a key given twice in one object (the last wins: `{"output_tokens": [1], "output_tokens": [2]}`);
  * `NaN`, `Infinity` and `-Infinity` literals, and numbers too large for a float (`1e999` → inf);
  * a lone UTF-16 surrogate escape (`"\\ud800"`), a string no encoder (tokenizer, UTF-8 writer) accepts;
  * raw UTF-8-encoded surrogates in bytes (`json.loads` decodes bytes with "surrogatepass");
  * nesting so deep that the parser, or any later code walking the value, overflows the stack.
`loads` refuses each with `StrictJSONError(field, message)`, `field` the path of the offending member
(`output_tokens`, `messages[0].content`, or "" for the document itself), so that a caller can say
`file:line: field: what is wrong`.

Cost (the trace loader parses multi-GB files with it): the object hook runs once per JSON object, not
per value (a trace line has a few objects and long lists of token ids), `NaN`/`Infinity` and float
hooks run only when such a literal appears, and the nesting and surrogate checks only walk a value
whose text could hold the problem (more brackets than the limit, a `\\ud`/`\\uD` escape). Finding
*where* a problem is happens after it was found, on the error path only.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

MAX_DEPTH = 100  # real inputs nest < 10 deep (chat content parts, tool arguments); 100 keeps every walk safe


class StrictJSONError(json.JSONDecodeError):
    """A JSON document refused: `field` is the path of the member at fault ("" for the whole document),
    `message` what is wrong, `line` the line of a multi-line document where the parser knows it (else None).

    It is a `json.JSONDecodeError`, so `loads` replaces `json.loads` where a caller catches that: `msg` is
    the decoder's own message for text that is not JSON (and `str()` json's "msg: line L column C"), and
    `field: message` for a refused value, whose position the hooks do not know (`pos` -1)."""

    def __init__(self, field: str, message: str, line: int | None = None,
                 decode: json.JSONDecodeError | None = None) -> None:
        ValueError.__init__(self, str(decode) if decode else f"{field}: {message}" if field else message)
        self.field, self.message, self.line = field, message, line
        self.msg = decode.msg if decode else f"{field}: {message}" if field else message
        self.doc, self.pos = (decode.doc, decode.pos) if decode else ("", -1)
        self.lineno, self.colno = (decode.lineno, decode.colno) if decode else (line or 0, 0)

    def __reduce__(self):  # picklable (sweep workers send errors back) despite the extra arguments
        return _rebuild, (self.field, self.message, self.line, self.msg, self.doc, self.pos)


def _rebuild(field: str, message: str, line: int | None, msg: str, doc: str, pos: int) -> StrictJSONError:
    decode = json.JSONDecodeError(msg, doc, pos) if pos >= 0 else None
    return StrictJSONError(field, message, line, decode)


class _Refused(Exception):
    """Raised by the strict parser's hooks; `loads` then locates the problem in a lenient parse."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Refused
    return obj


def _refuse_constant(name: str) -> Any:
    raise _Refused


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused
    return value


# A \\uD800–\\uDFFF escape (a regex search is ~3× faster than two `in` tests on bytes).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD]")
_STRICT = json.JSONDecoder(object_pairs_hook=_unique_pairs, parse_constant=_refuse_constant,
                           parse_float=_finite_float)


# The largest JSON document (a configuration, a profile, a baseline, a tokenizer) read whole: real ones are
# KB to tens of MB; a larger one is not such a file, and an endless device or pipe must not fill memory.
MAX_DOCUMENT_BYTES = 256 << 20


def read_document(path: str | os.PathLike[str], limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of the JSON document at `path`, read at most `limit` bytes far: past it (a device,
    a FIFO, a file of the wrong kind) `StrictJSONError` ("more than … bytes"). OSError and
    UnicodeDecodeError as `Path.read_text` raises them."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise StrictJSONError("", f"more than {limit:,} bytes: too large for this kind of JSON file")
    return data.decode("utf-8")


def load_path(path: str | os.PathLike[str], limit: int = MAX_DOCUMENT_BYTES) -> Any:
    """`loads(read_document(path))`."""
    return loads(read_document(path, limit))


def json_lines(text: str, refuse: Callable[[int, StrictJSONError], Exception]) -> Iterator[tuple[int, Any]]:
    """(line number from 1, value) for each non-blank line of the JSON-lines `text`, parsed by `loads`; a line
    it refuses raises `refuse(number, error)`: the caller's one-line message, naming its file."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = loads(line)
        except StrictJSONError as exc:
            raise refuse(number, exc) from None
        yield number, value


def loads(data: str | bytes | bytearray) -> Any:
    """The JSON value of `data` (bytes must be UTF-8); refuses duplicate keys, NaN/Infinity, floats that
    overflow, lone surrogates and nesting deeper than MAX_DEPTH with `StrictJSONError`. Bytes that are
    not UTF-8 raise UnicodeDecodeError; text that is not JSON raises `StrictJSONError` with the line."""
    if isinstance(data, (bytes, bytearray)):
        # "utf-8-sig" drops a byte-order mark as json.loads does; strict errors refuse encoded surrogates.
        text = bytes(data).decode("utf-8-sig" if data[:3] == b"\xef\xbb\xbf" else "utf-8")
        raw: str | bytes | bytearray = data  # the cheap checks below scan bytes (faster than the str)
        brackets, escape = (b"[", b"{"), _SURROGATE_ESCAPE_BYTES
    else:
        text = raw = data
        brackets, escape = ("[", "{"), _SURROGATE_ESCAPE
    try:
        value = _STRICT.decode(text)
    except json.JSONDecodeError as exc:
        where = f"column {exc.colno}" if exc.lineno == 1 else f"line {exc.lineno} column {exc.colno}"
        raise StrictJSONError("", f"invalid JSON ({exc.msg} at {where})", exc.lineno, exc) from None
    except RecursionError:
        raise StrictJSONError("", f"nested more than {MAX_DEPTH} levels deep") from None
    except _Refused:
        raise _locate(text) from None
    # Only text with more brackets than the limit can nest past it; only a \u escape can make a surrogate.
    if raw.count(brackets[0]) + raw.count(brackets[1]) > MAX_DEPTH and _depth(value) > MAX_DEPTH:  # type: ignore[arg-type]
        raise StrictJSONError("", f"nested more than {MAX_DEPTH} levels deep")
    if escape.search(raw) and _has_surrogate(value):  # type: ignore[arg-type]
        raise _locate(text)
    return value


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (iterative: the value may be deeper than the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
                         if isinstance(child, (list, dict)))
    return deepest


def _is_surrogate_free(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _has_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in `value` holds a lone surrogate (iterative, like `_depth`)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not _is_surrogate_free(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (str, list, dict)))
    return False


# --------------------------------------------------------------------------------------------
# The error path: parse again, keeping everything, and name the first member at fault.


class _Pairs(list):
    """An object as its (key, value) pairs, duplicates kept."""


class _Constant(str):
    """A NaN / Infinity / -Infinity literal, kept as its text."""


class _BigFloat(str):
    """A float literal that overflows (1e999), kept as its text."""


def _lenient_float(text: str) -> float | _BigFloat:
    value = float(text)
    return value if math.isfinite(value) else _BigFloat(text)


_LENIENT = json.JSONDecoder(object_pairs_hook=_Pairs, parse_constant=_Constant, parse_float=_lenient_float)


def _member(where: str, key: str) -> str:
    """The path of `key` in the object at `where`; a key that is not text is shown escaped (it is printed)."""
    shown = key.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{where}.{shown}" if where else shown


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, item) for `value` (as the lenient parser makes it) and everything in it, in document order; each
    key is yielded as an item too, before its value."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        yield where, item
        if isinstance(item, _Pairs):
            children = []
            for key, child in item:
                member = _member(where, key)
                children += [(member, key), (member, child)]
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([(f"{where}[{i}]", v) for i, v in enumerate(item)]))


def _locate(text: str) -> StrictJSONError:
    """The first refused member of `text` (which the lenient parser reads), as a StrictJSONError with the
    line it is on."""
    try:
        value = _LENIENT.decode(text)
    except RecursionError:
        return StrictJSONError("", f"nested more than {MAX_DEPTH} levels deep")
    for where, item in _walk(value):
        if isinstance(item, _Pairs):
            seen: set[str] = set()
            for key, _ in item:
                if key in seen:
                    member = _member(where, key)
                    return StrictJSONError(member, "the key is given twice in one object (which value is meant "
                                                   "is ambiguous); keep one", _line_of(text, member, 2))
                seen.add(key)
        elif isinstance(item, _Constant):
            return StrictJSONError(where, f"{item} is not a JSON number; give a finite number (or null)",
                                   _line_of(text, where))
        elif isinstance(item, _BigFloat):
            return StrictJSONError(where, f"{item} is too large for a number; give a finite number",
                                   _line_of(text, where))
        elif isinstance(item, str) and not _is_surrogate_free(item):
            bad = next(c for c in item if 0xD800 <= ord(c) <= 0xDFFF)
            return StrictJSONError(where, f"contains a lone UTF-16 surrogate (\\u{ord(bad):04x}), which is not "
                                          "text; escape a character outside the BMP as a surrogate pair",
                                   _line_of(text, where))
    return StrictJSONError("", "refused by the strict JSON parser")  # not reached: the strict parse refused it


# A JSON token: a string, a punctuation mark, or a bare word (number, true, false, null, NaN, Infinity).
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')


def _line_of(text: str, target: str, occurrence: int = 1) -> int | None:
    """The line of `text` where the member at path `target` (as `_walk` names it) starts, its key's
    `occurrence`-th time for a duplicated key (the error path only: a small scanner, not a parser)."""
    stack: list[list] = []  # per open container: [is_object, its path, current key's path or index, expect key]
    seen = 0

    def value_path() -> str:
        if not stack:
            return ""
        is_object, _, at, _ = stack[-1]
        return at if is_object else f"{stack[-1][1]}[{at}]"

    for match in _TOKEN.finditer(text):
        token, top = match.group(), stack[-1] if stack else None
        if top is not None and top[0] and top[3] and token.startswith('"'):  # a key
            try:
                key = json.loads(token)
            except ValueError:
                return None
            top[2], top[3] = _member(top[1], key), False
            if top[2] == target:
                seen += 1
                if seen >= occurrence:
                    return text.count("\n", 0, match.start()) + 1
            continue
        if token in (":", "}", "]"):
            if token != ":" and stack:
                stack.pop()
            continue
        if token == ",":
            if top is not None:
                if top[0]:
                    top[3] = True
                else:
                    top[2] += 1
            continue
        here = value_path()
        if here == target and occurrence == 1:
            return text.count("\n", 0, match.start()) + 1
        if token in ("{", "["):
            stack.append([token == "{", here, "" if token == "{" else 0, token == "{"])
    return None


__all__ = ["MAX_DEPTH", "StrictJSONError", "loads"]
