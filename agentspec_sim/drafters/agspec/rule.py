"""`agspec`: retrieval drafting for coding agents, after the article on AgSpec ("AgSpec: Pushing the
Limits of Retrieval-Based Speculative Decoding in Coding Agent Pipelines", KAIST/SNU; the article
is `reference/001_*.txt` beside DESIGN.md). docs/agspec.md has the rules with the article's words.

Rule, per draft:

1. **Representations.** "When an agent opens an artifact from the workspace, AgSpec indexes the
   file in multiple emission representations": the raw file; for unified-diff harnesses the file
   with every line prefixed by ' ' (context) and by '-' (deletion); for JSON tool calls the
   JSON-string-escaped file (`json.dumps(text, ensure_ascii=False)[1:-1]`). Which forms a call's
   workspace corpus holds follows the call's `emission` (raw → raw; diff → raw, context, deletion;
   json → raw, json) and raw, context, deletion, json when the trace gives none (`forms`,
   `forms_when_absent`); the '+' form exists but is indexed only when asked for.
2. **Three corpora**, queried in priority order "active session first, opened workspace artifacts
   second, and static global references third"; the first that matches provides the draft
   (`select: "first"`; `"longest"` takes the longest match, ties by that order).
   - session: the call's own token history (its prompt — earlier turns, tool output, errors — and
     every token emitted so far; an agent's prompt already holds the query's earlier calls);
   - workspace: the call's `workspace` files (cumulative: every file opened in the query up to
     this call, latest content) in their representations, each tokenized on its own;
   - global: a static corpus built once (`global_corpus`): other queries' outputs from a trace
     file, or from the workload being replayed ("workload-other-queries"); the current query's
     own text is always excluded from it. Default "none".
   Matching is token-level: the longest suffix of the context (≥ `min_match` tokens, compared up
   to `max_match`) found in the corpus with at least one token after it; the draft is what
   follows, up to the cap, never past the end of a document (`corpus_index`).
3. **Caps.** "Profiling each agent role offline … setting an individual maximum draft cap per role":
   each call starts at its role's cap (`role_caps`, a file from `agentspec_sim.analysis.roles`;
   none: k). "If the current turn hits repeated rejections, it scales down draft length": a
   controller per call multiplies the cap by `shrink_factor` after `reject_streak` consecutive
   rejected drafts (`rejection`: first token rejected, or any) and adds `grow_step` after each
   fully accepted draft, never above the role cap nor below `min_cap` (with `min_cap` 0, one
   token is proposed every `probe_interval` steps so the cap can grow back).

Tokenization boundary: a workspace file is tokenized in isolation, so its first tokens may differ
from the same text inside an output (BPE merges across the boundary). Matching is on token ids of
the representation, so a copied block matches from its inner tokens on: drafting starts after
`min_match` tokens of the block were emitted as the isolated tokenization has them (at line starts
the pre-tokenizer splits the same way in both). Nothing is re-tokenized per step.

State: per drafter (one tenant): the tokenized representations (by content hash and form, LRU),
the workspace indexes (by their file list), the session indexes of finished calls (by query, reused
when the next call's prompt extends them — the index depends only on the tokens, so reuse never
changes a draft), the global corpus. Per call (`drafter_state`): its corpora and controller.

Config keys (defaults in `DEFAULTS`, checked by `configure`): `min_match`, `max_match`,
`max_candidates`, `corpora`, `select`, `forms`, `forms_when_absent`, `json_ensure_ascii`,
`global_corpus`, `role_caps`, `controller`, `rejection`, `reject_streak`, `shrink_factor`, `grow_step`,
`min_cap`, `probe_interval`, `tokenizer` (the trace's; null disables the workspace corpus).
`num_speculative_tokens` (k, default 16) is the most any draft holds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from agentspec_sim.drafters.agspec.corpus_index import NGramIndex, continuation_len, lookup
from agentspec_sim.drafters.registry import register_drafter
from agentspec_sim.engine.drafting import BaseDrafter, SpecConfigError, SpeculativeConfig
from agentspec_sim.io import strict_json

if TYPE_CHECKING:
    from agentspec_sim.engine.drafting import CallState
    from agentspec_sim.trace.schema import Call, Workload

# --------------------------------------------------------------------------------------------
# Representations (pure functions of the file text)

FORMS = ("raw", "context", "deletion", "addition", "json")
# What the article indexes for each harness: the raw file always ("for general context"), plus the
# diff variants ("one where every line has a leading space, and one where every line has a leading
# minus sign") or the escaped string ("if the harness uses JSON tool parameters").
EMISSION_FORMS: dict[str, tuple[str, ...]] = {
    "raw": ("raw",),
    "diff": ("raw", "context", "deletion"),
    "json": ("raw", "json"),
}
ALL_FORMS = ("raw", "context", "deletion", "json")  # `forms_when_absent: "all"`; '+' is opt-in


def prefix_lines(text: str, prefix: str) -> str:
    """Every line of `text` with `prefix` in front, as unified diff writes lines.

    Lines end at '\\n' only (a '\\r' stays in its line); an empty line becomes the prefix alone; a
    final newline stays final and starts no extra line. '' → ''."""
    if not text:
        return ""
    lines = text.split("\n")
    final_newline = lines[-1] == ""
    if final_newline:
        lines.pop()
    out = "\n".join(prefix + line for line in lines)
    return out + "\n" if final_newline else out


def raw_form(text: str) -> str:
    """The file as it sits on disk."""
    return text


def context_form(text: str) -> str:
    """The file as unchanged context lines of a unified diff: each line prefixed by ' '."""
    return prefix_lines(text, " ")


def deletion_form(text: str) -> str:
    """The file as deleted lines of a unified diff: each line prefixed by '-'."""
    return prefix_lines(text, "-")


def addition_form(text: str) -> str:
    """The file as added lines of a unified diff: each line prefixed by '+' (not indexed by default:
    added lines are new text, which the article does not index)."""
    return prefix_lines(text, "+")


def json_form(text: str, ensure_ascii: bool = False) -> str:
    """The file inside a JSON string parameter, without the quotes: `json.dumps(text)[1:-1]`.

    '\\n' → `\\n`, '"' → `\\"`, '\\' → `\\\\`, tab → `\\t`, other controls → `\\u00XX`. Non-ASCII text is
    kept as is (ensure_ascii=False), as chat templates render tool-call arguments (`tojson` in
    Hugging Face templates, and `agentspec_sim.trace.tokenizer`) and so as models emit them."""
    return json.dumps(text, ensure_ascii=ensure_ascii)[1:-1]


def represent(text: str, form: str, ensure_ascii: bool = False) -> str:
    """`text` in representation `form` (one of `FORMS`)."""
    if form == "raw":
        return text
    if form == "context":
        return context_form(text)
    if form == "deletion":
        return deletion_form(text)
    if form == "addition":
        return addition_form(text)
    if form == "json":
        return json_form(text, ensure_ascii)
    raise ValueError(f"unknown representation {form!r} (known: {', '.join(FORMS)})")


def forms_for(emission: str | None, forms: str | Sequence[str] = "emission",
              when_absent: str | Sequence[str] = "all") -> tuple[str, ...]:
    """The representations a call's workspace corpus holds.

    forms "emission": by the call's emission (`EMISSION_FORMS`); no emission → `when_absent`
    ("all" = `ALL_FORMS`, "raw", or a list). A list for `forms`: those, whatever the emission."""
    if not isinstance(forms, str):
        return tuple(forms)
    if emission in EMISSION_FORMS:
        return EMISSION_FORMS[emission]
    if isinstance(when_absent, str):
        return ALL_FORMS if when_absent == "all" else (when_absent,)
    return tuple(when_absent)


# --------------------------------------------------------------------------------------------
# Settings

CORPORA = ("session", "workspace", "global")
_SESSION, _WORKSPACE, _GLOBAL = range(3)

DEFAULT_K = 16
DEFAULTS: dict[str, Any] = {
    "min_match": 2,
    "max_match": 32,
    "max_candidates": 256,
    "corpora": ("session", "workspace", "global"),
    "select": "first",
    "forms": "emission",
    "forms_when_absent": "all",
    "json_ensure_ascii": False,
    "global_corpus": "none",
    "role_caps": None,
    "controller": True,
    "rejection": "first-token",
    "reject_streak": 2,
    "shrink_factor": 0.5,
    "grow_step": 1,
    "min_cap": 1,
    "probe_interval": 8,
    "tokenizer": "qwen3",
}
WORKLOAD_OTHER_QUERIES = "workload-other-queries"


@dataclass(frozen=True)
class AgSpecSettings:
    """The resolved knobs of one `agspec` configuration (see `DEFAULTS` and docs/agspec.md)."""

    k: int = DEFAULT_K
    min_match: int = 2
    max_match: int = 32
    max_candidates: int = 256
    corpora: tuple[str, ...] = ("session", "workspace", "global")
    select: str = "first"
    forms: str | tuple[str, ...] = "emission"
    forms_when_absent: str | tuple[str, ...] = "all"
    json_ensure_ascii: bool = False
    global_corpus: str = "none"
    role_caps: str | None = None
    controller: bool = True
    rejection: str = "first-token"
    reject_streak: int = 2
    shrink_factor: float = 0.5
    grow_step: int = 1
    min_cap: int = 1
    probe_interval: int = 8
    tokenizer: str | None = "qwen3"

    @classmethod
    def from_spec(cls, spec: SpeculativeConfig) -> AgSpecSettings:
        opts = {**DEFAULTS, **dict(spec.options)}
        k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else DEFAULT_K
        return cls(k=k, **{key: opts[key] for key in DEFAULTS})

    def forms_of(self, emission: str | None) -> tuple[str, ...]:
        return forms_for(emission, self.forms, self.forms_when_absent)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_forms(key: str, value: Any, allow: tuple[str, ...]) -> Any:
    """A `forms` option: one of the words in `allow`, or a non-empty list of representations (deduplicated)."""
    if isinstance(value, str):
        if value not in allow:
            raise SpecConfigError(f"{key}={value!r}: expected {' or '.join(map(repr, allow))} or a list of "
                                  f"representations ({', '.join(FORMS)})")
        return value
    if not isinstance(value, list | tuple) or not value or any(f not in FORMS for f in value):
        raise SpecConfigError(f"{key}={value!r}: a list of representations must be non-empty, from {', '.join(FORMS)}")
    return tuple(dict.fromkeys(value))


def validate_options(opts: dict[str, Any]) -> dict[str, Any]:
    """Check every agspec key (raising SpecConfigError with the rule) and normalise lists to tuples."""
    out = dict(opts)
    for key, lo in (("min_match", 1), ("max_match", 1), ("max_candidates", 1), ("reject_streak", 1),
                    ("grow_step", 0), ("min_cap", 0), ("probe_interval", 1)):
        if not _is_int(out[key]) or out[key] < lo:
            raise SpecConfigError(f"{key}={out[key]!r} must be an integer ≥ {lo}")
    if out["max_match"] < out["min_match"]:
        raise SpecConfigError(f"max_match ({out['max_match']}) must be ≥ min_match ({out['min_match']})")
    factor = out["shrink_factor"]
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 <= factor < 1:
        raise SpecConfigError(f"shrink_factor={factor!r} must be a number in [0, 1)")
    corpora = out["corpora"]
    if (not isinstance(corpora, list | tuple) or not corpora or any(c not in CORPORA for c in corpora)
            or len(set(corpora)) != len(corpora)):
        raise SpecConfigError(f"corpora={corpora!r}: a non-empty list of distinct names from {', '.join(CORPORA)} "
                              "(the query order)")
    out["corpora"] = tuple(corpora)
    if out["select"] not in ("first", "longest"):
        raise SpecConfigError(f"select={out['select']!r} must be 'first' (the article's priority order) or 'longest'")
    out["forms"] = check_forms("forms", out["forms"], ("emission",))
    out["forms_when_absent"] = check_forms("forms_when_absent", out["forms_when_absent"], ("all", *FORMS))
    if out["rejection"] not in ("first-token", "any-token"):
        raise SpecConfigError(f"rejection={out['rejection']!r} must be 'first-token' (a draft whose first token "
                              "was rejected) or 'any-token' (a draft not fully accepted)")
    for key in ("json_ensure_ascii", "controller"):
        if not isinstance(out[key], bool):
            raise SpecConfigError(f"{key}={out[key]!r} must be true or false")
    source = out["global_corpus"]
    if not isinstance(source, str) or not source:
        raise SpecConfigError(f"global_corpus={source!r}: 'none', '{WORKLOAD_OTHER_QUERIES}' or a trace path")
    if source not in ("none", WORKLOAD_OTHER_QUERIES) and not Path(source).expanduser().is_file():
        raise SpecConfigError(f"global_corpus={source!r}: no such trace file")
    tokenizer = out["tokenizer"]
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise SpecConfigError(f"tokenizer={tokenizer!r} must be a tokenizer name, a path, or null")
    check_role_caps(out["role_caps"])
    return out


def check_role_caps(caps: Any) -> None:
    """A `role_caps` option: None, or the path of a readable cap file (SpecConfigError otherwise)."""
    if caps is None:
        return
    if not isinstance(caps, str):
        raise SpecConfigError(f"role_caps={caps!r} must be the path of a cap file (agentspec-sim analyze roles)")
    try:
        read_cap_file(caps)
    except ValueError as exc:
        raise SpecConfigError(f"role_caps: {exc}") from None


# --------------------------------------------------------------------------------------------
# Cap files (written by agentspec_sim.analysis.roles)

CAP_FILE_VERSION = 1


@dataclass(frozen=True)
class RoleCaps:
    """Per-role draft caps: `caps[role]`, else `default` (calls with no role or an unprofiled one);
    `default` None means k."""

    caps: Mapping[str, int]
    default: int | None = None

    def cap_for(self, role: str | None, k: int) -> int:
        cap = self.caps.get(role) if role is not None else None
        if cap is None:
            cap = self.default if self.default is not None else k
        return min(int(cap), k)


def parse_cap_document(data: Any, where: str = "cap file") -> RoleCaps:
    """A cap-file document (`{"version": 1, "caps": {role: cap}, "default": cap, ...}`) → RoleCaps."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if data.get("version") != CAP_FILE_VERSION:
        raise ValueError(f"{where}: version {data.get('version')!r}, expected {CAP_FILE_VERSION}")
    caps = data.get("caps")
    if not isinstance(caps, dict) or not all(isinstance(r, str) and _is_int(c) and c >= 0 for r, c in caps.items()):
        raise ValueError(f"{where}: 'caps' must map role names to integers ≥ 0")
    default = data.get("default")
    if default is not None and (not _is_int(default) or default < 0):
        raise ValueError(f"{where}: 'default' must be an integer ≥ 0 or null")
    return RoleCaps(dict(caps), default)


def read_cap_file(path: str | os.PathLike) -> RoleCaps:
    """Read and check a cap file (ValueError names the file and what is wrong)."""
    p = Path(path).expanduser()
    try:
        data = strict_json.load_path(p)
    except OSError as exc:
        raise ValueError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    return parse_cap_document(data, str(p))


# --------------------------------------------------------------------------------------------
# The online controller


class CapController:
    """One call's draft cap: starts at the role cap; × `shrink_factor` (floor `min_cap`) after
    `reject_streak` consecutive rejected drafts; + `grow_step` (up to the role cap) after a fully
    accepted draft; any other draft ends the streak. A draft is *rejected* when its first token was
    (`rejection: "first-token"`: it saved nothing) or when any token was ("any-token"). At cap 0 one
    token is proposed every `probe_interval` steps. `controller: false`: always the role cap."""

    __slots__ = ("any_token", "cap", "ceiling", "enabled", "grow", "idle", "min_cap", "probe", "shrink", "streak",
                 "streak_limit")

    def __init__(self, ceiling: int, settings: AgSpecSettings) -> None:
        self.ceiling = int(ceiling)
        self.cap = self.ceiling
        self.enabled = settings.controller
        self.any_token = settings.rejection == "any-token"
        self.streak_limit = settings.reject_streak
        self.shrink = float(settings.shrink_factor)
        self.grow = settings.grow_step
        self.min_cap = min(settings.min_cap, self.ceiling)
        self.probe = settings.probe_interval
        self.streak = 0
        self.idle = 0

    def allowance(self) -> int:
        """The most tokens the next draft may hold (call once per drafting opportunity)."""
        if self.cap > 0:
            return self.cap
        if self.ceiling == 0:
            return 0
        self.idle += 1
        if self.idle >= self.probe:
            self.idle = 0
            return 1
        return 0

    def update(self, drafted: int, accepted: int) -> None:
        """The verification of a draft of `drafted` ≥ 1 tokens accepted `accepted` of them."""
        if not self.enabled or drafted <= 0:
            return
        if accepted <= 0 or (self.any_token and accepted < drafted):
            self.streak += 1
            if self.streak >= self.streak_limit:
                self.cap = max(self.min_cap, int(self.cap * self.shrink))
                self.streak = 0
        else:
            self.streak = 0
            if accepted >= drafted:
                self.cap = min(self.ceiling, self.cap + self.grow)


# --------------------------------------------------------------------------------------------
# Corpora


@functools.lru_cache(maxsize=2)
def _trace_corpus(path: str, mtime_ns: int, n: int, tokenizer: str | None) -> tuple[NGramIndex, dict]:
    from agentspec_sim.trace.io import load_trace

    workload = load_trace(path)
    meta_tok = workload.meta.tokenizer
    if tokenizer is not None and meta_tok is not None and meta_tok != tokenizer:
        raise SpecConfigError(f"global_corpus {path}: its tokenizer {meta_tok!r} is not the drafter's {tokenizer!r} "
                              "(token ids would not match)")
    return build_global_corpus(workload, n)


def build_global_corpus(workload: Workload, n: int) -> tuple[NGramIndex, dict]:
    """The global corpus of `workload`: every call's output, one document each, owned by its query
    ((agent_id, query_id) → owner id in the returned map), so a query's own text can be excluded."""
    owners: dict[tuple, int] = {}
    docs, tags = [], []
    for q in workload.queries:
        owner = owners.setdefault((q.agent_id, q.query_id), len(owners))
        for c in q.calls:
            docs.append(c.output_tokens)
            tags.append(owner)
    index = NGramIndex.from_docs(docs, n, tags)
    index.tokens.flags.writeable = False
    return index, owners


def load_global_corpus(source: str, n: int, tokenizer: str | None) -> tuple[NGramIndex, dict] | None:
    """The global corpus named by `global_corpus` (None for "none"; a trace path is built once per
    process and file version)."""
    if source == "none":
        return None
    if source == WORKLOAD_OTHER_QUERIES:
        raise ValueError("global_corpus 'workload-other-queries' is built by bind_workload")
    p = Path(source).expanduser().resolve()
    return _trace_corpus(str(p), p.stat().st_mtime_ns, n, tokenizer)


class RepresentationCache:
    """Token ids of file representations, tokenized once per distinct (content, form); LRU-bounded."""

    def __init__(self, tokenizer: str | None, ensure_ascii: bool, max_tokens: int = 8_000_000) -> None:
        self.tokenizer_name = tokenizer
        self.ensure_ascii = ensure_ascii
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[bytes, str], np.ndarray] = OrderedDict()
        self.tokens = 0
        self._tokenizer = None

    def _encoder(self):
        if self._tokenizer is None:
            from agentspec_sim.trace.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    @staticmethod
    def digest(content: str) -> bytes:
        return hashlib.blake2b(content.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, items: Sequence[tuple[bytes, str, str]]) -> list[np.ndarray]:
        """Token arrays of (digest, form, content) items, tokenizing the missing ones in one batch."""
        entries = self.entries
        missing = [(d, f, c) for d, f, c in dict.fromkeys(items) if (d, f) not in entries]
        if missing:
            texts = [represent(c, f, self.ensure_ascii) for _, f, c in missing]
            for (d, f, _), ids in zip(missing, self._encoder().encode_batch(texts), strict=True):
                ids.flags.writeable = False
                entries[(d, f)] = ids
                self.tokens += ids.shape[0]
        out = []
        for d, f, _ in items:
            entries.move_to_end((d, f))
            out.append(entries[(d, f)])
        while self.tokens > self.max_tokens and len(entries) > len(items):
            _, ids = entries.popitem(last=False)
            self.tokens -= ids.shape[0]
        return out


class Retriever:
    """AgSpec's retrieval (rules 1–2 of the module docstring) without an engine: the drafter drives it
    per step and `agentspec_sim.analysis.roles` per output position. One instance per tenant."""

    MAX_SESSIONS = 64  # finished calls' session indexes kept for the query's next call
    MAX_WORKSPACES = 64  # built workspace indexes, by file list

    def __init__(self, settings: AgSpecSettings, global_corpus: tuple[NGramIndex, dict] | None = None) -> None:
        self.s = settings
        self.order = tuple(CORPORA.index(c) for c in settings.corpora)
        self.use_workspace = "workspace" in settings.corpora and settings.tokenizer is not None
        self.reps = RepresentationCache(settings.tokenizer, settings.json_ensure_ascii)
        self.sessions: OrderedDict[Any, NGramIndex] = OrderedDict()
        self.workspaces: OrderedDict[tuple, NGramIndex] = OrderedDict()
        self.global_index: NGramIndex | None = None
        self.global_owners: dict = {}
        if "global" in settings.corpora:
            self.set_global(global_corpus)

    def set_global(self, corpus: tuple[NGramIndex, dict] | None) -> None:
        self.global_index, self.global_owners = corpus if corpus is not None else (None, {})

    # -- per call -------------------------------------------------------------------------------
    def begin(self, call: Call, tokens: np.ndarray) -> CallCorpora:
        """The corpora of a call whose history so far is `tokens` (prompt [+ first emitted token])."""
        key = (call.agent_id, call.query_id)
        session = self.sessions.pop(key, None)
        if session is None or not session.extends(tokens):
            session = NGramIndex(self.s.min_match, tokens.shape[0] + 256)
        workspace = self._workspace(call) if self.use_workspace and call.workspace else None
        exclude = self.global_owners.get(key, -1)
        return CallCorpora(key, session, workspace, exclude)

    def end(self, cc: CallCorpora) -> None:
        """The call is done: keep its session index for the query's next call (bounded LRU)."""
        self.sessions[cc.key] = cc.session
        self.sessions.move_to_end(cc.key)
        while len(self.sessions) > self.MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def _workspace(self, call: Call) -> NGramIndex | None:
        forms = self.s.forms_of(call.emission)
        items = [(RepresentationCache.digest(f.content), form, f.content) for f in call.workspace if f.content
                 for form in forms]
        if not items:
            return None
        key = tuple((d, form) for d, form, _ in items)
        index = self.workspaces.get(key)
        if index is None:
            index = NGramIndex.from_docs(self.reps.get(items), self.s.min_match)
            self.workspaces[key] = index
            while len(self.workspaces) > self.MAX_WORKSPACES:
                self.workspaces.popitem(last=False)
        else:
            self.workspaces.move_to_end(key)
        return index

    # -- per draft ------------------------------------------------------------------------------
    def draft(self, cc: CallCorpora, tokens: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
        """(draft of ≤ cap tokens, the corpus it came from: 0 session, 1 workspace, 2 global; -1 none)."""
        s = self.s
        session = cc.session
        session.sync(tokens)
        length = tokens.shape[0]
        n, max_n, max_cand = s.min_match, s.max_match, s.max_candidates
        best_m, best_src, best_start, best_corpus, best_end = 0, -1, -1, tokens, 0
        for src in self.order:
            if src == _SESSION:
                corpus, end = tokens, length
                start, m = lookup(tokens, length, tokens, length, session.tkey, session.tval, session.prev,
                                  session.owner, -1, n, max_n, max_cand)
            else:
                index = cc.workspace if src == _WORKSPACE else self.global_index
                if index is None:
                    continue
                corpus = index.tokens
                end = corpus.shape[0]
                start, m = lookup(tokens, length, corpus, end, index.tkey, index.tval, index.prev, index.owner,
                                  cc.exclude if src == _GLOBAL else -1, n, max_n, max_cand)
            if start >= 0 and m > best_m:
                best_m, best_src, best_start, best_corpus, best_end = m, src, start, corpus, end
                if s.select == "first":
                    break
        if best_src < 0:
            return _EMPTY, -1
        return best_corpus[best_start:best_start + continuation_len(best_corpus, best_start, best_end, cap)], best_src


class CallCorpora:
    """One call's view of the corpora: its session index, workspace index, and global exclusion."""

    __slots__ = ("exclude", "key", "session", "workspace")

    def __init__(self, key: Any, session: NGramIndex, workspace: NGramIndex | None, exclude: int) -> None:
        self.key, self.session, self.workspace, self.exclude = key, session, workspace, exclude


_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False


# --------------------------------------------------------------------------------------------
# The drafter


class _Slot:
    """Per call: its corpora, its cap controller, and the length of the draft awaiting verification."""

    __slots__ = ("corpora", "ctl", "pending")

    def __init__(self, corpora: CallCorpora, ctl: CapController) -> None:
        self.corpora = corpora
        self.ctl = ctl
        self.pending = 0


@register_drafter("agspec")
class AgSpecDrafter(BaseDrafter):
    """AgSpec retrieval drafting (module docstring); one instance per run and tenant."""

    # `--drafter agspec`: k=16, the static cap the AgSpec article names; role caps and the controller shrink it.
    shorthand: ClassVar[dict] = {"method": "agspec", "num_speculative_tokens": 16}

    config_keys: ClassVar[frozenset[str]] = frozenset(DEFAULTS)
    supports_batch_size_schedule: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        self.settings = s = AgSpecSettings.from_spec(spec)
        self.k = s.k
        self.caps = read_cap_file(s.role_caps) if s.role_caps else RoleCaps({}, None)
        corpus = None
        if "global" in s.corpora and s.global_corpus not in ("none", WORKLOAD_OTHER_QUERIES):
            corpus = load_global_corpus(s.global_corpus, s.min_match, s.tokenizer)
        self.retriever = Retriever(s, corpus)
        self._needs_workload = "global" in s.corpora and s.global_corpus == WORKLOAD_OTHER_QUERIES
        self.source_counts = [0, 0, 0]  # drafts proposed from session, workspace, global (diagnostics)

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        """Fill every key's default (k = 16) and check each (SpecConfigError with the rule). `tokenizer`
        stays unset unless given, so that an engine can bind the trace's (`setdefault`); unset means
        "qwen3"."""
        given = dict(spec.options)
        unknown = sorted(set(given) - set(DEFAULTS))
        if unknown:
            raise SpecConfigError(f"unknown agspec key(s): {', '.join(unknown)}")
        opts = validate_options({**DEFAULTS, **given})
        if "tokenizer" not in given:
            del opts["tokenizer"]
        k = spec.num_speculative_tokens if spec.num_speculative_tokens >= 0 else DEFAULT_K
        return replace(spec, num_speculative_tokens=k, options=tuple(sorted(opts.items())))

    def bind_workload(self, workload: Workload) -> None:
        """Build the global corpus of `global_corpus: "workload-other-queries"` from the workload being
        replayed (the engine calls this once, before the first call starts); a no-op otherwise."""
        if self._needs_workload:
            self.retriever.set_global(build_global_corpus(workload, self.settings.min_match))
            self._needs_workload = False

    # -- the engine's hooks ---------------------------------------------------------------------
    def start_call(self, state: CallState) -> None:
        """Attach the call's corpora (session index reused from the query's previous call when its
        prompt extends it) and a controller at the role's cap."""
        if self._needs_workload:
            raise SpecConfigError("agspec: global_corpus 'workload-other-queries' needs the engine to call "
                                  "AgSpecDrafter.bind_workload(workload) before the run; give a trace path instead")
        call = state.call
        corpora = self.retriever.begin(call, state.tokens)
        state.drafter_state = _Slot(corpora, CapController(self.caps.cap_for(call.role, self.k), self.settings))

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Per row: the first (or longest) corpus match's continuation, ≤ min(max_len, the call's cap)."""
        out = []
        retriever = self.retriever
        for row, m in zip(rows, max_lens, strict=True):
            slot: _Slot = row.drafter_state
            cap = min(int(m), slot.ctl.allowance())
            if cap <= 0:
                slot.pending = 0
                out.append(_EMPTY)
                continue
            draft, src = retriever.draft(slot.corpora, row.tokens, cap)
            slot.pending = int(draft.shape[0])
            if src >= 0:
                self.source_counts[src] += 1
            out.append(draft)
        return out

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        """Feed the verification of the pending draft to the controller: accepted = emitted − 1."""
        slot: _Slot | None = state.drafter_state
        if slot is not None and slot.pending:
            slot.ctl.update(slot.pending, min(int(emitted.shape[0]) - 1, slot.pending))
            slot.pending = 0

    def finish_call(self, state: CallState) -> None:
        """Keep the call's session index for the query's next call; drop the rest."""
        slot: _Slot | None = state.drafter_state
        if slot is not None:
            slot.corpora.session.sync(state.tokens)
            self.retriever.end(slot.corpora)
        state.drafter_state = None


__all__ = [
    "ALL_FORMS", "CORPORA", "DEFAULTS", "EMISSION_FORMS", "FORMS", "AgSpecDrafter", "AgSpecSettings", "CapController",
    "Retriever", "RoleCaps", "addition_form", "build_global_corpus", "context_form", "deletion_form", "forms_for",
    "json_form", "parse_cap_document", "prefix_lines", "raw_form", "read_cap_file", "represent",
]
