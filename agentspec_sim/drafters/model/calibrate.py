"""Fitting the acceptance model of the `eagle3` / `mtp` drafters (drafters/model/rule.py).

The model: a step that starts at output position t of a call drafts k tokens, and

    P(slot i accepted | slots < i accepted) = σ(a_i + b_copy·copy(t+i) + b_code·code(t)).

What this module does:

- **Feature streams** (`build_streams`): copy / code of every output position of some calls,
  computed exactly as the drafter computes them (`copy_stream`, `structure.segment`).
- **Exact expectations** (`expected_counts`): for one call, the number of steps and of steps with
  ≥ i+1 accepted drafts that the drafter's process produces *in expectation*, by a forward
  recursion over step-start positions (a step at t that accepts j < k moves to t + j + 1; the
  first token comes from prefill, so steps start at t = 1). This is what a replay measures, without
  sampling noise.
- **Sampling** (`sample_steps`): the same process with the drafter's counter-based draws (per-step
  accepted counts), for synthetic data and checks.
- **Fitting** by maximum likelihood on the per-position *conditional* acceptance
  (`fit_steps`): observations are per-step accepted lengths (vLLM's per-request
  `spec_decode_metrics` JSONL, or Spec-Bench's `accept_lengths`); each observed request is tied to a
  feature stream (its own call when the trace holds it, else a pooled reference stream); the
  conditional rate at position i is E[#steps accepting ≥ i+1] / E[#steps accepting ≥ i] of that
  stream, and each observed step that reached slot i is a Bernoulli trial of it.
  `fit_targets` solves the intercepts a_i for published per-position rates (least squares),
  with the feature coefficients held fixed.
- **Reports** (`group_report`): observed vs predicted per-position cumulative acceptance
  (vLLM's `num_accepted_tokens_per_pos / num_drafts`) and mean acceptance length per category.

`regenerate_bundled()` rebuilds the parameter files shipped in `drafters/model/acceptance/` from the
public figures in `PUBLIC_TARGETS` (sources in each entry) and the Spec-Bench answers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from agentspec_sim.drafters.common.structure import token_bytes_of
from agentspec_sim.drafters.model.rule import (
    ACCEPTANCE_DIR,
    FEATURES,
    AcceptanceParams,
    accepted_prefix,
    call_key,
    copy_stream,
    structure_of,
)
from agentspec_sim.io import strict_json
from agentspec_sim.trace.schema import Call, Workload


class CalibrationError(ValueError):
    """Input the fit cannot use (a malformed metrics file, no observations, unknown categories)."""


# --------------------------------------------------------------------------------------------
# Feature streams


@dataclass(frozen=True)
class Streams:
    """Features of the output positions of some calls, concatenated: call c owns
    [offsets[c], offsets[c+1]); `copy` / `code` are int8 per output position."""

    call_ids: tuple[str, ...]
    offsets: np.ndarray
    copy: np.ndarray
    code: np.ndarray
    categories: tuple[str | None, ...] = ()

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def index(self) -> dict[str, int]:
        return {cid: i for i, cid in enumerate(self.call_ids)}

    def subset(self, rows: Sequence[int]) -> Streams:
        rows = list(rows)
        lens = np.diff(self.offsets)[rows]
        offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        pick = np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in rows]) if rows else \
            np.zeros(0, dtype=np.int64)
        cats = tuple(self.categories[r] for r in rows) if self.categories else ()
        return Streams(tuple(self.call_ids[r] for r in rows), offsets, self.copy[pick], self.code[pick], cats)


def call_features(call: Call, token_bytes: Sequence[bytes] | None) -> tuple[np.ndarray, np.ndarray]:
    """(copy, code) of each output position of `call`, as the drafter computes them."""
    from agentspec_sim.drafters.common.structure import segment

    full = np.concatenate([call.prompt_tokens, call.output_tokens]).astype(np.int32)
    copy = np.zeros(call.output_len, dtype=np.int8)
    copy_stream(full, call.prompt_len, copy)
    if token_bytes is None:
        code = np.zeros(call.output_len, dtype=np.int8)
    else:
        size = len(token_bytes)
        ids = call.output_tokens
        if ids.size and (int(ids.max()) >= size or int(ids.min()) < 0):
            ids = np.where((ids >= 0) & (ids < size), ids, 0)  # unknown ids: no bytes (as the drafter)
        code = (segment(ids, token_bytes, structure_of(call.structure)) != 0).astype(np.int8)
    return copy, code


def build_streams(calls: Iterable[Call], tokenizer: str | None = "qwen3") -> Streams:
    """Feature streams of `calls` (tokenizer: the trace's, for the code feature; None turns it off)."""
    calls = list(calls)
    table = token_bytes_of(tokenizer) if tokenizer else None
    copies, codes = [], []
    for c in calls:
        cp, cd = call_features(c, table)
        copies.append(cp)
        codes.append(cd)
    lens = np.fromiter((c.output_len for c in calls), dtype=np.int64, count=len(calls))
    offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    cats = tuple((c.extra or {}).get("category") for c in calls)
    return Streams(tuple(c.id for c in calls), offsets,
                   np.concatenate(copies) if copies else np.zeros(0, np.int8),
                   np.concatenate(codes) if codes else np.zeros(0, np.int8), cats)


def workload_streams(workload: Workload) -> Streams:
    return build_streams(workload.calls, workload.meta.tokenizer)


# MT-Bench inside the bundled Spec-Bench trace: its first 80 questions (ids 81–160, two turns each).
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
REFERENCE_STREAM = "traces/spec-bench.jsonl.zst, MT-Bench calls (question ids 81-160, both turns)"


def reference_streams() -> Streams:
    """The representative stream the bundled parameters are calibrated on: MT-Bench answers
    (Vicuna-7B, greedy, Qwen3 tokens) from the bundled Spec-Bench trace."""
    from agentspec_sim.trace.bundled import bundled_trace
    from agentspec_sim.trace.io import load_trace

    workload = load_trace(bundled_trace("spec-bench.jsonl.zst"))
    calls = [c for c in workload.calls if (c.extra or {}).get("category") in MT_BENCH_CATEGORIES]
    return build_streams(calls, workload.meta.tokenizer)


# --------------------------------------------------------------------------------------------
# The process: exact expectations and sampling


@njit(cache=True, nogil=True)
def _walk(copy, code, offsets, a, b_copy, b_code, k, out):
    last = a.shape[0] - 1
    for c in range(offsets.shape[0] - 1):
        lo = offsets[c]
        length = offsets[c + 1] - lo
        if length <= 1:
            continue
        v = np.zeros(length + 1)
        v[1] = 1.0
        for t in range(1, length):
            w = v[t]
            if w == 0.0:
                continue
            out[c, 0] += w
            m = min(k, length - t)
            cum = 1.0
            for j in range(m):
                z = a[min(j, last)] + b_copy * copy[lo + t + j] + b_code * code[lo + t]
                p = 1.0 / (1.0 + math.exp(-z))
                nxt = cum * p
                v[t + j + 1] += w * (cum - nxt)  # exactly j accepted: j + 1 tokens emitted
                out[c, j + 1] += w * nxt
                cum = nxt
            v[min(t + min(m + 1, length - t), length)] += w * cum


def expected_counts(streams: Streams, params: AcceptanceParams, k: int) -> np.ndarray:
    """E[steps] and E[steps accepting ≥ i+1], i < k, per call: a (num_calls, k+1) array."""
    out = np.zeros((streams.num_calls, k + 1))
    _walk(streams.copy, streams.code, streams.offsets, params.a, params.coefficient("copy"),
          params.coefficient("code"), k, out)
    return out


@njit(cache=True, nogil=True)
def _sample(copy, code, offsets, keys, a, b_copy, b_code, k, acc, owner):
    s = 0
    for c in range(offsets.shape[0] - 1):
        lo = offsets[c]
        length = offsets[c + 1] - lo
        t = 1
        while t < length:
            m = min(k, length - t)
            j = accepted_prefix(a, b_copy, b_code, copy[lo + t:lo + t + m], int(code[lo + t]), keys[c], t, k)
            acc[s] = j
            owner[s] = c
            s += 1
            t += min(j + 1, length - t)
    return s


def sample_steps(streams: Streams, params: AcceptanceParams, k: int, seed: int = 0) -> list[np.ndarray]:
    """Per-call accepted counts of every step, drawn as the drafter draws them (same seed ⇒ same)."""
    keys = np.fromiter((call_key(seed, cid) for cid in streams.call_ids), dtype=np.uint64, count=streams.num_calls)
    total = int(np.diff(streams.offsets).clip(min=0).sum()) + 1
    acc = np.zeros(total, dtype=np.int64)
    owner = np.zeros(total, dtype=np.int64)
    s = _sample(streams.copy, streams.code, streams.offsets, keys, params.a, params.coefficient("copy"),
                params.coefficient("code"), k, acc, owner)
    acc, owner = acc[:s], owner[:s]
    bounds = np.searchsorted(owner, np.arange(streams.num_calls + 1))
    return [acc[bounds[c]:bounds[c + 1]] for c in range(streams.num_calls)]


# --------------------------------------------------------------------------------------------
# Observations


@dataclass(frozen=True)
class Observation:
    """One request's per-step draft and accepted counts (accepted excludes the bonus token)."""

    call_id: str | None
    group: str
    drafted: np.ndarray
    accepted: np.ndarray
    aligned: bool = False  # the steps are in the tokens of the trace call `call_id` (same tokenizer)

    def positions(self, length: int) -> np.ndarray | None:
        """Each step's start (output index) if the steps tile an output of `length` tokens exactly
        (the first token from prefill, each step emitting accepted + 1, the last possibly cut by the
        end); None when they do not."""
        t = 1
        starts = np.empty(self.accepted.shape[0], dtype=np.int64)
        for s, a in enumerate(self.accepted.tolist()):
            if t >= length:
                return None
            starts[s] = t
            t += min(a + 1, length - t)
        return starts if t == length else None

    def conditional_counts(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(trials, successes) per position i < k: steps that reached slot i (drafted > i, accepted ≥ i)
        and those that accepted it."""
        i = np.arange(k)[:, None]
        reached = (self.drafted[None, :] > i) & (self.accepted[None, :] >= i)
        won = reached & (self.accepted[None, :] >= i + 1)
        return reached.sum(axis=1).astype(np.float64), won.sum(axis=1).astype(np.float64)


def _read_lines_text(path: str | Path) -> str:
    """A JSONL file's text, read no further than the memory available can hold (a device or pipe that never
    ends is refused, not read until the kernel kills the process)."""
    from agentspec_sim.host.resources import available_memory

    available = available_memory()
    limit = strict_json.MAX_DOCUMENT_BYTES if available is None else max(strict_json.MAX_DOCUMENT_BYTES, available // 4)
    try:
        return strict_json.read_document(path, limit)
    except strict_json.StrictJSONError as exc:
        raise CalibrationError(f"{path}: {exc.message}") from None


def _records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSONL file; a line that is not JSON is a
    `CalibrationError` naming file and line."""
    for line_no, line in enumerate(_read_lines_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield line_no, strict_json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}:{line_no}: not JSON ({exc.msg})") from None


def load_vllm_metrics(path: str | Path) -> list[Observation]:
    """vLLM 0.33 per-request metrics JSONL: one object per request with `per_step_drafted` and
    `per_step_accepted` (top level or under `spec_decode_metrics`), optional `id` / `request_id` /
    `call_id` (a trace call id) and `category`."""
    out = []
    for line_no, rec in _records(path):
        metrics = rec.get("spec_decode_metrics", rec) if isinstance(rec, dict) else None
        for name in ("per_step_accepted", "per_step_drafted"):
            if not isinstance(metrics, dict) or name not in metrics:
                raise CalibrationError(f"{path}:{line_no}: {name}: missing (need per_step_drafted and "
                                       "per_step_accepted arrays: vLLM's per_request_spec_decode_metrics=\"detailed\")")
        acc = _step_counts(metrics["per_step_accepted"], f"{path}:{line_no}: per_step_accepted")
        drafted = _step_counts(metrics["per_step_drafted"], f"{path}:{line_no}: per_step_drafted")
        if drafted.shape != acc.shape:
            raise CalibrationError(f"{path}:{line_no}: per_step_drafted and per_step_accepted differ in length "
                                   f"({drafted.shape[0]} vs {acc.shape[0]} steps)")
        if acc.size and (acc.min() < 0 or (acc > drafted).any()):
            raise CalibrationError(f"{path}:{line_no}: per_step_accepted must be in [0, per_step_drafted]")
        keep = drafted > 0  # steps without drafts are not drafts (vLLM does not count them)
        cid = rec.get("call_id", rec.get("id", rec.get("request_id")))
        out.append(Observation(None if cid is None else str(cid), str(rec.get("category", "all")),
                               drafted[keep], acc[keep], aligned=bool(keep.all())))
    if not out:
        raise CalibrationError(f"{path}: no requests")
    return out


def _step_counts(value: object, where: str, what: str = "integers (token counts per step)",
                 item: str = "count") -> np.ndarray:
    """A list of integers (per-step token counts, or `what`) as int64: integers only (np.asarray would truncate
    1.5 to 1 and turn true into 1), each fitting in 64 bits."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise CalibrationError(f"{where}: expected a list of {what}")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise CalibrationError(f"{where}: a {item} does not fit in 64 bits") from None


def load_spec_bench(path: str | Path, k: int | None = None) -> list[Observation]:
    """Spec-Bench `model_answer` JSONL: per question, `choices[0].accept_lengths` (every turn's steps,
    concatenated; each length includes the bonus token) split by `decoding_steps`. Tree drafting of
    depth k (default: the largest accepted count seen) is recorded as k drafts per step. Call ids
    are the bundled trace's `spec-bench/<question_id>/<turn>`."""
    rows = list(_records(path))
    per_turn = []
    for line_no, rec in rows:
        choices = rec.get("choices") if isinstance(rec, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise CalibrationError(f"{path}:{line_no}: choices: expected a non-empty list of objects")
        choice = choices[0]
        lengths = _step_counts(choice.get("accept_lengths"), f"{path}:{line_no}: choices[0].accept_lengths")
        steps = _step_counts(choice.get("decoding_steps"), f"{path}:{line_no}: choices[0].decoding_steps")
        bounds = np.concatenate(([0], np.cumsum(steps)))
        if bounds[-1] != lengths.shape[0]:
            raise CalibrationError(f"{path}:{line_no}: question {rec.get('question_id')}: decoding_steps do not "
                                   "add up to accept_lengths")
        for turn in range(len(choice["decoding_steps"])):
            per_turn.append((f"spec-bench/{rec['question_id']}/{turn}", str(rec.get("category", "all")),
                             lengths[bounds[turn]:bounds[turn + 1]] - 1))
    depth = k if k is not None else max(int(a.max()) for _, _, a in per_turn if a.size)
    return [Observation(cid, cat, np.full(a.shape, depth, dtype=np.int64), np.minimum(a, depth))
            for cid, cat, a in per_turn]


def _first_record(path: str | Path) -> Any:
    """The value on a JSONL file's first non-blank line; None when there is none or it is not JSON (the
    format's reader then says why)."""
    with open(path, "rb") as f:
        # Lines read with a bound: a file with no line breaks (a device, a binary file) must not fill memory.
        while line := f.readline(strict_json.MAX_DOCUMENT_BYTES):
            if line.strip():
                try:
                    return strict_json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return None
    return None


def looks_like_spec_bench(path: str | Path) -> bool:
    rec = _first_record(path)
    return isinstance(rec, dict) and "choices" in rec and "question_id" in rec


def looks_like_specdecode_bench(path: str | Path) -> bool:
    """A SpecDecode-Bench request file: JSONL objects with prompt and generated token ids and `acc_*`
    objects holding `acc_len` lists (data/<model>/combined_<dataset>.jsonl)."""
    rec = _first_record(path)
    return isinstance(rec, dict) and "generated_token_ids" in rec and any(
        isinstance(v, dict) and "acc_len" in v for k, v in rec.items() if k.startswith("acc"))


SPECDECODE_BENCH_PROPOSERS = {"eagle3": "acc_eagle", "mtp": "acc_mtp", "ngram": "acc_ngram"}


def _token_ids(value: object, where: str) -> np.ndarray:
    ids = _step_counts(value, where, "non-negative integer token ids", "token id")
    if ids.size and ids.min() < 0:
        raise CalibrationError(f"{where}: expected a list of non-negative integer token ids")
    return ids


def walk_positions(per_position: np.ndarray) -> np.ndarray:
    """The tokens each step emits when `per_position[t]` is what a step starting with t + 1 tokens
    emitted would emit (accepted + the bonus token): the first token comes from prefill, each step
    starts where the last one ended (SpecDecode-Bench's simulator walks its lists this way)."""
    steps = []
    t = 1
    n = per_position.shape[0]
    while t < n:
        g = int(per_position[t - 1])
        steps.append(g)
        t += g
    return np.asarray(steps, dtype=np.int64)


def specdecode_bench_group(path: str | Path) -> str:
    """The dataset a SpecDecode-Bench file holds, from its name: combined_gsm8k.jsonl → gsm8k."""
    return Path(path).name.split(".")[0].removeprefix("combined_")


def load_specdecode_bench(path: str | Path, *, proposer: str = "acc_eagle", k: int | None = None,
                          limit: int | None = None, group: str | None = None
                          ) -> tuple[list[Observation], list[Call]]:
    """A SpecDecode-Bench request file: per request `id`, `prompt_token_ids`, `generated_token_ids` and,
    per proposer, `acc_<name>.acc_len` — per output position, the tokens a verify step starting there
    emits, bonus included (k = 20 in the published Llama-3.1-8B data); a list may also be per step
    (it then tiles the output: Σ = output length − 1). Returns one observation per request (its steps,
    walked as `walk_positions`, tied to its own call) and the calls (prompt and output ids; id
    `<group>/<id>`). k (drafts per step) defaults to the largest accepted count of any proposer in
    the file. `limit`: the first requests only. Bad input: `CalibrationError` naming file, line, field."""
    group = group or specdecode_bench_group(path)
    rows: list[tuple[int, dict]] = []
    for line_no, rec in _records(path):
        if not isinstance(rec, dict):
            raise CalibrationError(f"{path}:{line_no}: expected an object per request")
        rows.append((line_no, rec))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise CalibrationError(f"{path}: no requests")
    parsed = []
    largest = 1
    for line_no, rec in rows:
        where = f"{path}:{line_no}"
        acc = rec.get(proposer)
        if not isinstance(acc, dict) or "acc_len" not in acc:
            raise CalibrationError(f"{where}: {proposer}.acc_len: missing")
        lengths = _step_counts(acc["acc_len"], f"{where}: {proposer}.acc_len")
        if lengths.size and lengths.min() < 1:
            raise CalibrationError(f"{where}: {proposer}.acc_len: every step emits at least one token (≥ 1)")
        for name, other in rec.items():
            if name.startswith("acc") and isinstance(other, dict) and isinstance(other.get("acc_len"), list):
                got = [v for v in other["acc_len"] if type(v) is int]
                largest = max(largest, max(got, default=1))
        prompt = _token_ids(rec.get("prompt_token_ids"), f"{where}: prompt_token_ids")
        output = _token_ids(rec.get("generated_token_ids"), f"{where}: generated_token_ids")
        if output.shape[0] < 1:
            raise CalibrationError(f"{where}: generated_token_ids: empty")
        rid = rec.get("id", line_no)
        parsed.append((str(rid), prompt, output, lengths))
    depth = k if k is not None else max(largest - 1, 1)
    observations, calls = [], []
    for rid, prompt, output, lengths in parsed:
        tiles = int(lengths.sum()) + 1 == output.shape[0] and lengths.shape[0] < output.shape[0]
        if not tiles:
            # Per position. Where the proposer's own run emitted a different number of tokens than recorded
            # (its greedy run diverged somewhere), both are cut to the shorter: past it nothing pairs up.
            n = min(lengths.shape[0], output.shape[0])
            output, lengths = output[:n], lengths[:n]
        steps = lengths if tiles else walk_positions(lengths)
        accepted = np.minimum(steps - 1, depth)
        cid = f"{group}/{rid}"
        observations.append(Observation(cid, group, np.full(accepted.shape, depth, dtype=np.int64), accepted,
                                        aligned=True))
        calls.append(Call(cid, "specdecode-bench", cid, 0, prompt, output, extra={"category": group}))
    return observations, calls


# --------------------------------------------------------------------------------------------
# Fitting


@njit(cache=True, nogil=True)
def _aligned_nll(copy, code, offsets, call, start, accepted, drafted, a, b_copy, b_code, grad):
    """−log-likelihood of aligned steps; its gradient (a_0.., b_copy, b_code) is added to `grad`."""
    last = a.shape[0] - 1
    total = 0.0
    for s in range(call.shape[0]):
        lo = offsets[call[s]]
        length = offsets[call[s] + 1] - lo
        t = start[s]
        m = min(drafted[s], length - t)
        acc = accepted[s]
        x_code = code[lo + t]
        for j in range(min(acc + 1, m)):
            x_copy = copy[lo + t + j]
            z = a[min(j, last)] + b_copy * x_copy + b_code * x_code
            p = 1.0 / (1.0 + math.exp(-z))
            if j < acc:
                total += math.log1p(math.exp(-z)) if z > -30 else -z  # −log σ(z)
                dz = p - 1.0
            else:
                total += math.log1p(math.exp(z)) if z < 30 else z  # −log(1 − σ(z))
                dz = p
            grad[min(j, last)] += dz
            grad[last + 1] += dz * x_copy
            grad[last + 2] += dz * x_code
    return total


@dataclass
class _Problem:
    """Observations bound to streams. Aggregated part: per stream key the summed (trials,
    successes) per position, the model's conditional rate from the walk over that key's calls
    (pooled calls share one key). Aligned part: every step at its known start in its call."""

    k: int
    streams: Streams  # the aggregated part's calls
    keys: np.ndarray  # per call of `streams`: its key
    num_keys: int
    trials: np.ndarray  # (num_keys, k)
    wins: np.ndarray
    aligned_streams: Streams | None = None
    step_call: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_drafted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_steps(self) -> int:
        return int(self.trials[:, 0].sum()) + int(self.step_call.shape[0]) if self.num_keys else \
            int(self.step_call.shape[0])

    def conditional(self, params: AcceptanceParams) -> np.ndarray:
        e = expected_counts(self.streams, params, self.k)
        pooled = np.zeros((self.num_keys, self.k + 1))
        np.add.at(pooled, self.keys, e)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = pooled[:, 1:] / pooled[:, :-1]
        return np.clip(np.nan_to_num(q, nan=0.5), 1e-9, 1 - 1e-9)

    def nll(self, params: AcceptanceParams) -> float:
        total = 0.0
        if self.num_keys:
            q = self.conditional(params)
            total -= float((self.wins * np.log(q) + (self.trials - self.wins) * np.log1p(-q)).sum())
        if self.aligned_streams is not None and self.step_call.shape[0]:
            total += self.aligned(params)[0]
        return total

    def aligned(self, params: AcceptanceParams) -> tuple[float, np.ndarray]:
        """The aligned part's −log-likelihood and its gradient in (a_0.., b_copy, b_code)."""
        grad = np.zeros(params.a.shape[0] + 2)
        st = self.aligned_streams
        if st is None or not self.step_call.shape[0]:
            return 0.0, grad
        value = _aligned_nll(st.copy, st.code, st.offsets, self.step_call, self.step_start, self.step_accepted,
                             self.step_drafted, params.a, params.coefficient("copy"), params.coefficient("code"),
                             grad)
        return value, grad


def bind(observations: Sequence[Observation], streams: Streams, k: int,
         reference: Streams | None = None) -> tuple[_Problem, list[int | None]]:
    """Tie each observation to its call's stream (by call id) or, failing that, to the pooled
    `reference` stream (default: `streams` pooled). Observations marked `aligned` whose steps tile
    their call's output exactly are fitted step by step (exact likelihood); the others through the
    walk's expected conditional rates. Returns the problem and each observation's aggregate key
    (None for an aligned one)."""
    index = streams.index()
    lengths = np.diff(streams.offsets)
    matched = [index.get(o.call_id) if o.call_id is not None else None for o in observations]
    starts: list[np.ndarray | None] = [
        o.positions(int(lengths[m])) if (m is not None and o.aligned) else None
        for o, m in zip(observations, matched, strict=True)]
    agg_calls = sorted({m for m, st in zip(matched, starts, strict=True) if m is not None and st is None})
    pooled_needed = any(m is None for m in matched)
    key_of_call = {c: i for i, c in enumerate(agg_calls)}
    parts = [streams.subset(agg_calls)] if agg_calls else []
    keys = list(range(len(agg_calls)))
    num_keys = len(agg_calls)
    pooled_key = None
    if pooled_needed:
        ref = reference if reference is not None else streams
        pooled_key = num_keys
        num_keys += 1
        parts.append(ref)
        keys.extend([pooled_key] * ref.num_calls)
    trials = np.zeros((num_keys, k))
    wins = np.zeros((num_keys, k))
    obs_keys: list[int | None] = []
    al_calls = sorted({m for m, st in zip(matched, starts, strict=True) if st is not None})
    al_index = {c: i for i, c in enumerate(al_calls)}
    step_parts: list[tuple[np.ndarray, ...]] = []
    for o, m, st in zip(observations, matched, starts, strict=True):
        if st is not None:
            n = st.shape[0]
            step_parts.append((np.full(n, al_index[m], dtype=np.int64), st, o.accepted, o.drafted))
            obs_keys.append(None)
            continue
        key = key_of_call[m] if m is not None else pooled_key
        t, w = o.conditional_counts(k)
        trials[key] += t
        wins[key] += w
        obs_keys.append(key)
    empty = Streams((), np.zeros(1, dtype=np.int64), np.zeros(0, np.int8), np.zeros(0, np.int8))
    problem = _Problem(k, _concat(parts) if parts else empty, np.asarray(keys, dtype=np.int64), num_keys,
                       trials, wins)
    if step_parts:
        problem.aligned_streams = streams.subset(al_calls)
        problem.step_call, problem.step_start, problem.step_accepted, problem.step_drafted = (
            np.concatenate([p[i] for p in step_parts]).astype(np.int64) for i in range(4))
    return problem, obs_keys


def _concat(parts: Sequence[Streams]) -> Streams:
    if len(parts) == 1:
        return parts[0]
    lens = np.concatenate([np.diff(p.offsets) for p in parts])
    return Streams(tuple(c for p in parts for c in p.call_ids), np.concatenate(([0], np.cumsum(lens))).astype(np.int64),
                   np.concatenate([p.copy for p in parts]), np.concatenate([p.code for p in parts]),
                   tuple(c for p in parts for c in (p.categories or (None,) * p.num_calls)))


@dataclass
class FitResult:
    params: AcceptanceParams
    nll: float
    num_steps: int
    fitted: tuple[str, ...]  # which parameters were free
    details: dict[str, Any] = field(default_factory=dict)


A_BOUNDS = (-8.0, 8.0)
B_BOUNDS = (-4.0, 4.0)


def fit_steps(observations: Sequence[Observation], streams: Streams, k: int, *, method: str = "eagle3",
              model: str = "custom", coefficients: Mapping[str, float] | None = None,
              reference: Streams | None = None, source: str = "", num_positions: int | None = None) -> FitResult:
    """Maximum-likelihood a_0..a_{P−1} (and the feature coefficients unless `coefficients` fixes them)
    from per-step accepted counts. P = `num_positions` (default k): slots from P−1 on share a_{P−1}, as the
    drafter reuses the last intercept. L-BFGS-B within A_BOUNDS / B_BOUNDS."""
    from scipy.optimize import minimize

    if not observations:
        raise CalibrationError("no observations to fit")
    problem, _ = bind(observations, streams, k, reference)
    if problem.num_steps == 0:
        raise CalibrationError("no drafted steps in the observations")
    free_b = coefficients is None
    fixed = dict(coefficients or {})
    npos = k if num_positions is None else max(1, min(int(num_positions), k))
    x0 = np.concatenate([np.full(npos, 0.5), np.zeros(len(FEATURES) if free_b else 0)])

    def unpack(x: np.ndarray) -> AcceptanceParams:
        coef = {f: float(x[npos + i]) for i, f in enumerate(FEATURES)} if free_b else fixed
        return AcceptanceParams(method, model, tuple(float(v) for v in x[:npos]), coef)

    total = float(problem.num_steps)
    if problem.num_keys == 0:  # every step aligned: exact likelihood with its analytic gradient
        def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
            value, grad = problem.aligned(unpack(x))
            return value / total, (grad if free_b else grad[:npos]) / total
        jac = True
    else:
        def objective(x: np.ndarray) -> float:
            return problem.nll(unpack(x)) / total
        jac = None
    res = minimize(objective, x0, jac=jac, method="L-BFGS-B",
                   bounds=[A_BOUNDS] * npos + ([B_BOUNDS] * len(FEATURES) if free_b else []),
                   options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-8})
    best = unpack(res.x)
    fitted = tuple(f"a{i}" for i in range(npos)) + (tuple(FEATURES) if free_b else ())
    params = AcceptanceParams(method, model, best.positions, best.coefficients, source=source)
    return FitResult(params, float(res.fun * total), int(total), fitted,
                     {"converged": bool(res.success), "message": str(res.message)})


def cumulative_rates(counts: np.ndarray) -> np.ndarray:
    """Per-position cumulative acceptance (≥ i+1 accepted per draft) from summed expected counts."""
    counts = np.asarray(counts, dtype=np.float64)
    return counts[1:] / counts[0] if counts[0] > 0 else np.zeros(counts.shape[0] - 1)


def model_rates(streams: Streams, params: AcceptanceParams, k: int) -> np.ndarray:
    """The model's cumulative per-position acceptance over `streams` (all calls pooled)."""
    return cumulative_rates(expected_counts(streams, params, k).sum(axis=0))


def fit_targets(streams: Streams, targets: Sequence[float], coefficients: Mapping[str, float], *,
                method: str, model: str, ks: Sequence[int] | None = None) -> AcceptanceParams:
    """Intercepts a_0..a_{K−1} whose pooled cumulative rates on `streams` equal `targets`
    (K = len(targets); target i is P(accepted ≥ i+1) per draft when drafting `ks[i]` tokens,
    default K), feature coefficients fixed. Solved by scipy least_squares (K equations, K unknowns)."""
    from scipy.optimize import least_squares

    targets = np.asarray(targets, dtype=np.float64)
    n = targets.shape[0]
    ks = [n] * n if ks is None else [int(x) for x in ks]
    if len(ks) != n or any(k <= i for i, k in enumerate(ks)):
        raise CalibrationError("each target i needs a draft length ks[i] > i")
    if not (np.all(np.diff(targets) <= 0) and targets[-1] > 0 and targets[0] < 1):
        raise CalibrationError("cumulative targets must be non-increasing and inside (0, 1)")
    cond = targets / np.concatenate(([1.0], targets[:-1]))
    x0 = np.log(cond / (1 - np.minimum(cond, 0.999)))

    def residual(x: np.ndarray) -> np.ndarray:
        params = AcceptanceParams(method, model, tuple(x), coefficients)
        rates = {k: model_rates(streams, params, k) for k in set(ks)}
        return np.array([rates[k][i] for i, k in enumerate(ks)]) - targets

    res = least_squares(residual, x0, bounds=A_BOUNDS, xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return AcceptanceParams(method, model, tuple(float(v) for v in res.x), dict(coefficients))


# --------------------------------------------------------------------------------------------
# Reports


def observed_rates(observations: Sequence[Observation], k: int) -> tuple[np.ndarray, int]:
    """vLLM's per-position acceptance (steps accepting ≥ i+1 / drafted steps) and the step count."""
    steps = sum(int(o.accepted.shape[0]) for o in observations)
    if not steps:
        return np.zeros(k), 0
    counts = np.array([sum(int((o.accepted >= i + 1).sum()) for o in observations) for i in range(k)])
    return counts / steps, steps


def predicted_rates(observations: Sequence[Observation], streams: Streams, params: AcceptanceParams, k: int,
                    reference: Streams | None = None) -> np.ndarray:
    """The model's per-position acceptance for these observations: each request's own stream (or
    the pooled reference) weighted by its observed number of steps (expected rates from the walk,
    also for aligned observations)."""
    observations = [replace(o, aligned=False) for o in observations]
    problem, keys = bind(observations, streams, k, reference)
    e = expected_counts(problem.streams, params, k)
    pooled = np.zeros((problem.num_keys, k + 1))
    np.add.at(pooled, problem.keys, e)
    rates = np.zeros(k)
    steps = 0
    for o, key in zip(observations, keys, strict=True):
        n = int(o.accepted.shape[0])
        if n and pooled[key, 0] > 0:
            rates += n * pooled[key, 1:] / pooled[key, 0]
            steps += n
    return rates / steps if steps else rates


@dataclass(frozen=True)
class GroupRow:
    group: str
    split: str  # "train" / "held-out"
    steps: int
    observed: tuple[float, ...]
    predicted: tuple[float, ...]

    @property
    def max_abs_error(self) -> float:
        return float(np.max(np.abs(np.subtract(self.predicted, self.observed)))) if self.observed else 0.0

    @property
    def observed_length(self) -> float:
        return 1.0 + float(sum(self.observed))

    @property
    def predicted_length(self) -> float:
        return 1.0 + float(sum(self.predicted))

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "split": self.split, "steps": self.steps,
                "observed": [round(x, 4) for x in self.observed], "predicted": [round(x, 4) for x in self.predicted],
                "observed_length": round(self.observed_length, 4), "predicted_length": round(self.predicted_length, 4),
                "max_abs_error": round(self.max_abs_error, 4)}


def group_report(observations: Sequence[Observation], streams: Streams, params: AcceptanceParams, k: int,
                 train: set[str] | None = None, reference: Streams | None = None) -> list[GroupRow]:
    """Observed vs predicted per-position acceptance per group (category), then 'train' and
    'held-out' totals when a training set is given, else one 'all' row."""
    groups: dict[str, list[Observation]] = {}
    for o in observations:
        groups.setdefault(o.group, []).append(o)
    rows = []

    def row(name: str, obs: list[Observation], split: str) -> GroupRow:
        observed, steps = observed_rates(obs, k)
        predicted = predicted_rates(obs, streams, params, k, reference)
        return GroupRow(name, split, steps, tuple(map(float, observed)), tuple(map(float, predicted)))

    for name in sorted(groups):
        split = "train" if train is None or name in train else "held-out"
        rows.append(row(name, groups[name], split))
    if train is None:
        rows.append(row("all", list(observations), "train"))
    else:
        for split in ("train", "held-out"):
            obs = [o for o in observations if (o.group in train) == (split == "train")]
            if obs:
                rows.append(row(f"{split} total", obs, split))
    return rows


@dataclass(frozen=True)
class Replay:
    """What `replay_drafter` measured: vLLM's per-position counts and each call's per-step accepted."""

    counts: np.ndarray  # steps accepting ≥ i+1, per position i
    steps: int  # drafted steps
    accepted: tuple[np.ndarray, ...]  # per call, per step

    @property
    def rates(self) -> np.ndarray:
        return self.counts / self.steps if self.steps else np.zeros_like(self.counts, dtype=np.float64)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + float(self.rates.sum())


def replay_drafter(calls: Iterable[Call], spec, k: int | None = None) -> Replay:
    """Run a drafter standalone over `calls`, one call at a time, as the engine drives it (start_call
    after the first token, propose / greedy verify / observe each step, finish_call), with a fixed
    k (default: the config's). No batching, scheduling or cost: the acceptance model alone."""
    from agentspec_sim.drafters.registry import make_drafter, parse_drafter
    from agentspec_sim.engine.drafting import CallState, verify

    spec = parse_drafter(spec)
    drafter = make_drafter(spec)
    k = spec.num_speculative_tokens if k is None else k
    counts = np.zeros(k, dtype=np.int64)
    per_call = []
    lens = np.array([k], dtype=np.int64)
    for index, call in enumerate(calls):
        state = CallState(index, call, call.id, 0, index, call.output_len)
        start = call.prompt_len
        state.history[start] = call.output_tokens[0]  # the prefill step samples the first token
        state.num_emitted = 1
        drafter.start_call(state)
        drafter.observe(state, state.history[start:start + 1])
        accepted = []
        while state.num_emitted < state.target_len:
            draft = drafter.propose([state], lens)[0]
            acc, emitted = verify(draft, call.output_tokens, state.num_emitted, state.target_len)
            pos = start + state.num_emitted
            state.history[pos:pos + emitted] = call.output_tokens[state.num_emitted:state.num_emitted + emitted]
            state.num_emitted += emitted
            counts[:acc] += 1
            accepted.append(acc)
            drafter.observe(state, state.history[pos:pos + emitted])
        drafter.finish_call(state)
        per_call.append(np.asarray(accepted, dtype=np.int64))
    return Replay(counts, sum(a.shape[0] for a in per_call), tuple(per_call))


# --------------------------------------------------------------------------------------------
# One entry point for the CLI


def calibrate_file(path: str | Path, *, method: str = "eagle3", model: str = "custom", k: int | None = None,
                   train_categories: Sequence[str] | None = None, features: Workload | None = None,
                   coefficients: Mapping[str, float] | None = None) -> tuple[FitResult, list[GroupRow]]:
    """Fit parameters from a vLLM per-request metrics JSONL or a Spec-Bench answer file.

    Streams: the requests' own calls from `features` (a trace whose outputs produced the metrics;
    for Spec-Bench the bundled spec-bench trace by default), matched by call id; requests without
    a match use the pooled stream of `features`, or the reference stream (`REFERENCE_STREAM`).
    Feature coefficients are fitted when the data is tied to per-call streams and `coefficients`
    is None; otherwise they are held at `coefficients` (default: the method's bundled default).
    """
    from agentspec_sim.drafters.model.rule import load_params

    spec_bench = looks_like_spec_bench(path)
    observations = load_spec_bench(path, k) if spec_bench else load_vllm_metrics(path)
    if k is None:
        k = max(int(o.drafted.max()) for o in observations if o.drafted.size)
    if features is None and spec_bench:
        from agentspec_sim.trace.bundled import bundled_trace
        from agentspec_sim.trace.io import load_trace

        features = load_trace(bundled_trace("spec-bench.jsonl.zst"))
    streams = workload_streams(features) if features is not None else reference_streams()
    reference = streams if features is not None else None
    index = streams.index()
    per_call = features is not None and any(o.call_id in index for o in observations)
    if coefficients is None and not per_call:
        coefficients = dict(load_params(method).coefficients)
    train = set(train_categories) if train_categories else None
    groups = {o.group for o in observations}
    if train is not None:
        unknown = sorted(train - groups)
        if unknown:
            raise CalibrationError(f"unknown categories {unknown} (in the file: {', '.join(sorted(groups))})")
    fit_obs = [o for o in observations if train is None or o.group in train]
    where = "Spec-Bench answers" if spec_bench else "vLLM per-request spec_decode_metrics"
    source = (f"fitted by agentspec_sim.drafters.model.calibrate (maximum likelihood) to {Path(path).name} "
              f"({where}; {len(fit_obs)} requests"
              + (f", categories {', '.join(sorted(train))}" if train else "") + ")")
    result = fit_steps(fit_obs, streams, k, method=method, model=model, coefficients=coefficients,
                       reference=reference, source=source)
    sources = {"positions": source,
               "coefficients": source if coefficients is None else "held fixed (given, or the method's bundled "
                                                                    "default file)"}
    stream_note = "each request's own call" if per_call else REFERENCE_STREAM if features is None else \
        "the pooled calls of the features trace"
    result.params = AcceptanceParams(method, model, result.params.positions, result.params.coefficients,
                                     source=source, sources=sources,
                                     calibration={"k": k, "streams": stream_note, "steps": result.num_steps})
    rows = group_report(observations, streams, result.params, k, train, reference)
    return result, rows


POOLED_POSITIONS = 12  # slots ≥ 11 share one intercept: they are < 1 % of the slot trials at k = 20
BAND_DRAWS = 400
BAND_QUANTILES = (0.025, 0.975)


def _shifted(params: AcceptanceParams, delta: float) -> AcceptanceParams:
    return replace(params, positions=tuple(a + delta for a in params.positions), band={})


def _band(params: AcceptanceParams, observations: Sequence[Observation], streams: Streams, k: int,
          requests: int, seed: int = 0) -> dict[str, Any]:
    """The uncertainty band of a fit from its own error spread: per training dataset, `BAND_DRAWS` seeded
    samples of `requests` requests; in each, the observed mean acceptance length over the expected one
    (the walk over those requests' own streams). The 2.5 % and 97.5 % quantiles of that ratio, over every
    dataset's samples, set the bounds: all intercepts shifted by the one δ that scales the expected mean
    acceptance length over the training requests by that ratio. So the band holds the dataset-to-dataset
    differences the features do not explain and the request-to-request spread of a sample that size."""
    index = streams.index()
    rows = [index[o.call_id] for o in observations]
    sub = streams.subset(rows)
    expected = expected_counts(sub, params, k)  # per request: E[steps], E[steps accepting ≥ i+1]
    exp_tokens = expected[:, 1:].sum(axis=1)
    obs_steps = np.array([o.accepted.shape[0] for o in observations], dtype=np.float64)
    obs_tokens = np.array([float(o.accepted.sum()) for o in observations])
    rng = np.random.default_rng(seed)
    ratios = []
    groups = sorted({o.group for o in observations})
    for g in groups:
        members = np.array([i for i, o in enumerate(observations) if o.group == g])
        n = min(requests, members.shape[0])
        for _ in range(BAND_DRAWS):
            pick = rng.choice(members, size=n, replace=False)
            observed = 1.0 + obs_tokens[pick].sum() / obs_steps[pick].sum()
            predicted = 1.0 + exp_tokens[pick].sum() / expected[pick, 0].sum()
            ratios.append(observed / predicted)
    lo, hi = np.quantile(ratios, BAND_QUANTILES)
    source = (f"the fit's own error spread: {BAND_DRAWS} seeded samples of {requests} requests from each training "
              f"dataset ({', '.join(groups)}); observed / expected mean acceptance length "
              f"{BAND_QUANTILES[0]:.1%} quantile {lo:.4f}, {BAND_QUANTILES[1]:.1%} quantile {hi:.4f}; each bound "
              "shifts every intercept by the δ that scales the expected length over the training requests by "
              "that ratio")
    return _ratio_band(params, sub, k, round(float(lo), 4), round(float(hi), 4), source, exact_ratios=(lo, hi))


def _ratio_band(params: AcceptanceParams, stream: Streams, k: int, lo: float, hi: float, source: str,
                exact_ratios: tuple[float, float] | None = None) -> dict[str, Any]:
    """A band whose bounds shift every intercept of `params` by the δ (scipy brentq) that scales its
    expected mean acceptance length on `stream` at draft length k by the ratio lo (low) and hi (high);
    `exact_ratios`, when given, are the unrounded ratios solved for (the band records lo, hi)."""
    from scipy.optimize import brentq

    base = 1.0 + float(model_rates(stream, params, k).sum())
    out: dict[str, Any] = {"source": source, "ratio": [lo, hi]}
    for bound, ratio in zip(("low", "high"), exact_ratios or (lo, hi), strict=True):
        def gap(delta: float, target: float = base * ratio) -> float:
            return 1.0 + float(model_rates(stream, _shifted(params, delta), k).sum()) - target

        delta = 0.0 if abs(ratio - 1.0) < 1e-12 else brentq(gap, -4.0, 4.0, xtol=1e-6)
        out[bound] = {"positions": [round(a + delta, 6) for a in params.positions],
                      "coefficients": {f: round(params.coefficient(f), 6) for f in FEATURES},
                      "logit_shift": round(float(delta), 6)}
    return out


def calibrate_specdecode_bench(paths: Sequence[str | Path], *, method: str = "eagle3", model: str = "custom",
                               k: int | None = None, train: Sequence[str] | None = None, limit: int | None = None,
                               coefficients: Mapping[str, float] | None = None,
                               proposer: str | None = None, num_positions: int | None = POOLED_POSITIONS,
                               band: bool = True, band_requests: int = 100
                               ) -> tuple[FitResult, list[GroupRow], Streams]:
    """Fit from SpecDecode-Bench request files (`load_specdecode_bench`), one dataset (group) per file.

    Every request is its own call (its prompt and output ids; no tokenizer, so code = 0), its steps at
    their known output positions: the exact likelihood of the drafter's process. `train`: the datasets
    to fit on (default: all); the others are held out and only reported. `coefficients` fixes the
    feature coefficients (e.g. all zero: per-position intercepts only); None fits them too. Slots from
    `num_positions` − 1 on share one intercept. The report compares observed and expected (the walk over
    each request's own stream) per-position acceptance.

    `band`: the file's uncertainty band (`_band`): how far the mean acceptance length of `band_requests`
    requests of one kind of text falls from the fit's expectation for them."""
    proposer = proposer or SPECDECODE_BENCH_PROPOSERS.get(method, f"acc_{method}")
    observations: list[Observation] = []
    calls: list[Call] = []
    for path in paths:
        obs, cs = load_specdecode_bench(path, proposer=proposer, k=k, limit=limit)
        observations += obs
        calls += cs
    depth = k
    if depth is None:  # one k for every file: the largest any of them shows (no step accepted more in any)
        depth = max(int(o.drafted.max(initial=1)) for o in observations)
        observations = [replace(o, drafted=np.full_like(o.drafted, depth)) for o in observations]
    groups = sorted({o.group for o in observations})
    train_set = set(train) if train else set(groups)
    unknown = sorted(train_set - set(groups))
    if unknown:
        raise CalibrationError(f"unknown datasets {unknown} (in the files: {', '.join(groups)})")
    streams = build_streams(calls, tokenizer=None)
    fit_obs = [o for o in observations if o.group in train_set]
    names = ", ".join(Path(p).name for p in paths if specdecode_bench_group(p) in train_set)
    source = (f"fitted by agentspec_sim.drafters.model.calibrate (maximum likelihood, every step at its output "
              f"position) to SpecDecode-Bench {proposer} data: {names} ({len(fit_obs)} requests"
              + (f", first {limit} per file" if limit else "") + f"; k = {depth})")
    result = fit_steps(fit_obs, streams, depth, method=method, model=model, coefficients=coefficients,
                       source=source, num_positions=num_positions)
    held_out = [g for g in groups if g not in train_set]
    band_doc = _band(result.params, fit_obs, streams, depth, band_requests, seed=0) if band else {}
    sources = {"positions": source,
               "coefficients": source if coefficients is None else "held fixed at the given values"}
    result.params = AcceptanceParams(method, model, result.params.positions, result.params.coefficients,
                                     source=source, sources=sources,
                                     calibration={"k": depth, "train": sorted(train_set), "held_out": held_out,
                                                  "steps": result.num_steps, "streams": "each request's own call"},
                                     band=band_doc)
    rows = group_report(observations, streams, result.params, depth, train_set if held_out else None)
    return result, rows, streams


# --------------------------------------------------------------------------------------------
# The bundled parameter files


def _constant_tail(first: float, total: float, k: int) -> list[float]:
    """Cumulative rates P(≥ i+1) = first · r^i, i < k, with Σ = total (r by bisection)."""
    lo, hi = 1e-6, 1.0 - 1e-9
    for _ in range(200):
        r = 0.5 * (lo + hi)
        s = first * sum(r**i for i in range(k))
        lo, hi = (r, hi) if s < total else (lo, r)
    r = 0.5 * (lo + hi)
    return [first * r**i for i in range(k)]


def _deepseek_targets() -> list[float]:
    # DeepSeek-V3 MTP reused autoregressively, k = 7, length 3.20 at T = 0 → Σ P(≥ i+1) = 2.20, with
    # the second token (first draft) accepted 85–90% (midpoint 0.875) and a constant conditional rate after.
    return _constant_tail(0.875, 2.20, 7)


def _mimo_targets() -> list[float]:
    # MiMo-7B: one MTP layer, ~90% acceptance at k = 1; deeper slots reuse the layer (vLLM warns of
    # lower acceptance) and take DeepSeek-V3's conditional decay (assumption, see the file's sources).
    ds = _deepseek_targets()
    r = ds[1] / ds[0]
    return [0.90 * r**i for i in range(7)]


PUBLIC_TARGETS: dict[tuple[str, str], dict[str, Any]] = {
    ("eagle3", "gpt-oss-20b"): {
        "targets": lambda: [0.622, 0.356, 0.203, 0.119, 0.060],
        "aliases": ["openai/gpt-oss-20b", "gpt-oss-120b", "openai/gpt-oss-120b"],
        "source": "EAGLE-3 on gpt-oss, k=5, vLLM per-position acceptance 0.622 / 0.356 / 0.203 / 0.119 / 0.060 "
                  "(mean acceptance length 2.36), as collected in VLLM-NOTES 'Public acceptance figures'; the "
                  "prompt set is not stated, so the MT-Bench reference stream stands in. Positions >= 5 reuse "
                  "the last intercept (conditional ~0.50).",
    },
    ("mtp", "mimo-7b"): {
        "targets": _mimo_targets,
        "ks": [1, 7, 7, 7, 7, 7, 7],
        "aliases": ["XiaomiMiMo/MiMo-7B-RL", "XiaomiMiMo/MiMo-7B-Base", "mimo-7b-rl"],
        "source": "MiMo-7B (one MTP layer, num_nextn_predict_layers = 1): ~90% acceptance at k=1 (MiMo report; "
                  "recommended k=1); the first target is matched at k=1. Slots >= 1 reuse the single layer "
                  "autoregressively; their conditional acceptance is ASSUMED equal to DeepSeek-V3's (see "
                  "mtp.default.json): P(>= i+1) = 0.90 r^i, matched at k=7.",
    },
    ("mtp", "default"): {
        "targets": _deepseek_targets,
        "aliases": ["deepseek-v3", "deepseek-ai/DeepSeek-V3", "deepseek-r1", "deepseek-ai/DeepSeek-R1"],
        "source": "DeepSeek-V3 MTP (DeepSeek-V3 technical report): second-token acceptance 85-90% (0.875 used); "
                  "reused autoregressively with k=7 at temperature 0, mean acceptance length 3.20 (as collected "
                  "in VLLM-NOTES). Shape: P(>= 1) = 0.875, then a constant conditional rate r fitted so that "
                  "1 + sum P(>= i+1) = 3.20.",
    },
}

SPEC_BENCH_EAGLE = "spec-bench/model_answer/vicuna-7b-v1.3-eagle-float16-temperature-0.0.jsonl"

# The EAGLE-3 files fitted to measured per-step vLLM data: SpecDecode-Bench/simulator (commit 2fdccbd),
# data/llama3.1-8B/combined_<dataset>.jsonl, Llama-3.1-8B-Instruct with its EAGLE-3 head on an H100, k = 20.
# The fit sees gsm8k and sharegpt only; instructcoder and cnn are the held-out evaluation.
SPECDECODE_BENCH_TRAIN = ("gsm8k", "sharegpt")
SPECDECODE_BENCH_HELD_OUT = ("instructcoder", "cnn")
SPECDECODE_BENCH = "SpecDecode-Bench/simulator (commit 2fdccbd) data/llama3.1-8B"
MEASURED_FITS: dict[tuple[str, str], dict[str, Any]] = {
    ("eagle3", "llama-3.1-8b"): {
        "aliases": ["meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"],
        "draft_model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "source": "MEASURED: Llama-3.1-8B-Instruct with its EAGLE-3 head on an H100 in vLLM, per-step accepted "
                  f"lengths at every output position ({SPECDECODE_BENCH}), k = 20; fitted on gsm8k and "
                  "sharegpt, instructcoder and cnn held out (docs/model-based-drafters.md).",
    },
    ("eagle3", "default"): {
        "aliases": [],
        "source": "default for EAGLE-3 heads without a file of their own: the Llama-3.1-8B-Instruct EAGLE-3 fit to "
                  f"measured per-step vLLM data ({SPECDECODE_BENCH}; gsm8k + sharegpt, k = 20), the one EAGLE-3 "
                  "head with public per-step data.",
    },
    ("eagle3", "qwen3-8b"): {
        "aliases": ["Qwen/Qwen3-8B", "RedHatAI/Qwen3-8B-speculator.eagle3", "AngelSlim/Qwen3-8B_eagle3"],
        "source": "ASSUMPTION: no public per-step vLLM data for an EAGLE-3 head on Qwen3-8B was found; this file "
                  "reuses the Llama-3.1-8B-Instruct EAGLE-3 fit to measured per-step vLLM data "
                  f"({SPECDECODE_BENCH}; gsm8k + sharegpt, k = 20): same one-layer head architecture and training "
                  "recipe (SpecForge configs/qwen3-8b-eagle3.json). Published Qwen3-8B heads report MT-Bench "
                  "acceptance lengths from 1.97 (AngelSlim/Qwen3-8B_eagle3 on vLLM, k unstated); recalibrate with "
                  "`agentspec-sim calibrate acceptance` when per-step data for the head you deploy is available.",
    },
}


def regenerate_measured(specdecode_bench_dir: str | Path, out_dir: str | Path = ACCEPTANCE_DIR) -> list[Path]:
    """Rewrite the `MEASURED_FITS` files (atomically) from SpecDecode-Bench's Llama-3.1-8B files in
    `specdecode_bench_dir`: per-position intercepts by maximum likelihood on the training datasets, every
    step at its output position, feature coefficients held at zero (see docs/model-based-drafters.md:
    on this data the copy feature, fitted, makes the training walk worse, and code has no tokenizer),
    the per-dataset band, and the fit report (training and held-out) in `calibration`."""
    from agentspec_sim.io.atomic import write_json_atomic

    paths = [Path(specdecode_bench_dir) / f"combined_{d}.jsonl" for d in (*SPECDECODE_BENCH_TRAIN,
                                                                        *SPECDECODE_BENCH_HELD_OUT)]
    zero = {f: 0.0 for f in FEATURES}
    result, rows, _ = calibrate_specdecode_bench(paths, method="eagle3", model="llama-3.1-8b", k=20,
                                                 train=SPECDECODE_BENCH_TRAIN, coefficients=zero)
    fit = result.params
    written = []
    for (method, model), entry in MEASURED_FITS.items():
        params = replace(
            fit, model=model, positions=tuple(round(a, 6) for a in fit.positions), source=entry["source"],
            sources={**fit.sources, "data": f"{SPECDECODE_BENCH}: " + ", ".join(p.name for p in paths)},
            aliases=tuple(entry["aliases"]), draft_model=entry.get("draft_model"),
            calibration={**fit.calibration, "report": [r.to_json() for r in rows],
                         "regenerate": "agentspec_sim.drafters.model.calibrate.regenerate_measured(<SpecDecode-Bench "
                                       "data/llama3.1-8B>)"})
        path = Path(out_dir) / f"{method}.{model}.json"
        write_json_atomic(path, params.to_json())
        written.append(path)
    return written


def fit_coefficients(spec_bench_answers: str | Path) -> tuple[dict[str, float], FitResult]:
    """The feature coefficients every bundled file uses: fitted (with free intercepts, then discarded)
    on Spec-Bench's EAGLE answers, each turn tied to its own call of the bundled spec-bench trace."""
    from agentspec_sim.trace.bundled import bundled_trace
    from agentspec_sim.trace.io import load_trace

    observations = load_spec_bench(spec_bench_answers)
    k = max(int(o.drafted.max()) for o in observations)
    streams = workload_streams(load_trace(bundled_trace("spec-bench.jsonl.zst")))
    result = fit_steps(observations, streams, k, method="eagle", model="vicuna-7b-v1.3")
    return {f: round(result.params.coefficient(f), 4) for f in FEATURES}, result


def regenerate_bundled(spec_bench_answers: str | Path, out_dir: str | Path = ACCEPTANCE_DIR) -> list[Path]:
    """Rewrite every file of `PUBLIC_TARGETS` (atomically): coefficients from Spec-Bench, intercepts
    solved for the public per-position targets on the MT-Bench reference stream."""
    from agentspec_sim.io.atomic import write_json_atomic

    coefficients, coef_fit = fit_coefficients(spec_bench_answers)
    coef_source = (f"fitted by maximum likelihood on Spec-Bench EAGLE answers ({Path(spec_bench_answers).name}: "
                   f"Vicuna-7B v1.3, EAGLE-1 tree depth 5, greedy; {coef_fit.num_steps} steps, all 13 categories, "
                   "each turn tied to its call of traces/spec-bench.jsonl.zst); only the feature coefficients are "
                   "kept (the intercepts of that fit describe EAGLE-1 tree drafting, not this drafter)")
    stream = reference_streams()
    written = []
    for (method, model), entry in PUBLIC_TARGETS.items():
        targets = [round(float(x), 6) for x in entry["targets"]()]
        ks = entry.get("ks") or [len(targets)] * len(targets)
        params = fit_targets(stream, targets, coefficients, method=method, model=model, ks=ks)
        rates = {k: model_rates(stream, params, k) for k in set(ks)}
        achieved = [rates[k][i] for i, k in enumerate(ks)]
        params = AcceptanceParams(
            method, model, tuple(round(a, 6) for a in params.positions), coefficients, source=entry["source"],
            sources={"positions": "solved (scipy least_squares) so that the model's cumulative per-position "
                                  "acceptance on the reference stream equals the targets",
                     "coefficients": coef_source, "targets": entry["source"]},
            aliases=tuple(entry["aliases"]),
            calibration={"k": ks[-1], **({"k_per_target": ks} if len(set(ks)) > 1 else {}),
                         "targets_cumulative": targets,
                         "model_cumulative": [round(float(x), 4) for x in achieved],
                         "stream": REFERENCE_STREAM,
                         "regenerate":
                             "agentspec_sim.drafters.model.calibrate.regenerate_bundled(<spec-bench answers>)"})
        params = replace(params, band=borrowed_band(params, stream, ks[-1]))
        path = Path(out_dir) / f"{method}.{model}.json"
        write_json_atomic(path, params.to_json())
        written.append(path)
    return written


def borrowed_band(params: AcceptanceParams, stream: Streams, k: int,
                  measured: AcceptanceParams | None = None) -> dict[str, Any]:
    """A band for a file solved for published figures, which has no error spread of its own: the measured
    EAGLE-3 fit's (`measured`, default the bundled Llama-3.1-8B file) observed / expected ratio quantiles,
    applied as a logit shift of every intercept that scales this file's expected mean acceptance length on
    `stream` at draft length k by each ratio. An assumption, and the band's source says so."""
    from agentspec_sim.drafters.model.rule import load_params

    measured = measured or load_params("eagle3", "llama-3.1-8b")
    lo, hi = measured.band["ratio"]
    source = (f"ASSUMPTION: borrowed from the measured EAGLE-3 fit ({measured.model}: observed / expected mean "
              f"acceptance length {lo:.4f}–{hi:.4f} over samples of its training data); each bound shifts every "
              f"intercept by the δ that scales this file's expected length on the reference stream at k = {k} by "
              "that ratio. A file solved for one published figure has no error spread of its own; its real "
              "uncertainty is likely wider")
    return _ratio_band(params, stream, k, lo, hi, source)


__all__ = [
    "MT_BENCH_CATEGORIES",
    "PUBLIC_TARGETS",
    "REFERENCE_STREAM",
    "CalibrationError",
    "FitResult",
    "GroupRow",
    "Observation",
    "Replay",
    "Streams",
    "borrowed_band",
    "build_streams",
    "calibrate_file",
    "calibrate_specdecode_bench",
    "call_features",
    "cumulative_rates",
    "expected_counts",
    "fit_coefficients",
    "fit_steps",
    "fit_targets",
    "group_report",
    "load_spec_bench",
    "load_specdecode_bench",
    "load_vllm_metrics",
    "looks_like_specdecode_bench",
    "model_rates",
    "observed_rates",
    "predicted_rates",
    "reference_streams",
    "regenerate_bundled",
    "regenerate_measured",
    "replay_drafter",
    "sample_steps",
    "walk_positions",
    "workload_streams",
]
