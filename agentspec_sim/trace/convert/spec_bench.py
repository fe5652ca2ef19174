"""Spec-Bench questions + recorded answers → trace records (converter `spec-bench`).

Source: hemingkx/Spec-Bench `data/spec_bench/question.jsonl` (`question_id`, `category`, `turns[]`)
and one answer file `model_answer/<model-id>.jsonl` (FastChat answer format: `question_id`,
`model_id`, `choices[0]` with `turns[]` texts and, per turn, `new_tokens`, `decoding_steps`,
`wall_time`, plus `accept_lengths`: one entry per decoding step, all turns concatenated).

Input: a Spec-Bench folder (holding `question.jsonl` and `model_answer/*.jsonl`), or the question
file and an answer file, or a folder plus an answer file. Files are told apart by content. Without
an explicit answer file the folder's vanilla (autoregressive) answers are used: the one answer file
whose name contains "vanilla" or "baseline", or the only answer file there is; name the answer file
to convert another one (e.g. the EAGLE answers).

Rules:

- One query per answered question: `agent_id` "spec-bench", `query_id` the question id, one call
  per turn, role "assistant". Questions without an answer in the file are left out.
- Prompt: the conversation as chat messages. Spec-Bench prompted each model with its FastChat
  conversation template; for Vicuna answers that template's system message is kept (as a system
  message). Turn 2 re-sends turn 1 and its answer, so it is written in the delta form
  (`prompt_extends` turn 1 + `messages_append` [turn 2 question]).
- Output: the recorded answer text + the end-of-turn text. A turn whose `new_tokens` reached
  Spec-Bench's `--max-new-tokens` (1024, the default of its inference scripts) was cut off without
  an end-of-turn, so none is appended; it is marked `extra.truncated`. A turn recorded as "ERROR"
  (the generation raised) ends its question: it and later turns are left out.
- `extra`: `category`, `turn` (0-based), and the answer file's per-turn `new_tokens`,
  `decoding_steps`, `wall_time_s` (counts in the answering model's own tokenizer, not the trace's).
  `accept_lengths` (tokens accepted per verification step, bonus token included) is kept per turn
  when it carries information, i.e. when some entry is > 1 (speculative answers such as EAGLE);
  the vanilla file's lists are all ones and are dropped. The per-turn split follows
  `decoding_steps`; a file whose lengths do not add up is rejected.

On the published files: 480 questions, 560 calls (80 two-turn questions), 13 categories.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from agentspec_sim.io import strict_json
from agentspec_sim.trace.convert.base import (
    ChatCall,
    ConvertError,
    ConvertOptions,
    chat_call_records,
    register,
)

AGENT_ID = "spec-bench"
QUESTION_FILE = "question.jsonl"
MAX_NEW_TOKENS = 1024  # Spec-Bench evaluation/inference_*.py: --max-new-tokens default
# FastChat's vicuna_v1.1 conversation template, which Spec-Bench used for vicuna-* models.
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
_VANILLA_MARKERS = ("vanilla", "baseline")


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read ({exc})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((n, strict_json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConvertError(path, f"line {n}: not JSON ({exc.msg})") from None
    if not rows:
        raise ConvertError(path, "empty file; expected Spec-Bench questions or answers")
    return rows


def _kind(path: Path) -> str | None:
    """'questions', 'answers' or None, from the file's first row."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
        row = strict_json.loads(first)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(row, dict) or "question_id" not in row:
        return None
    if "choices" in row:
        return "answers"
    return "questions" if "turns" in row else None


def _resolve(paths: Sequence[Path]) -> tuple[Path, Path]:
    """(question file, answer file) from the inputs; see the module docstring."""
    questions: list[Path] = []
    answers: list[Path] = []
    candidates: list[Path] = []  # answer files found in folders
    for p in paths:
        if p.is_dir():
            q = p / QUESTION_FILE
            if not q.is_file():
                found = sorted(p.rglob(QUESTION_FILE))
                if not found:
                    raise ConvertError(p, f"no {QUESTION_FILE} in this directory; not a Spec-Bench folder")
                q = found[0]
            questions.append(q)
            candidates.extend(f for f in sorted(q.parent.rglob("*.jsonl")) if f != q and _kind(f) == "answers")
        elif p.is_file():
            kind = _kind(p)
            if kind is None:
                raise ConvertError(p, "not a Spec-Bench file (expected question rows with 'question_id' and "
                                      "'turns', or answer rows with 'question_id' and 'choices')")
            (questions if kind == "questions" else answers).append(p)
        else:
            raise ConvertError(p, "no such file or directory")
    questions = list({q.resolve(): q for q in questions}.values())
    if len(questions) != 1:
        where = paths[0] if paths else Path(".")
        raise ConvertError(where, f"expected one question file, got {len(questions)}"
                                  + (f": {', '.join(map(str, questions))}" if questions else ""))
    answers = list({a.resolve(): a for a in answers}.values())
    if len(answers) > 1:
        raise ConvertError(answers[1], "give one answer file (several were named)")
    if answers:
        return questions[0], answers[0]
    vanilla = [f for f in candidates if any(m in f.name.lower() for m in _VANILLA_MARKERS)]
    if len(vanilla) == 1:
        return questions[0], vanilla[0]
    if not vanilla and len(candidates) == 1:
        return questions[0], candidates[0]
    names = ", ".join(f.name for f in (vanilla or candidates)) or "none"
    raise ConvertError(questions[0].parent, f"cannot pick the vanilla answer file (found: {names}); "
                                            "name the answer file to convert")


def _questions(path: Path) -> dict[object, dict]:
    out: dict[object, dict] = {}
    for n, row in _read_jsonl(path):
        if not (isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]
                and all(isinstance(t, str) for t in row["turns"]) and "question_id" in row):
            raise ConvertError(path, f"line {n}: not a Spec-Bench question (needs 'question_id' and 'turns')")
        qid = row["question_id"]
        if not isinstance(qid, (int, str)) or isinstance(qid, bool):
            raise ConvertError(path, f"line {n}: 'question_id' must be an integer or a string")
        if qid in out:
            raise ConvertError(path, f"line {n}: duplicate question_id {qid!r}")
        out[qid] = row
    return out


def _int_list(value: object) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _turn_extras(path: Path, n: int, choice: dict, n_turns: int) -> list[dict]:
    """Per-turn statistics of one answer (new_tokens, decoding_steps, wall_time, accept_lengths)."""
    extras: list[dict] = [{} for _ in range(n_turns)]
    new_tokens, steps = _int_list(choice.get("new_tokens")), _int_list(choice.get("decoding_steps"))
    wall = choice.get("wall_time")
    for name, values in (("new_tokens", new_tokens), ("decoding_steps", steps)):
        if values is not None and len(values) == n_turns:
            for e, v in zip(extras, values, strict=True):
                e[name] = v
    if isinstance(wall, list) and len(wall) == n_turns and all(isinstance(v, (int, float)) for v in wall):
        for e, v in zip(extras, wall, strict=True):
            e["wall_time_s"] = float(v)
    accept = _int_list(choice.get("accept_lengths"))
    if accept is not None and any(a > 1 for a in accept):
        if steps is None or len(steps) != n_turns or sum(steps) != len(accept):
            raise ConvertError(path, f"line {n}: accept_lengths ({len(accept)} steps) does not split by "
                                     f"decoding_steps {steps}")
        start = 0
        for e, s in zip(extras, steps, strict=True):
            e["accept_lengths"] = accept[start:start + s]
            start += s
    return extras


def _queries(qpath: Path, apath: Path, opts: ConvertOptions) -> tuple[str, list[list[dict]]]:
    questions = _questions(qpath)
    model_ids: set[str] = set()
    queries: list[list[dict]] = []
    seen: set[object] = set()
    for n, row in _read_jsonl(apath):
        choices = row.get("choices") if isinstance(row, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and isinstance(choices[0].get("turns"), list)
                and all(isinstance(t, str) for t in choices[0]["turns"])):
            raise ConvertError(apath, f"line {n}: not a Spec-Bench answer (needs 'question_id' and "
                                      "'choices[0].turns')")
        qid = row.get("question_id")
        if qid not in questions:
            raise ConvertError(apath, f"line {n}: question_id {qid!r} is not in {qpath.name}")
        if qid in seen:
            raise ConvertError(apath, f"line {n}: a second answer to question {qid!r}")
        seen.add(qid)
        question, answers = questions[qid], choices[0]["turns"]
        if len(answers) != len(question["turns"]):
            raise ConvertError(apath, f"line {n}: {len(answers)} answer turns for a question of "
                                      f"{len(question['turns'])}")
        model_id = row.get("model_id") if isinstance(row.get("model_id"), str) else ""
        model_ids.add(model_id)
        stats = _turn_extras(apath, n, choices[0], len(answers))
        history: list[dict] = []
        if model_id.lower().startswith("vicuna"):
            history.append({"role": "system", "content": VICUNA_SYSTEM})
        calls, truncated = [], []
        for turn, (asked, answer) in enumerate(zip(question["turns"], answers, strict=True)):
            if answer == "ERROR":
                break
            history.append({"role": "user", "content": asked})
            cut = stats[turn].get("new_tokens", 0) >= MAX_NEW_TOKENS
            extra = {"category": question.get("category", row.get("category")), "turn": turn, **stats[turn]}
            if cut:
                extra["truncated"] = True
            calls.append(ChatCall(messages=list(history), response=answer, role="assistant", extra=extra))
            truncated.append(cut)
            history.append({"role": "assistant", "content": answer})
        records = []
        for record, cut in zip(chat_call_records(AGENT_ID, qid, calls, opts), truncated, strict=True):
            if cut and opts.eot_text and record["output"].endswith(opts.eot_text):
                record["output"] = record["output"][: -len(opts.eot_text)]
            records.append(record)
        if records:
            queries.append(records)
    if not queries:
        raise ConvertError(apath, "no answered questions")
    return ",".join(sorted(m for m in model_ids if m)), queries


@register("spec-bench", "Spec-Bench question.jsonl + a model_answer file (vanilla by default) → multi-turn chats")
def convert_spec_bench(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then one query per answered question; rules in the module docstring."""
    qpath, apath = _resolve(paths)
    model, queries = _queries(qpath, apath, opts)
    meta: dict = {"type": "meta", "version": 1, "tokenizer": opts.tokenizer}
    if model:
        meta["model"] = model
    meta["workload"] = "chat"
    meta["source"] = f"Spec-Bench: {qpath.name} + model_answer/{apath.name}"
    yield meta
    for records in queries:
        yield from records
