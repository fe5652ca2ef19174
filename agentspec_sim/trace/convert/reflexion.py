"""Reflexion programming logs → trace records (converter `reflexion`).

Source: noahshinn/reflexion `programming_runs/root/<run>/*.jsonl` (GPT-4 on HumanEval / MBPP, in
Python and Rust). Each row is one problem: `prompt` (signature + docstring), `solution`,
`is_solved`, `reflections[]` (absent in "simple" runs), and in newer logs `implementations[]` and
`test_feedback[]`.

What Reflexion ran per problem (`programming_runs/reflexion.py`, pass@1):

    gen_0 = write the function from its signature                      (LLM call, "simple")
    for i = 0, 1, ...:
        feedback_i = run self-written unit tests on gen_i              (tool time, no LLM)
        stop when they pass or the iteration budget is spent
        refl_i = explain why gen_i fails, given feedback_i            (LLM call)
        gen_i+1 = rewrite, given gen_i, feedback_i and refl_i         (LLM call)

A row with k reflections therefore made k+1 generation calls and k reflection calls, and
`solution` is the last generation, gen_k. (A test-writing call precedes the loop; its output is
never logged, so it is never emitted.)

Reconstruction rules — a recorded output is never invented:

1. A call is emitted only if its output is in the row: `reflections[i]` is refl_i's output,
   `implementations[j]` (n of them) is gen_j's output, and `solution` is gen_k's output when no
   implementation fills that slot (n <= k) and it is not one of the implementations (then it is
   that call already). Empty generations are dropped (no program was recorded). Without
   `implementations`, gen_0 … gen_k-1 happened but their text is lost, so they are left out: such
   a query holds the k reflection calls and the final generation, in loop order. The lists may
   have any length (rule 6).
2. A prompt part that was not recorded (gen_i as shown to refl_i and gen_i+1, and feedback_i
   unless `test_feedback` has it) is replaced by a visible stand-in, never by other recorded
   text: the implementation becomes the problem's own signature and docstring around a marker
   comment "(implementation of attempt n not recorded in the Reflexion log)" (in body-only runs,
   just the marker), the test results a similar marker line. Markers name the attempt, so the
   stand-in prompts of one problem diverge where the real ones did (after the shared instruction,
   example and signature) and a prefix cache cannot reuse a whole earlier prompt. Putting the
   final `solution` in as the previous implementation was rejected: the last generation's prompt
   would then contain its own output, which inflates any prompt-lookup drafter's acceptance.
   Such calls list their stand-ins in `extra.unrecorded` ("implementation", "test_feedback"),
   so their prompt lengths are known to be lower bounds.
3. Prompts are this module's own templates, modelled on Reflexion's structure (instruction, a
   worked example, then the `[implementation]` / `[unit test results]` / `[reflection]` sections),
   as chat messages (system + user). As in Reflexion, every call starts a fresh conversation (no
   history is re-sent), so calls carry full `messages`.
4. A generation's output is its code in a ```python / ```rust fence (chat-model Reflexion asked for
   one fenced block and parsed the code out of it); `structure` names that fence. A reflection's
   output is its text. Runs whose solutions are function bodies only (the oldest HumanEval log) get
   a body-only instruction.
5. "simple" runs (no `reflections` key) are one generation per problem. UCS runs
   (`reflexion_ucs.py`, file name contains "ucs") searched a tree, sampling several completions
   per rewrite; their tree links are not logged, so they are reconstructed like the linear loop
   (the reflections in logged order, then the final generation) with `extra.strategy`
   "reflexion-ucs".
6. Lists of any length (tree-search logs in this format, e.g. LATS, log a few implementations and
   many reflections, or more implementations than reflections + 1) are laid on the loop's slots in
   logged order: gen_0, refl_0, gen_1, refl_1, …, refl_k-1, gen_k, then gen_k+1 … gen_n-1. A slot
   whose output is not recorded is left out (gen_j for n <= j < k); what a call's prompt shows of
   attempt i is implementations[i] and test_feedback[i] where the lists reach that far, else the
   stand-ins of rule 2 (test_feedback longer than needed is ignored past the last use). The extra
   generations past gen_k (n > k + 1) are rewrites of the previous implementation in log order
   with the latest reflection, refl_k-1 (the plain generate prompt when k = 0); their tree links
   are not logged, so where that previous implementation equals the call's own output it is shown
   as the stand-in instead, and a prompt never contains its own call's output. With n = k + 1 this
   is the linear loop; with n = 0 it is rule 1's "reflections, then the final generation".

One query per problem: `agent_id` "reflexion", `query_id` "<run>/<task>" (run = the log's folder
name), roles "generator" / "reflector"; `extra` holds task, run, language, strategy, attempt
(the loop index i) and is_solved. On the published logs (7 runs, 1,690 problems): 3,073 calls —
1,676 generations and 1,397 reflections (14 empty final solutions dropped); no row there has
`implementations`, so every reflection and every rewrite prompt carries stand-ins.

Input: Reflexion log files, or folders searched for `*.jsonl` (there, files without a Reflexion
result row, such as `benchmarks/*.jsonl`, and files whose result rows are not programming runs, such
as LATS's test-generation logs whose `solution` is a list of asserts, are skipped). A row with neither `solution` nor
`is_solved` is a problem that was listed but not run (logs that copy every benchmark problem but
ran only some): it is skipped and counted, and the total is the meta line's `extra.skipped_rows`
(present only when some were skipped). Any other defect fails with one line naming the file and
line: a row that is not JSON or not an object, one with only one of `solution` / `is_solved` or no
`prompt`, a field present with the wrong type (`solution`, `prompt` strings; `is_solved` a
boolean; `reflections`, `implementations`, `test_feedback` lists of strings), no task id; and a
file with no result row at all is an error too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentspec_sim.io import strict_json
from agentspec_sim.trace.convert.base import (
    ChatCall,
    ConvertError,
    ConvertOptions,
    chat_call_records,
    register,
)

AGENT_ID = "reflexion"


@dataclass(frozen=True, slots=True)
class _Language:
    name: str  # as written in prose
    fence: str  # the code-fence info string
    comment: str  # line-comment leader
    example: str  # a worked example (own text) up to the reflection, for the few-shot part of prompts
    example_fix: str  # the example's improved implementation


_PY_EXAMPLE = '''[implementation]
```python
def count_vowels(text: str) -> int:
    """Return how many vowels (a, e, i, o, u, in either case) occur in text."""
    return sum(1 for ch in text if ch in "aeiou")
```

[unit test results]
Passed:
assert count_vowels("banana") == 3
Failed:
assert count_vowels("HELLO") == 2  # output: 0

[reflection]
The function only checks characters against lowercase vowels, so every uppercase vowel is missed
and "HELLO" counts as 0 instead of 2. Lower-casing each character before the membership test
fixes it without changing the result for lowercase input.'''

_PY_EXAMPLE_FIX = '''[improved implementation]
```python
def count_vowels(text: str) -> int:
    """Return how many vowels (a, e, i, o, u, in either case) occur in text."""
    return sum(1 for ch in text if ch.lower() in "aeiou")
```'''

_RS_EXAMPLE = '''[implementation]
```rust
/// Return the sum of the even numbers in v.
fn sum_even(v: Vec<isize>) -> isize {
    v.iter().filter(|x| *x % 2 == 1).sum()
}
```

[unit test results]
Passed:
assert_eq!(sum_even(vec![]), 0);
Failed:
assert_eq!(sum_even(vec![1, 2, 3, 4]), 6); // output: 4

[reflection]
The filter keeps the numbers whose remainder is 1, which are the odd numbers, so the function
sums 1 and 3 instead of 2 and 4. The condition must keep numbers whose remainder is 0.'''

_RS_EXAMPLE_FIX = '''[improved implementation]
```rust
/// Return the sum of the even numbers in v.
fn sum_even(v: Vec<isize>) -> isize {
    v.iter().filter(|x| *x % 2 == 0).sum()
}
```'''

LANGUAGES = {
    "py": _Language("Python", "python", "#", _PY_EXAMPLE, _PY_EXAMPLE_FIX),
    "rs": _Language("Rust", "rust", "//", _RS_EXAMPLE, _RS_EXAMPLE_FIX),
}

_GEN_SYSTEM = (
    "You are a careful {lang} programmer. The user gives you a function signature and its "
    "documentation. {what} Reply with one ```{fence} code block and nothing else."
)
_WHAT_FULL = "Write the complete implementation, restating the signature."
_WHAT_BODY = "Write only the body of the function, indented to follow the signature."

_REWRITE_SYSTEM = (
    "You are a careful {lang} programmer fixing your own code. You are shown your previous "
    "implementation of a function, the results of unit tests run on it, and your reflection on "
    "what went wrong. {what} Reply with one ```{fence} code block and nothing else."
)

_REFLECT_SYSTEM = (
    "You are a {lang} programmer reviewing your own code that failed its tests. You are shown a "
    "function implementation and the results of unit tests run on it. In a few sentences, explain "
    "why the implementation is wrong and what has to change. Do not write the corrected code."
)

_EXAMPLE_INTRO = "Here is a worked example of the format.\n\n"

# Stand-ins name the attempt, so stand-in prompts of one problem differ where the real ones did.
NOT_RECORDED_FEEDBACK = "(unit test results of attempt {n} not recorded in the Reflexion log)"
NOT_RECORDED_CODE = "(implementation of attempt {n} not recorded in the Reflexion log)"


@dataclass(frozen=True, slots=True)
class _Problem:
    run: str
    task: str
    row: dict
    language: str
    body_only: bool
    strategy: str


def _fenced(fence: str, code: str) -> str:
    return f"```{fence}\n{code.rstrip()}\n```"


class _Templates:
    """The prompts of one problem (own wording, Reflexion's structure)."""

    def __init__(self, p: _Problem) -> None:
        self.p = p
        self.lang = LANGUAGES[p.language]
        self.what = _WHAT_BODY if p.body_only else _WHAT_FULL

    def stand_in_code(self, attempt: int) -> str:
        lang = self.lang
        marker = f"    {lang.comment} {NOT_RECORDED_CODE.format(n=attempt + 1)}"
        if self.p.body_only:
            return marker
        signature = self.p.row["prompt"].rstrip("\n")
        closing = "\n}" if self.p.language == "rs" else ""
        return f"{signature}\n{marker}{closing}"

    def generate(self) -> list[dict]:
        lang = self.lang
        system = _GEN_SYSTEM.format(lang=lang.name, fence=lang.fence, what=self.what)
        return [{"role": "system", "content": system},
                {"role": "user", "content": f"Implement this function:\n\n{self.p.row['prompt']}"}]

    def reflect(self, code: str, feedback: str) -> list[dict]:
        lang = self.lang
        user = (
            f"{_EXAMPLE_INTRO}{lang.example}\n\nNow your turn.\n\n"
            f"[implementation]\n{_fenced(lang.fence, code)}\n\n"
            f"[unit test results]\n{feedback}\n\n[reflection]"
        )
        return [{"role": "system", "content": _REFLECT_SYSTEM.format(lang=lang.name)},
                {"role": "user", "content": user}]

    def rewrite(self, code: str, feedback: str, reflection: str) -> list[dict]:
        lang = self.lang
        user = (
            f"{_EXAMPLE_INTRO}{lang.example}\n\n{lang.example_fix}\n\nNow your turn.\n\n"
            f"[implementation]\n{_fenced(lang.fence, code)}\n\n"
            f"[unit test results]\n{feedback}\n\n[reflection]\n{reflection}\n\n"
            f"[improved implementation]\n{self.p.row['prompt']}"
        )
        system = _REWRITE_SYSTEM.format(lang=lang.name, fence=lang.fence, what=self.what)
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _calls(p: _Problem) -> list[ChatCall]:
    """The calls of one problem whose outputs are recorded, in loop order (rules 1-6)."""
    row, t = p.row, _Templates(p)
    fence = t.lang.fence
    structure = [[[f"```{fence}", "```"]]]
    reflections: list[str] = row.get("reflections") or []
    impls: list[str] = row.get("implementations") or []
    feedback: list[str] = row.get("test_feedback") or []
    k, n = len(reflections), len(impls)

    def extra(attempt: int, unrecorded: list[str]) -> dict:
        out: dict = {"task": p.task, "run": p.run, "language": p.language, "strategy": p.strategy,
                     "attempt": attempt, "is_solved": bool(row.get("is_solved"))}
        if unrecorded:
            out["unrecorded"] = unrecorded
        return out

    def code_and_feedback(i: int, output: str | None = None) -> tuple[str, str, list[str]]:
        """gen_i and feedback_i as the prompts show them, plus which are stand-ins. A gen_i equal to
        `output` (the asking call's own output) is shown as the stand-in."""
        missing = []
        code = impls[i] if i < n and impls[i] != output else None
        if code is None:
            code = t.stand_in_code(i)
            missing.append("implementation")
        fb = feedback[i] if i < len(feedback) else None
        if fb is None:
            fb = NOT_RECORDED_FEEDBACK.format(n=i + 1)
            missing.append("test_feedback")
        return code, fb, missing

    def generation(i: int, output: str) -> ChatCall | None:
        if not output.strip():
            return None
        if i == 0 or k == 0:
            messages, missing = t.generate(), []
        else:
            # past the loop (i > k) the previous generation is not known to be this one's parent
            code, fb, missing = code_and_feedback(i - 1, output if i > k else None)
            messages = t.rewrite(code, fb, reflections[min(i, k) - 1])
        return ChatCall(messages=messages, response=_fenced(fence, output), role="generator",
                        structure=structure, extra=extra(i, missing))

    calls: list[ChatCall | None] = []
    for i in range(max(n - 1, k) + 1):
        if i < n:
            calls.append(generation(i, impls[i]))
        elif i == k and row["solution"] not in impls:
            calls.append(generation(i, row["solution"]))
        if i < k:
            code, fb, missing = code_and_feedback(i)
            calls.append(ChatCall(messages=t.reflect(code, fb), response=reflections[i], role="reflector",
                                  structure=structure, extra=extra(i, missing)))
    return [c for c in calls if c is not None]


# --------------------------------------------------------------------------------------------
# Input


def _is_result_row(row: object) -> bool:
    return isinstance(row, dict) and "solution" in row and "is_solved" in row


def _is_no_run_row(row: dict) -> bool:
    """A problem listed but not run (a benchmark row): neither 'solution' nor 'is_solved'."""
    return "solution" not in row and "is_solved" not in row


def _check_str_list(path: Path, n: int, row: dict, key: str) -> None:
    value = row.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConvertError(path, f"line {n}: '{key}' must be a list of strings")


def _read_rows(path: Path) -> tuple[list[dict], int]:
    """The file's result rows, and how many rows without a run were skipped."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(path, f"cannot read ({exc})") from None
    rows, skipped = [], 0

    def not_json(n: int, exc: strict_json.StrictJSONError) -> ConvertError:
        return ConvertError(path, f"line {n}: not JSON ({exc.msg}); expected a Reflexion log row")

    for n, row in strict_json.json_lines(text, not_json):
        if not isinstance(row, dict):
            raise ConvertError(path, f"line {n}: not a JSON object; expected a Reflexion log row")
        if _is_no_run_row(row):
            skipped += 1
            continue
        if not _is_result_row(row) or not isinstance(row.get("prompt"), str):
            raise ConvertError(path, f"line {n}: not a Reflexion log row (needs 'prompt', 'solution' and "
                                     "'is_solved')")
        if not isinstance(row["solution"], str):
            raise ConvertError(path, f"line {n}: 'solution' must be a string")
        if not isinstance(row["is_solved"], bool):
            raise ConvertError(path, f"line {n}: 'is_solved' must be true or false")
        for key in ("reflections", "implementations", "test_feedback"):
            _check_str_list(path, n, row, key)
        if not (isinstance(row.get("name"), str) or isinstance(row.get("task_id"), str)):
            raise ConvertError(path, f"line {n}: no task id ('name' or 'task_id')")
        rows.append(row)
    if not rows:
        if skipped:
            raise ConvertError(path, f"not a Reflexion log: no result row ({skipped} rows without 'solution' "
                                     "and 'is_solved', e.g. a benchmark file)")
        raise ConvertError(path, "empty file; expected Reflexion log rows")
    return rows, skipped


def _has_result_row(path: Path) -> bool:
    """A programming log found in a folder: its first result row has a string `solution`. Files of
    other runs in the same folders are passed over, e.g. LATS's test-generation logs (`solution`:
    the list of generated asserts) beside its programming runs."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            for line in f:
                row = strict_json.loads(line) if line.strip() else None
                if _is_result_row(row):
                    return isinstance(row["solution"], str)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def _inputs(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = [f for f in sorted(p.rglob("*.jsonl")) if f.is_file() and _has_result_row(f)]
            if not found:
                raise ConvertError(p, "no Reflexion log files (*.jsonl with 'solution' and 'is_solved' rows) here")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ConvertError(p, "no such file or directory")
    return list(dict.fromkeys(files))


_MODEL_IN_NAME = re.compile(r"_((?:gpt|claude|starchat|codellama)[\w.-]*?)_pass_at_k")


def _language(path: Path, row: dict) -> str:
    lang = row.get("language")
    if lang is None:
        lang = "rs" if re.search(r"[._-]rs([._-]|$)", path.stem) else "py"
    if lang not in LANGUAGES:
        raise ConvertError(path, f"language {lang!r} is not supported (expected one of {sorted(LANGUAGES)})")
    return lang


def _strategy(path: Path, rows: list[dict]) -> str:
    if "ucs" in path.name.lower():
        return "reflexion-ucs"
    return "reflexion" if any("reflections" in r for r in rows) else "simple"


def _run_labels(files: list[Path]) -> dict[Path, str]:
    counts: dict[str, int] = {}
    for f in files:
        counts[f.parent.name] = counts.get(f.parent.name, 0) + 1
    return {f: f.parent.name if counts[f.parent.name] == 1 else f"{f.parent.name}/{f.stem}" for f in files}


@register("reflexion", "Reflexion programming logs (HumanEval/MBPP rows with reflections) → generator/reflector calls")
def convert_reflexion(paths: Sequence[Path], opts: ConvertOptions) -> Iterator[dict]:
    """Meta record, then the calls of every problem (one query each); rules in the module docstring."""
    files = _inputs(paths)
    parsed = [(f, *_read_rows(f)) for f in files]  # validate every file before yielding anything
    labels = _run_labels(files)
    models = sorted({m.group(1) for f in files if (m := _MODEL_IN_NAME.search(f.name))})
    meta: dict = {"type": "meta", "version": 1, "tokenizer": opts.tokenizer}
    if models:
        meta["model"] = ",".join(models)
    meta["workload"] = "coding"
    meta["source"] = "noahshinn/reflexion programming_runs: " + ", ".join(labels[f] for f in files)
    skipped = sum(s for _, _, s in parsed)
    if skipped:
        meta["extra"] = {"skipped_rows": skipped}
    yield meta
    for f, rows, _ in parsed:
        strategy = _strategy(f, rows)
        solutions = [r["solution"] for r in rows if r["solution"].strip()]
        body_only = sum(s[:1] in (" ", "\t") for s in solutions) * 2 > len(solutions)
        seen: dict[str, int] = {}
        for row in rows:
            task = row.get("name") if isinstance(row.get("name"), str) else row["task_id"]
            seen[task] = seen.get(task, 0) + 1
            if seen[task] > 1:
                task = f"{task}#{seen[task]}"
            problem = _Problem(run=labels[f], task=task, row=row, language=_language(f, row),
                               body_only=body_only, strategy=strategy)
            calls = _calls(problem)
            if calls:
                yield from chat_call_records(AGENT_ID, f"{problem.run}/{task}", calls, opts)
