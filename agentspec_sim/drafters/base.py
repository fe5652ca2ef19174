"""The drafter interface, the drafter registry, and vLLM's `--speculative-config` parsing.

A drafter decides *what* is proposed; the engine decides how many tokens each call may draft (the
budget policy, `agentspec_sim.budget`) and verifies the proposal against the recorded output.
Adding a drafter is one new module in this package that defines a class decorated with
`@register_drafter("name")`: the registry imports every module of the package on first lookup, so
the CLI, sweeps and configs find it by name and nothing else changes — its compiled fast path
included, which the engine reaches only through drafters/protocol.py (docs/adding-a-drafter.md).

Speculative configs are the JSON `vllm serve --speculative-config` takes (vLLM 0.33,
`vllm/config/speculative.py`): `method`, `num_speculative_tokens`, `num_speculative_tokens_per_batch_size`,
plus the keys the method itself declares (ngram: `prompt_lookup_min`/`prompt_lookup_max`). A
handful of vLLM keys that only pick weights or kernels are accepted and have no effect here
(`NO_EFFECT_KEYS`). Any other key is an error, as in vLLM.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from agentspec_sim.cost.base import StepCostModel
    from agentspec_sim.engine.request import CallState


class SpecConfigError(ValueError):
    """A speculative config (JSON or `--drafter` name) that vLLM would reject, with the reason."""


# Keys every method accepts (vLLM SpeculativeConfig fields the simulator models).
# `budget_policy` (simulator-only) picks a registered budget policy, e.g. "adaspec" (agentspec_sim.budget).
COMMON_KEYS = frozenset({"method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "budget_policy"})
# vLLM fields that select weights, kernels or parallelism of a draft model: accepted, no effect here.
NO_EFFECT_KEYS = frozenset({"model", "draft_tensor_parallel_size", "quantization", "revision", "code_revision"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculative-decoding configuration, resolved (defaults filled, vLLM's rules applied).

    `num_speculative_tokens` is k, the most tokens a call drafts per step (0 for `normal`).
    `num_speculative_tokens_per_batch_size` holds `(start, end, k)` inclusive ranges of the number
    of requests scheduled in a step. `options` holds the method's own keys (sorted (key, value) pairs),
    `label` the name shown in tables (default: the method).
    """

    method: str
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    options: tuple[tuple[str, Any], ...] = ()
    label: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.label or self.method

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str, label: str | None = None) -> SpeculativeConfig:
        """Parse a `--speculative-config` JSON object (a dict or its JSON text) as vLLM does."""
        if isinstance(data, str):
            data = _config_json(data)
        if not isinstance(data, Mapping):
            raise SpecConfigError(f"speculative config must be a JSON object such as {_EXAMPLE}, got "
                                  f"{_json_kind(data)}")
        method = data.get("method")
        if not isinstance(method, str) or not method:
            raise SpecConfigError(f'speculative config needs "method" (e.g. {_EXAMPLE})')
        drafter_cls = drafter_class(method)
        allowed = COMMON_KEYS | NO_EFFECT_KEYS | frozenset(drafter_cls.config_keys)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise SpecConfigError(f"unknown key(s) {', '.join(map(repr, unknown))} in speculative config for "
                                  f"method {method!r} (accepted: {', '.join(sorted(allowed))})")
        _check_numbers(data)
        k = data.get("num_speculative_tokens")
        _check_k(method, k)
        policy = data.get("budget_policy")
        if policy is not None and not isinstance(policy, str):
            raise SpecConfigError(f"budget_policy must be a policy name (a string), got {_json_kind(policy)}")
        schedule = data.get("num_speculative_tokens_per_batch_size")
        spec = cls(
            method=method,
            num_speculative_tokens=int(k) if k is not None else -1,  # -1: not given (the method decides)
            prompt_lookup_min=data.get("prompt_lookup_min"),
            prompt_lookup_max=data.get("prompt_lookup_max"),
            num_speculative_tokens_per_batch_size=None if schedule is None else _parse_schedule(schedule),
            options=tuple(sorted((key, data[key]) for key in data
                                 if key in drafter_cls.config_keys and not key.startswith("prompt_lookup_"))),
            label=label,
            raw=dict(data),
        )
        spec = drafter_cls.configure(spec)
        if spec.num_speculative_tokens < 0:
            raise SpecConfigError(f"method {method!r} needs num_speculative_tokens")
        if spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:  # a default the method derived (suffix: depth)
            raise SpecConfigError(f"num_speculative_tokens ({spec.num_speculative_tokens}, from the method's "
                                  f"settings) must be ≤ {MAX_SPECULATIVE_TOKENS}")
        if policy is not None:
            from agentspec_sim.budget import budget_policy_name

            budget_policy_name(spec)  # an unknown name fails now, not when the run starts
        if spec.num_speculative_tokens_per_batch_size is not None and not drafter_cls.supports_batch_size_schedule:
            raise SpecConfigError(f"num_speculative_tokens_per_batch_size is not supported for method {method!r} "
                                  "(vLLM 0.33 supports it for ngram, eagle, eagle3, mtp)")
        return spec

    def to_json(self) -> dict[str, Any]:
        """The resolved config as `--speculative-config` JSON (defaults made explicit). The vLLM keys that
        have no effect here (`NO_EFFECT_KEYS`: the draft `model`…) are kept as given, so a configuration
        printed for `vllm serve` still names the draft weights the user chose."""
        out: dict[str, Any] = {"method": self.method}
        if self.method != "normal":
            out["num_speculative_tokens"] = self.num_speculative_tokens
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        if self.num_speculative_tokens_per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.num_speculative_tokens_per_batch_size]
        out.update(dict(self.options))
        for key in sorted(NO_EFFECT_KEYS & set(self.raw)):
            out.setdefault(key, self.raw[key])
        return out


# The longest draft the simulator takes: per-call draft buffers are sized by k, and no context is long
# enough for more to matter (vLLM itself sets no upper bound).
MAX_SPECULATIVE_TOKENS = 4096
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 5}'
INT64_MAX = 2**63 - 1


def _json_kind(value: object) -> str:
    return {dict: "an object", list: "a list", tuple: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _config_json(text: str) -> Any:
    """The JSON value of a speculative config's text, parsed strictly (agentspec_sim/strict_json.py)."""
    from agentspec_sim import strict_json

    try:
        return strict_json.loads(text)
    except strict_json.StrictJSONError as exc:
        if exc.field:  # a duplicate key, NaN, a lone surrogate: name the key
            raise SpecConfigError(f"speculative config: {exc.field}: {exc.message}") from None
        raise SpecConfigError(f"speculative config is not valid JSON: {exc.message}") from None


def _check_numbers(data: Mapping[str, Any]) -> None:
    """Every number in a config (nested too) is finite and every integer fits in 64 bits: a config given
    as a dict can hold NaN, and the engine's compiled code takes integers as int64."""
    stack: list[tuple[str, Any]] = list(data.items())
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecConfigError(f"speculative config: {where}: must be a finite number, got {value}")
        if is_int(value) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise SpecConfigError(f"speculative config: {where}: {value} does not fit in 64 bits")
        if isinstance(value, Mapping):
            stack.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def _check_k(method: str, k: object) -> None:
    """vLLM 0.33's rule for num_speculative_tokens (vllm/config/speculative.py): the field is declared
    `Field(default=None, gt=0)` (line 413) and `_verify_args` raises "Expected num_speculative_tokens to be
    greater than zero" (line 1967), for every method; None lets the method decide (suffix: the tree depth,
    mtp: the draft model's n_predict) or is refused. `normal` (no speculation, the simulator's baseline,
    not a vLLM method) takes 0 or nothing."""
    if k is None:
        return
    if not is_int(k):
        raise SpecConfigError(f"num_speculative_tokens must be an integer, got {_json_kind(k)} {k!r}")
    if method == "normal":
        if k != 0:
            raise SpecConfigError("method 'normal' drafts nothing; num_speculative_tokens must be 0 or absent")
        return
    if k <= 0:
        raise SpecConfigError(f"num_speculative_tokens must be > 0, got {k} (vLLM refuses 0 and below for every "
                              "method; for no speculation use the drafter 'normal')")
    if k > MAX_SPECULATIVE_TOKENS:
        raise SpecConfigError(f"num_speculative_tokens must be ≤ {MAX_SPECULATIVE_TOKENS}, got {k}")


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON configs give both)."""
    return isinstance(value, int) and not isinstance(value, bool)


def grown(array: np.ndarray, rows: int, fill: int) -> np.ndarray:
    """`array` if it has ≥ `rows` rows, else a copy with at least twice as many, the new rows `fill`
    (per-row state that drafters share with the engine's compiled loop grows this way)."""
    if rows <= array.shape[0]:
        return array
    out = np.full((max(2 * array.shape[0], rows), *array.shape[1:]), fill, dtype=array.dtype)
    out[:array.shape[0]] = array
    return out


def _parse_schedule(value: object) -> tuple[tuple[int, int, int], ...]:
    """Validate `[[start, end, k], ...]`: inclusive ranges of scheduled requests, the first from 1."""
    what = "num_speculative_tokens_per_batch_size"
    if not isinstance(value, list | tuple) or not value:
        raise SpecConfigError(f"{what} must be a non-empty list of [start, end, k]")
    ranges: list[tuple[int, int, int]] = []
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 3 or not all(is_int(x) for x in item):
            raise SpecConfigError(f"{what}: each entry must be [start, end, k] integers, got {item!r}")
        start, end, k = item
        if start < 1 or end < start or k < 0:
            raise SpecConfigError(f"{what}: need 1 ≤ start ≤ end and k ≥ 0, got {list(item)}")
        if ranges and start <= ranges[-1][1]:
            raise SpecConfigError(f"{what}: ranges must be ascending and not overlap, got {list(item)} "
                                  f"after {list(ranges[-1])}")
        ranges.append((start, end, k))
    if ranges[0][0] != 1:
        raise SpecConfigError(f"{what}: the first range must start at 1, got {list(ranges[0])}")
    return tuple(ranges)


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for running calls. One instance per run and tenant (replicate copy).

    The engine drives it in this order for each call: `start_call` once, when the call's prompt is
    fully prefilled and its first output token has been sampled; then, after every engine step in
    which the call emitted tokens, `observe` with exactly those tokens, and (if the call goes on)
    `propose` for the next step; `finish_call` once, after the call's last `observe`. A preempted
    call keeps its state and is not started again. Exceptions the V1 runner imposes: in a step whose
    batch has a request within k tokens of max_model_len nobody is proposed for (the engine hands out
    k token-0 drafts), and a drafter with `driven_per_step` (suffix) is driven as vLLM drives it:
    `propose` after every step, no `observe` at max_model_len or in such skipped steps.

    What a drafter may read of a `CallState`: `call` (the trace `Call`: agent_id, query_id, role,
    structure, workspace — never `output_tokens`), `tokens` (prompt + tokens emitted so far; the
    buffer behind it is larger, and reading past `num_tokens` is reading the answer), `num_tokens`,
    `prompt_len`, `num_emitted`, and `drafter_state`, a slot the drafter owns. It must not assume
    where the recorded output ends.
    """

    name: ClassVar[str]

    def start_call(self, state: CallState) -> None:
        """Pre: `state.num_emitted == 1`. Post: the drafter may keep per-call state in `state.drafter_state`."""

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        """Draft for the next step, one call per row.

        Pre:  every row is started, not finished, and sampled a token in the step just ended;
              `max_lens[i] ≥ 1` (rows whose budget is 0 are not passed).
        Post: returns `len(rows)` int32 arrays, the i-th of length ≤ `max_lens[i]` (empty: no
              draft); proposals depend only on what the drafter has been shown (determinism).
        """
        ...

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        """Pre: `emitted` (≥ 1 token) is already appended to `state.tokens`. Post: state updated."""

    def finish_call(self, state: CallState) -> None:
        """The call emitted its last token; release per-call state (shared history may keep it)."""

    def draft_time(self, cost: StepCostModel, rows: Sequence[CallState], max_lens: np.ndarray) -> float:
        """Seconds of drafting for one `propose` over `rows` (before the step that verifies them); ≥ 0."""
        ...


class BaseDrafter:
    """Default no-op hooks and model-free drafting cost; drafters subclass it and override `propose`.

    Class attributes a drafter sets: `name` (registry key), `config_keys` (its own speculative-config
    keys), `supports_batch_size_schedule` (vLLM allows `num_speculative_tokens_per_batch_size`).
    `configure` applies the method's defaults and vLLM's validation to a parsed config.
    """

    name: ClassVar[str] = ""
    config_keys: ClassVar[frozenset[str]] = frozenset()
    supports_batch_size_schedule: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        return spec

    @classmethod
    def bind_context(cls, spec: SpeculativeConfig, **context: Any) -> SpeculativeConfig:
        """`spec` with what an engine run knows filled in where the drafter's config takes it and does not
        set it (`bind_engine_context`: hardware, model, tensor_parallel_size, calibration, seed, tokenizer)."""
        return spec

    def engine_drafting(self, run: Any) -> Any:
        """This drafter's fast path for a run (drafters/protocol.py `EngineDrafting`, given a `RunView`), or
        None: the engine drives the hooks and `propose`."""
        return None

    def start_call(self, state: CallState) -> None:
        return None

    def propose(self, rows: Sequence[CallState], max_lens: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    def observe(self, state: CallState, emitted: np.ndarray) -> None:
        return None

    def finish_call(self, state: CallState) -> None:
        return None

    def draft_time(self, cost: StepCostModel, rows: Sequence[CallState], max_lens: np.ndarray) -> float:
        # Model-free proposers (n-gram lookup, suffix trees) run on the CPU between steps.
        return float(cost.model_free_draft_time(len(rows))) if len(rows) else 0.0

    def draft_time_bound(self, cost: StepCostModel, num_calls: int, draft_len: int,
                         context_lens: np.ndarray) -> float | None:
        """The most seconds one proposal over at most `num_calls` rows, drafts of at most `draft_len` tokens and
        contexts of at most `context_lens`, can take (`draft_time` is non-decreasing in each): the event loop's
        horizon (engine/simulator.py `_step_bound`). None for a drafter that prices drafting its own way and
        states no bound."""
        if type(self).draft_time is not BaseDrafter.draft_time:
            return None
        return float(cost.model_free_draft_time(num_calls)) if num_calls else 0.0


# --------------------------------------------------------------------------------------------
# Registry

DRAFTERS: dict[str, type[BaseDrafter]] = {}
_loaded = False
_broken: dict[str, str] = {}  # drafter modules that failed to import → the error (named when a lookup fails)


def register_drafter(name: str) -> Callable[[type[BaseDrafter]], type[BaseDrafter]]:
    """Class decorator: register a drafter class under `name` (the speculative-config `method`)."""

    def decorate(cls: type[BaseDrafter]) -> type[BaseDrafter]:
        if name in DRAFTERS and DRAFTERS[name] is not cls:
            raise ValueError(f"drafter {name!r} is already registered by {DRAFTERS[name].__module__}")
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return decorate


def _load_builtin() -> None:
    # Import every module of this package once so that each drafter file registers itself.
    global _loaded
    if _loaded:
        return
    _loaded = True
    import agentspec_sim.drafters as package

    for info in pkgutil.iter_modules(package.__path__):
        try:
            importlib.import_module(f"{package.__name__}.{info.name}")
        except Exception as exc:  # one broken drafter file must not take the others down
            _broken[info.name] = f"{type(exc).__name__}: {exc}"


def drafter_class(method: str) -> type[BaseDrafter]:
    _load_builtin()
    if method not in DRAFTERS:
        broken = "".join(f"; drafters/{name}.py failed to import ({err})" for name, err in sorted(_broken.items()))
        raise SpecConfigError(f"unknown drafter {method!r} (known: {', '.join(sorted(DRAFTERS))}){broken}")
    return DRAFTERS[method]


def bind_engine_context(spec: SpeculativeConfig, **context: Any) -> SpeculativeConfig:
    """`spec` with what the run knows filled in by its drafter class (`BaseDrafter.bind_context`)."""
    return drafter_class(spec.method).bind_context(spec, **context)


def make_drafter(spec: SpeculativeConfig) -> BaseDrafter:
    """A fresh drafter instance (no state shared with any other instance)."""
    return drafter_class(spec.method)(spec)


# `--drafter a,b,c` shorthand: the paper's settings (AgentSpec appendix A.1) for methods it names.
# ngram: k=5, prompt_lookup_max=4; vLLM's rule "if one is given the other copies it" makes min=4 too.
SHORTHAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "normal": {"method": "normal"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    # ngram-adaptive: the same settings; k is the longest draft a call's length may grow to.
    "ngram-adaptive": {"method": "ngram-adaptive", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    # suffix: the paper's k=32; vLLM's defaults for the tree (depth 24, factor 1.0, min prob 0.1).
    "suffix": {"method": "suffix", "num_speculative_tokens": 32},
    # ngram-v2 (vLLM 0.33's default runner): the same paper settings as ngram.
    "ngram-v2": {"method": "ngram-v2", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    # eagle3: k=3, the default of the published EAGLE-3 speculator heads that `vllm serve` reads;
    # mtp: k=1, vLLM's default of one step per MTP layer (MiMo-7B has one).
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "mtp": {"method": "mtp", "num_speculative_tokens": 1},
    # agspec: k=16, the static cap the AgSpec article names; role caps and the online controller shrink it.
    "agspec": {"method": "agspec", "num_speculative_tokens": 16},
    # agentspec+: AgentSpec's k=32 (the cap, not the draft length: M(b) and the controller size drafts).
    "agentspec+": {"method": "agentspec+", "num_speculative_tokens": 32},
}


def parse_drafter(value: str | Mapping[str, Any] | SpeculativeConfig, flag: str | None = None) -> SpeculativeConfig:
    """A drafter given by shorthand name, speculative-config JSON (text or dict), or a config. `flag`: the
    option the value came from (`--speculative-config`), named at the start of any error."""
    try:
        return _parse_drafter(value)
    except SpecConfigError as exc:
        if flag is None:
            raise
        raise SpecConfigError(f"{flag}: {str(exc).removeprefix('speculative config: ')}") from None


def _parse_drafter(value: str | Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, Mapping):
        return SpeculativeConfig.from_json(value)
    text = value.strip()
    if _looks_like_json(text):  # an object is a config; a list, number, string or null is a mistake it names
        data = _config_json(text)
        if not isinstance(data, dict):
            raise SpecConfigError(f"must be a JSON object such as {_EXAMPLE}, or a drafter name; got "
                                  f"{_json_kind(data)}")
        return SpeculativeConfig.from_json(data)
    if text in SHORTHAND_DEFAULTS:
        return SpeculativeConfig.from_json(SHORTHAND_DEFAULTS[text], label=text)
    return SpeculativeConfig.from_json({"method": text}, label=text)


def _looks_like_json(text: str) -> bool:
    """Whether `text` is meant as JSON rather than a drafter name: it opens an object, list or string, or
    it is a JSON number, true, false or null (no drafter is named so)."""
    if text[:1] in ('{', '[', '"'):
        return True
    from agentspec_sim import strict_json

    try:
        strict_json.loads(text)
    except (strict_json.StrictJSONError, ValueError):
        return False
    return True


def parse_drafter_list(text: str, flag: str | None = None) -> list[SpeculativeConfig]:
    """`normal,ngram` → configs (empty items ignored); an item may be a JSON object, commas and all
    (`normal,{"method": "ngram", "num_speculative_tokens": 3}`)."""
    return [parse_drafter(item, flag) for item in split_drafter_list(text)]


def split_drafter_list(text: str) -> list[str]:
    """The items of a comma-separated drafter list, a JSON object (whose commas do not split) being one."""
    import json

    items, at, decoder = [], 0, json.JSONDecoder()
    while at < len(text):
        while at < len(text) and text[at] in " \t,":
            at += 1
        if at >= len(text):
            break
        if text[at] == "{":
            try:
                _, end = decoder.raw_decode(text, at)
            except ValueError:  # not JSON: the rest is one item, and parsing it says what is wrong
                end = len(text)
            items.append(text[at:end])
            at = end
            continue
        end = text.find(",", at)
        end = len(text) if end < 0 else end
        items.append(text[at:end].strip())
        at = end
    return [item for item in items if item.strip()]


def with_label(spec: SpeculativeConfig, label: str) -> SpeculativeConfig:
    return replace(spec, label=label)


def describe(spec: SpeculativeConfig) -> str:
    """A short label for tables: the method, then the settings that differ from nothing (k, n range, schedule)."""
    if spec.label:
        return spec.label
    parts = [spec.method]
    if spec.method != "normal":
        parts.append(f"k={spec.num_speculative_tokens}")
    if spec.prompt_lookup_min is not None:
        parts.append(f"n={spec.prompt_lookup_min}..{spec.prompt_lookup_max}")
    if spec.num_speculative_tokens_per_batch_size:
        parts.append("k(b)=" + ",".join(f"{a}-{b}:{k}" for a, b, k in spec.num_speculative_tokens_per_batch_size))
    parts.extend(f"{k}={v}" for k, v in spec.options)
    return " ".join(parts)


def unique_labels(specs: Sequence[SpeculativeConfig]) -> list[SpeculativeConfig]:
    """Label every config (see `describe`), numbering repeats, so each row of a comparison is distinct."""
    seen: dict[str, int] = {}
    out = []
    for spec in specs:
        label = describe(spec)
        seen[label] = seen.get(label, 0) + 1
        out.append(replace(spec, label=label if seen[label] == 1 else f"{label} #{seen[label]}"))
    return out
