"""Converters for Reflexion, TapeAgents, STORM and Spec-Bench: inline fixtures plus the real logs."""

from __future__ import annotations

import gzip
import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from agentspec_sim.trace.convert import CONVERTERS
from agentspec_sim.trace.convert.base import ConvertError, ConvertOptions
from agentspec_sim.trace.convert.reflexion import NOT_RECORDED_CODE, NOT_RECORDED_FEEDBACK
from agentspec_sim.trace.convert.storm import classify_role
from agentspec_sim.trace.io import parse_records

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
OPTS = ConvertOptions()
EOT = OPTS.eot_text


# ---------------------------------------------------------------------------------------------
# helpers


def convert(name: str, paths: list[Path]) -> list[dict]:
    return list(CONVERTERS[name].convert(paths, OPTS))


def check_records(records: list[dict]) -> list[dict]:
    """Meta first; ids unique; seq 0..n-1 per query; prompt_extends names an earlier call of the
    same query; outputs end with the end-of-turn text unless marked truncated."""
    meta, calls = records[0], records[1:]
    assert meta["type"] == "meta" and meta["version"] == 1 and meta["tokenizer"] == OPTS.tokenizer
    assert meta["workload"] and meta["source"]
    assert calls and all(r["type"] == "call" for r in calls)
    ids = [r["id"] for r in calls]
    assert len(ids) == len(set(ids))
    by_id = {r["id"]: r for r in calls}
    by_query: dict[tuple, list[int]] = {}
    for r in calls:
        by_query.setdefault((r["agent_id"], r["query_id"]), []).append(r["seq"])
        truncated = (r.get("extra") or {}).get("truncated", False)
        assert r["output"].endswith(EOT) != truncated, r["id"]
        if "prompt_extends" in r:
            parent = by_id[r["prompt_extends"]]
            assert (parent["agent_id"], parent["query_id"]) == (r["agent_id"], r["query_id"])
            assert parent["seq"] < r["seq"]
        else:
            assert r["messages"]
    for seqs in by_query.values():
        assert seqs == list(range(len(seqs)))
    return calls


def loads(records: list[dict]):
    """The records through the trace loader (tokenizes with the bundled Qwen3 tokenizer)."""
    return parse_records(list(enumerate(records, start=1)), "<converted>")


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def all_text(record: dict) -> str:
    return "\n".join(m["content"] for m in record.get("messages") or record.get("messages_append") or [])


# ---------------------------------------------------------------------------------------------
# Reflexion

PY_PROMPT = 'def add(a: int, b: int) -> int:\n    """Add a and b."""\n'
PY_SOLUTION = PY_PROMPT + "    return a + b"
RS_PROMPT = "/// Double x.\nfn double(x: isize) -> isize {\n"


def reflexion_rows() -> list[dict]:
    return [
        {"name": "mbpp_1_add", "language": "py", "prompt": PY_PROMPT, "solution": PY_SOLUTION,
         "is_solved": True, "reflections": []},
        {"name": "mbpp_2_add", "language": "py", "prompt": PY_PROMPT, "solution": PY_SOLUTION,
         "is_solved": True, "reflections": ["It subtracts instead of adding.", "It still subtracts."]},
        {"name": "mbpp_3_add", "language": "py", "prompt": PY_PROMPT, "solution": "", "is_solved": False,
         "reflections": ["Off by one."]},
    ]


def test_reflexion_loop_without_implementations(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "reflexion_mbpp_py" / "mbpp-py._reflexion_5_gpt-4_pass_at_k_1_py.jsonl",
                    reflexion_rows())
    records = convert("reflexion", [f])
    assert records[0]["model"] == "gpt-4" and records[0]["workload"] == "coding"
    calls = check_records(records)
    by_query: dict[str, list[dict]] = {}
    for r in calls:
        assert r["agent_id"] == "reflexion"
        by_query.setdefault(r["query_id"], []).append(r)
    assert list(by_query) == ["reflexion_mbpp_py/mbpp_1_add", "reflexion_mbpp_py/mbpp_2_add",
                              "reflexion_mbpp_py/mbpp_3_add"]
    # solved at once: one generation, output = the solution in a fence
    (only,) = by_query["reflexion_mbpp_py/mbpp_1_add"]
    assert only["role"] == "generator" and only["output"] == f"```python\n{PY_SOLUTION}\n```{EOT}"
    assert only["structure"] == [[["```python", "```"]]]
    assert [m["role"] for m in only["messages"]] == ["system", "user"] and PY_PROMPT in only["messages"][1]["content"]
    assert "unrecorded" not in only["extra"]
    # two reflections: reflector, reflector, generator (the lost intermediate programs are left out)
    q = by_query["reflexion_mbpp_py/mbpp_2_add"]
    assert [r["role"] for r in q] == ["reflector", "reflector", "generator"]
    assert [r["output"] for r in q[:2]] == ["It subtracts instead of adding." + EOT, "It still subtracts." + EOT]
    assert [r["extra"]["attempt"] for r in q] == [0, 1, 2]
    for r in q:
        assert r["extra"]["unrecorded"] == ["implementation", "test_feedback"]
        assert "return a + b" not in all_text(r)  # never the final program as a stand-in
    assert NOT_RECORDED_CODE.format(n=1) in all_text(q[0]) and NOT_RECORDED_CODE.format(n=2) in all_text(q[1])
    assert NOT_RECORDED_FEEDBACK.format(n=2) in all_text(q[2])
    assert "It still subtracts." in all_text(q[2])  # the rewrite sees the latest reflection
    assert all_text(q[0]) != all_text(q[1])
    # empty solution: only the reflection is known
    assert [r["role"] for r in by_query["reflexion_mbpp_py/mbpp_3_add"]] == ["reflector"]
    assert loads(records).num_calls == len(calls)


def test_reflexion_uses_implementations_and_feedback(tmp_path: Path) -> None:
    row = {"name": "HumanEval_1_double", "language": "rs", "prompt": RS_PROMPT, "is_solved": True,
           "reflections": ["Returns x instead of 2x."],
           "implementations": [RS_PROMPT + "    x\n}", RS_PROMPT + "    2 * x\n}"],
           "test_feedback": ["Failed: assert_eq!(double(2), 4); // output: 2", "Passed: all"],
           "solution": RS_PROMPT + "    2 * x\n}"}
    records = convert("reflexion", [write_jsonl(tmp_path / "run_rs" / "log.jsonl", [row])])
    calls = check_records(records)
    assert [r["role"] for r in calls] == ["generator", "reflector", "generator"]
    assert calls[0]["output"] == f"```rust\n{RS_PROMPT}    x\n}}\n```{EOT}"
    assert calls[2]["output"] == f"```rust\n{RS_PROMPT}    2 * x\n}}\n```{EOT}"
    for r in calls:
        assert "unrecorded" not in r["extra"] and r["structure"] == [[["```rust", "```"]]]
    assert "    x\n}" in all_text(calls[1]) and "output: 2" in all_text(calls[1])
    assert "Returns x instead of 2x." in all_text(calls[2]) and "output: 2" in all_text(calls[2])
    assert loads(records).num_calls == 3


def test_reflexion_simple_and_body_only(tmp_path: Path) -> None:
    rows = [{"task_id": f"HumanEval/{i}", "prompt": PY_PROMPT, "solution": "    return a + b", "is_solved": True,
             "entry_point": "add"} for i in range(3)]
    records = convert("reflexion", [write_jsonl(tmp_path / "simple_run" / "he_simple_1_py.jsonl", rows)])
    calls = check_records(records)
    assert len(calls) == 3 and all(r["role"] == "generator" and r["extra"]["strategy"] == "simple" for r in calls)
    assert "body" in calls[0]["messages"][0]["content"]
    assert calls[0]["output"] == f"```python\n    return a + b\n```{EOT}"


def test_reflexion_rejects_wrong_format(tmp_path: Path) -> None:
    bench = write_jsonl(tmp_path / "benchmarks" / "mbpp-py.jsonl", [{"name": "x", "prompt": PY_PROMPT}])
    with pytest.raises(ConvertError, match=r"not a Reflexion log: no result row \(1 rows without") as err:
        convert("reflexion", [bench])
    assert err.value.path == str(bench)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    with pytest.raises(ConvertError, match=r"junk\.jsonl: line 1: not JSON"):
        convert("reflexion", [junk])
    bad_lang = write_jsonl(tmp_path / "go" / "log.jsonl", [{**reflexion_rows()[0], "language": "go"}])
    with pytest.raises(ConvertError, match="language 'go'"):
        convert("reflexion", [bad_lang])
    with pytest.raises(ConvertError, match="no Reflexion log files"):
        convert("reflexion", [tmp_path / "benchmarks"])


def test_reflexion_folder_skips_benchmark_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "benchmarks" / "mbpp-py.jsonl", [{"name": "x", "prompt": PY_PROMPT}])
    write_jsonl(tmp_path / "root" / "run_a" / "log.jsonl", reflexion_rows())
    calls = check_records(convert("reflexion", [tmp_path]))
    assert {r["query_id"].split("/")[0] for r in calls} == {"run_a"}


def test_reflexion_folder_skips_test_generation_logs(tmp_path: Path) -> None:
    # LATS publishes, beside its programming runs, test-generation runs in the same row shape whose
    # `solution` is the list of generated asserts: a folder search passes over them; named, one line.
    tests_log = [{"task_id": "HumanEval/0", "prompt": PY_PROMPT, "solution": ["assert f(1) == 2"], "is_solved": True}]
    write_jsonl(tmp_path / "root" / "testacc" / "log.jsonl", tests_log)
    write_jsonl(tmp_path / "root" / "run_a" / "log.jsonl", reflexion_rows())
    calls = check_records(convert("reflexion", [tmp_path / "root"]))
    assert {r["query_id"].split("/")[0] for r in calls} == {"run_a"}
    with pytest.raises(ConvertError, match=r"log\.jsonl: line 1: 'solution' must be a string"):
        convert("reflexion", [tmp_path / "root" / "testacc" / "log.jsonl"])


def impl(body: str) -> str:
    return PY_PROMPT + f"    {body}"


def one_query(tmp_path: Path, row: dict, name: str = "run_py") -> list[dict]:
    return check_records(convert("reflexion", [write_jsonl(tmp_path / name / "log.jsonl", [row])]))


def test_reflexion_skips_and_counts_rows_without_a_run(tmp_path: Path) -> None:
    no_run = [{"name": f"mbpp_{i}_x", "prompt": PY_PROMPT, "entry_point": "x"} for i in (7, 8, 9)]
    mixed = [no_run[0], *reflexion_rows()[:2], no_run[1], reflexion_rows()[2], no_run[2]]
    records = convert("reflexion", [write_jsonl(tmp_path / "mixed" / "log.jsonl", mixed)])
    plain = convert("reflexion", [write_jsonl(tmp_path / "plain" / "mixed" / "log.jsonl", reflexion_rows())])
    assert records[0]["extra"] == {"skipped_rows": 3} and "extra" not in plain[0]
    assert records[1:] == plain[1:]  # the result rows' calls are unchanged
    assert loads(records).meta.extra == {"skipped_rows": 3}
    # the count adds up over files; a folder finds a log whose first row has no run
    write_jsonl(tmp_path / "root" / "b" / "log.jsonl", [no_run[0], reflexion_rows()[0]])
    write_jsonl(tmp_path / "root" / "a" / "log.jsonl", mixed)
    write_jsonl(tmp_path / "root" / "benchmarks" / "mbpp-py.jsonl", no_run)
    both = convert("reflexion", [tmp_path / "root"])
    assert both[0]["extra"] == {"skipped_rows": 4}
    assert len(check_records(both)) == len(check_records(plain)) + 1  # run a's calls, then b's one
    # a file of rows without a run is still an error, naming it
    bench = write_jsonl(tmp_path / "bench.jsonl", no_run)
    with pytest.raises(ConvertError, match=r"bench\.jsonl: not a Reflexion log: no result row \(3 rows"):
        convert("reflexion", [bench])


def test_reflexion_implementations_longer_than_the_loop(tmp_path: Path) -> None:
    impls = [impl("return a - b"), impl("return a + b + 0"), impl("return b + a"), impl("return b + a")]
    row = {"name": "t", "prompt": PY_PROMPT, "solution": impls[2], "is_solved": True,
           "reflections": ["It subtracts."], "implementations": impls,
           "test_feedback": ["fb one", "fb two", "fb three", "fb four"]}
    calls = one_query(tmp_path, row)
    assert [r["role"] for r in calls] == ["generator", "reflector", "generator", "generator", "generator"]
    assert [r["extra"]["attempt"] for r in calls] == [0, 0, 1, 2, 3]
    gens = [r for r in calls if r["role"] == "generator"]
    assert [r["output"] for r in gens] == [f"```python\n{c}\n```{EOT}" for c in impls]
    # past the loop: the previous implementation and its feedback, with the latest reflection
    assert "return a + b + 0" in all_text(gens[2]) and "fb two" in all_text(gens[2])
    assert "It subtracts." in all_text(gens[2]) and "unrecorded" not in gens[2]["extra"]
    # never the call's own output in its prompt: an identical previous implementation is a stand-in
    assert "return b + a" not in all_text(gens[3]) and NOT_RECORDED_CODE.format(n=3) in all_text(gens[3])
    assert gens[3]["extra"]["unrecorded"] == ["implementation"] and "fb three" in all_text(gens[3])
    # no reflection at all: every generation gets the plain prompt
    calls = one_query(tmp_path, {**row, "reflections": [], "implementations": impls[:2]}, "no_refl")
    assert [r["role"] for r in calls] == ["generator", "generator"]
    assert calls[0]["messages"] == calls[1]["messages"]


def test_reflexion_implementations_shorter_than_the_loop(tmp_path: Path) -> None:
    refl = ["R one.", "R two.", "R three."]
    row = {"name": "t", "prompt": PY_PROMPT, "solution": impl("return a + b"), "is_solved": True,
           "reflections": refl, "implementations": [impl("return a - b")], "test_feedback": ["fb one"]}
    calls = one_query(tmp_path, row)
    assert [r["role"] for r in calls] == ["generator", "reflector", "reflector", "reflector", "generator"]
    assert [r["extra"]["attempt"] for r in calls] == [0, 0, 1, 2, 3]
    assert "return a - b" in all_text(calls[1]) and "fb one" in all_text(calls[1])
    assert "unrecorded" not in calls[1]["extra"]
    assert calls[2]["extra"]["unrecorded"] == ["implementation", "test_feedback"]
    assert calls[-1]["output"] == f"```python\n{impl('return a + b')}\n```{EOT}"
    assert "return a + b" not in all_text(calls[-1]) and "R three." in all_text(calls[-1])
    # the solution is one of the implementations (a tree search's best): no second call for it
    two = [impl("return a - b"), impl("return a + b")]
    calls = one_query(tmp_path, {**row, "implementations": two, "solution": two[0]}, "best_first")
    assert [r["role"] for r in calls] == ["generator", "reflector", "generator", "reflector", "reflector"]
    assert "return a - b" in all_text(calls[2]) and "R one." in all_text(calls[2])


def test_reflexion_test_feedback_shorter_or_longer(tmp_path: Path) -> None:
    impls = [impl("return a - b"), impl("return a * b"), impl("return a + b")]
    row = {"name": "t", "prompt": PY_PROMPT, "solution": impls[-1], "is_solved": True,
           "reflections": ["R one.", "R two."], "implementations": impls, "test_feedback": ["fb one"]}
    calls = one_query(tmp_path, row, "short")
    assert [r["role"] for r in calls] == ["generator", "reflector", "generator", "reflector", "generator"]
    assert "fb one" in all_text(calls[1]) and "unrecorded" not in calls[1]["extra"]
    assert calls[3]["extra"]["unrecorded"] == ["test_feedback"]
    assert NOT_RECORDED_FEEDBACK.format(n=2) in all_text(calls[3]) and "return a * b" in all_text(calls[3])
    full = one_query(tmp_path, {**row, "test_feedback": ["fb one", "fb two", "fb three"]}, "exact")
    longer = one_query(tmp_path, {**row, "test_feedback": ["fb one", "fb two", "fb three", "x", "y"]}, "exact")
    assert longer == full and all("unrecorded" not in r["extra"] for r in full)
    assert "fb two" in all_text(full[3]) and "fb two" in all_text(full[4])


@pytest.mark.parametrize(("change", "message"), [
    ({"implementations": "def add(): pass"}, "'implementations' must be a list of strings"),
    ({"test_feedback": ["ok", 3]}, "'test_feedback' must be a list of strings"),
    ({"reflections": None}, "'reflections' must be a list of strings"),
    ({"is_solved": "yes"}, "'is_solved' must be true or false"),
    ({"solution": None}, "'solution' must be a string"),
    ({"prompt": 3}, "not a Reflexion log row"),
    ({"is_solved": None}, "not a Reflexion log row"),  # None: the field is removed (only 'solution' left)
])
def test_reflexion_bad_types_are_one_line_errors(tmp_path: Path, change: dict, message: str) -> None:
    bad = {key: value for key, value in {**reflexion_rows()[1], **change}.items()
           if not (key == "is_solved" and value is None)}
    rows = [{"name": "x", "prompt": PY_PROMPT}, reflexion_rows()[0], bad]
    f = write_jsonl(tmp_path / "run" / "log.jsonl", rows)
    with pytest.raises(ConvertError) as err:
        convert("reflexion", [f])
    assert str(err.value).startswith(f"{f}: line 3: {message}")
    assert "\n" not in str(err.value)
    f.write_text(json.dumps(reflexion_rows()[0]) + "\n[1, 2]\n")
    with pytest.raises(ConvertError, match=r"log\.jsonl: line 2: not a JSON object"):
        convert("reflexion", [f])


# ---------------------------------------------------------------------------------------------
# TapeAgents


def make_tape_run(root: Path) -> Path:
    """A two-task TapeAgents run folder: tapedata.sqlite + tapes/*.json."""
    root.mkdir(parents=True)
    system = {"role": "system", "content": "You are an agent."}
    question = {"role": "user", "content": '{"kind": "question", "content": "2+2?"}'}
    calls = {
        "p-plan": ([system, question, {"role": "user", "content": "Write a plan."}], "1. Compute 2+2."),
        "p-act1": ([system, question, {"role": "assistant", "content": "1. Compute 2+2."},
                    {"role": "user", "content": "Produce single next step."}],
                   '{"kind":"python_code_action","code":"print(2+2)"}'),
        "p-act2": ([system, question, {"role": "assistant", "content": "1. Compute 2+2."},
                    {"role": "assistant", "content": '{\n  "kind": "python_code_action"\n}'},
                    {"role": "user", "content": '{"kind": "code_execution_result", "output": "4"}'},
                    {"role": "user", "content": "Produce single next step."}],
                   '{"kind":"gaia_answer_action","answer":"4"}'),
        "p-other": ([system, {"role": "user", "content": "Other task."}], "Plan B."),
        "p-unused": ([system, {"role": "user", "content": "never referenced"}], "unused"),
    }
    con = sqlite3.connect(root / "tapedata.sqlite")
    con.execute("CREATE TABLE LLMCalls (prompt_id TEXT PRIMARY KEY, timestamp TEXT, prompt TEXT, output TEXT, "
                "prompt_length_tokens INTEGER, output_length_tokens INTEGER, cached INTEGER, llm_info TEXT, "
                "cost REAL)")
    for pid, (messages, out) in calls.items():
        con.execute("INSERT INTO LLMCalls VALUES (?,?,?,?,?,?,?,?,?)", (
            pid, "2025-06-11T13:20:26", json.dumps({"id": pid, "tools": None, "messages": messages}),
            json.dumps({"content": out, "role": "assistant", "tool_calls": None}), 100, 10, 0,
            json.dumps({"model_name": "gpt-4o-mini-2024-07-18"}), 0.0))
    con.commit()
    con.close()

    def step(kind: str, pid: str = "", node: str = "", other: dict | None = None) -> dict:
        return {"kind": kind, "metadata": {"id": kind, "prompt_id": pid, "node": node, "agent": "web_agent" if pid
                                           else "", "other": other or {}}}

    tape0 = {"metadata": {"task": {"task_id": "t0"}}, "steps": [
        step("question"),
        step("reasoning_thought", "p-plan", "plan"),
        step("python_code_action", "p-act1", "act"), step("set_next_node", "p-act1", "act"),
        step("code_execution_result", other={"action_execution_time": 1.5}),
        step("page_observation", other={"action_execution_time": 0.25}),
        step("gaia_answer_action", "p-act2", "act"),
    ]}
    tape1 = {"metadata": {"task": {"task_id": "t1"}}, "steps": [step("question"), step("t", "p-other", "plan")]}
    (root / "tapes").mkdir()
    (root / "tapes" / "l1_task000.json").write_text(json.dumps(tape0))
    (root / "tapes" / "l1_task001.json").write_text(json.dumps(tape1))
    return root


def test_tapeagents_orders_calls_by_tape_steps(tmp_path: Path) -> None:
    run = make_tape_run(tmp_path / "run")
    db = run / "tapedata.sqlite"
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    records = convert("tapeagents", [run])
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest  # opened read-only
    assert records[0]["model"] == "gpt-4o-mini-2024-07-18"
    calls = check_records(records)
    assert [(r["query_id"], r["role"], r["extra"]["prompt_id"]) for r in calls] == [
        ("l1_task000", "plan", "p-plan"), ("l1_task000", "act", "p-act1"), ("l1_task000", "act", "p-act2"),
        ("l1_task001", "plan", "p-other")]
    assert all(r["agent_id"] == "tapeagents-gaia" for r in calls)
    plan, act1, act2, _ = calls
    assert "emission" not in plan and "structure" not in plan
    assert act1["emission"] == "json" and act1["structure"] == [[["{", "}"]]]
    assert act1["output"] == '{"kind":"python_code_action","code":"print(2+2)"}' + EOT
    assert act2.get("think_s") == pytest.approx(1.75) and act1.get("think_s", 0) == 0
    assert act2["extra"]["usage"] == {"prompt_tokens": 100, "completion_tokens": 10}
    assert act2["extra"]["task_id"] == "t0"
    assert loads(records).num_calls == 4


def test_tapeagents_accepts_db_plus_tape_files(tmp_path: Path) -> None:
    run = make_tape_run(tmp_path / "run")
    calls = check_records(convert("tapeagents", [run / "tapedata.sqlite", run / "tapes" / "l1_task001.json"]))
    assert [r["extra"]["prompt_id"] for r in calls] == ["p-other"]
    calls = check_records(convert("tapeagents", [run / "tapedata.sqlite", run / "tapes"]))
    assert len(calls) == 4


def test_tapeagents_reads_gzipped_database(tmp_path: Path) -> None:
    run = make_tape_run(tmp_path / "run")
    db = run / "tapedata.sqlite"
    with gzip.open(run / "tapedata.sqlite.gz", "wb") as out:
        out.write(db.read_bytes())
    db.unlink()
    calls = check_records(convert("tapeagents", [run]))
    assert len(calls) == 4
    assert sorted(p.name for p in run.iterdir()) == ["tapedata.sqlite.gz", "tapes"]  # nothing left behind


def test_tapeagents_rejects_wrong_format(tmp_path: Path) -> None:
    run = make_tape_run(tmp_path / "run")
    tape = json.loads((run / "tapes" / "l1_task001.json").read_text())
    tape["steps"][1]["metadata"]["prompt_id"] = "p-missing"
    (run / "tapes" / "l1_task001.json").write_text(json.dumps(tape))
    with pytest.raises(ConvertError, match=r"l1_task001\.json: step prompt_id 'p-missing'"):
        convert("tapeagents", [run])
    (run / "tapes" / "l1_task001.json").write_text("[1, 2]")
    with pytest.raises(ConvertError, match="not a TapeAgents tape"):
        convert("tapeagents", [run])
    other = tmp_path / "other"
    other.mkdir()
    con = sqlite3.connect(other / "tapedata.sqlite")
    con.execute("CREATE TABLE Something (x INTEGER)")
    con.commit()
    con.close()
    (other / "tapes").mkdir()
    (other / "tapes" / "a.json").write_text(json.dumps({"steps": []}))
    with pytest.raises(ConvertError, match=r"tapedata\.sqlite: not a TapeAgents database"):
        convert("tapeagents", [other])
    (other / "tapedata.sqlite").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(ConvertError, match=r"tapedata\.sqlite"):
        convert("tapeagents", [other])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="not a TapeAgents run folder"):
        convert("tapeagents", [tmp_path / "empty"])


# ---------------------------------------------------------------------------------------------
# STORM


def storm_line(prompt: str, text: str, created: int, model: str = "gpt-4o-mini", finish: str = "stop") -> dict:
    return {"prompt": prompt, "raw_kwargs": {}, "response": {
        "id": "x", "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}}


def test_storm_orders_by_created_and_tags_roles(tmp_path: Path) -> None:
    rows = [
        storm_line("You want to answer the question using Google search. What do you type?", "- q1", 105),
        storm_line("You are an expert who can use information effectively. ...", "Answer [1].", 107),
        storm_line("You are an experienced Wikipedia writer and want to edit a specific page.", "Question?", 100,
                   model="gpt-4o"),
        storm_line("Write an outline for a Wikipedia page.\n", "# Intro\n## History", 110, finish="length"),
    ]
    f = write_jsonl(tmp_path / "my_topic" / "llm_call_history.jsonl", rows)
    records = convert("storm", [tmp_path / "my_topic"])
    assert records[0]["model"] == "gpt-4o,gpt-4o-mini" and records[0]["workload"] == "deep-research"
    calls = check_records(records)
    assert [r["role"] for r in calls] == ["question_asker", "query_writer", "topic_expert", "outline_writer"]
    assert [r["extra"]["history_index"] for r in calls] == [2, 0, 1, 3]
    assert all(r["query_id"] == "my_topic" and r["agent_id"] == "storm" for r in calls)
    assert calls[0]["messages"] == [{"role": "user", "content": rows[2]["prompt"]}]
    assert calls[2]["extra"]["usage"]["completion_tokens"] == 5
    assert calls[2]["structure"] == [[["[", "]"]], [["# ", "\n"]]]
    assert calls[3]["output"] == "# Intro\n## History" and calls[3]["extra"]["truncated"] is True
    assert calls[1]["output"] == "- q1" + EOT
    assert loads(records).num_calls == 4
    assert check_records(convert("storm", [f]))[0]["query_id"] == "my_topic"


def test_storm_role_table() -> None:
    assert classify_role("I'm writing a Wikipedia page for a topic mentioned below. Please identify and recommend "
                         "some Wikipedia pages on closely related subjects.") == "related_topics"
    assert classify_role("You need to select a group of Wikipedia editors who will work together") == \
        "persona_generator"
    assert classify_role("Improve an outline for a Wikipedia page. You already have") == "outline_refiner"
    assert classify_role("Write a Wikipedia section based on the collected information.") == "section_writer"
    assert classify_role("Write a lead section for the given Wikipedia page") == "lead_writer"
    assert classify_role("You are a faithful text editor that is good at finding repeated information") == "polisher"
    assert classify_role("Something else entirely") == "other"


def test_storm_rejects_wrong_format(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConvertError, match=r"a\.jsonl: line 1: not a STORM call record"):
        convert("storm", [f])
    f = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "hi", "response": {"choices": []}}])
    with pytest.raises(ConvertError, match=r"b\.jsonl: line 1: 'response' has no completion text"):
        convert("storm", [f])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match=r"no llm_call_history\.jsonl"):
        convert("storm", [tmp_path / "empty"])


# ---------------------------------------------------------------------------------------------
# Spec-Bench


def make_spec_bench(root: Path) -> Path:
    write_jsonl(root / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "qa", "turns": ["What is 2+2?"]},
        {"question_id": 83, "category": "qa", "turns": ["Unanswered?"]},
    ])

    def answer(model_id: str, qid: int, cat: str, turns: list[str], new: list[int], steps: list[int],
               accept: list[int]) -> dict:
        return {"question_id": qid, "category": cat, "answer_id": "a", "model_id": model_id, "tstamp": 1.0,
                "choices": [{"index": 0, "turns": turns, "new_tokens": new, "decoding_steps": steps,
                             "wall_time": [0.5] * len(turns), "accept_lengths": accept}]}

    vanilla = "vicuna-7b-v1.3-vanilla-float16-temp-0.0"
    write_jsonl(root / "model_answer" / f"{vanilla}.jsonl", [
        answer(vanilla, 81, "writing", ["Roses are red.", "Red."], [5, 1024], [5, 1024], [1] * 1029),
        answer(vanilla, 82, "qa", ["4"], [2], [2], [1, 1]),
    ])
    eagle = "vicuna-7b-v1.3-eagle-float16-temperature-0.0"
    write_jsonl(root / "model_answer" / f"{eagle}.jsonl", [
        answer(eagle, 81, "writing", ["Roses are red.", "Red."], [5, 3], [2, 1], [3, 2, 3]),
    ])
    return root


def test_spec_bench_vanilla_by_default_with_delta_turns(tmp_path: Path) -> None:
    root = make_spec_bench(tmp_path / "spec-bench")
    records = convert("spec-bench", [root])
    assert records[0]["model"] == "vicuna-7b-v1.3-vanilla-float16-temp-0.0" and records[0]["workload"] == "chat"
    calls = check_records(records)
    assert [(r["query_id"], r["seq"]) for r in calls] == [(81, 0), (81, 1), (82, 0)]
    t1, t2, single = calls
    assert t1["messages"][0]["role"] == "system"
    assert t1["messages"][1:] == [{"role": "user", "content": "Write a poem."}]
    assert t1["output"] == "Roses are red." + EOT and t1["role"] == "assistant"
    assert t2["prompt_extends"] == t1["id"] and t2["messages_append"] == [{"role": "user", "content": "Now shorter."}]
    assert t2["output"] == "Red." and t2["extra"]["truncated"] is True  # hit max_new_tokens
    assert t1["extra"] == {"category": "writing", "turn": 0, "new_tokens": 5, "decoding_steps": 5,
                           "wall_time_s": 0.5}  # all-ones accept_lengths are dropped
    assert single["extra"]["category"] == "qa"
    w = loads(records)
    assert w.num_calls == 3
    loaded = w.call_by_id()
    assert loaded[t2["id"]].prompt_extends == t1["id"]


def test_spec_bench_eagle_keeps_accept_lengths_per_turn(tmp_path: Path) -> None:
    root = make_spec_bench(tmp_path / "spec-bench")
    eagle = root / "model_answer" / "vicuna-7b-v1.3-eagle-float16-temperature-0.0.jsonl"
    for paths in ([root, eagle], [root / "question.jsonl", eagle]):
        calls = check_records(convert("spec-bench", paths))
        assert [r["extra"]["accept_lengths"] for r in calls] == [[3, 2], [3]]
        assert [r["extra"]["new_tokens"] for r in calls] == [5, 3]


def test_spec_bench_rejects_wrong_format(tmp_path: Path) -> None:
    root = make_spec_bench(tmp_path / "spec-bench")
    (root / "model_answer" / "other-model.jsonl").write_text(
        (root / "model_answer" / "vicuna-7b-v1.3-eagle-float16-temperature-0.0.jsonl").read_text())
    (root / "model_answer" / "vicuna-7b-v1.3-vanilla-float16-temp-0.0.jsonl").unlink()
    with pytest.raises(ConvertError, match="cannot pick the vanilla answer file"):
        convert("spec-bench", [root])
    junk = write_jsonl(tmp_path / "junk.jsonl", [{"hello": 1}])
    with pytest.raises(ConvertError, match=r"junk\.jsonl: not a Spec-Bench file"):
        convert("spec-bench", [root / "question.jsonl", junk])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 999, "choices": [{"turns": ["x"]}]}])
    with pytest.raises(ConvertError, match=r"bad\.jsonl: line 1: question_id 999 is not in question.jsonl"):
        convert("spec-bench", [root / "question.jsonl", bad])
    split = write_jsonl(tmp_path / "split.jsonl", [{"question_id": 82, "model_id": "m", "choices": [
        {"turns": ["4"], "decoding_steps": [1], "new_tokens": [2], "accept_lengths": [2, 1]}]}])
    with pytest.raises(ConvertError, match="does not split by decoding_steps"):
        convert("spec-bench", [root / "question.jsonl", split])
    with pytest.raises(ConvertError, match=r"no question\.jsonl"):
        convert("spec-bench", [root / "model_answer"])


# ---------------------------------------------------------------------------------------------
# The real logs in shared/traces


def real(folder: str) -> Path:
    path = TRACES / folder
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def test_real_reflexion() -> None:
    records = convert("reflexion", [real("reflexion_noahshinn")])
    calls = check_records(records)
    assert len(calls) == 3073 and len({r["query_id"] for r in calls}) == 1690
    roles = [r["role"] for r in calls]
    assert roles.count("generator") == 1676 and roles.count("reflector") == 1397
    assert records[0]["model"] == "gpt-4"
    for r in calls:
        if r["role"] == "generator":
            assert r["output"].startswith("```python\n") or r["output"].startswith("```rust\n")
            assert r["output"].endswith("\n```" + EOT)
    assert loads(records).num_calls == 3073


def test_real_tapeagents() -> None:
    records = convert("tapeagents", [real("tapeagents_gaia")])
    calls = check_records(records)
    assert len(calls) == 73 and len({r["query_id"] for r in calls}) == 8
    assert {r["role"] for r in calls} == {"plan", "facts_survey", "act"}
    assert all(r.get("emission") == "json" for r in calls if r["role"] == "act")
    assert sum(r.get("think_s", 0) > 0 for r in calls) > 20
    assert loads(records).num_calls == 73


def test_real_storm() -> None:
    records = convert("storm", [real("storm_deep_research")])
    calls = check_records(records)
    assert len(calls) == 48 and {r["query_id"] for r in calls} == {"storm_deep_research"}
    roles = [r["role"] for r in calls]
    assert "other" not in roles
    assert roles.count("question_asker") == roles.count("topic_expert") == roles.count("query_writer") == 12
    assert roles.count("section_writer") == 7 and roles[-1] == "lead_writer"
    assert roles[:2] == ["related_topics", "persona_generator"]
    created = [r["extra"]["created"] for r in calls]
    assert created == sorted(created)
    assert sum(r["extra"].get("truncated", False) for r in calls) == 1
    assert loads(records).num_calls == 48


def test_real_spec_bench() -> None:
    root = real("spec-bench")
    records = convert("spec-bench", [root])
    calls = check_records(records)
    assert len(calls) == 560 and len({r["query_id"] for r in calls}) == 480
    assert sum("prompt_extends" in r for r in calls) == 80
    assert "vanilla" in records[0]["model"] and not any("accept_lengths" in r["extra"] for r in calls)
    assert loads(records).num_calls == 560
    eagle = root / "model_answer" / "vicuna-7b-v1.3-eagle-float16-temperature-0.0.jsonl"
    calls = check_records(convert("spec-bench", [root, eagle]))
    accepted = [a for r in calls for a in r["extra"]["accept_lengths"]]
    assert sum(accepted) / len(accepted) == pytest.approx(3.58, abs=0.01)
    for r in calls:
        assert sum(r["extra"]["accept_lengths"]) == r["extra"]["new_tokens"]
