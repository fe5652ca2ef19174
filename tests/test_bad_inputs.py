"""The bad-input catalogue: every command, fed what users feed it, answers with one clear line and exit 2.

Each case runs the real entry point (`run_guarded`, as the console script does) in-process and
checks: exit code 2, exactly one line on stderr starting `error:`, no traceback, and the fragments
that name the file, line and field where there is one. The loader's own 38 cases are in
tests/test_trace_errors.py; here each kind of bad input is driven through the command line.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import zstandard

from agentspec_sim.cli.app import app
from agentspec_sim.cli.errors import run_guarded

META = {"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 100}


def call(i: int = 0, **fields) -> dict:
    rec = {"type": "call", "id": f"c{i}", "agent_id": 1, "query_id": 1, "seq": i,
           "prompt_tokens": [1, 2, 3, 4, 5, 6, 7, 8], "output_tokens": [4, 5, 6]}
    rec.update(fields)
    return {k: v for k, v in rec.items() if v is not ...}


def jsonl(*records) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n"


GOOD = jsonl(META, call(0), call(1))
# Files each case may use (written into a fresh directory); bytes are written as they are.
FILES: dict[str, str | bytes] = {
    "good.jsonl": GOOD,
    "bad-json.jsonl": jsonl(META, call(0), '{"type": "call", "id": '),
    "seq-string.jsonl": jsonl(META, call(0, seq="0")),
    "no-output.jsonl": jsonl(META, call(0, output_tokens=...)),
    "no-id.jsonl": jsonl(META, call(0, id=...)),
    "out-of-vocab.jsonl": jsonl(META, call(0, output_tokens=[4, 100])),
    "int64-token.jsonl": jsonl({**META, "vocab_size": None}, call(0, prompt_tokens=[1, 2**33])),
    "empty-output.jsonl": jsonl(META, call(0, output_tokens=[])),
    "seq-gap.jsonl": jsonl(META, call(0), call(2)),
    "seq-duplicate.jsonl": jsonl(META, call(0), call(1, seq=0)),
    "id-duplicate.jsonl": jsonl(META, call(0), call(1, id="c0")),
    "unknown-tokenizer.jsonl": jsonl({**META, "tokenizer": "no-such-tokenizer"}, call(0)),
    "unbalanced-structure.jsonl": jsonl(META, call(0, structure=[["```python"]])),
    "empty-delimiter.jsonl": jsonl(META, call(0, structure=[["", "```"]])),
    "binary.jsonl": bytes(range(256)) * 8,
    "truncated.jsonl.gz": gzip.compress(GOOD.encode() * 40)[:-30],
    "truncated.jsonl.zst": zstandard.ZstdCompressor().compress(GOOD.encode() * 40)[:-9],
    "empty.jsonl": "",
    "no-meta.jsonl": jsonl(call(0)),
    "tiny-kv.jsonl": jsonl(META, call(0, prompt_tokens=list(range(60)))),
    "metrics-binary.jsonl": bytes(range(128, 256)) * 4,
    "metrics-no-steps.jsonl": jsonl({"id": "r0"}),
    "chat.jsonl": jsonl({"messages": [{"role": "user", "content": "hi"}]}),
    "params.json": "{not json",
}


def case(name: str, argv: str, *fragments: str, env: dict[str, str] | None = None):
    return pytest.param(argv, fragments, env or {}, id=name)


# (argv with {d} for the case's directory, fragments the one error line must contain)
CATALOGUE = [
    # -- trace lines (through replay and inspect) --------------------------------------------
    case("invalid JSON", "replay {d}/bad-json.jsonl", "bad-json.jsonl:3: line: invalid JSON"),
    case("wrong type", "inspect {d}/seq-string.jsonl", "seq-string.jsonl:2: seq: expected an integer, got a string"),
    case("missing output", "replay {d}/no-output.jsonl", "no-output.jsonl:2: output: missing"),
    case("missing id", "inspect {d}/no-id.jsonl", "no-id.jsonl:2: id: missing"),
    case("token out of vocabulary", "replay {d}/out-of-vocab.jsonl",
         "out-of-vocab.jsonl:2: output_tokens: token id 100 is out of the vocabulary (size 100)"),
    case("token id over 32 bits", "inspect {d}/int64-token.jsonl",
         "int64-token.jsonl:2: prompt_tokens: token id 8589934592 does not fit in 32 bits"),
    case("empty output", "replay {d}/empty-output.jsonl", "empty-output.jsonl:2: output_tokens: empty output"),
    case("seq gap", "replay {d}/seq-gap.jsonl", "seq-gap.jsonl:3: seq: gap in query 1: expected seq 1, got 2"),
    case("seq duplicate", "inspect {d}/seq-duplicate.jsonl", "seq-duplicate.jsonl:3: seq: duplicate seq 0"),
    case("call id duplicate", "replay {d}/id-duplicate.jsonl", "id-duplicate.jsonl:3: id: duplicate call id 'c0'"),
    case("unknown tokenizer", "replay {d}/unknown-tokenizer.jsonl",
         "unknown-tokenizer.jsonl:1: tokenizer: unknown tokenizer 'no-such-tokenizer'"),
    case("unbalanced structure", "replay {d}/unbalanced-structure.jsonl",
         "unbalanced-structure.jsonl:2: structure: group 1 pair 1: unbalanced or empty delimiter pair"),
    case("empty delimiter", "inspect {d}/empty-delimiter.jsonl", "empty-delimiter.jsonl:2: structure:",
         "unbalanced or empty"),
    case("binary garbage", "replay {d}/binary.jsonl", "binary.jsonl:1: line: "),
    case("truncated gzip", "replay {d}/truncated.jsonl.gz", "truncated.jsonl.gz: file: cannot decompress"),
    case("truncated zstd", "inspect {d}/truncated.jsonl.zst", "truncated.jsonl.zst: file: cannot decompress",
         "truncated"),
    case("empty file", "replay {d}/empty.jsonl", "empty.jsonl: file: empty trace"),
    case("no meta line", "replay {d}/no-meta.jsonl", "no-meta.jsonl:1: type: the first line must be the meta line"),
    # -- engine configuration --------------------------------------------------------------------
    case("zero max-num-seqs", "replay {d}/good.jsonl --max-num-seqs 0", "max_num_seqs must be a positive integer"),
    case("negative max-num-seqs", "replay {d}/good.jsonl --max-num-seqs -4", "max_num_seqs", "got -4"),
    case("zero token budget", "replay {d}/good.jsonl --max-num-batched-tokens 0", "max_num_batched_tokens must be"),
    case("zero KV blocks", "replay {d}/good.jsonl --num-kv-blocks 0", "num_kv_blocks must be a positive integer"),
    case("negative replicate", "replay {d}/good.jsonl --replicate -1", "replicate must be a positive integer"),
    case("zero tensor parallel", "replay {d}/good.jsonl --tensor-parallel-size 0", "tensor_parallel_size must be"),
    case("GPU memory share over 1", "replay {d}/good.jsonl --gpu-memory-utilization 1.5",
         "gpu_memory_utilization must be in (0, 1]"),
    case("a call larger than the KV cache", "replay {d}/tiny-kv.jsonl --num-kv-blocks 3 --max-model-len 4096",
         "call 'c0' needs 4 KV blocks", "the cache holds 2 blocks"),
    case("unknown drafter", "replay {d}/good.jsonl --drafter normal,ngram,nope", "unknown drafter 'nope'"),
    case("speculative config not JSON", "replay {d}/good.jsonl --speculative-config {{bad",
         "speculative config is not valid JSON"),
    case("speculative config without k", "replay {d}/good.jsonl --speculative-config {{\"method\":\"ngram\"}}",
         "num_speculative_tokens"),
    case("drafter the model lacks", "replay {d}/good.jsonl --drafter mtp", "no 'mtp' draft network"),
    case("unknown hardware", "replay {d}/good.jsonl --hardware tpu-v9", "unknown hardware profile 'tpu-v9'"),
    case("unknown model", "replay {d}/good.jsonl --model gpt-9", "unknown model profile or config.json 'gpt-9'"),
    case("missing calibration", "replay {d}/good.jsonl --calibration {d}/nope.json", "nope.json",
         "no such calibration file"),
    case("token budget below max-num-seqs", "replay {d}/good.jsonl --max-num-batched-tokens 4 --max-num-seqs 8",
         "max_num_batched_tokens (4) must be ≥ max_num_seqs (8)"),
    case("output and steps the same file", "replay {d}/good.jsonl -o {d}/x.out --steps {d}/x.out",
         "--output and --steps name the same file"),
    case("negative rate", "replay {d}/good.jsonl --rate -2", "--rate: must be a finite number", "got -2"),
    case("rate not a number", "replay {d}/good.jsonl --rate nan", "--rate: must be a finite number"),
    case("negative seed", "replay {d}/good.jsonl --seed -1", "--seed: must be ≥ 0, got -1"),
    case("negative think time", "replay {d}/good.jsonl --think-time -1", "think_time must be ≥ 0"),
    case("inspect context limit zero", "inspect {d}/good.jsonl --max-model-len 0", "--max-model-len: must be ≥ 1"),
    # -- files -------------------------------------------------------------------------------------
    case("missing trace", "replay {d}/nope.jsonl", "nope.jsonl: file: no such file"),
    case("trace is a directory", "inspect {d}", ": file: is a directory"),
    case("output is a directory", "replay {d}/good.jsonl -o {d}", "is a directory, not a file to write"),
    case("output under a file", "replay {d}/good.jsonl --steps {d}/good.jsonl/steps.parquet",
         "good.jsonl/steps.parquet: a parent of this path is a file"),
    case("trace larger than memory", "inspect {d}/good.jsonl", "good.jsonl: file: too large for this machine",
         "AGENTSPEC_SIM_MEMORY_GIB", env={"AGENTSPEC_SIM_MEMORY_GIB": "0.000001"}),
    case("memory limit not a number", "inspect {d}/good.jsonl", "AGENTSPEC_SIM_MEMORY_GIB: environment:",
         env={"AGENTSPEC_SIM_MEMORY_GIB": "lots"}),
    # -- convert -----------------------------------------------------------------------------------
    case("convert unknown format", "convert nope {d}/chat.jsonl -o {d}/t.jsonl", "FORMAT: unknown format 'nope'"),
    case("convert missing input", "convert openai-chat {d}/nope.json -o {d}/t.jsonl", "nope.json"),
    case("convert binary input", "convert openai-chat {d}/binary.jsonl -o {d}/t.jsonl", "binary.jsonl",
         "UTF-8"),
    case("convert wrong format", "convert openai-chat {d}/good.jsonl -o {d}/t.jsonl", "good.jsonl",
         "not an openai-chat log line"),
    case("convert bad max-queries", "convert openai-chat {d}/chat.jsonl -o {d}/t.jsonl --max-queries 0",
         "--max-queries: must be ≥ 1"),
    case("convert unknown tokenizer", "convert openai-chat {d}/chat.jsonl -o {d}/t.jsonl --tokenizer nope",
         "unknown tokenizer 'nope'"),
    # -- analyze -----------------------------------------------------------------------------------
    case("analyze bad match lengths", "analyze redundancy {d}/good.jsonl --match-lens 4,x",
         "--match-lens: expected comma-separated integers"),
    case("analyze bad candidates", "analyze redundancy {d}/good.jsonl --max-candidates 0", "--max-candidates"),
    case("analyze missing trace", "analyze redundancy {d}/nope.jsonl", "nope.jsonl: file: no such file"),
    case("analyze roles output a directory", "analyze roles {d}/good.jsonl -o {d}", "is a directory"),
    case("analyze roles bad drafter", "analyze roles {d}/good.jsonl -o {d}/caps.json --drafter {{bad",
         "analyze roles:"),
    case("analyze roles bad batch size", "analyze roles {d}/good.jsonl -o {d}/caps.json --batch-size 0",
         "--batch-size must be ≥ 1"),
    # -- calibrate acceptance --------------------------------------------------------------------
    case("calibrate missing file", "calibrate acceptance {d}/nope.jsonl -o {d}/p.json", "nope.jsonl"),
    case("calibrate binary file", "calibrate acceptance {d}/metrics-binary.jsonl -o {d}/p.json",
         "metrics-binary.jsonl"),
    case("calibrate no steps", "calibrate acceptance {d}/metrics-no-steps.jsonl -o {d}/p.json",
         "metrics-no-steps.jsonl:1: per_step_accepted: missing"),
    case("calibrate not model-based", "calibrate acceptance {d}/metrics-no-steps.jsonl -o {d}/p.json --method ngram",
         "--method ngram: not a model-based drafter"),
    case("calibrate unknown method", "calibrate acceptance {d}/metrics-no-steps.jsonl -o {d}/p.json --method zz",
         "--method: unknown drafter 'zz'"),
    case("calibrate bad k", "calibrate acceptance {d}/metrics-no-steps.jsonl -o {d}/p.json --k 0", "--k must be ≥ 1"),
    case("calibrate bad coefficients file",
         "calibrate acceptance {d}/metrics-no-steps.jsonl -o {d}/p.json --coefficients-from {d}/params.json",
         "--coefficients-from:"),
    # -- sweep, plan, report, check, synth, validate, calibrate cost --------------------------------
    case("sweep missing trace", "sweep {d}/nope.jsonl -o {d}/s.parquet", "nope.jsonl: file: no such file"),
    case("sweep zero batch size", "sweep {d}/good.jsonl -o {d}/s.parquet --max-num-seqs 4,0", "--max-num-seqs:",
         "got 0"),
    case("sweep no seeds", "sweep {d}/good.jsonl -o {d}/s.parquet --seeds 0", "--seeds must be ≥ 1"),
    case("sweep unknown executor", "sweep {d}/good.jsonl -o {d}/s.parquet --executor mpi", "unknown executor 'mpi'"),
    case("sweep bad grid", "sweep {d}/good.jsonl -o {d}/s.parquet --grid k", "--grid 'k': expected KEY=V1,V2"),
    case("sweep output a directory", "sweep {d}/good.jsonl -o {d} --max-num-seqs 1", "is a directory"),
    case("sweep unknown drafter", "sweep {d}/good.jsonl -o {d}/s.parquet --drafter nope", "unknown drafter 'nope'"),
    case("plan missing results", "plan --results {d}/nope.parquet", "nope.parquet: no such file"),
    case("plan results not parquet", "plan --results {d}/good.jsonl", "good.jsonl: not a parquet file"),
    case("plan negative SLO", "plan {d}/good.jsonl --slo-ttft -1", "--slo-ttft must be > 0"),
    case("report missing results", "report {d}/nope.parquet -o {d}/rep", "nope.parquet"),
    case("report not sweep results", "report {d}/good.jsonl -o {d}/rep", "good.jsonl: missing column(s)"),
    case("report binary results", "report {d}/binary.jsonl -o {d}/rep", "binary.jsonl: not UTF-8 text"),
    case("report zero batch size", "report {d}/good.jsonl --batch-size 0", "--batch-size must be ≥ 1"),
    case("check missing baseline", "check --baseline {d}/nope.json", "nope.json: no such baseline"),
    case("check baseline not JSON", "check --baseline {d}/good.jsonl", "good.jsonl:2: not JSON"),
    case("check binary baseline", "check --baseline {d}/binary.jsonl", "binary.jsonl: not UTF-8 text"),
    case("check negative tolerance", "check --tolerance -1", "--tolerance and --goodput-tolerance must be ≥ 0"),
    case("synth no queries", "synth --like {d}/good.jsonl -o {d}/s.jsonl --queries 0", "--queries: must be ≥ 1"),
    case("synth both sizes", "synth --like {d}/good.jsonl -o {d}/s.jsonl --queries 2 --output-tokens 9",
         "give exactly one of them"),
    case("synth missing trace", "synth --like {d}/nope.jsonl -o {d}/s.jsonl --queries 1",
         "nope.jsonl: file: no such file"),
    case("synth output a directory", "synth --like {d}/good.jsonl -o {d} --queries 1", "is a directory"),
    case("validate missing steps", "validate timing {d}/nope.parquet -o {d}/vt", "nope.parquet: no such file"),
    case("validate steps not parquet", "validate timing {d}/good.jsonl -o {d}/vt",
         "good.jsonl: cannot read as parquet"),
    case("validate zero repeats", "validate timing {d}/good.jsonl -o {d}/vt --repeats 0", "--repeats must be ≥ 1"),
    case("calibrate cost missing", "calibrate cost {d}/nope.parquet -o {d}/c.json", "nope.parquet: no such file"),
    case("calibrate cost not parquet", "calibrate cost {d}/good.jsonl -o {d}/c.json",
         "good.jsonl: cannot read as parquet"),
    case("calibrate cost bad holdout", "calibrate cost {d}/good.jsonl -o {d}/c.json --holdout 2",
         "--holdout must be in [0, 1)"),
    case("record zero batch size", "record {d}/good.jsonl --model m -o {d}/r.jsonl --max-num-seqs 0",
         "--max-num-seqs and --queries must be ≥ 1"),
    case("record no queries", "record {d}/good.jsonl --model m -o {d}/r.jsonl --queries 0",
         "--max-num-seqs and --queries must be ≥ 1"),
    case("record missing trace", "record {d}/nope.jsonl --model m -o {d}/r.jsonl", "nope.jsonl: file: no such file"),
    case("validate output is a file", "validate timing {d}/good.jsonl -o {d}/good.jsonl",
         "exists and is not a folder"),
    # -- option parsing (click) ------------------------------------------------------------------
    case("not an integer", "replay {d}/good.jsonl --max-num-seqs many", "Invalid value for '--max-num-seqs'"),
    case("unknown option", "inspect {d}/good.jsonl --frobnicate", "No such option: --frobnicate"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name, content in FILES.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / ".cache"))
    monkeypatch.setenv("COLUMNS", "300")
    return tmp_path


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["agentspec-sim", *argv])
    code = run_guarded(app)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("argv", "fragments", "env"), CATALOGUE)
def test_bad_input_is_one_clear_line(workdir, monkeypatch, capsys, argv, fragments, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = run_cli(argv.format(d=workdir).split(), monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    if "error:" in err:  # ours; click's usage errors come in its own (boxed) format
        assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_no_partial_output_after_a_bad_input(workdir, monkeypatch, capsys):
    """A failure before the work writes nothing; a failure after it leaves no temporary file."""
    out = workdir / "result.json"
    code, _, _ = run_cli(["replay", str(workdir / "good.jsonl"), "-o", str(out), "--drafter", "nope"], monkeypatch,
                         capsys)
    assert code == 2 and not out.exists()
    assert not [p for p in workdir.iterdir() if p.name.endswith(".tmp")]


def test_unreadable_trace(workdir, monkeypatch, capsys):
    # As root chmod cannot make a file unreadable: the loader's open() refuses instead.
    import agentspec_sim.trace.io as trace_io

    target = workdir / "good.jsonl"

    def refuse(path, *args, **kwargs):
        if Path(path) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(trace_io, "open", refuse, raising=False)
    code, _, err = run_cli(["inspect", str(target)], monkeypatch, capsys)
    assert code == 2 and "good.jsonl: file: permission denied" in err and "Traceback" not in err


def test_debug_shows_the_traceback(workdir, monkeypatch, capsys):
    code, _, err = run_cli(["replay", str(workdir / "seq-gap.jsonl"), "--debug"], monkeypatch, capsys)
    assert code == 2 and "Traceback" in err and "seq-gap.jsonl:3: seq:" in err


def test_enormous_output_is_truncated_and_counted_not_an_error(workdir, monkeypatch, capsys):
    """An output longer than the context is not bad input: vLLM stops at max_model_len; the run says so."""
    trace = workdir / "long.jsonl"
    trace.write_text(jsonl(META, call(0, output_tokens=[7] * 5000)))
    code, out, err = run_cli(["replay", str(trace), "--json", "--max-model-len", "1024", "--drafter", "normal"],
                             monkeypatch, capsys)
    assert code == 0, err
    run = json.loads(out)["runs"][0]
    assert run["truncated_calls"] == 1 and run["output_tokens"] == 1024 - 8
