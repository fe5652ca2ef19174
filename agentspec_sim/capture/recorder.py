"""The trace file a recording proxy writes: one call appended per completed exchange, durable as it goes.

Identity (docs/trace-format.md, "Recording live agents"), first rule that applies:
1. the request headers `X-Agent-Id`, `X-Query-Id` (and `X-Agent-Role`);
2. the body's `metadata` object: `agent_id`, `query_id`, `role`;
3. chat calls whose messages start with an earlier call's messages followed by an assistant message join
   that call's query (and agent): an agent that re-sends its history is one query;
4. otherwise a new query `auto-N`; the agent is the body's `user` field, or `agent`.
A call's `seq` is its place among its query's completed calls; its think time is the gap between the end of
the query's previous call and this call's arrival at the proxy (0 when they overlapped).

Delta form: a call that extends its query's previous call is written with `prompt_extends`: as token ids
(`prompt_append_tokens`) when both carry the server's ids and the ids extend, as chat messages
(`messages_append`) when both are text and the messages extend.

Durability: every call is one `os.write` of a whole line (`.jsonl`) or of a whole zstd frame holding the line
(`.jsonl.zst`: frames concatenate, the loader reads every frame), on a descriptor opened with O_APPEND, so a
process killed at any point leaves only complete calls and a reader (`inspect`) sees only complete calls. The
file is fsynced at most once a second and on close. Reopening the same output continues it: a cut last line
or frame (a write the machine did not finish) is cut off, and the identities, sequence numbers and end times
already recorded are read back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from agentspec_sim.capture.exchange import Exchange, NotRecordable
from agentspec_sim.io.outputs import OutputError

SOURCE = "agentspec-sim proxy"
SUFFIXES = (".jsonl", ".jsonl.zst")
FSYNC_EVERY_S = 1.0
DEFAULT_AGENT = "agent"
# Queries whose last call is kept in memory for the delta form (an old query's next call is written whole).
DELTA_QUERIES = 4096


@dataclass(frozen=True, slots=True)
class Identity:
    """Who made a call, as far as the request says (None: not said)."""

    agent_id: str | None = None
    query_id: str | None = None
    role: str | None = None
    user: str | None = None

    @classmethod
    def of(cls, headers: dict[str, str] | object, body: dict) -> Identity:
        get = headers.get  # type: ignore[attr-defined]
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}

        def pick(header: str, key: str) -> str | None:
            value = get(header) or meta.get(key)
            return str(value) if isinstance(value, str | int) and not isinstance(value, bool) and value != "" else None

        user = body.get("user")
        return cls(pick("X-Agent-Id", "agent_id"), pick("X-Query-Id", "query_id"), pick("X-Agent-Role", "role"),
                   user if isinstance(user, str) and user else None)


@dataclass(slots=True)
class _Query:
    """What the next call of a query needs: its seq and when the query's last call ended."""

    next_seq: int = 0
    last_done_s: float | None = None


@dataclass(slots=True)
class _Last:
    """A query's last recorded call, for the delta form of its next one."""

    call_id: str
    tokens: list[int] | None  # prompt + output ids, when recorded as ids
    messages: list[dict] | None  # the trace's messages + the output as an assistant message, when text


def conversation_digests(messages: list[dict]) -> list[str]:
    """digests[n]: the SHA-256 of messages[:n] as sent (canonical JSON), for n = 0 … len(messages)."""
    h = hashlib.sha256()
    out = [h.hexdigest()]
    for m in messages:
        h.update(json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
        h.update(b"\n")
        out.append(h.hexdigest())
    return out


def trace_messages(messages: list[dict]) -> list[dict]:
    """Messages in the trace's form: role and text, an assistant's tool calls rendered into the text."""
    from agentspec_sim.trace.convert.openai_chat import message_text

    out = []
    for m in messages:
        try:
            out.append({"role": str(m.get("role")), "content": message_text(m)})
        except TypeError as exc:
            raise NotRecordable(f"messages: {exc}") from None
    return out


@dataclass
class RecorderStats:
    recorded: int = 0
    resumed_calls: int = 0
    as_token_ids: int = 0
    ids_past_vocabulary: int = 0
    not_recorded: Counter = field(default_factory=Counter)  # reason → count

    def as_dict(self) -> dict:
        return {"recorded": self.recorded, "resumed_calls": self.resumed_calls, "as_token_ids": self.as_token_ids,
                "ids_past_vocabulary": self.ids_past_vocabulary,
                "not_recorded": dict(sorted(self.not_recorded.items()))}


class TraceRecorder:
    """Appends recorded calls to `path` (created with its meta line, or continued)."""

    def __init__(self, path: str | os.PathLike, tokenizer: str = "qwen3", vocab_size: int | None = None,
                 clock=time.time) -> None:
        from agentspec_sim.trace.tokenizer import load_tokenizer

        self.path = Path(path)
        name = self.path.name
        if not name.endswith(SUFFIXES):
            raise OutputError(self.path, f"-o: the recording proxy writes {' or '.join(SUFFIXES)} (appended as it "
                                         "goes), not this name")
        self.compressed = name.endswith(".zst")
        tok = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.eot_text = tok.eot_text or ""
        self.vocab_size = max(tok.vocab_size, vocab_size or 0)
        self._clock = clock
        self.stats = RecorderStats()
        self._queries: dict[tuple[str, str], _Query] = {}
        self._conversations: dict[str, tuple[str, str]] = {}  # digest of a call's messages → its query key
        self._last: OrderedDict[tuple[str, str], _Last] = OrderedDict()
        self._ids: set[str] = set()
        self._auto = 0
        self._fd: int | None = None
        self._synced = 0.0
        self._zstd = None
        self._open()

    # ---- the file ------------------------------------------------------------------------------------------

    def _open(self) -> None:
        p = self.path
        if p.is_symlink() or (p.exists() and not stat.S_ISREG(p.stat().st_mode)):
            raise OutputError(p, "-o: not a regular file (a symlink, device or FIFO is never written by the proxy)")
        if self.compressed:
            import zstandard

            self._zstd = zstandard.ZstdCompressor(level=3)
        existing = p.exists() and p.stat().st_size > 0
        if existing:
            self._resume()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(p, flags, 0o666)
        except OSError as exc:
            raise OutputError(p, f"-o: cannot open for appending: {exc.strerror}", exc.errno or errno.EIO) from None
        if not existing:
            self.started_unix = self._clock()
            self._append({"type": "meta", "version": 1, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                          "workload": "recorded", "source": SOURCE,
                          "extra": {"started_unix": self.started_unix}})
            self._sync()

    def _resume(self) -> None:
        """Read back what an earlier run recorded; cut off an unfinished last write."""
        raw = self.path.read_bytes()
        try:
            text, keep = _complete_part(raw, self.compressed)
        except zstandard.ZstdError as exc:  # damaged, not merely cut off at its end
            raise OutputError(self.path, f"-o: cannot read it back ({exc}); choose a new file", errno.EINVAL) from None
        lines = text.split(b"\n")
        try:
            meta = json.loads(lines[0])
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or meta.get("type") != "meta" or meta.get("source") != SOURCE:
            raise OutputError(self.path, "-o: exists and is not a trace this proxy recorded; choose a new file (a "
                                         "recording continues only its own file)", errno.EEXIST)
        if meta.get("tokenizer") != self.tokenizer:
            raise OutputError(self.path, f"-o: was recorded with --tokenizer {meta.get('tokenizer')!r}, not "
                                         f"{self.tokenizer!r}", errno.EINVAL)
        self.vocab_size = int(meta.get("vocab_size") or self.vocab_size)
        self.started_unix = float((meta.get("extra") or {}).get("started_unix", self._clock()))
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (str(rec["agent_id"]), str(rec["query_id"]))
                seq = int(rec["seq"])
            except (ValueError, TypeError, KeyError):
                raise OutputError(self.path, f"-o: line {number} is not a call this proxy wrote; the file was changed "
                                             "since (continue it only as the proxy left it)", errno.EINVAL) from None
            q = self._queries.setdefault(key, _Query())
            q.next_seq = max(q.next_seq, seq + 1)
            extra = rec.get("extra") or {}
            done = (extra.get("timing") or {}).get("done_s")
            if isinstance(done, int | float):
                q.last_done_s = max(done, q.last_done_s or 0.0)
            if isinstance(extra.get("conversation"), str):
                self._conversations[extra["conversation"]] = key
            self._ids.add(str(rec["id"]))
            if key[1].startswith("auto-") and key[1][5:].isdigit():
                self._auto = max(self._auto, int(key[1][5:]))
            self.stats.resumed_calls += 1
        if keep < len(raw):
            os.truncate(self.path, keep)

    def _append(self, record: dict) -> None:
        try:
            line = (json.dumps(record, ensure_ascii=False, separators=(", ", ": "), allow_nan=False) + "\n").encode()
        except ValueError as exc:  # a NaN in a sampling parameter, say
            raise NotRecordable(f"not JSON-safe ({exc})") from None
        data = self._zstd.compress(line) if self._zstd is not None else line
        size = os.fstat(self._fd).st_size  # type: ignore[arg-type]
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)  # type: ignore[arg-type]
                view = view[n:]
        except OSError:
            # A full disk mid-line: take the part back, so the file still ends with a whole call.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # type: ignore[arg-type]
            raise
        now = time.monotonic()
        if now - self._synced >= FSYNC_EVERY_S:
            self._sync()

    def _sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
        self._synced = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self._sync()
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def now_s(self) -> float:
        """Seconds since the recording started (the trace's time axis)."""
        return self._clock() - self.started_unix

    # ---- calls ---------------------------------------------------------------------------------------------

    def skip(self, reason: str) -> None:
        """Count a call that passed through without being recorded."""
        self.stats.not_recorded[reason] += 1

    def record(self, x: Exchange, who: Identity, sent_s: float, first_s: float | None, done_s: float) -> dict:
        """Append the call; returns its record. Raises NotRecordable (nothing written) for one the trace cannot
        hold."""
        digests = conversation_digests(x.messages) if x.messages is not None else None
        key = self._query_key(who, digests, x.messages)
        q = self._queries.setdefault(key, _Query())
        seq = q.next_seq
        call_id = f"{key[0]}/{key[1]}/{seq}"
        while call_id in self._ids:
            call_id += "+"
        record: dict = {"type": "call", "id": call_id, "agent_id": key[0], "query_id": key[1], "seq": seq}
        if who.role:
            record["role"] = who.role
        following = self._body(record, x, self._last.get(key))
        if seq == 0:
            record["arrival_s"] = round(sent_s, 6)
        else:
            record["think_s"] = round(max(0.0, sent_s - (q.last_done_s if q.last_done_s is not None else sent_s)), 6)
        extra: dict = {"api": x.api, "stream": x.streamed}
        if x.model:
            extra["model"] = x.model
        if x.sampling:
            extra["sampling"] = x.sampling
        if x.finish_reason is not None:
            extra["finish_reason"] = x.finish_reason
        if x.usage:
            extra["usage"] = x.usage
        timing = {"sent_s": round(sent_s, 6), "done_s": round(done_s, 6)}
        if first_s is not None:
            timing["first_token_s"] = round(first_s, 6)
        extra["timing"] = timing
        if digests is not None:
            extra["conversation"] = digests[-1]
        record["extra"] = extra
        self._append(record)
        # Only now, with the call on disk, does it count.
        self._ids.add(call_id)
        q.next_seq = seq + 1
        q.last_done_s = done_s
        if digests is not None:
            self._conversations[digests[-1]] = key
        self._remember(key, following)
        self.stats.recorded += 1
        self.stats.as_token_ids += following.tokens is not None
        return record

    def _query_key(self, who: Identity, digests: list[str] | None, messages: list[dict] | None) -> tuple[str, str]:
        if who.query_id is not None:
            return (who.agent_id or who.user or DEFAULT_AGENT, who.query_id)
        if digests is not None and messages is not None:
            # The longest earlier conversation this one continues: messages[:n], then the assistant's answer.
            for n in range(len(messages) - 1, 0, -1):
                if messages[n].get("role") != "assistant":
                    continue
                key = self._conversations.get(digests[n])
                if key is not None and (who.agent_id is None or who.agent_id == key[0]):
                    return key
        self._auto += 1
        return (who.agent_id or who.user or DEFAULT_AGENT, f"auto-{self._auto}")

    def _body(self, record: dict, x: Exchange, last: _Last | None) -> _Last:
        """Set the prompt and output fields; returns what the query's next call may extend (`tokens` set when
        written as the server's token ids)."""
        call_id = record["id"]
        ids_ok = (x.prompt_token_ids and x.output_token_ids
                  and max(max(x.prompt_token_ids), max(x.output_token_ids)) < self.vocab_size)
        if x.prompt_token_ids and x.output_token_ids and not ids_ok:
            self.stats.ids_past_vocabulary += 1  # recorded as text: the trace's vocabulary could not hold them
        if ids_ok:
            prompt = x.prompt_token_ids
            if last is not None and last.tokens is not None and len(prompt) > len(last.tokens) \
                    and prompt[:len(last.tokens)] == last.tokens:
                record["prompt_extends"] = last.call_id
                record["prompt_append_tokens"] = prompt[len(last.tokens):]
            else:
                record["prompt_tokens"] = prompt
            record["output_tokens"] = x.output_token_ids
            return _Last(call_id, [*prompt, *x.output_token_ids], None)  # type: ignore[misc]
        text = x.output_message_text
        # The model ended its turn: the end-of-turn token is part of the output.
        ended = x.api == "chat" and x.finish_reason in ("stop", "tool_calls")
        output = text + self.eot_text if ended else text
        if not output:
            raise NotRecordable("empty output")
        record["output"] = output
        if x.messages is None:
            if isinstance(x.prompt, str):
                record["prompt"] = x.prompt
            else:
                record["prompt_tokens"] = x.prompt
            return _Last(call_id, None, None)
        msgs = trace_messages(x.messages)
        n = len(last.messages) if last is not None and last.messages is not None else 0
        if n and len(msgs) > n and msgs[:n] == last.messages:  # type: ignore[union-attr]
            record["prompt_extends"] = last.call_id  # type: ignore[union-attr]
            record["messages_append"] = msgs[n:]
        else:
            record["messages"] = msgs
        # The answer as the loader renders it into the next call's history: end-of-turn text stripped.
        answer = output[:-len(self.eot_text)] if self.eot_text and output.endswith(self.eot_text) else output
        return _Last(call_id, None, [*msgs, {"role": "assistant", "content": answer}])

    def _remember(self, key: tuple[str, str], last: _Last) -> None:
        self._last[key] = last
        self._last.move_to_end(key)
        while len(self._last) > DELTA_QUERIES:
            self._last.popitem(last=False)


def _complete_part(raw: bytes, compressed: bool) -> tuple[bytes, int]:
    """(the text of every whole line or zstd frame, how many bytes of `raw` hold it); corrupt zstd data raises."""
    if not compressed:
        keep = raw.rfind(b"\n") + 1
        return raw[:keep], keep
    from agentspec_sim.trace.io import zstd_frames

    return zstd_frames(raw)
