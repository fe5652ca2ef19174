"""Resource guards (agentspec_sim/host/resources.py): a knob whose value multiplies memory or work is refused
before any work, with one line naming the option, the estimate and the limit — and `report` counts a
cell once however many files hold it.

Every CLI case runs the real entry point in-process (`run_guarded`) on a two-call trace and checks:
exit 2, exactly one `error:` line naming the option, no traceback, back within seconds, and no output
file left behind. The estimates themselves are checked against a measured run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest
from test_bad_inputs import META, call, jsonl, run_cli

from agentspec_sim.engine.config import EngineConfig, resolve
from agentspec_sim.engine.footprint import run_footprint
from agentspec_sim.host import resources
from agentspec_sim.host.resources import ResourceError
from agentspec_sim.trace import io as trace_io

SCHEDULE = Path(__file__).resolve().parents[1] / "validation" / "schedules" / "qwen3-8b_seqs32.json.gz"
QUICK_S = 15.0  # in-process, imports done: a refusal takes well under a second; the VM is shared


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "good.jsonl").write_text(jsonl(META, call(0), call(1)))
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / ".cache"))
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.delenv("AGENTSPEC_SIM_MEMORY_GIB", raising=False)
    return tmp_path


def refused(argv: str, workdir: Path, monkeypatch, capsys, *fragments: str) -> str:
    """Run `argv` ({d}: the work folder); assert the guard's one line (naming `fragments`), fast, and that
    nothing but the inputs is left in the folder; return the line."""
    before = set(workdir.iterdir())
    start = time.monotonic()
    code, _, err = run_cli(argv.format(d=workdir).split(), monkeypatch, capsys)
    elapsed = time.monotonic() - start
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert elapsed < QUICK_S, elapsed
    assert set(workdir.iterdir()) - {workdir / ".cache"} <= before, "output left behind"
    return lines[0]


GIB = "GiB of memory"

def case(name: str, argv: str, *fragments: str):
    return pytest.param(argv, fragments, id=name)


# (argv with {d} for the work folder, fragments of the one line): each knob that multiplies work or memory.
CASES = [
    case("replay replicate", "replay {d}/good.jsonl -o {d}/r.json --replicate 1000000000",
         "error: --replicate: at 1,000,000,000", "available", "lower --replicate (about"),
    case("replay KV blocks", "replay {d}/good.jsonl -o {d}/r.json --num-kv-blocks 10000000000",
         "error: --num-kv-blocks:", GIB),
    case("replay context", "replay {d}/good.jsonl -o {d}/r.json --max-model-len 1000000000",
         "error: --max-model-len:", GIB),
    case("replay max-num-seqs", "replay {d}/good.jsonl -o {d}/r.json --max-num-seqs 1000000000 "
         "--max-num-batched-tokens 1000000000 --num-kv-blocks 1000",
         "error: --max-num-seqs: at 1,000,000,000", "TiB of memory"),
    case("replay draft length", "replay {d}/good.jsonl -o {d}/r.json --drafter normal --speculative-config "
         '{{"method":"ngram","num_speculative_tokens":100000000}}',
         # Refused by the config's own bound (engine/drafting.py) before the memory estimate is reached.
         "error: --speculative-config: num_speculative_tokens must be ≤ 4096, got 100000000"),
    case("replay tensor parallel huge", "replay {d}/good.jsonl -o {d}/r.json --tensor-parallel-size 1000000",
         "error: --tensor-parallel-size: qwen3-8b has 32 attention heads", "got 1,000,000 GPUs",
         "use one of 1, 2, 4, 8, 16, 32"),
    case("replay tensor parallel not dividing", "replay {d}/good.jsonl -o {d}/r.json --drafter normal,eagle3 "
         "--tensor-parallel-size 3", "error: --tensor-parallel-size:", "got 3 GPUs"),
    case("replay token budget past int64", "replay {d}/good.jsonl -o {d}/r.json --max-num-batched-tokens "
         "100000000000000000000", "max_num_batched_tokens must be at most 2**62"),
    case("sweep seeds", "sweep {d}/good.jsonl -o {d}/s.parquet --seeds 1000000",
         "error: --seeds: the sweep has 54,000,000 cells", "1,000,000 seeds",
         "over the limit of 10,000 (--max-cells)", "lower --seeds (at most 185 fits) or raise --max-cells"),
    case("sweep seeds past int64", "sweep {d}/good.jsonl -o {d}/s.parquet --seeds 100000000000000000000",
         "error: --seeds:"),
    case("sweep grid", "sweep {d}/good.jsonl -o {d}/s.parquet --drafter ngram --grid num_speculative_tokens="
         + ",".join(map(str, range(1, 201))) + " --grid prompt_lookup_max=" + ",".join(map(str, range(1, 101))),
         "error: --grid: the sweep has 180,009 cells (20,001 drafter configurations", "use fewer --grid values"),
    case("sweep over max-cells", "sweep {d}/good.jsonl -o {d}/s.parquet --drafter normal --max-num-seqs 1,2,3 "
         "--seeds 2 --max-cells 5", "error: --max-num-seqs: the sweep has 6 cells",
         "over the limit of 5 (--max-cells)"),
    case("sweep replicate", "sweep {d}/good.jsonl -o {d}/s.parquet --drafter normal --max-num-seqs 1 --replicate "
         "1000000000", "error: --replicate: at 1,000,000,000", "of memory"),
    case("plan seeds", "plan {d}/good.jsonl --seeds 1000000", "error: --seeds: the sweep has"),
    case("synth queries", "synth --like {d}/good.jsonl -o {d}/s.jsonl --queries 1000000000",
         "error: --queries: at 1,000,000,000, the synthetic trace needs about", "TiB of memory"),
    case("synth output tokens", "synth --like {d}/good.jsonl -o {d}/s.jsonl.zst --output-tokens 1000000000000",
         "error: --output-tokens:"),
    case("analyze roles k-max", "analyze roles {d}/good.jsonl -o {d}/caps.json --k-max 1000000000",
         "error: --k-max: at 1,000,000,000, the role profile needs", GIB),
    case("validate repeats", f"validate timing {SCHEDULE} -o {{d}}/vt --repeats 1000000000",
         "error: --repeats: the timing run has", "forward passes", "(--max-passes)"),
    case("validate steps", f"validate timing {SCHEDULE} -o {{d}}/vt --max-passes 10",
         "error: --sample:", "time a --sample of fewer steps"),
]


@pytest.mark.parametrize(("argv", "fragments"), CASES)
def test_a_multiplying_knob_is_refused_before_the_work(workdir, monkeypatch, capsys, argv, fragments):
    refused(argv, workdir, monkeypatch, capsys, *fragments)


def test_a_drafter_run_is_refused_before_the_normal_run(workdir, monkeypatch, capsys):
    """replay runs `normal` first: a drafter that cannot fit is refused before that run, not after it."""
    argv = ["replay", str(workdir / "good.jsonl"), "--drafter", "normal", "--speculative-config",
            '{"method":"ngram","num_speculative_tokens":100000000}']
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2 and "finished normal" not in err and "num_speculative_tokens" in err


def test_sweep_workers_at_once_must_fit(workdir, monkeypatch, capsys):
    """One cell fits, two local workers (each with its interpreter and trace) do not: --jobs is named."""
    monkeypatch.setenv("AGENTSPEC_SIM_MEMORY_GIB", "0.2")
    refused("sweep {d}/good.jsonl -o {d}/s.parquet --drafter normal --max-num-seqs 1,2 -j 2", workdir, monkeypatch,
            capsys, "error: --jobs: at 2, running 2 cells at once needs about", "lower --jobs (about 1 fits)")


def test_synth_refuses_more_than_the_disk_holds(workdir, monkeypatch, capsys):
    monkeypatch.setenv("AGENTSPEC_SIM_MEMORY_GIB", "1000000000")  # memory allowed: the disk is what runs out
    refused("synth --like {d}/good.jsonl -o {d}/out/s.jsonl --queries 100000000000", workdir, monkeypatch, capsys,
            "error: --queries: at 100,000,000,000, the synthetic trace (200,000,000,000 calls) takes about",
            "of disk", "free in")


def test_max_cells_raises_the_limit(workdir, monkeypatch, capsys):
    out = workdir / "s.parquet"
    argv = ["sweep", str(workdir / "good.jsonl"), "-o", str(out), "--drafter", "normal", "--max-num-seqs", "1,2",
            "--seeds", "2", "-j", "1", "-q"]
    code, _, err = run_cli([*argv, "--max-cells", "3"], monkeypatch, capsys)
    assert code == 2 and "the sweep has 4 cells" in err and not out.exists()
    code, _, err = run_cli([*argv, "--max-cells", "4"], monkeypatch, capsys)
    assert code == 0, err
    assert pl.read_parquet(out).height == 4


def test_library_functions_raise_resource_error_naming_their_keyword(workdir):
    from agentspec_sim.run.simulation import simulate
    from agentspec_sim.sweep.run import sweep_cells
    from agentspec_sim.trace.synth import synthesize

    workload = trace_io.load_trace(workdir / "good.jsonl")
    with pytest.raises(ResourceError, match=r"^replicate: at 1,000,000,000, the run needs about .* lower replicate"):
        simulate(workload, "normal", EngineConfig(replicate=10**9))
    with pytest.raises(ResourceError, match=r"^seeds: .* \(max_cells\); lower seeds \(at most 185 fits\)") as info:
        sweep_cells("t.jsonl", seeds=range(10**6))
    assert info.value.knob == "seeds"
    assert len(sweep_cells("t.jsonl", drafters=("normal",), max_num_seqs=(1,), seeds=range(3))) == 3
    with pytest.raises(ResourceError, match=r"^queries: at 1,000,000,000, the synthetic trace needs"):
        synthesize(workload, queries=10**9)
    with pytest.raises(ResourceError, match=r"^tensor_parallel_size: qwen3-8b has 32 attention heads"):
        resolve(EngineConfig(tensor_parallel_size=12))
    assert resolve(EngineConfig(tensor_parallel_size=8)).num_kv_blocks > resolve(EngineConfig()).num_kv_blocks


def test_the_memory_limit_is_the_cgroups_where_that_is_lower(tmp_path, monkeypatch):
    """A container's cgroup limit (v2 memory.max, v1 memory.limit_in_bytes) caps MemAvailable; its
    inactive page cache counts as free; "max" (v2) or v1's huge number mean no limit."""
    monkeypatch.delenv("AGENTSPEC_SIM_MEMORY_GIB", raising=False)
    group = tmp_path / "cg" / "job"
    group.mkdir(parents=True)
    (tmp_path / "proc").write_text("0::/job\n")
    monkeypatch.setattr(resources, "_CGROUP_ROOT", str(tmp_path / "cg"))
    monkeypatch.setattr(resources, "_PROC_CGROUP", str(tmp_path / "proc"))
    (group / "memory.max").write_text(f"{3 * 2**30}\n")
    (group / "memory.current").write_text(f"{2**30}\n")
    (group / "memory.stat").write_text(f"anon 1\ninactive_file {2**29}\n")
    assert resources._cgroup_available() == 3 * 2**30 - 2**30 + 2**29  # limit − usage + inactive cache
    monkeypatch.setattr(resources, "_meminfo_available", lambda: 2**40)
    assert resources.available_memory() == resources._cgroup_available()
    (group / "memory.max").write_text("max\n")
    assert resources._cgroup_available() is None and resources.available_memory() == 2**40
    v1 = tmp_path / "cg" / "memory" / "job"
    v1.mkdir(parents=True)
    (tmp_path / "proc").write_text("4:memory:/job\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{2**31}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert resources._cgroup_available() == 2**31 - 2**30


def _rows(goodput: float = 100.0, wall: float = 1.0) -> list[dict]:
    rows = []
    for i, (drafter, size) in enumerate([("normal", 1), ("normal", 2), ("ngram", 1), ("ngram", 2)]):
        rows.append({"cell_id": f"cell{i}", "trace": "t.jsonl", "drafter": drafter, "speculative_config": "{}",
                     "max_num_seqs": size, "hardware": "a100-80g", "model": "qwen3-8b", "seed": 0,
                     "goodput_tok_s": goodput * (i + 1), "speedup": 1.0, "rejection_rate": None,
                     "draft_tokens_per_step": 0.0, "token_budget_mean": 0.0, "draft_time_s": 0.0,
                     "forward_time_s": 1.0, "query_latencies_s": [1.0 + i, 2.0 + i, 9.0 + i], "wall_s": wall})
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_counts_a_cell_once_whatever_holds_it(tmp_path):
    """The same file twice, or two files holding the same cells (another wall-clock time: a rerun), give the
    cells and pooled latencies of one file."""
    from agentspec_sim.report.results import load_results, seed_means

    a = _write(tmp_path / "a.jsonl", _rows())
    rerun = _write(tmp_path / "b.jsonl", _rows(wall=7.5)[1:])
    one = seed_means(load_results([a]))
    for paths in ([a, a], [a, rerun], [rerun, a]):
        frame = load_results(paths)
        assert frame.height == 4 and frame["cell_id"].n_unique() == 4
        means = seed_means(frame)
        assert means["query_latencies_s"].to_list() == one["query_latencies_s"].to_list()
        assert means["goodput_tok_s"].to_list() == one["goodput_tok_s"].to_list()


def test_report_refuses_one_cell_with_two_different_results(workdir, monkeypatch, capsys):
    from agentspec_sim.report.results import ResultsError, load_results

    a = _write(workdir / "a.jsonl", _rows())
    b = _write(workdir / "b.jsonl", _rows(goodput=120.0)[2:])
    with pytest.raises(ResultsError, match=r"b\.jsonl: cell cell2 \(ngram at max_num_seqs 1, seed 0\) is also in "
                                           r".*a\.jsonl with different results \(goodput_tok_s 300\.0 vs 360\.0\)"):
        load_results([a, b])
    refused("report {d}/a.jsonl {d}/b.jsonl -o {d}/rep", workdir, monkeypatch, capsys,
            "b.jsonl: cell cell2", "two different runs of one cell")


def test_the_run_estimate_is_within_2x_of_the_measured_peak(tmp_path):
    """engine/footprint.py's estimate against the peak RSS a real run adds (VmHWM reset just before it), in
    a fresh process with the kernels loaded by a first, tiny run."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    trace = tmp_path / "t.jsonl"
    trace.write_text(jsonl({**META, "vocab_size": 1000}, call(0, output_tokens=list(range(1, 600))),
                           call(1, output_tokens=list(range(1, 600)))))
    script = textwrap.dedent(f"""
        import json
        from agentspec_sim.engine.config import EngineConfig, resolve
        from agentspec_sim.engine.footprint import run_footprint
        from agentspec_sim.drafters.registry import parse_drafter
        from agentspec_sim.run.simulation import simulate
        from agentspec_sim.trace.io import load_trace
        w = load_trace({str(trace)!r})
        simulate(w, "normal", EngineConfig(max_num_seqs=4))
        config = EngineConfig(replicate=20000)
        estimate = sum(run_footprint(w, parse_drafter("normal"), config, resolve(config)).values())
        def status(key):
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
        before = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        simulate(w, "normal", config)
        print(json.dumps({{"estimate": estimate, "measured": status("VmHWM:") - before}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AGENTSPEC_SIM_CACHE": str(tmp_path / ".cache")})
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["measured"] > 50 * 2**20, figures  # 40,000 calls × 600 tokens: a run large enough to measure
    assert 0.5 <= figures["estimate"] / figures["measured"] <= 2.0, figures


def test_estimate_terms_follow_their_knobs(workdir):
    """Each knob's term grows with its value (so the refusal blames the knob that was raised)."""
    from agentspec_sim.drafters.registry import parse_drafter

    workload = trace_io.load_trace(workdir / "good.jsonl")
    spec = parse_drafter("normal")

    def terms(**changes):
        config = EngineConfig(**changes)
        return run_footprint(workload, spec, config, resolve(config))

    base = terms(num_kv_blocks=1000, max_num_seqs=1)  # one call at a time: steps scale with the copies too
    assert terms(num_kv_blocks=2000, max_num_seqs=1)["num_kv_blocks"] == pytest.approx(2 * base["num_kv_blocks"])
    assert terms(num_kv_blocks=1000, max_num_seqs=1, replicate=4)["replicate"] == pytest.approx(4 * base[None])
    assert terms(num_kv_blocks=1000, max_model_len=10**7)["max_model_len"] > 100 * base["max_num_seqs"]
    assert "max_model_len" not in terms(num_kv_blocks=1000, max_model_len=10**7, max_num_seqs=10**6,
                                        max_num_batched_tokens=10**7)


def test_the_console_script_refuses_at_once(tmp_path):
    """The installed entry point, in a fresh interpreter: the guard fires before the engine is even built."""
    trace = tmp_path / "good.jsonl"
    trace.write_text(jsonl(META, call(0), call(1)))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "replay", str(trace), "--replicate",
                           "1000000000"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "300", "AGENTSPEC_SIM_CACHE": str(tmp_path / "c")})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("error: --replicate:") and len(done.stderr.strip().splitlines()) == 1
    assert time.monotonic() - start < 60
