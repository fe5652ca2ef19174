"""Measured acceptance, read: per-step accepted lengths from vLLM's per-request `spec_decode_metrics` JSONL,
Spec-Bench's `accept_lengths`, or SpecDecode-Bench's per-position records (walked as vLLM ran them,
`walk_positions`), each an `Observation` the fit ties to a feature stream (drafters/model/calibrate.py)."""


from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentspec_sim.host.resources import available_memory
from agentspec_sim.io import strict_json
from agentspec_sim.trace.schema import Call


class CalibrationError(ValueError):
    """Input the fit cannot use (a malformed metrics file, no observations, unknown categories)."""


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
