"""The drafter registry and vLLM's `--speculative-config` parsing.

A drafter family is a package under `drafters/` whose `__init__.py` names the methods it registers
(`METHODS`: method → the module of the package that defines it, decorated `@register_drafter(method)`). The
registry imports a family when one of its methods is first asked for — a `normal,ngram` replay loads
`normal` and `ngram` only — and a drafter defined anywhere else registers itself by being imported
(docs/adding-a-drafter.md).

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
from dataclasses import replace
from typing import Any

from agentspec_sim.engine.budget import budget_policy_name
from agentspec_sim.engine.drafting import (
    COMMON_KEYS,
    MAX_SPECULATIVE_TOKENS,
    NO_EFFECT_KEYS,
    BaseDrafter,
    SpecConfigError,
    SpeculativeConfig,
    new_drafter,
)
from agentspec_sim.io import strict_json


def speculative_config(data: Mapping[str, Any] | str, label: str | None = None) -> SpeculativeConfig:
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
    spec = SpeculativeConfig(
        method=method,
        num_speculative_tokens=int(k) if k is not None else -1,  # -1: not given (the method decides)
        prompt_lookup_min=data.get("prompt_lookup_min"),
        prompt_lookup_max=data.get("prompt_lookup_max"),
        num_speculative_tokens_per_batch_size=None if schedule is None else _parse_schedule(schedule),
        options=tuple(sorted((key, data[key]) for key in data
                             if key in drafter_cls.config_keys and not key.startswith("prompt_lookup_"))),
        label=label,
        raw=dict(data),
        drafter_class=drafter_cls,
    )
    spec = drafter_cls.configure(spec)
    if spec.num_speculative_tokens < 0:
        raise SpecConfigError(f"method {method!r} needs num_speculative_tokens")
    if spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:  # a default the method derived (suffix: depth)
        raise SpecConfigError(f"num_speculative_tokens ({spec.num_speculative_tokens}, from the method's "
                              f"settings) must be ≤ {MAX_SPECULATIVE_TOKENS}")
    budget_policy_name(spec, drafter_cls.budget_policy)  # an unknown policy fails now, not when the run starts
    if spec.num_speculative_tokens_per_batch_size is not None and not drafter_cls.supports_batch_size_schedule:
        raise SpecConfigError(f"num_speculative_tokens_per_batch_size is not supported for method {method!r} "
                              "(vLLM 0.33 supports it for ngram, eagle, eagle3, mtp)")
    return spec


_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 5}'
INT64_MAX = 2**63 - 1


def _json_kind(value: object) -> str:
    return {dict: "an object", list: "a list", tuple: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _config_json(text: str) -> Any:
    """The JSON value of a speculative config's text, parsed strictly (agentspec_sim/strict_json.py)."""
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


# --------------------------------------------------------------------------------------------
# Registry

DRAFTERS: dict[str, type[BaseDrafter]] = {}
_families: dict[str, tuple[str, str]] | None = None  # method → (family package, module), from each METHODS
_broken: dict[str, str] = {}  # family packages that failed to import → the error (named when a lookup fails)


def register_drafter(name: str) -> Callable[[type[BaseDrafter]], type[BaseDrafter]]:
    """Class decorator: register a drafter class under `name` (the speculative-config `method`)."""

    def decorate(cls: type[BaseDrafter]) -> type[BaseDrafter]:
        if name in DRAFTERS and DRAFTERS[name] is not cls:
            raise ValueError(f"drafter {name!r} is already registered by {DRAFTERS[name].__module__}")
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return decorate


def families() -> dict[str, tuple[str, str]]:
    """Every method the bundled families declare → (family package, module), read from the families'
    `__init__.py` (which import nothing): no family is loaded by asking."""
    global _families
    if _families is None:
        import agentspec_sim.drafters as package

        found: dict[str, tuple[str, str]] = {}
        for info in pkgutil.iter_modules(package.__path__):
            if not info.ispkg:
                continue
            name = f"{package.__name__}.{info.name}"
            try:
                methods = getattr(importlib.import_module(name), "METHODS", {})
            except Exception as exc:  # one broken family must not take the others down
                _broken[info.name] = f"{type(exc).__name__}: {exc}"
                continue
            for method, module in methods.items():
                found[method] = (name, f"{name}.{module}")
        _families = found
    return _families


def _load(method: str) -> None:
    where = families().get(method)
    if where is None or method in DRAFTERS:
        return
    try:
        importlib.import_module(where[1])
    except Exception as exc:
        _broken[where[0].rpartition(".")[2]] = f"{type(exc).__name__}: {exc}"


def known_drafters() -> list[str]:
    """Every method that can be asked for: the families' and those registered from elsewhere."""
    return sorted(set(families()) | set(DRAFTERS))


def shorthand_config(method: str) -> dict[str, Any]:
    """The speculative config `--drafter METHOD` stands for (the drafter's `shorthand`, else the bare method)."""
    shorthand = drafter_class(method).shorthand
    return dict(shorthand) if shorthand is not None else {"method": method}


def drafter_class(method: str) -> type[BaseDrafter]:
    if method not in DRAFTERS:
        _load(method)
    if method not in DRAFTERS:
        broken = "".join(f"; drafters/{name} failed to import ({err})" for name, err in sorted(_broken.items()))
        raise SpecConfigError(f"unknown drafter {method!r} (known: {', '.join(known_drafters())}){broken}")
    return DRAFTERS[method]


def bind_engine_context(spec: SpeculativeConfig, **context: Any) -> SpeculativeConfig:
    """`spec` with what the run knows filled in by its drafter class (`BaseDrafter.bind_context`)."""
    return drafter_class(spec.method).bind_context(spec, **context)


def make_drafter(spec: SpeculativeConfig) -> BaseDrafter:
    """A fresh drafter instance (no state shared with any other instance)."""
    if spec.drafter_class is None:
        spec = replace(spec, drafter_class=drafter_class(spec.method))
    return new_drafter(spec)


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
        return speculative_config(value)
    text = value.strip()
    if _looks_like_json(text):  # an object is a config; a list, number, string or null is a mistake it names
        data = _config_json(text)
        if not isinstance(data, dict):
            raise SpecConfigError(f"must be a JSON object such as {_EXAMPLE}, or a drafter name; got "
                                  f"{_json_kind(data)}")
        return speculative_config(data)
    # `--drafter NAME`: the drafter's shorthand (the paper's settings for the methods it names), else the bare method
    # (an unknown name then fails in `speculative_config`, naming the known ones).
    config = shorthand_config(text) if text in known_drafters() else {"method": text}
    return speculative_config(config, label=text)


def _looks_like_json(text: str) -> bool:
    """Whether `text` is meant as JSON rather than a drafter name: it opens an object, list or string, or
    it is a JSON number, true, false or null (no drafter is named so)."""
    if text[:1] in ('{', '[', '"'):
        return True
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
