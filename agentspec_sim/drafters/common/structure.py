"""The per-call string pushdown automaton of AgentSpec (paper §4.1, Algorithm 1, lines 5–8).

Each generated token is turned into its raw bytes through a cached token→bytes map (XGrammar-style,
`TraceTokenizer.token_bytes()`), and the bytes are fed to the automaton of the call, which tracks
the active semantic block from the call's `structure` delimiters. The drafter keys its history
cache by (agent, query, block). One automaton per call, fed with the call's *output* only, starting
outside every block.

Rules (deterministic; each has a test in tests/test_structure.py):

- Matching is on bytes, so a delimiter split across tokens, or a multi-byte UTF-8 character split
  across tokens, is found the same as in one piece. Bytes that may still grow into a delimiter wait
  in a pending buffer.
- Longest match: when a complete delimiter is also the prefix of a longer live one (`$` vs `$$`,
  ```` ``` ```` vs ```` ```python ````), the automaton waits for the next byte; `flush()` resolves
  what is pending at the end of the input. A delimiter is *live* if it is an opener, or the closer
  of a block on the stack; other closers are plain text.
- The closer of the innermost open block wins over everything, at once, without waiting for a
  longer match (inside ```` ```python ````, ```` ``` ```` closes even if ```` ```bash ```` could follow).
- Otherwise the longest live delimiter applies: an opener pushes its block (if several pairs share
  an opener, the first in structure order); a pair whose opener equals its closer (`$$`/`$$`)
  therefore closes only when it is the innermost block, and opens otherwise.
- A closer of an open block that is not the innermost pops to it (closing the blocks above it too),
  as stack-based tag matchers recover from a missing closer: an unclosed fence inside a tool call
  ends with the tool call. A closer with no open block is plain text. Blocks left open at the end
  of a call simply stay open.

Label semantics: the block label is the innermost open block's `(group index, pair index)` into
the structure, or `ROOT = (-1, -1)` outside every block — not the whole stack. The paper's blocks
are defined by one (start, end) tag pair and the cache is keyed by block, so all text of one kind
(every ```` ```python ```` fence, nested in a tool call or not) shares one history; a stack-path
label would split that history into an unbounded number of paths and make one missed closer
change the label of everything after it. Text of an outer block after an inner one closes is the
outer block again.

Timing: a change takes effect at the byte that completes (or, for a longest-match wait, resolves)
the delimiter. `segment` (one call) and `segment_many` (many calls, each fresh) label each token
with the block the automaton reports when the token starts, i.e. after feeding every earlier token
— exactly what an online drafter sees before drafting that token. So an opener's own tokens carry
the outer label and a closer's tokens the inner one.

Cost: with nothing pending, one compiled-regex search (C speed) skips to the next place where a
delimiter starts or the data ends inside one (no state can change in between); only from there do
bytes go one by one through the pending buffer, O(longest delimiter) each: O(1) amortised per byte.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from agentspec_sim.drafters.common import table_cache
from agentspec_sim.trace.schema import Structure

Label = tuple[int, int]
ROOT: Final[Label] = (-1, -1)


@dataclass(frozen=True)
class _Tables:
    """Per-structure lookup tables, built once per distinct structure."""

    labels: tuple[Label, ...]  # flat pair index -> (group, pair)
    closes: tuple[bytes, ...]  # flat pair index -> closer bytes
    openers: dict[bytes, int]  # opener bytes -> flat pair index (first in structure order)
    longer: dict[bytes, tuple[bytes, ...]]  # proper prefix -> the delimiters strictly longer than it
    delimiters: frozenset[bytes]  # every delimiter
    max_len: int
    candidate: re.Pattern[bytes] | None  # where a delimiter, or a prefix of one cut by the end of data, starts


def _normalise(structure) -> Structure:
    return tuple(tuple((str(o), str(c)) for o, c in group) for group in structure)


@functools.lru_cache(maxsize=256)
def _tables(structure: Structure) -> _Tables:
    labels: list[Label] = []
    closes: list[bytes] = []
    openers: dict[bytes, int] = {}
    for g, group in enumerate(structure):
        for p, (open_text, close_text) in enumerate(group):
            open_b, close_b = open_text.encode("utf-8"), close_text.encode("utf-8")
            if not open_b or not close_b:
                raise ValueError(f"structure group {g} pair {p}: empty delimiter")
            openers.setdefault(open_b, len(labels))
            labels.append((g, p))
            closes.append(close_b)
    delimiters = set(openers) | set(closes)
    longer: dict[bytes, list[bytes]] = {}
    for d in delimiters:
        for n in range(1, len(d)):
            longer.setdefault(d[:n], []).append(d)
    # A position can change the state only if a delimiter starts there, or the data ends inside one.
    alternatives = [re.escape(d) for d in sorted(delimiters, key=lambda d: (-len(d), d))]
    alternatives += [re.escape(p) + rb"\Z" for p in sorted(longer, key=lambda p: (-len(p), p))]
    candidate = re.compile(b"|".join(alternatives)) if alternatives else None
    return _Tables(
        labels=tuple(labels), closes=tuple(closes), openers=openers,
        longer={k: tuple(sorted(v)) for k, v in longer.items()}, delimiters=frozenset(delimiters),
        max_len=max(map(len, delimiters), default=0),
        candidate=candidate,
    )


def _tables_for(structure) -> _Tables:
    try:
        return _tables(structure)
    except TypeError:  # lists instead of tuples: unhashable
        return _tables(_normalise(structure))


def block_labels(structure) -> list[Label]:
    """The labels `segment` indexes: `[ROOT, (0, 0), (0, 1), …]`, one per pair in structure order."""
    return [ROOT, *_tables_for(structure).labels]


class StructureAutomaton:
    """The pushdown automaton of one call: feed it the bytes of each emitted token, read `block`.

    State: the stack of open blocks (flat pair indices, innermost last) and the pending bytes that
    may still become a delimiter. Not thread-safe; one instance per call.
    """

    __slots__ = ("_buf", "_open_closers", "_stack", "_t")

    def __init__(self, structure) -> None:
        """`structure`: the call's groups of (open, close) pairs (`Call.structure`)."""
        self._t = _tables_for(structure)
        self._stack: list[int] = []
        self._buf = b""
        self._open_closers: dict[bytes, int] = {}  # closer bytes -> how many open blocks it closes

    @property
    def block(self) -> Label:
        """The active block: the innermost open block's (group, pair), or ROOT."""
        return self._t.labels[self._stack[-1]] if self._stack else ROOT

    @property
    def block_index(self) -> int:
        """The active block as an index into `block_labels(structure)` (0 = ROOT)."""
        return self._stack[-1] + 1 if self._stack else 0

    @property
    def stack(self) -> tuple[Label, ...]:
        """The open blocks, outermost first."""
        return tuple(self._t.labels[i] for i in self._stack)

    @property
    def pending(self) -> bytes:
        """Bytes fed but not yet resolved (a possible delimiter prefix)."""
        return self._buf

    def reset(self) -> None:
        """Back to the start state: no open block, nothing pending."""
        self._stack.clear()
        self._buf = b""
        self._open_closers.clear()

    def feed(self, data: bytes) -> Label:
        """Consume `data` (any slice of the byte stream, e.g. one token's bytes); returns `block`."""
        if self._t.candidate is not None and data:
            self._run(data, None, 0, len(data))
        return self.block

    def flush(self) -> Label:
        """Resolve pending bytes as if the input ended here (longest complete match, else text);
        returns `block`. Feeding may continue afterwards."""
        if self._buf:
            self._drain(final=True)
        return self.block

    # -- internals ---------------------------------------------------------------------------------

    def _run(self, data: bytes, events: list | None, pos: int, end: int) -> None:
        """Feed data[pos:end]; with `events`, append (offset just after the byte, block index) at
        each change of the active block."""
        t = self._t
        search = t.candidate.search
        while pos < end:
            if not self._buf:
                m = search(data, pos, end)  # `\Z` matches at `end`: the input so far ends there
                if m is None:
                    return
                pos = m.start()
                d = m.group()  # the longest delimiter starting here (or a prefix cut by `end`)
                if len(d) > 1 and d in t.delimiters and self._live(d):
                    top_close = t.closes[self._stack[-1]] if self._stack else b""
                    if not (top_close and len(top_close) < len(d) and d.startswith(top_close)):
                        # Byte by byte, every proper prefix of d would wait (d is a longer live
                        # delimiter, and none is the innermost closer): jump to d's last byte.
                        self._buf = d[:-1]
                        pos += len(d) - 1
            top = self._stack[-1] if self._stack else -1
            self._buf += data[pos : pos + 1]
            pos += 1
            self._drain(final=False)
            if events is not None and (self._stack[-1] if self._stack else -1) != top:
                events.append((pos, self.block_index))

    def _live(self, d: bytes) -> bool:
        return d in self._t.openers or self._open_closers.get(d, 0) > 0

    def _push(self, i: int) -> None:
        self._stack.append(i)
        c = self._t.closes[i]
        self._open_closers[c] = self._open_closers.get(c, 0) + 1

    def _pop(self) -> None:
        c = self._t.closes[self._stack.pop()]
        self._open_closers[c] -= 1

    def _drain(self, final: bool) -> None:
        t, buf = self._t, self._buf
        while buf:
            stack = self._stack
            if stack and buf.startswith(t.closes[stack[-1]]):  # the innermost closer wins, at once
                buf = buf[len(t.closes[stack[-1]]) :]
                self._pop()
                continue
            if not final and any(self._live(d) for d in t.longer.get(buf, ())):
                break  # may still grow into a longer live delimiter: wait for the next byte
            for n in range(min(len(buf), t.max_len), 0, -1):
                d = buf[:n]
                if d in t.openers:
                    self._push(t.openers[d])
                elif self._open_closers.get(d, 0) > 0:  # closer of a deeper block: pop to it
                    while t.closes[stack[-1]] != d:
                        self._pop()
                    self._pop()
                else:
                    continue
                buf = buf[n:]
                break
            else:
                buf = buf[1:]  # the first byte is plain text
        self._buf = buf


def segment(token_ids: np.ndarray | Sequence[int], token_bytes: Sequence[bytes], structure) -> np.ndarray:
    """Block of each token of one call: int32 indices into `block_labels(structure)` (0 = ROOT).

    Entry i is the block a fresh `StructureAutomaton(structure)` reports after being fed the bytes
    of tokens 0..i-1 — the block active when token i starts. `token_bytes[id]` is the token's raw
    bytes (`TraceTokenizer.token_bytes()`). One pass over the joined bytes, no per-token calls.
    """
    return segment_many([np.asarray(token_ids)], token_bytes, structure)


_BYTE_TABLES: dict[int, tuple[Sequence[bytes], np.ndarray, np.ndarray]] = {}


def _joined_bytes(ids: np.ndarray, token_bytes: Sequence[bytes]) -> tuple[bytes, np.ndarray]:
    """The bytes of tokens `ids` end to end, and each token's byte offset (then the end), gathered from
    one array of the whole vocabulary's bytes (built once per token map) instead of token by token."""
    entry = _BYTE_TABLES.get(id(token_bytes))
    if entry is None or entry[0] is not token_bytes:
        lengths = np.fromiter(map(len, token_bytes), dtype=np.int64, count=len(token_bytes))
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        entry = (token_bytes, np.frombuffer(b"".join(token_bytes), dtype=np.uint8), offsets)
        if len(_BYTE_TABLES) >= 8:  # (token maps live as long as their tokenizer: a handful)
            _BYTE_TABLES.clear()
        _BYTE_TABLES[id(token_bytes)] = entry
    _, blob, offsets = entry
    first = offsets[ids]
    lengths = offsets[ids + 1] - first
    starts = np.zeros(ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    where = np.repeat(first - starts[:-1], lengths) + np.arange(int(starts[-1]), dtype=np.int64)
    return blob[where].tobytes(), starts


def segment_fed(token_ids: np.ndarray | Sequence[int], token_bytes: Sequence[bytes],
                structure) -> tuple[np.ndarray, StructureAutomaton]:
    """`segment`, and the automaton after all the tokens (what feeding a fresh one their bytes leaves)."""
    return _segment([np.asarray(token_ids)], token_bytes, structure)


def segment_many(calls: Sequence[np.ndarray], token_bytes: Sequence[bytes], structure) -> np.ndarray:
    """`segment` of several calls that share a structure, concatenated: each call is segmented
    by its own fresh automaton (blocks never carry over from one call to the next)."""
    return _segment(calls, token_bytes, structure)[0]


def _segment(calls: Sequence[np.ndarray], token_bytes: Sequence[bytes],
             structure) -> tuple[np.ndarray, StructureAutomaton]:
    lens = np.fromiter((len(c) for c in calls), dtype=np.int64, count=len(calls))
    n = int(lens.sum())
    out = np.zeros(n, dtype=np.int32)
    t = _tables_for(structure)
    automaton = StructureAutomaton(structure)
    if n == 0 or t.candidate is None:
        return out, automaton
    ids = np.concatenate([np.asarray(c).reshape(-1) for c in calls]) if len(calls) > 1 else np.asarray(calls[0])
    data, starts = _joined_bytes(ids, token_bytes)
    bounds = starts[np.concatenate(([0], np.cumsum(lens)))].tolist()  # byte range of each call
    events: list[tuple[int, int]] = []
    per_call = np.zeros(len(calls), dtype=np.int64)  # events of each call
    for c, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        before = len(events)
        if automaton._stack or automaton._buf:
            automaton.reset()
            events.append((lo, 0))
        automaton._run(data, events, lo, hi)
        per_call[c] = len(events) - before
    if not events:
        return out, automaton
    # Offsets shifted by the call index keep a call's events apart from the next call's, even
    # when tokens of zero bytes end a call at the offset where the next call starts.
    ev = np.asarray(events, dtype=np.int64)
    ev_pos = ev[:, 0] + np.repeat(np.arange(len(calls), dtype=np.int64), per_call)
    token_pos = starts[:-1] + np.repeat(np.arange(len(calls), dtype=np.int64), lens)
    k = np.searchsorted(ev_pos, token_pos, side="right") - 1
    has = k >= 0
    out[has] = ev[k[has], 1]
    return out, automaton


TOKEN_BYTES_FORMAT = 1


@functools.lru_cache(maxsize=8)
def token_bytes_of(tokenizer: str) -> list[bytes]:
    """`load_tokenizer(tokenizer).token_bytes()` — the token→bytes map the structure-aware drafters
    need of a tokenizer — made once and then read from the disk cache (drafters/common/table_cache.py), keyed
    by the tokenizer file's bytes and the code that makes the map. Loading Qwen3's tokenizer and making
    its map takes ~1 s, every process; reading the map ~0.05 s. One list per tokenizer and process."""
    from agentspec_sim.trace import tokenizer as tokenizers

    key = table_cache.key_hash("token bytes", TOKEN_BYTES_FORMAT, (tokenizers.__file__, __file__), {},
                               tokenizers.tokenizer_file(tokenizer).read_bytes()).hexdigest()

    def make() -> table_cache.Arrays:
        table = tokenizers.load_tokenizer(tokenizer).token_bytes()
        return {"blob": np.frombuffer(b"".join(table), dtype=np.uint8),
                "ends": np.cumsum([len(t) for t in table], dtype=np.int64)}

    arrays = table_cache.cached_arrays("token-bytes", key, make, _valid_token_bytes)
    data, ends = arrays["blob"].tobytes(), arrays["ends"].tolist()
    return [data[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _valid_token_bytes(arrays: table_cache.Arrays) -> bool:
    blob, ends = arrays["blob"], arrays["ends"]
    return (blob.dtype == np.uint8 and ends.dtype == np.int64 and ends.ndim == 1
            and (ends.shape[0] == 0 or (ends[-1] == blob.shape[0] and bool((np.diff(ends, prepend=0) >= 0).all()))))


__all__ = ["ROOT", "Label", "StructureAutomaton", "block_labels", "segment", "segment_fed", "segment_many",
           "token_bytes_of"]
