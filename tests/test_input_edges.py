"""Input edges: what JSON (and the numbers in options) can hold that is not what the user meant.

Every user JSON input goes through agentspec_sim/io/strict_json.py: duplicate keys, NaN/Infinity, numbers
too large for a float, lone surrogates and deep nesting are refused there, naming `file:line: field`.
Each case runs the real entry point in-process (as tests/test_bad_inputs.py does) and checks exit code
2, one `error:` line, no traceback, and the fragments that name file, line and field.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from agentspec_sim.drafters.registry import speculative_config
from agentspec_sim.io import strict_json
from tests.test_bad_inputs import META, call, jsonl, run_cli

GOOD = jsonl(META, call(0), call(1))
TEXT_META = {"type": "meta", "version": 1, "tokenizer": "qwen3"}


def _one_error_line(code: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / ".cache"))
    monkeypatch.setenv("COLUMNS", "300")
    return tmp_path


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# ---------------------------------------------------------------------------------------------
# The strict parser itself


@pytest.mark.parametrize(("text", "field", "message"), [
    ('{"a": 1, "a": 2}', "a", "given twice"),
    ('{"m": [{"content": "x", "content": "y"}]}', "m[0].content", "given twice"),
    ('{"x": NaN}', "x", "NaN is not a JSON number"),
    ('{"x": [1, -Infinity]}', "x[1]", "-Infinity is not a JSON number"),
    ('{"t": 1e999}', "t", "1e999 is too large"),
    ('{"p": "\\ud800"}', "p", "lone UTF-16 surrogate (\\ud800)"),
    ('{"p": "ok \\uDFFF"}', "p", "lone UTF-16 surrogate (\\udfff)"),
    ('{"\\udc00": 1}', "\\udc00", "lone UTF-16 surrogate"),
    ("[" * 100_000 + "]" * 100_000, "", "nested more than 100 levels deep"),
    ("[" * 101 + "]" * 101, "", "nested more than 100 levels deep"),
    ('{"a": ', "", "invalid JSON"),
])
def test_strict_json_refuses_and_names_the_member(text, field, message):
    for data in (text, text.encode()):
        with pytest.raises(strict_json.StrictJSONError) as info:
            strict_json.loads(data)
        assert info.value.field == field and message in info.value.message, info.value


def test_strict_json_accepts_what_is_json():
    assert strict_json.loads('{"p": "\\ud83d\\ude00", "q": "\\\\ud800"}') == {"p": "😀", "q": "\\ud800"}
    assert strict_json.loads("[" * 100 + "]" * 100) is not None
    assert strict_json.loads(b'\xef\xbb\xbf{"a": 1.5, "b": [1, 2]}') == {"a": 1.5, "b": [1, 2]}
    with pytest.raises(UnicodeDecodeError):  # json.loads would decode these bytes to a lone surrogate
        strict_json.loads(b'"\xed\xa0\x80"')


# ---------------------------------------------------------------------------------------------
# Trace lines


def _trace_line(record: str) -> str:
    return jsonl(META, record)


TRACE_CASES = [
    pytest.param(_trace_line('{"type": "call", "id": "c0", "agent_id": 1, "query_id": 1, "seq": 0, '
                             '"prompt_tokens": [1, 2], "output_tokens": [4], "output_tokens": [5]}'),
                 ["t.jsonl:2: output_tokens: the key is given twice"], id="duplicate output_tokens"),
    pytest.param(_trace_line('{"type": "call", "id": "c0", "id": "c1", "agent_id": 1, "query_id": 1, "seq": 0, '
                             '"prompt_tokens": [1, 2], "output_tokens": [4]}'),
                 ["t.jsonl:2: id: the key is given twice"], id="duplicate id"),
    pytest.param(_trace_line(json.dumps(call(0))[:-1] + ', "arrival_s": NaN}'),
                 ["t.jsonl:2: arrival_s: NaN is not a JSON number"], id="NaN arrival"),
    pytest.param(_trace_line(json.dumps(call(0))[:-1] + ', "think_s": Infinity}'),
                 ["t.jsonl:2: think_s: Infinity is not a JSON number"], id="Infinity think time"),
    pytest.param(_trace_line(json.dumps(call(0))[:-1] + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                 ["t.jsonl:2: line: nested more than 100 levels deep"], id="nested 100000 deep"),
    pytest.param(jsonl(TEXT_META, call(0, prompt_tokens=..., prompt="ok \ud800 then")),
                 ["t.jsonl:2: prompt: contains a lone UTF-16 surrogate (\\ud800)"], id="surrogate in a prompt"),
    pytest.param(jsonl(TEXT_META, call(0, prompt_tokens=..., messages=[{"role": "user", "content": "\udfff"}])),
                 ["t.jsonl:2: messages[0].content: contains a lone UTF-16 surrogate"], id="surrogate in a message"),
]


@pytest.mark.parametrize(("text", "fragments"), TRACE_CASES)
def test_trace_line_edges(workdir, monkeypatch, capsys, text, fragments):
    trace = _write(workdir / "t.jsonl", text)
    for argv in (["inspect", str(trace)], ["replay", str(trace), "--drafter", "normal"]):
        code, _, err = run_cli(argv, monkeypatch, capsys)
        _one_error_line(code, err, *fragments)


def test_skip_bad_lines_skips_a_duplicate_key_line(workdir, monkeypatch, capsys):
    dup = json.dumps(call(1))[:-1] + ', "seq": 1}'
    trace = _write(workdir / "t.jsonl", jsonl(META, call(0), dup))
    code, out, err = run_cli(["inspect", str(trace), "--skip-bad-lines", "--json"], monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["calls"] == 1 and "t.jsonl:3: seq: the key is given twice" in err


# ---------------------------------------------------------------------------------------------
# `-`: the trace on standard input


class _Stdin:
    """What the loader reads of sys.stdin: `buffer` and `isatty`."""

    def __init__(self, data: bytes, tty: bool = False) -> None:
        self.buffer, self.closed, self._tty = io.BytesIO(data), False, tty

    def isatty(self) -> bool:
        return self._tty


@pytest.fixture
def stdin(monkeypatch):
    """Feed bytes to standard input (the loader keeps what it read once per process: start afresh)."""
    import agentspec_sim.trace.io as trace_io

    def feed(data: bytes, tty: bool = False) -> None:
        monkeypatch.setattr(trace_io, "_stdin_data", None)
        monkeypatch.setattr(sys, "stdin", _Stdin(data, tty))

    return feed


COMPRESSORS = {"plain": bytes, "gzip": gzip.compress, "xz": lzma.compress,
               "zstd": lambda b: zstandard.ZstdCompressor().compress(b)}


@pytest.mark.parametrize("kind", COMPRESSORS)
def test_stdin_trace_plain_or_compressed(workdir, monkeypatch, capsys, stdin, kind):
    stdin(COMPRESSORS[kind](GOOD.encode()))
    code, out, err = run_cli(["inspect", "-", "--json"], monkeypatch, capsys)
    assert code == 0, err
    stats = json.loads(out)
    assert stats["calls"] == 2 and stats["trace"] == "<stdin>"
    assert not (workdir / ".cache").exists() or not any((workdir / ".cache").rglob("*.npy"))  # never cached


@pytest.mark.parametrize(("data", "fragments"), [
    (jsonl(META, call(0), call(2)).encode(), ["<stdin>:3: seq: gap in query 1"]),
    (jsonl(META, '{"type": "call", "id": "a", "id": "b"}').encode(), ["<stdin>:2: id: the key is given twice"]),
    (gzip.compress(GOOD.encode() * 40)[:-30], ["<stdin>: file: cannot decompress gz"]),
    (zstandard.ZstdCompressor().compress(GOOD.encode())[:-5], ["<stdin>: file: cannot decompress zst"]),
    (b"", ["<stdin>: file: empty trace"]),
])
def test_stdin_errors_name_stdin(workdir, monkeypatch, capsys, stdin, data, fragments):
    for argv in (["replay", "-", "--drafter", "normal"], ["sweep", "-", "-o", str(workdir / "s.parquet"),
                                                          "--drafter", "normal", "--max-num-seqs", "1", "-j", "1"]):
        stdin(data)
        code, _, err = run_cli(argv, monkeypatch, capsys)
        _one_error_line(code, err, *fragments)


def test_stdin_that_is_a_terminal_is_refused(workdir, monkeypatch, capsys, stdin):
    stdin(b"", tty=True)
    code, _, err = run_cli(["inspect", "-"], monkeypatch, capsys)
    _one_error_line(code, err, "<stdin>: file: standard input is a terminal", "pipe one in")


def test_stdin_trace_through_a_fresh_process_and_sweep_workers(tmp_path):
    """The console entry point reads `-` from a real pipe; sweep's spawned workers (whose own stdin is not
    the parent's) get the bytes and name the trace <stdin>."""
    import polars as pl

    env = {**os.environ, "AGENTSPEC_SIM_CACHE": str(tmp_path / ".cache")}
    data = zstandard.ZstdCompressor().compress(GOOD.encode())
    out = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "inspect", "-", "--json"], input=data,
                         capture_output=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout)["calls"] == 2
    results = tmp_path / "s.parquet"
    out = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "sweep", "-", "-o", str(results), "--drafter",
                          "normal", "--max-num-seqs", "1,2", "-j", "2", "-q"], input=gzip.compress(GOOD.encode()),
                         capture_output=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    frame = pl.read_parquet(results)
    assert frame.height == 2 and set(frame["trace"]) == {"<stdin>"}


# ---------------------------------------------------------------------------------------------
# NaN and infinity in options and environment variables


@pytest.mark.parametrize(("argv", "fragment"), [
    ("plan {d}/good.jsonl --slo-ttft nan", "--slo-ttft: must be a finite number, got nan"),
    ("plan {d}/good.jsonl --slo-p99-latency inf", "--slo-p99-latency: must be a finite number, got inf"),
    ("plan {d}/good.jsonl --min-goodput -inf", "--min-goodput: must be a finite number, got -inf"),
    ("plan {d}/good.jsonl --slo-tpot NaN", "--slo-tpot: must be a finite number, got nan"),
    ("replay {d}/good.jsonl --gpu-memory-utilization nan", "--gpu-memory-utilization: must be a finite number"),
    ("replay {d}/good.jsonl --think-time inf", "--think-time: must be a finite number, got inf"),
    ("sweep {d}/good.jsonl -o {d}/s.parquet --rate nan", "--rate: must be a finite number, got nan"),
    ("check --tolerance nan", "--tolerance: must be a finite number, got nan"),
    ("check --goodput-tolerance inf", "--goodput-tolerance: must be a finite number, got inf"),
    ("calibrate cost {d}/good.jsonl -o {d}/c.json --holdout nan", "--holdout: must be a finite number, got nan"),
    ("analyze roles {d}/good.jsonl -o {d}/caps.json --penalty nan", "--penalty: must be a finite number"),
])
def test_non_finite_option_is_refused(workdir, monkeypatch, capsys, argv, fragment):
    _write(workdir / "good.jsonl", GOOD)
    code, _, err = run_cli(argv.format(d=workdir).split(), monkeypatch, capsys)
    _one_error_line(code, err, fragment)


def test_every_command_is_preflighted():
    """The guard is one mechanism over all commands, so an option added later is covered too."""
    from agentspec_sim.cli.app import app

    def commands(typer_app):
        yield from (info.callback for info in typer_app.registered_commands)
        for group in typer_app.registered_groups:
            yield from commands(group.typer_instance)

    callbacks = list(commands(app))
    assert len(callbacks) >= 15 and all(getattr(c, "_preflighted", False) for c in callbacks)


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("AGENTSPEC_SIM_TABLE_CACHE_MB", "nan", "must be a finite number of MB ≥ 0, got 'nan'"),
    ("AGENTSPEC_SIM_TABLE_CACHE_MB", "inf", "must be a finite number of MB ≥ 0, got 'inf'"),
    ("AGENTSPEC_SIM_TABLE_CACHE_MB", "-1", "must be a finite number of MB ≥ 0, got '-1'"),
    ("AGENTSPEC_SIM_TABLE_CACHE_MB", "lots", "expected a number of MB, got 'lots'"),
    ("AGENTSPEC_SIM_MEMORY_GIB", "NaN", "must be a finite number of GiB > 0, got 'NaN'"),
    ("AGENTSPEC_SIM_MEMORY_GIB", "-inf", "must be a finite number of GiB > 0"),
    ("AGENTSPEC_SIM_MEMORY_GIB", "0", "must be a finite number of GiB > 0, got '0'"),
])
def test_bad_numeric_environment_variable(workdir, monkeypatch, capsys, name, value, fragment):
    _write(workdir / "good.jsonl", GOOD)
    monkeypatch.setenv(name, value)
    code, _, err = run_cli(["replay", str(workdir / "good.jsonl"), "--drafter", "normal"], monkeypatch, capsys)
    _one_error_line(code, err, f"{name}: environment: ", fragment, "unset it for the default")


def test_table_cache_limit_is_read_strictly(monkeypatch):
    """The library reads the variable the same way (a sweep worker or a script gets the same refusal)."""
    from agentspec_sim.drafters.common import table_cache
    from agentspec_sim.host.env import EnvironmentSettingError

    monkeypatch.setenv(table_cache.LIMIT_ENV, "inf")
    with pytest.raises(EnvironmentSettingError, match="AGENTSPEC_SIM_TABLE_CACHE_MB: environment"):
        table_cache._limit_bytes()
    monkeypatch.setenv(table_cache.LIMIT_ENV, "")
    assert table_cache._limit_bytes() == table_cache.DEFAULT_LIMIT_MB << 20
    monkeypatch.setenv(table_cache.LIMIT_ENV, "0.5")
    assert table_cache._limit_bytes() == 1 << 19


# ---------------------------------------------------------------------------------------------
# Speculative configs


def _methods() -> list[str]:
    from agentspec_sim.drafters.registry import families

    return sorted(families())  # the built-in drafters only (other test modules register test drafters)


def _base_config(method: str) -> dict:
    from agentspec_sim.drafters.registry import shorthand_config

    base = shorthand_config(method)
    if method != "normal":
        base.setdefault("num_speculative_tokens", 3)
    return base


@pytest.mark.parametrize("method", [m for m in _methods() if m != "normal"])
@pytest.mark.parametrize("k", [0, -1, -32])
def test_num_speculative_tokens_follows_vllm(method, k):
    """vLLM 0.33, vllm/config/speculative.py: `num_speculative_tokens: int = Field(default=None, gt=0)`
    (line 413) and `_verify_args`: "Expected num_speculative_tokens to be greater than zero" (line 1967), for
    every method. None lets the method decide (suffix: suffix_decoding_max_tree_depth, line 1732-1735)."""
    from agentspec_sim.engine.drafting import SpecConfigError

    with pytest.raises(SpecConfigError, match=f"num_speculative_tokens must be > 0, got {k}"):
        speculative_config({**_base_config(method), "num_speculative_tokens": k})


def test_num_speculative_tokens_defaults_and_normal():
    from agentspec_sim.engine.drafting import SpecConfigError

    suffix = speculative_config({"method": "suffix", "suffix_decoding_max_tree_depth": 12})
    assert suffix.num_speculative_tokens == 12  # vLLM: k defaults to the tree depth
    assert speculative_config({"method": "normal", "num_speculative_tokens": 0}).num_speculative_tokens == 0
    for k in (-1, 2):
        with pytest.raises(SpecConfigError, match="'normal' drafts nothing"):
            speculative_config({"method": "normal", "num_speculative_tokens": k})
    with pytest.raises(SpecConfigError, match="must be ≤ 4096"):
        speculative_config({"method": "ngram", "num_speculative_tokens": 2**40})


# An integer default may belong to a number option (agentspec's alpha = 512 takes 2.5): no float for int.
_WRONG = {int: ["5", True, [1], {"a": 1}], float: ["0.5", True, [0.5], {"a": 1}],
          bool: ["yes", 1, [True]], str: [5, True, ["x"], {"a": 1}]}


@pytest.mark.parametrize("method", _methods())
def test_every_config_field_refuses_a_wrong_json_type(method):
    """For each drafter, every key it resolves (its options with their defaults, k, the n-gram range)
    refuses a value of another JSON type with SpecConfigError, never a traceback or a silent run."""
    from agentspec_sim.drafters.registry import is_int
    from agentspec_sim.engine.drafting import SpecConfigError

    base = _base_config(method)
    spec = speculative_config(base)
    fields = {**dict(spec.options), "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.prompt_lookup_min is not None:
        fields.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    checked = 0
    for key, default in fields.items():
        kind = (bool if isinstance(default, bool) else int if is_int(default) else
                float if isinstance(default, float) else str if isinstance(default, str) else None)
        if kind is None:  # lists and null defaults have their own rules
            continue
        for value in _WRONG[kind]:
            with pytest.raises(SpecConfigError):
                speculative_config({**base, key: value})
            checked += 1
    assert checked >= 4  # at least num_speculative_tokens, four wrong types


@pytest.mark.parametrize(("config", "message"), [
    ({"budget_policy": ["fixed"]}, "budget_policy must be a policy name (a string), got a list"),
    ({"budget_policy": "nope"}, "unknown budget_policy 'nope'"),
    ({"num_speculative_tokens_per_batch_size": "1-4:2"}, "must be a non-empty list of [start, end, k]"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, True]]}, "[start, end, k] integers"),
    ({"prompt_lookup_max": float("nan")}, "prompt_lookup_max: must be a finite number, got nan"),
    ({"prompt_lookup_max": 2**70}, "does not fit in 64 bits"),
])
def test_common_keys_are_checked_at_parse_time(config, message):
    from agentspec_sim.engine.drafting import SpecConfigError

    with pytest.raises(SpecConfigError) as info:
        speculative_config({"method": "ngram", "num_speculative_tokens": 3, **config})
    assert message in str(info.value), info.value


@pytest.mark.parametrize(("value", "fragment"), [
    ("[1,2,3]", "--speculative-config: must be a JSON object such as {\"method\": \"ngram\""),
    ("5", "or a drafter name; got an integer"),
    ("null", "or a drafter name; got null"),
    ('"ngram"', "or a drafter name; got a string"),
    ("true", "or a drafter name; got a boolean"),
    ('{"method": "ngram", "num_speculative_tokens": 5, "num_speculative_tokens": 0}',
     "--speculative-config: num_speculative_tokens: the key is given twice"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": NaN}',
     "--speculative-config: suffix_decoding_max_spec_factor: NaN is not a JSON number"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "--speculative-config: num_speculative_tokens must be > 0"),
    ('{"method": "ngram", "num_speculative_tokens": "5"}', "num_speculative_tokens must be an integer, got a string"),
    ('{"method": "ngram", "num_speculative_tokens": 1000000000000000000000000000000}', "does not fit in 64 bits"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 100000000000000000000}', "does not fit in 64 bits"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1099511627776}', "must be an integer in [1, 4096]"),
    ('{"method": "agentspec", "num_speculative_tokens": 8, "max_candidates": 1099511627776}', "[1, 4096]"),
])
def test_speculative_config_option(workdir, monkeypatch, capsys, value, fragment):
    trace = _write(workdir / "good.jsonl", GOOD)
    code, _, err = run_cli(["replay", str(trace), "--drafter", "normal", "--speculative-config", value],
                           monkeypatch, capsys)
    _one_error_line(code, err, fragment)


def test_drafter_lists_and_grids(workdir, monkeypatch, capsys):
    trace = _write(workdir / "good.jsonl", GOOD)
    # A JSON object inside a --drafter list keeps its commas.
    code, out, err = run_cli(["replay", str(trace), "--json", "--drafter",
                              'normal,{"method": "ngram", "num_speculative_tokens": 3}'], monkeypatch, capsys)
    assert code == 0, err
    assert [r["drafter"] for r in json.loads(out)["runs"]][-1].startswith("ngram")
    sweep = ["sweep", str(trace), "-o", str(workdir / "s.parquet"), "--drafter", "ngram", "--max-num-seqs", "1",
             "-j", "1", "--grid"]
    code, _, err = run_cli([*sweep, "num_speculative_tokens=3,0"], monkeypatch, capsys)
    _one_error_line(code, err, "--grid: ngram k=0: num_speculative_tokens must be > 0")
    code, _, err = run_cli([*sweep, "num_speculative_tokens=NaN"], monkeypatch, capsys)
    _one_error_line(code, err, "--grid: ngram k=NaN: num_speculative_tokens must be an integer")


# ---------------------------------------------------------------------------------------------
# Every other JSON input: raw logs for convert, calibration / acceptance / profile / baseline / results files

DEEP = "[" * 100_000 + "]" * 100_000
CHAT = '{"messages": [{"role": "user", "content": %s}], "response": "yo"%s}\n'
OTHER_INPUTS = [
    # (name, file name, content, argv with {d} for the directory and {f} for the file, fragments)
    ("convert: surrogate", "c.jsonl", CHAT % ('"hi \\ud800"', ""), "convert openai-chat {f} -o {d}/t.jsonl",
     ["c.jsonl: line 1:", "messages[0].content: contains a lone UTF-16 surrogate"]),
    ("convert: duplicate key", "c.jsonl", CHAT % ('"hi"', ', "response": "no"'),
     "convert openai-chat {f} -o {d}/t.jsonl", ["c.jsonl: line 1:", "response: the key is given twice"]),
    ("convert: deep nesting", "c.jsonl", CHAT % ('"hi"', ', "x": ' + DEEP), "convert openai-chat {f} -o {d}/t.jsonl",
     ["c.jsonl: line 1:", "nested more than 100 levels deep"]),
    ("convert: deep trajectory", "t.traj", '{"history": ' + DEEP + "}", "convert swe-agent {f} -o {d}/t.jsonl",
     ["t.traj: not a SWE-agent trajectory", "nested more than 100 levels deep"]),
    ("convert: storm NaN", "s.jsonl", '{"prompt": "p", "response": "r", "usage": NaN}\n',
     "convert storm {f} -o {d}/t.jsonl", ["s.jsonl: line 1:", "usage: NaN is not a JSON number"]),
    ("acceptance: NaN step", "m.jsonl", '{"per_step_drafted": [3, 3], "per_step_accepted": [1, NaN]}\n',
     "calibrate acceptance {f} -o {d}/p.json", ["m.jsonl:1:", "per_step_accepted[1]: NaN is not a JSON number"]),
    ("acceptance: fractional step", "m.jsonl", '{"per_step_drafted": [3, 3], "per_step_accepted": [1, 1.5]}\n',
     "calibrate acceptance {f} -o {d}/p.json", ["m.jsonl:1: per_step_accepted: expected a list of integers"]),
    ("acceptance: duplicate key", "m.jsonl",
     '{"per_step_drafted": [3], "per_step_accepted": [1], "per_step_accepted": [3]}\n',
     "calibrate acceptance {f} -o {d}/p.json", ["m.jsonl:1:", "per_step_accepted: the key is given twice"]),
    ("acceptance: spec-bench infinity", "sb.jsonl",
     '{"question_id": 1, "choices": [{"accept_lengths": [1, Infinity], "decoding_steps": [2]}]}\n',
     "calibrate acceptance {f} -o {d}/p.json", ["sb.jsonl:1:", "accept_lengths[1]: Infinity is not a JSON number"]),
    ("cost calibration: NaN factor", "cal.json",
     '{"format": "agentspec-sim/cost-calibration", "version": 1,\n "factors": {\n  "x": NaN}}\n',
     "replay {d}/good.jsonl --drafter normal --calibration {f}",
     ["cal.json:3:", "factors.x: NaN is not a JSON number"]),
    ("model config: duplicate key", "config.json", '{"hidden_size": 4096,\n "hidden_size": 1}\n',
     "replay {d}/good.jsonl --drafter normal --model {f}", ["config.json:2:", "hidden_size: the key is given twice"]),
    ("baseline: duplicate key", "base.json", '{"version": 1,\n "version": 2}\n', "check --baseline {f}",
     ["base.json:2:", "version: the key is given twice"]),
    ("results: NaN", "res.jsonl", '{"cell_id": "a", "trace": "t", "speedup": NaN}\n', "report {f} -o {d}/rep",
     ["res.jsonl:1:", "speedup: NaN is not a JSON number"]),
    ("acceptance params: too large", "params.json", '{"intercepts": [1e999]}', "calibrate acceptance "
     "{d}/m.jsonl -o {d}/p.json --coefficients-from {f}", ["--coefficients-from:", "params.json",
                                                          "intercepts[0]: 1e999 is too large"]),
]


@pytest.mark.parametrize(("file", "content", "argv", "fragments"),
                         [pytest.param(*case[1:], id=case[0]) for case in OTHER_INPUTS])
def test_other_json_inputs(workdir, monkeypatch, capsys, file, content, argv, fragments):
    _write(workdir / "good.jsonl", GOOD)
    _write(workdir / "m.jsonl", '{"per_step_drafted": [3, 3], "per_step_accepted": [1, 2]}\n')
    path = _write(workdir / file, content)
    code, _, err = run_cli(argv.format(d=workdir, f=path).split(), monkeypatch, capsys)
    _one_error_line(code, err, *fragments)


def test_multi_line_json_errors_give_the_line():
    with pytest.raises(strict_json.StrictJSONError) as info:
        strict_json.loads('{\n "a": 1,\n "b": {"c": [1,\n  2, NaN]},\n "a": 2\n}')
    assert (info.value.field, info.value.line) == ("a", 5)  # the duplicate's second occurrence
    with pytest.raises(strict_json.StrictJSONError) as info:
        strict_json.loads('{\n "b": {"c": [1,\n  2, NaN]}\n}')
    assert (info.value.field, info.value.line, info.value.lineno) == ("b.c[2]", 3, 3)


# -- traces with no size to check before reading: devices, FIFOs, pipes ----------------------------------


def test_an_endless_device_as_a_trace_is_refused_at_the_memory_limit(tmp_path, monkeypatch, capsys):
    """A private /dev/zero twin: read until the memory limit's worth of text, then one line (it used to grow
    until the kernel killed the process: a character device reports size 0 to the up-front check)."""
    import stat

    zero = tmp_path / "zero.jsonl"
    try:
        os.mknod(zero, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    monkeypatch.setenv("AGENTSPEC_SIM_MEMORY_GIB", "0.05")
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(["inspect", str(zero)], monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {zero}: file: too large for this machine: more than ") and "MEMORY_GIB" in err


def test_a_compressed_bomb_on_standard_input_is_refused_as_it_expands(tmp_path):
    bomb = gzip.compress(b"{}\n" * 20_000_000, compresslevel=1)  # 60 MB of text in ~100 KB
    env = {**os.environ, "AGENTSPEC_SIM_MEMORY_GIB": "0.1", "AGENTSPEC_SIM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "inspect", "-"], input=bomb,
                          capture_output=True, env=env, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 2 and "Traceback" not in err, err
    assert err.startswith("error: <stdin>: file: too large for this machine: more than ")


def test_a_fifo_trace_is_read_once_and_whole(tmp_path):
    """A named pipe (compressed by its name) loads like a file: nothing peeks at its first bytes first."""
    import threading

    fifo = tmp_path / "pipe.jsonl.zst"
    os.mkfifo(fifo)
    data = zstandard.ZstdCompressor().compress(jsonl(META, call(0), call(1)).encode())

    def feed() -> None:
        with open(fifo, "wb") as out:
            out.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    env = {**os.environ, "AGENTSPEC_SIM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "inspect", str(fifo), "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    writer.join(timeout=10)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["calls"] == 2


@pytest.mark.parametrize("argv", [
    "check --baseline {zero}",
    "replay {d}/good.jsonl --calibration {zero}",
    "replay {d}/good.jsonl --model {zero}",
    "calibrate acceptance {zero} -o {d}/p.json",
    "calibrate acceptance {d}/m.jsonl -o {d}/p.json --coefficients-from {zero}",
], ids=["baseline", "calibration", "model config", "acceptance metrics", "acceptance parameters"])
def test_an_endless_device_as_a_json_input_is_refused(tmp_path, monkeypatch, capsys, argv):
    """Every JSON file read whole (configurations, profiles, baselines, metrics) is read no further than
    its bound: a /dev/zero twin grew each of these to the machine's memory before."""
    import stat

    zero = tmp_path / "zero.json"
    try:
        os.mknod(zero, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    (tmp_path / "good.jsonl").write_text(jsonl(META, call(0)))
    (tmp_path / "m.jsonl").write_text('{"per_step_drafted": [2], "per_step_accepted": [1]}\n')
    monkeypatch.setenv("AGENTSPEC_SIM_MEMORY_GIB", "0.5")
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(argv.format(d=tmp_path, zero=zero).split(), monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(zero) in err and "too large" in err, err


def test_json_lines_numbers_lines_skips_blanks_and_refuses_with_the_callers_message():
    from agentspec_sim.io.strict_json import json_lines

    class Refused(Exception):
        pass

    text = '{"a": 1}\n\n   \n[2]\n{"a": 1, "a": 2}\n{"b": 3}\n'
    got = []
    with pytest.raises(Refused, match=r"^f\.jsonl:5: a: the key is given twice") as info:
        for number, value in json_lines(text, lambda n, e: Refused(f"f.jsonl:{n}: {e.msg}")):
            got.append((number, value))
    assert got == [(1, {"a": 1}), (4, [2])]  # blank lines keep their numbers; nothing past the refusal
    assert info.value.__suppress_context__  # one line, no chained traceback
    assert list(json_lines("", lambda n, e: Refused())) == []
