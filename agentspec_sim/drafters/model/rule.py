"""`eagle3` and `mtp`: model-based drafters, simulated by a seeded, calibrated acceptance model.

No draft weights run here, so *what* an EAGLE-3 head or an MTP layer would propose is replaced by
*whether* its proposal would match the target's token, drawn from a per-position statistical model
(DESIGN.md, "Drafters"); the drafting cost is the draft network's own (`draft_time`).

Behaviour kept from vLLM 0.33 (`EagleSpeculator` / `MTPSpeculator`, Model Runner V2, and the V1
`EagleProposer`): every drafting call gets exactly k draft tokens (chain drafting; the KV lookahead
is k), k = `num_speculative_tokens` or its per-batch-size schedule, truncated only by the engine's
max_model_len / token-budget rules. Drafting is k sequential forward passes of the draft network.

The acceptance model (per call, per step that starts at output position n, k draft slots):

    P(slot i accepted | slots 0..i−1 accepted) = σ(a_i + b_copy·copy(n+i) + b_code·code(n))

- a_i: per-position intercepts (conditional acceptance falls with depth); i ≥ len(a) uses the last.
- copy(p) = 1 when prompt lookup predicts the true token at output position p: the rightmost
  earlier occurrence of the trigram ending at p−1 (in prompt + output up to p−1) is followed by
  the token at p. Text that repeats its context is easier for any drafter, EAGLE and MTP included.
- code(n) = 1 when the step starts inside a semantic block of the call's `structure` (or a Markdown
  ``` fence when the call has no structure), from `structure.StructureAutomaton` fed with the
  emitted tokens' bytes; it is held for the whole window. 0 when the trace has no tokenizer.
- The parameters come from one JSON file per (method, target model) in `acceptance/`, each value
  with its source (fitted by `agentspec_sim.drafters.model.calibrate`); see docs/model-based-drafters.md.

Randomness is counter-based, never a shared generator: slot i of the step at output position n of
call c draws u = splitmix64 chain(seed, hash(call id), n, i) ∈ [0, 1), accepted iff u < P. So the
same seed gives the same drafts whatever the batch order, the tenant mix or the wall clock.

**The exception to the Drafter protocol.** A real drafter never sees the recorded continuation;
a *statistical model of* a drafter must, to decide whether its proposal would match. This module
reads it in exactly one place, `_continuation()`, which returns
`state.call.output_tokens[state.num_emitted : state.num_emitted + k]` — the k tokens the step will
be verified against, nothing further — and uses them (a) for the copy feature of those k positions
and (b) to write the draft: the true tokens for the accepted prefix, then at the first rejected
slot a token guaranteed to differ from the true one, then filler (that rejected token again), so
the engine's ordinary greedy verification reproduces the drawn acceptance. Slots past the end of
the recording are filler too (never accepted). Everything else (the trigram index, the structure
automaton) is built from the prompt and the emitted tokens only. `acceptance_tables` makes the same
reads for a whole run up front (copy(p) from the tokens up to p, code(n) from the output before n),
so the engine can draw in compiled code without the per-call state (docs/model-based-drafters.md).

Config (vLLM `--speculative-config`): `num_speculative_tokens` (required), `num_speculative_tokens_
per_batch_size`, and vLLM's `model` (the draft weights: accepted, ignored). Simulator keys:
`target_model` (which parameter file: the engine's model id; default file `<method>.default.json`),
`acceptance_params` (a parameter file path, e.g. from `agentspec-sim calibrate acceptance`; wins over
`target_model`), `seed` (default 0), `tokenizer` (the trace's tokenizer for the code feature; default
"qwen3", null disables the feature). `bind_engine_context` fills target_model / seed / tokenizer
from an engine run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numba import njit

from agentspec_sim.cost.profiles import default_draft_model, load_model, model_by_repo, model_ids
from agentspec_sim.cost.roofline import DRAFT_MODEL_KIND
from agentspec_sim.drafters.common import structure, table_cache
from agentspec_sim.drafters.common.structure import StructureAutomaton, segment_many, token_bytes_of
from agentspec_sim.drafters.registry import drafter_class, register_drafter
from agentspec_sim.engine.drafting import BaseDrafter, SpecConfigError, SpeculativeConfig
from agentspec_sim.io import strict_json

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.engine.drafting import CallState

ACCEPTANCE_DIR = Path(__file__).parent / "acceptance"
FEATURES = ("copy", "code")
# Calls without a `structure` are segmented by Markdown code fences (the code-vs-prose feature).
DEFAULT_STRUCTURE = ((("```", "```"),),)
SIMULATOR_KEYS = frozenset({"target_model", "acceptance_params", "acceptance_bound", "seed", "tokenizer"})
BOUNDS = ("low", "high")  # the parameter sets of a file's uncertainty band (`AcceptanceParams.band`)
_EMPTY = np.zeros(0, dtype=np.int32)
CODE_TABLES_FORMAT = 1  # of the code(n) segments in the disk cache (`_code_tables`); the code's bytes are keyed too
_MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class AcceptanceParams:
    """One (method, target model)'s acceptance model: logit intercepts per draft position and one
    coefficient per feature (`FEATURES`). `sources` says where each value comes from."""

    method: str
    model: str
    positions: tuple[float, ...]
    coefficients: Mapping[str, float] = field(default_factory=dict)
    source: str = ""
    sources: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    calibration: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None
    # The draft weights the figures were measured with, as vLLM's --speculative-config "model" names them
    # (EAGLE-3 needs one; `plan` prints it); None where the file's figures come from no one head.
    draft_model: str | None = None
    # The uncertainty band: {"low": {"positions": [...], "coefficients": {...}}, "high": {...}, "source": "..."},
    # parameter sets whose replays bound the acceptance (`with_bound`); empty where the file has none.
    band: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.positions:
            raise ValueError(f"acceptance parameters {self.path or self.model!r}: 'positions' is empty")
        if not all(math.isfinite(a) for a in self.positions):
            raise ValueError(f"acceptance parameters {self.path or self.model!r}: 'positions' must be finite")
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"acceptance parameters {self.path or self.model!r}: unknown feature(s) {unknown} "
                             f"(known: {', '.join(FEATURES)})")

    @property
    def a(self) -> np.ndarray:
        return np.asarray(self.positions, dtype=np.float64)

    def coefficient(self, name: str) -> float:
        return float(self.coefficients.get(name, 0.0))

    @property
    def has_band(self) -> bool:
        return all(b in self.band for b in BOUNDS)

    def with_bound(self, bound: str) -> AcceptanceParams:
        """This file's `bound` ("low" / "high") parameter set, as parameters of their own."""
        if bound not in BOUNDS:
            raise ValueError(f"acceptance_bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
        if not self.has_band:
            raise ValueError(f"acceptance parameters {self.path or self.model!r} have no uncertainty band")
        one = self.band[bound]
        return replace(self, positions=tuple(float(x) for x in one["positions"]),
                       coefficients={str(k): float(v) for k, v in dict(one.get("coefficients", {})).items()},
                       band={}, source=f"{self.source} [{bound} bound of its band]")

    def intercepts(self, k: int) -> np.ndarray:
        """a_0..a_{k−1}, positions past the calibrated ones taking the last value."""
        a = self.a
        return a[np.minimum(np.arange(k), a.shape[0] - 1)]

    @classmethod
    def from_json(cls, data: Mapping[str, Any], path: str | None = None) -> AcceptanceParams:
        where = path or "acceptance parameters"
        try:
            positions = tuple(float(x) for x in data["positions"])
            coefficients = {str(k): float(v) for k, v in dict(data.get("coefficients", {})).items()}
            return cls(method=str(data["method"]), model=str(data["model"]), positions=positions,
                       coefficients=coefficients, source=str(data.get("source", "")),
                       sources={str(k): str(v) for k, v in dict(data.get("sources", {})).items()},
                       aliases=tuple(str(a) for a in data.get("aliases", ())),
                       calibration=dict(data.get("calibration", {})), path=path,
                       draft_model=str(data["draft_model"]) if data.get("draft_model") else None,
                       band=_read_band(data.get("band")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {type(exc).__name__}: {exc} (needs method, model, positions[, "
                             "coefficients])") from None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "model": self.model, "source": self.source}
        if self.aliases:
            out["aliases"] = list(self.aliases)
        if self.draft_model:
            out["draft_model"] = self.draft_model
        out["positions"] = [round(float(a), 6) for a in self.positions]
        out["coefficients"] = {k: round(float(self.coefficient(k)), 6) for k in FEATURES}
        out["sources"] = dict(self.sources)
        if self.calibration:
            out["calibration"] = dict(self.calibration)
        if self.band:
            out["band"] = dict(self.band)
        return out


def _read_band(band: Any) -> dict[str, Any]:
    """A file's `band`, checked: both bounds, each with finite positions and known features."""
    if band is None:
        return {}
    if not isinstance(band, Mapping) or not all(isinstance(band.get(b), Mapping) for b in BOUNDS):
        raise ValueError(f"'band' needs {' and '.join(BOUNDS)} parameter sets")
    out: dict[str, Any] = dict(band)
    for b in BOUNDS:
        positions = [float(x) for x in band[b]["positions"]]
        coefficients = {str(k): float(v) for k, v in dict(band[b].get("coefficients", {})).items()}
        if not positions or not all(math.isfinite(x) for x in positions):
            raise ValueError(f"band.{b}.positions must be a non-empty list of finite numbers")
        unknown = sorted(set(coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"band.{b}: unknown feature(s) {unknown}")
        out[b] = {"positions": positions, "coefficients": coefficients}
    return out


def load_params_file(path: str | Path) -> AcceptanceParams:
    path = Path(path)
    try:
        data = strict_json.load_path(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read acceptance parameters ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return AcceptanceParams.from_json(data, str(path))


@functools.lru_cache(maxsize=64)
def _bundled(method: str) -> tuple[AcceptanceParams, ...]:
    return tuple(load_params_file(p) for p in sorted(ACCEPTANCE_DIR.glob(f"{method}.*.json")))


def available_params(method: str) -> list[str]:
    """The target models with a bundled parameter file for `method` ('default' included)."""
    return [p.model for p in _bundled(method)]


def load_params(method: str, model: str | None = None) -> AcceptanceParams:
    """The bundled parameters of (method, model): the file whose `model` or one of whose `aliases`
    equals `model` (case-insensitive; an HF repo id matches by its last part too), else the
    method's `default` file."""
    bundled = _bundled(method)
    if not bundled:
        raise ValueError(f"no acceptance parameter files for method {method!r} in {ACCEPTANCE_DIR}")
    if model:
        wanted = {model.lower(), model.rsplit("/", 1)[-1].lower()}
        for params in bundled:
            names = {params.model.lower(), *(a.lower() for a in params.aliases)}
            if names & wanted:
                return params
    for params in bundled:
        if params.model == "default":
            return params
    raise ValueError(f"no acceptance parameters for ({method}, {model}) and no {method}.default.json")


def resolve_params(spec: SpeculativeConfig) -> AcceptanceParams:
    """The parameters a config selects: `acceptance_params` (a file) else (`method`, `target_model`);
    with `acceptance_bound` ("low" / "high"), that bound of the file's uncertainty band."""
    path = spec.option("acceptance_params")
    params = load_params_file(path) if path else load_params(spec.method, spec.option("target_model"))
    bound = spec.option("acceptance_bound")
    if bound is not None:
        params = params.with_bound(bound)
    if params.method != spec.method:
        raise SpecConfigError(f"acceptance parameters {params.path} are for method {params.method!r}, "
                              f"not {spec.method!r}")
    return params


# --------------------------------------------------------------------------------------------
# Counter-based randomness


@njit(cache=True, nogil=True)
def splitmix64(x: np.uint64) -> np.uint64:
    """splitmix64's output function of x + golden gamma (a bijection on 64-bit words)."""
    z = np.uint64(x) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def uniform_draw(key: np.uint64, position: np.int64, slot: np.int64) -> float:
    """u ∈ [0, 1) for (call key, output position, draft slot): independent of every other triple."""
    h = splitmix64(splitmix64(key ^ np.uint64(position)) ^ np.uint64(slot))
    return float(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)


def call_key(seed: int, call_id: str) -> int:
    """The 64-bit key of one call instance under `seed` (blake2b of the id: stable across runs)."""
    digest = int.from_bytes(hashlib.blake2b(call_id.encode("utf-8"), digest_size=8).digest(), "little")
    return int(splitmix64(np.uint64(int(seed) & _MASK64))) ^ digest


# --------------------------------------------------------------------------------------------
# The copy feature: a trigram → rightmost-occurrence index, as an open-addressing hash table

_PACK = 1 << 21  # token ids below this pack three to a 63-bit key exactly (every tokenizer here)


@njit(cache=True, nogil=True, inline="always")
def _key3(a: np.int64, b: np.int64, c: np.int64) -> np.int64:
    if 0 <= a < _PACK and 0 <= b < _PACK and 0 <= c < _PACK:
        return (np.int64(a) << 42) | (np.int64(b) << 21) | np.int64(c)
    # Out-of-range ids: a mixed 63-bit key (a collision would only blur one feature value).
    h = splitmix64(splitmix64(splitmix64(np.uint64(a)) ^ np.uint64(b)) ^ np.uint64(c))
    return np.int64(h >> np.uint64(1))


@njit(cache=True, nogil=True, inline="always")
def _slot(key: np.int64, mask: np.int64) -> np.int64:
    return np.int64(splitmix64(np.uint64(key)) & np.uint64(mask))


@njit(cache=True, nogil=True)
def _table_put(keys: np.ndarray, vals: np.ndarray, key: np.int64, value: np.int64) -> int:
    mask = keys.shape[0] - 1
    s = _slot(key, mask)
    while True:
        k = keys[s]
        if k == key:
            vals[s] = value
            return 0
        if k == -1:
            keys[s] = key
            vals[s] = value
            return 1
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def _table_get(keys: np.ndarray, vals: np.ndarray, key: np.int64) -> np.int64:
    mask = keys.shape[0] - 1
    s = _slot(key, mask)
    while True:
        k = keys[s]
        if k == key:
            return vals[s]
        if k == -1:
            return -1
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def _table_index(keys: np.ndarray, vals: np.ndarray, tokens: np.ndarray, lo: int, hi: int) -> int:
    """Record the trigrams ending at e = lo..hi−1 (e ≥ 2), each as its latest end; returns new keys."""
    added = 0
    for e in range(max(lo, 2), hi):
        added += _table_put(keys, vals, _key3(tokens[e - 2], tokens[e - 1], tokens[e]), e)
    return added


@njit(cache=True, nogil=True)
def _table_rehash(keys: np.ndarray, vals: np.ndarray, new_keys: np.ndarray, new_vals: np.ndarray) -> None:
    for s in range(keys.shape[0]):
        if keys[s] != -1:
            _table_put(new_keys, new_vals, keys[s], vals[s])


@njit(cache=True, nogil=True)
def _window_copy(keys: np.ndarray, vals: np.ndarray, hist: np.ndarray, cont: np.ndarray, out: np.ndarray) -> None:
    """copy(p) for p = n..n+len(cont)−1, n = len(hist): the table holds trigrams ending at e ≤ n−2;
    occurrences ending inside the window region (e ≥ n−1) are scanned directly, rightmost first."""
    n = hist.shape[0]
    for j in range(cont.shape[0]):
        p = n + j
        out[j] = 0
        if p < 3:
            continue
        c0 = hist[p - 3] if p - 3 < n else cont[p - 3 - n]
        c1 = hist[p - 2] if p - 2 < n else cont[p - 2 - n]
        c2 = hist[p - 1] if p - 1 < n else cont[p - 1 - n]
        found = -1
        for e in range(p - 2, max(n - 2, 1), -1):  # e ∈ [max(n−1, 2), p−2]
            x0 = hist[e - 2] if e - 2 < n else cont[e - 2 - n]
            x1 = hist[e - 1] if e - 1 < n else cont[e - 1 - n]
            x2 = hist[e] if e < n else cont[e - n]
            if x0 == c0 and x1 == c1 and x2 == c2:
                found = e
                break
        if found < 0:
            found = _table_get(keys, vals, _key3(c0, c1, c2))
        if found >= 0:
            nxt = hist[found + 1] if found + 1 < n else cont[found + 1 - n]
            out[j] = 1 if nxt == cont[j] else 0


@njit(cache=True, nogil=True)
def copy_stream(tokens: np.ndarray, start: int, out: np.ndarray) -> None:
    """copy(p) for every p ≥ `start` of one token sequence (one pass; out has len(tokens) − start
    entries). The same values the drafter computes step by step (tests check it)."""
    length = tokens.shape[0]
    cap = 16
    while cap < 2 * length + 2:
        cap *= 2
    keys = np.full(cap, -1, dtype=np.int64)
    vals = np.empty(cap, dtype=np.int64)
    for p in range(length):
        if p - 2 >= 2:  # the trigram ending at p−2 (its next token, p−1, is now history)
            _table_put(keys, vals, _key3(tokens[p - 4], tokens[p - 3], tokens[p - 2]), p - 2)
        if p >= start:
            v = 0
            if p >= 3:
                e = _table_get(keys, vals, _key3(tokens[p - 3], tokens[p - 2], tokens[p - 1]))
                if e >= 0 and tokens[e + 1] == tokens[p]:
                    v = 1
            out[p - start] = v


class CopyIndex:
    """The trigram index of one call's history (prompt + emitted tokens): the latest end of every
    trigram whose next token is known. Grows by doubling; O(1) amortised per token."""

    __slots__ = ("count", "indexed", "keys", "vals")

    def __init__(self, expected: int = 64) -> None:
        cap = 16
        while cap < 2 * expected:
            cap *= 2
        self.keys = np.full(cap, -1, dtype=np.int64)
        self.vals = np.empty(cap, dtype=np.int64)
        self.count = 0
        self.indexed = 0  # trigrams ending at e < indexed are in the table

    def sync(self, tokens: np.ndarray) -> None:
        """Index every trigram ending at e ≤ len(tokens) − 2."""
        hi = tokens.shape[0] - 1
        if hi <= self.indexed:
            return
        need = self.count + (hi - self.indexed)
        if 2 * need > self.keys.shape[0]:
            cap = self.keys.shape[0]
            while cap < 2 * need:
                cap *= 2
            keys = np.full(cap, -1, dtype=np.int64)
            vals = np.empty(cap, dtype=np.int64)
            _table_rehash(self.keys, self.vals, keys, vals)
            self.keys, self.vals = keys, vals
        self.count += _table_index(self.keys, self.vals, tokens, self.indexed, hi)
        self.indexed = hi

    def window(self, tokens: np.ndarray, cont: np.ndarray) -> np.ndarray:
        """copy(p) for the positions of `cont`, which follows `tokens` (synced first)."""
        self.sync(tokens)
        out = np.zeros(cont.shape[0], dtype=np.int8)
        if cont.shape[0]:
            _window_copy(self.keys, self.vals, tokens, cont, out)
        return out


# --------------------------------------------------------------------------------------------
# The code feature


def structure_of(call_structure) -> tuple:
    """The structure the code feature segments by: the call's own, else Markdown fences."""
    return call_structure if call_structure else DEFAULT_STRUCTURE


# --------------------------------------------------------------------------------------------
# The acceptance draw


@njit(cache=True, nogil=True)
def accepted_prefix(a: np.ndarray, b_copy: float, b_code: float, copy: np.ndarray, code: int,
                    key: np.uint64, position: int, k: int) -> int:
    """How many of k slots the model accepts at output `position`: slot i (while i < len(copy), the
    slots with a true token) is accepted iff uniform_draw(key, position, i) < σ(a_i + b·x_i) and all
    earlier slots were."""
    m = min(k, copy.shape[0])
    last = a.shape[0] - 1
    for i in range(m):
        z = a[min(i, last)] + b_copy * copy[i] + b_code * code
        p = 1.0 / (1.0 + math.exp(-z))
        if uniform_draw(key, position, i) >= p:
            return i
    return m


@njit(cache=True, nogil=True)
def draft_from_tables(tokens: np.ndarray, out_start: int, position: int, target_len: int, k: int,
                      copy: np.ndarray, code: int, key: np.uint64, a: np.ndarray, coef: np.ndarray,
                      draft: np.ndarray) -> int:
    """`ModelBasedDrafter.propose` of one call from `AcceptanceTables`: its k draft tokens into draft[:k]
    (the recording's output starts at tokens[out_start]; `copy` holds copy(p) from p = position on);
    returns how many the model accepts."""
    m = min(k, target_len - position)
    ok = accepted_prefix(a, coef[0], coef[1], copy[:max(m, 0)], code, key, position, k)
    for i in range(ok):
        draft[i] = tokens[out_start + position + i]
    if ok < k:
        if ok < m:
            true = tokens[out_start + position + ok]
            wrong = true - 1 if true > 0 else 1  # any id but the true one
        else:
            wrong = tokens[out_start + position - 1]  # past the end of the recording: never accepted
        for i in range(ok, k):
            draft[i] = wrong
    return ok


@njit(cache=True, nogil=True)
def _copy_regions(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out_at: np.ndarray,
                  out: np.ndarray) -> None:
    for i in range(starts.shape[0]):
        s, n, o = starts[i], lengths[i], out_at[i]
        copy_stream(tokens[s:s + n], 0, out[o:o + n])


@dataclass(frozen=True)
class AcceptanceTables:
    """Every call's inputs to the acceptance draw, computed once for a run, so drafting needs no
    per-call state (the engine drafts from them in compiled code: `draft_from_tables`).

    copy(p) depends on the history before p alone, and calls that share their history's start in the
    engine's token arena (a query's calls, each prompt extending the last) share one stream over the
    longest of them: O(arena) work, not O(Σ prompts). code(n) is the call's own automaton's, fed from
    the call's first output token (`structure.segment`)."""

    copy_at: np.ndarray  # int64 [rows]: copy(prompt_len + n) of row r's output position n is copy[copy_at[r] + n]
    copy: np.ndarray  # int8
    code_at: np.ndarray  # int64 [rows]: code(n) of row r is code[code_at[r] + n]
    code: np.ndarray  # int8
    keys: np.ndarray  # uint64 [rows]: call_key(seed, call id)
    a: np.ndarray  # float64: the per-position intercepts
    coef: np.ndarray  # float64: [b_copy, b_code]


class _PerCall:
    """What the drafter keeps per call: its random key, trigram index and structure automaton."""

    __slots__ = ("automaton", "fed", "index", "key", "table")

    def __init__(self, key: int, prompt_len: int, automaton: StructureAutomaton | None,
                 table: list[bytes] | None) -> None:
        self.key = np.uint64(key)
        self.index = CopyIndex(prompt_len + 64)
        self.automaton = automaton
        self.table = table
        self.fed = 0  # output tokens fed to the automaton

    def code(self) -> int:
        return 0 if self.automaton is None or self.automaton.block_index == 0 else 1


_UNSET: Any = object()  # `bind_engine_context`'s "not given" (None is a value: an ids-only trace)


class ModelBasedDrafter(BaseDrafter):
    """The shared implementation of `eagle3` and `mtp` (see the module docstring)."""

    # Memory per token of the trace (its workload table, one tenant; its live state, per tenant).
    bytes_per_token = (26.0, 8.0)
    uses_draft_network = True
    async_scheduling = True  # eagle*, mtp and draft models keep vLLM 0.33's async scheduling

    config_keys: ClassVar[frozenset[str]] = SIMULATOR_KEYS
    supports_batch_size_schedule: ClassVar[bool] = True

    @classmethod
    def acceptance_params(cls, spec: SpeculativeConfig, model: str | None = None) -> AcceptanceParams:
        """The parameter file a run of `spec` on `model` reads (the config's own `target_model` /
        `acceptance_params` win, as in a run)."""
        return resolve_params(bind_engine_context(spec, model=model))

    def __init__(self, spec: SpeculativeConfig) -> None:
        super().__init__(spec)
        try:
            self.params = resolve_params(spec)
        except ValueError as exc:
            raise SpecConfigError(str(exc)) from None
        self.seed = int(spec.option("seed", 0))
        self.network = type(self).draft_network(spec, spec.option("target_model"))  # the cost model's kind
        tokenizer = spec.option("tokenizer", "qwen3")
        self.tokenizer = str(tokenizer) if tokenizer else None
        self._a = self.params.a
        self._b_copy = self.params.coefficient("copy")
        self._b_code = self.params.coefficient("code")

    @classmethod
    def bind_context(cls, spec: SpeculativeConfig, *, model: str | None = None, seed: int | None = None,
                     tokenizer: str | None = _UNSET, **_: Any) -> SpeculativeConfig:
        return bind_engine_context(spec, model=model, seed=seed, tokenizer=tokenizer)

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        if spec.num_speculative_tokens < 0:
            raise SpecConfigError(f"method {spec.method!r} needs num_speculative_tokens (vLLM has no default for it)")
        options = dict(spec.options)
        seed = options.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise SpecConfigError(f"seed must be an integer, got {seed!r}")
        for key in ("target_model", "acceptance_params", "acceptance_bound", "tokenizer"):
            value = options.get(key)
            if value is not None and not isinstance(value, str):
                raise SpecConfigError(f"{key} must be a string, got {value!r}")
        bound = options.get("acceptance_bound")
        if bound is not None and bound not in BOUNDS:
            raise SpecConfigError(f"acceptance_bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
        try:
            # The file is checked here; whether it has a band is checked when the drafter is made, after an
            # engine run has bound its target model (bind_engine_context), which may select another file.
            resolve_params(replace(spec, options=tuple(kv for kv in spec.options if kv[0] != "acceptance_bound")))
        except ValueError as exc:
            raise SpecConfigError(str(exc)) from None
        return spec

    # -- Drafter protocol -------------------------------------------------------------------------
    def start_call(self, state: CallState) -> None:
        automaton = table = None
        if self.tokenizer is not None:
            table = token_bytes_of(self.tokenizer)
            automaton = StructureAutomaton(structure_of(state.call.structure))
        cs = _PerCall(call_key(self.seed, state.draw_id), state.prompt_len, automaton, table)
        state.drafter_state = cs
        self._sync(state, cs)

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        self._sync(state, state.drafter_state)

    def finish_call(self, state: CallState) -> None:
        state.drafter_state = None

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Exactly `max_lens[i]` tokens for row i: the accepted prefix of the true continuation,
        then a token that differs from the true one, then filler."""
        out = []
        for row, m in zip(rows, max_lens, strict=True):
            k = int(m)
            cs: _PerCall = row.drafter_state
            tokens = row.tokens
            cont = _continuation(row, k)
            copy = cs.index.window(tokens, cont)
            n_ok = accepted_prefix(self._a, self._b_copy, self._b_code, copy, cs.code(), cs.key,
                                   row.num_emitted, k)
            out.append(_draft(tokens, cont, n_ok, k))
        return out

    def draft_time(self, cost: StepCostModel, rows: Sequence[CallState], max_lens: np.ndarray) -> float:
        """k sequential draft-network passes over the drafting rows (`cost.draft_model_time`)."""
        if not len(rows):
            return 0.0
        k = int(np.max(max_lens))
        context = np.fromiter((r.num_tokens for r in rows), dtype=np.int64, count=len(rows))
        try:
            return float(cost.draft_model_time(len(rows), k, context, kind=self.network))
        except TypeError:  # a cost model without draft kinds
            return float(cost.draft_model_time(len(rows), k, context))
        except ValueError as exc:  # the target model has no such draft network (e.g. mtp on Qwen3-8B)
            raise SpecConfigError(f"method {self.name!r}: {exc}") from None

    def draft_time_bound(self, cost: StepCostModel, num_calls: int, draft_len: int,
                         context_lens: np.ndarray) -> float | None:
        """`draft_time` of `num_calls` rows drafting `draft_len` tokens at these (largest) contexts."""
        if not num_calls:
            return 0.0
        try:
            return float(cost.draft_model_time(num_calls, draft_len, context_lens, kind=self.network))
        except TypeError:
            return float(cost.draft_model_time(num_calls, draft_len, context_lens))
        except ValueError:
            return None

    def acceptance_tables(self, tokens: np.ndarray, hist_off: np.ndarray, prompt_len: np.ndarray,
                          target_len: np.ndarray, calls: Sequence, call_ids: Sequence[str],
                          tokens_digest: bytes | None = None) -> AcceptanceTables:
        """`AcceptanceTables` of the calls laid out in an engine token arena: row r's prompt + recorded
        output (target_len[r] tokens of it) at tokens[hist_off[r]:]; `calls` give the structures,
        `call_ids` the random keys. The same draws as `propose` (tests/test_model_based.py).
        `tokens_digest`: a digest of `tokens`, which the code table's key then hashes instead of them."""
        rows = len(call_ids)
        extent: dict[int, int] = {}
        for off, n in zip(hist_off.tolist(), (prompt_len + target_len).tolist(), strict=True):
            extent[off] = max(extent.get(off, 0), n)
        starts = np.fromiter(extent.keys(), dtype=np.int64, count=len(extent))
        lengths = np.fromiter(extent.values(), dtype=np.int64, count=len(extent))
        out_at = np.zeros(len(extent), dtype=np.int64)
        np.cumsum(lengths[:-1], out=out_at[1:])
        copy = np.zeros(int(lengths.sum()) + 1, dtype=np.int8)
        _copy_regions(tokens, starts, lengths, out_at, copy)
        region_at = dict(zip(starts.tolist(), out_at.tolist(), strict=True))
        copy_at = np.array([region_at[o] for o in hist_off.tolist()], dtype=np.int64) + prompt_len
        code_at = np.zeros(rows, dtype=np.int64)
        if self.tokenizer is None or rows == 0:
            code = np.zeros(int(target_len.max(initial=0)) + 1, dtype=np.int8)
        else:
            code, code_at = self._code_tables(tokens, hist_off, prompt_len, target_len, calls, tokens_digest)
        keys = np.array([call_key(self.seed, cid) for cid in call_ids], dtype=np.uint64)
        return AcceptanceTables(copy_at, copy, code_at, code, keys, self._a.copy(),
                                np.array([self._b_copy, self._b_code], dtype=np.float64))

    def _code_tables(self, tokens: np.ndarray, hist_off: np.ndarray, prompt_len: np.ndarray,
                     target_len: np.ndarray, calls: Sequence,
                     tokens_digest: bytes | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(code, code_at): code(n) of every output position, one segment per distinct call (replicate
        copies share theirs), the calls of one structure segmented together. Made once per workload and
        tokenizer (the disk cache, drafters/common/table_cache.py): segmenting the default trace's outputs takes
        ~0.4 s, the same for every run of it — each cell of a sweep."""
        first_row: dict[int, int] = {}  # id(call) -> its first row
        first = np.array([first_row.setdefault(id(call), r) for r, call in enumerate(calls)], dtype=np.int64)
        structures = [structure_of(call.structure) for call in calls]
        key = table_cache.key_hash("code tables", CODE_TABLES_FORMAT, (__file__, structure.__file__),
                                   {"tokenizer": self.tokenizer}, tokens if tokens_digest is None else tokens_digest,
                                   hist_off, prompt_len, target_len, first,
                                   np.frombuffer(repr(structures).encode(), dtype=np.uint8)).hexdigest()
        got = table_cache.cached_arrays(
            "code-tables", key,
            lambda: dict(zip(("code", "code_at"), self._segment_code(tokens, hist_off, prompt_len, target_len,
                                                                     first, structures), strict=True)),
            lambda a: a["code"].dtype == np.int8 and a["code_at"].shape == (len(calls),))
        return got["code"], got["code_at"]

    def _segment_code(self, tokens: np.ndarray, hist_off: np.ndarray, prompt_len: np.ndarray,
                      target_len: np.ndarray, first: np.ndarray, structures: list[tuple]
                      ) -> tuple[np.ndarray, np.ndarray]:
        """`_code_tables`, computed: row r's call is first seen at row first[r], its structure structures[r]."""
        table = token_bytes_of(self.tokenizer)
        size = len(table)
        padded = None
        by_structure: dict[tuple, list[int]] = {}
        for r, f in enumerate(first.tolist()):
            if f == r:
                by_structure.setdefault(structures[r], []).append(r)
        code_at = np.zeros(first.shape[0], dtype=np.int64)
        pieces: list[np.ndarray] = []
        at = 0
        for call_structure, rows in by_structure.items():
            outputs = []
            for r in rows:
                out = tokens[hist_off[r] + prompt_len[r]:hist_off[r] + prompt_len[r] + target_len[r]]
                if out.shape[0] and (int(out.min()) < 0 or int(out.max()) >= size):
                    # ids the tokenizer lacks feed no bytes, as `_sync` feeds them
                    padded = padded or [*table, b""]
                    out = np.where((out >= 0) & (out < size), out, size)
                outputs.append(out)
            labels = segment_many(outputs, padded or table, call_structure)
            pieces.append((labels != 0).astype(np.int8))
            for r, out in zip(rows, outputs, strict=True):
                code_at[r] = at
                at += out.shape[0]
        code_at = code_at[first]
        pieces.append(np.zeros(1, dtype=np.int8))
        return np.concatenate(pieces), code_at

    # -- helpers ------------------------------------------------------------------------------------
    def _sync(self, state: CallState, cs: _PerCall) -> None:
        tokens = state.tokens
        cs.index.sync(tokens)
        if cs.automaton is not None and cs.fed < state.num_emitted:
            ids = tokens[state.prompt_len + cs.fed:]
            table = cs.table
            size = len(table)
            cs.automaton.feed(b"".join(table[t] if 0 <= t < size else b"" for t in ids.tolist()))
            cs.fed = state.num_emitted


def _continuation(state: CallState, k: int) -> np.ndarray:
    """THE ONE READ OF THE RECORDED CONTINUATION (see the module docstring): the k tokens the next
    step is verified against (fewer at the end of the recording)."""
    return state.call.output_tokens[state.num_emitted:state.num_emitted + k]


def _draft(tokens: np.ndarray, cont: np.ndarray, accepted: int, k: int) -> np.ndarray:
    out = np.empty(k, dtype=np.int32)
    out[:accepted] = cont[:accepted]
    if accepted < k:
        if accepted < cont.shape[0]:
            true = int(cont[accepted])
            wrong = true - 1 if true > 0 else 1  # any id but the true one
        else:
            wrong = int(tokens[-1])  # past the end of the recording: never verified as accepted
        out[accepted:] = wrong
    return out


@register_drafter("eagle3")
class Eagle3Drafter(ModelBasedDrafter):
    """EAGLE-3 (Li et al. 2025) chain drafting as vLLM runs it, by the calibrated acceptance model."""

    # `--drafter eagle3`: k=3, the default of the published EAGLE-3 speculator heads that `vllm serve` reads.
    shorthand: ClassVar[dict] = {"method": "eagle3", "num_speculative_tokens": 3}


@register_drafter("mtp")
class MTPDrafter(ModelBasedDrafter):
    """MTP (DeepSeek-V3 / MiMo multi-token prediction layers, reused for k > 1 as vLLM does)."""

    # `--drafter mtp`: k=1, vLLM's default of one step per MTP layer (MiMo-7B has one).
    shorthand: ClassVar[dict] = {"method": "mtp", "num_speculative_tokens": 1}


@register_drafter("draft_model")
class DraftModelDrafter(ModelBasedDrafter):
    """vLLM's `draft_model` method: a small model of the target's family (its tokenizer) drafts k tokens, one forward
    pass of its own each (vllm/v1/spec_decode/draft_model.py), priced as that model's passes (cost model kind
    `draft_model:<id>`). The `model` key names the draft (a bundled profile id or its Hugging Face repo); without
    it, the smallest dense bundled model of the target's family with its vocabulary (`default_draft_model`).
    Acceptance: the bundled `draft_model.*.json` (an assumption, stated in the file)."""

    # `--drafter draft_model`: k=3 (vLLM has no default; a small draft model's passes cost more than a head's).
    shorthand: ClassVar[dict] = {"method": "draft_model", "num_speculative_tokens": 3}

    @classmethod
    def draft_network(cls, spec: SpeculativeConfig, model: str | None = None) -> str:
        return DRAFT_MODEL_KIND + draft_model_of(spec, model)

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        given = spec.raw.get("model")
        if given is not None and not isinstance(given, str):
            raise SpecConfigError(f"draft_model: model must be a model id or Hugging Face repo, got {given!r}")
        if given is not None and model_by_repo(given) is None:
            raise SpecConfigError(f"draft_model: no model profile for {given!r} (bundled: {', '.join(model_ids())}; "
                                  "the draft model must be a bundled profile, by id or Hugging Face repo)")
        return super().configure(spec)


def draft_model_of(spec: SpeculativeConfig, target: str | None) -> str:
    """The profile id of the draft model a `draft_model` config runs for `target` (see `DraftModelDrafter`)."""
    given = spec.raw.get("model")
    if given:
        ident = model_by_repo(str(given))
        if ident is None:
            raise SpecConfigError(f"draft_model: no model profile for {given!r}")
        return ident
    if target is None:
        raise SpecConfigError('draft_model needs its draft model: "model" in the speculative config')
    ident = default_draft_model(load_model(target))
    if ident is None:
        raise SpecConfigError(f"draft_model: no bundled model of {target}'s family shares its vocabulary; name the "
                              'draft model ("model" in the speculative config)')
    return ident


def bind_engine_context(spec: SpeculativeConfig, *, model: str | None = None, seed: int | None = None,
                        tokenizer: str | None = _UNSET) -> SpeculativeConfig:
    """Fill the simulator keys an engine run knows into a model-based drafter's config, unless the
    config sets them: `target_model` (the engine's model id), `seed` (the run's seed) and `tokenizer`
    (the trace's `meta.tokenizer`; None for an ids-only trace, which turns the code feature off).
    Configs of other methods are returned unchanged."""
    if not issubclass(drafter_class(spec.method), ModelBasedDrafter):
        return spec
    options = dict(spec.options)
    if model is not None:
        options.setdefault("target_model", model)
    if seed is not None:
        options.setdefault("seed", int(seed))
    if tokenizer is not _UNSET:
        options.setdefault("tokenizer", tokenizer)
    return replace(spec, options=tuple(sorted(options.items())))


__all__ = [
    "ACCEPTANCE_DIR", "BOUNDS", "FEATURES", "AcceptanceParams", "AcceptanceTables", "CopyIndex", "DraftModelDrafter",
    "Eagle3Drafter", "MTPDrafter", "ModelBasedDrafter", "accepted_prefix", "available_params", "bind_engine_context",
    "call_key", "copy_stream", "draft_from_tables", "draft_model_of", "load_params", "load_params_file",
    "resolve_params", "uniform_draw",
]
