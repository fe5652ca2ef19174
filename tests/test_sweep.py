"""`run_sweep` / `agentspec-sim sweep`: the grid, the result schema, -j 2 = -j 1, resume after SIGKILL,
interrupts (SIGTERM, Ctrl-C) that write what is complete, failures that name the cell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from simhelpers import agent_query

from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.metrics import summarize
from agentspec_sim.run.simulation import simulate
from agentspec_sim.sweep import KEY_COLUMNS, SweepError, read_results, run_sweep
from agentspec_sim.sweep.cells import Cell, drafter_configs, estimated_cost, expand_cells, parse_grid, start_order
from agentspec_sim.sweep.results import LATENCIES, journal_path
from agentspec_sim.trace.io import load_trace, write_records


def write_trace(path: Path, queries: int, calls: int, out_len: int, seed: int = 0) -> Path:
    """An agent trace whose outputs repeat earlier context (so n-gram drafters accept some tokens)."""
    rng = np.random.default_rng(seed)
    records: list[dict] = [{"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 1000}]
    for q in range(queries):
        for c in agent_query(rng, f"q{q}", calls, prompt_len=60, out_len=out_len, append=6, vocab=12):
            records.append({"type": "call", "id": c.id, "agent_id": 0, "query_id": c.query_id, "seq": c.seq,
                            "prompt_tokens": c.prompt_tokens.tolist(), "output_tokens": c.output_tokens.tolist()})
    write_records(records, path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_trace(tmp_path_factory.mktemp("sweep") / "tiny.jsonl", queries=4, calls=3, out_len=24)


def _sans_wall(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.drop("wall_s")


def test_grid_labels_and_keys():
    specs = drafter_configs(["ngram", "suffix"], ['{"method": "ngram", "num_speculative_tokens": 2, '
                                                  '"prompt_lookup_min": 2}'],
                            parse_grid(["num_speculative_tokens=1,3", "prompt_lookup_max=2,3"]))
    labels = [s.name for s in specs]
    assert labels[0] == "normal"  # always, first
    # prompt_lookup_max only crosses the configurations that accept it (ngram), k crosses all.
    assert "ngram k=1 prompt_lookup_max=2" in labels and "suffix k=3" in labels
    assert not any("prompt_lookup" in label for label in labels if label.startswith("suffix"))
    # The JSON config at prompt_lookup_max=2 is ngram 2..2 again: the same configuration runs once.
    assert len(labels) == 1 + 4 + 2 + 2 and len(set(labels)) == len(labels)
    ngram = next(s for s in specs if s.name == "ngram k=3 prompt_lookup_max=2")
    assert ngram.to_json()["num_speculative_tokens"] == 3 and ngram.prompt_lookup_max == 2
    assert ngram.prompt_lookup_min == 2  # vLLM: the max given alone copies into the min
    assert "ngram k=1 n=2..3" in labels  # a JSON configuration crossed with the grid: described in full
    with pytest.raises(SweepError, match="no drafter in the sweep accepts"):
        drafter_configs(["suffix"], (), parse_grid(["prompt_lookup_max=2"]))
    with pytest.raises(SweepError, match="KEY=V1"):
        parse_grid(["num_speculative_tokens"])


def test_cell_ids_and_order():
    specs = drafter_configs(["ngram"])
    a = expand_cells("t.jsonl", specs, [1, 4], ["a100-80g"], ["qwen3-8b"], [0, 1])
    b = expand_cells("t.jsonl", specs, [1, 4], ["a100-80g"], ["qwen3-8b"], [0, 1])
    assert [c.cell_id for c in a] == [c.cell_id for c in b] and len({c.cell_id for c in a}) == len(a) == 8
    other = expand_cells("t.jsonl", specs, [1, 4], ["a100-80g"], ["qwen3-8b"], [0, 1], EngineConfig(rate=2.0,
                                                                                                   arrival="poisson"))
    assert not {c.cell_id for c in a} & {c.cell_id for c in other}  # other engine settings: other cells
    # Slowest first: small batches (more steps) and drafters that see every step.
    cost = {(s.name, b): estimated_cost(Cell("t", s, EngineConfig(max_num_seqs=b)), 10_000, 64)
            for s in specs for b in (1, 64)}
    assert cost[("ngram", 1)] > cost[("ngram", 64)] and cost[("ngram", 1)] > cost[("normal", 1)]
    # A drafter with an acceptance band runs (or searches) three times: at its point and at the band's bounds.
    eagle = parse_drafter("eagle3")
    point = estimated_cost(Cell("t", eagle, EngineConfig(max_num_seqs=8)), 10_000, 64)
    plain = estimated_cost(Cell("t", drafter_configs(["normal"])[0], EngineConfig(max_num_seqs=8)), 10_000, 64)
    assert point > 2.5 * plain


def test_cells_that_build_a_table_start_one_per_table_first():
    """Slowest first, but the first cell of each table-building configuration (suffix, ngram, agentspec)
    before the second of any: two workers starting at once build two tables instead of one waiting for the
    other; a drafter without a table (normal) keeps its place."""
    specs = drafter_configs(["normal", "ngram", "suffix", "agentspec"])
    cells = expand_cells("t.jsonl", specs, [1, 8, 64], ["a100-80g"], ["qwen3-8b"], [0])
    order = start_order(cells, 2_000_000, 250)
    assert sorted(c.cell_id for c in order) == sorted(c.cell_id for c in cells)
    assert [c.label for c in order[:3]] == ["suffix", "ngram", "agentspec"]
    ranked = sorted(cells, key=lambda c: -estimated_cost(c, 2_000_000, 250))
    assert [c.label for c in ranked[:2]] == ["suffix", "suffix"]  # what slowest-first alone would start
    assert order[3:] == [c for c in ranked if c not in order[:3]]  # the others keep slowest-first
    plain = expand_cells("t.jsonl", drafter_configs(["normal", "ngram"]), [1, 8], ["a100-80g"], ["qwen3-8b"], [0])
    assert start_order(plain, 2_000_000, 250) == sorted(plain, key=lambda c: -estimated_cost(c, 2_000_000, 250))


def test_rows_match_simulate_and_schema(tiny, tmp_path):
    out = tmp_path / "r.parquet"
    frame = run_sweep(tiny, ["ngram"], max_num_seqs=[1, 4], output=out, jobs=1)
    assert frame.columns[:len(KEY_COLUMNS)] == list(KEY_COLUMNS) and frame.columns[-1] == LATENCIES
    assert frame.height == 4 and not journal_path(out).exists()
    assert read_results(out).equals(frame)
    workload = load_trace(tiny)
    for b in (1, 4):
        config = EngineConfig(max_num_seqs=b)
        base = simulate(workload, "normal", config)
        run = simulate(workload, "ngram", config)
        want = summarize(run, base).to_row()
        got = frame.filter((pl.col("max_num_seqs") == b) & (pl.col("drafter") == "ngram")).to_dicts()[0]
        for key, value in want.items():
            if key != "wall_s":
                assert got[key] == (pytest.approx(value) if key == "speedup" else value), key
        completed = run.queries.filter(pl.col("completed"))["latency_s"].to_list()
        assert got[LATENCIES] == completed and len(completed) == got["completed_queries"]
        assert got["trace"] == str(tiny) and json.loads(got["speculative_config"])["method"] == "ngram"
    assert frame.filter(pl.col("drafter") == "normal")["speedup"].to_list() == [1.0, 1.0]


def test_parallel_equals_serial(tiny, tmp_path):
    args = dict(drafters=["ngram", "suffix"], grid={"num_speculative_tokens": [2, 4]}, max_num_seqs=[1, 2, 8])
    serial = run_sweep(tiny, jobs=1, output=tmp_path / "j1.parquet", **args)
    # A workload given in memory reaches the workers pickled; the CLI tests below cover workers that
    # load the trace file themselves.
    parallel = run_sweep(tiny, jobs=2, output=tmp_path / "j2.parquet", workload=load_trace(tiny), **args)
    assert serial.height == 15
    assert _sans_wall(serial).equals(_sans_wall(parallel))


def test_interrupt_writes_what_is_complete_then_resume(tiny, tmp_path):
    out = tmp_path / "r.parquet"
    args = dict(drafters=["ngram"], max_num_seqs=[1, 2, 4], output=out, jobs=1)

    def stop_after_three(done, total, row):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(tiny, progress=stop_after_three, **args)
    partial = read_results(out)
    assert partial.height == 3 and not journal_path(out).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["r.parquet"]  # no temporary files left
    seen = []
    full = run_sweep(tiny, resume=True, progress=lambda d, t, row: seen.append(row), **args)
    assert len([r for r in seen if r is not None]) == 3  # only the missing cells ran
    assert _sans_wall(full).equals(_sans_wall(run_sweep(tiny, **{**args, "output": tmp_path / "ref.parquet"})))
    kept = full.join(partial, on="cell_id").select("wall_s", "wall_s_right")
    assert kept["wall_s"].to_list() == kept["wall_s_right"].to_list()  # finished cells were not re-run


def test_torn_journal_line_is_dropped(tiny, tmp_path):
    out = tmp_path / "r.parquet"
    args = dict(drafters=["ngram"], max_num_seqs=[1, 2], output=out, jobs=1)
    ref = run_sweep(tiny, **args)
    lines = [json.dumps(row) for row in ref.to_dicts()]
    out.unlink()
    journal_path(out).write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    seen = []
    again = run_sweep(tiny, resume=True, progress=lambda d, t, row: seen.append(row), **args)
    assert len([r for r in seen if r is not None]) == 2 and again.height == 4
    assert _sans_wall(again).equals(_sans_wall(ref))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentspec_sim.cli", *args]


def _wait_for_lines(path: Path, count: int, process: subprocess.Popen, limit_s: float = 120) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        lines = path.read_bytes().count(b"\n") if path.exists() else 0
        if lines >= count:
            return lines
        if process.poll() is not None:
            pytest.fail(f"the sweep ended before {count} cells were journaled: {process.stderr.read().decode()}")
        time.sleep(0.02)
    pytest.fail("the sweep journaled too slowly")


@pytest.fixture(scope="module")
def slow_trace(tmp_path_factory) -> Path:
    # 12 cells of ~1.8 CPU-seconds in all, slowest first: after the second is journaled, about
    # 0.7 s of work is left on two workers, so a kill then lands mid-way.
    return write_trace(tmp_path_factory.mktemp("slow") / "slow.jsonl", queries=8, calls=4, out_len=160, seed=1)


SWEEP_ARGS = ("--drafter", "ngram,suffix", "--max-num-seqs", "1,2,4,8", "-j", "2", "-q")


def test_sigkill_then_resume_gives_the_uninterrupted_results(slow_trace, tmp_path):
    out = tmp_path / "killed.parquet"
    process = subprocess.Popen(_cli("sweep", str(slow_trace), "-o", str(out), *SWEEP_ARGS), stderr=subprocess.PIPE)
    try:
        journaled = _wait_for_lines(journal_path(out), 2, process)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    assert not out.exists() and journaled < 12  # killed mid-way: only the journal holds finished cells
    kept = [json.loads(line) for line in journal_path(out).read_text().splitlines()]
    resumed = subprocess.run(_cli("sweep", str(slow_trace), "-o", str(out), "--resume", *SWEEP_ARGS),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    # The uninterrupted reference, in this process (-j 1 writes what -j 2 writes: test_parallel_equals_serial).
    want = run_sweep(slow_trace, ["ngram", "suffix"], max_num_seqs=[1, 2, 4, 8], jobs=1)
    got = read_results(out)
    assert got.height == 12 and got["cell_id"].n_unique() == 12  # no lost, no duplicated cells
    assert _sans_wall(got).equals(_sans_wall(want))
    walls = dict(zip(got["cell_id"], got["wall_s"], strict=True))
    assert all(walls[row["cell_id"]] == row["wall_s"] for row in kept)  # the journaled cells were kept, not re-run
    assert not journal_path(out).exists()


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_writes_finished_cells_and_exits_128_plus_it(slow_trace, tmp_path, signum, code):
    out = tmp_path / "termed.parquet"
    process = subprocess.Popen(_cli("sweep", str(slow_trace), "-o", str(out), *SWEEP_ARGS), stderr=subprocess.PIPE)
    try:
        _wait_for_lines(journal_path(out), 2, process)
        process.send_signal(signum)
        got = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
    err = process.stderr.read().decode().strip()
    assert got == code, err
    assert len(err.splitlines()) == 1 and "--resume" in err and "Traceback" not in err
    partial = read_results(out)
    assert 2 <= partial.height < 12 and partial["cell_id"].n_unique() == partial.height
    assert sorted(p.name for p in tmp_path.iterdir()) == ["termed.parquet"]  # journal and temporaries gone


def test_cli_table(tiny, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentspec_sim.cli.app import app

    monkeypatch.setenv("COLUMNS", "300")  # the caption line holds a long temporary path
    out = tmp_path / "r.parquet"
    result = CliRunner().invoke(app, ["sweep", str(tiny), "-o", str(out), "--drafter", "ngram", "--max-num-seqs",
                                      "1,2", "-j", "1"])
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output and "ngram" in result.output and f"4 cells in {out}" in result.output
    assert read_results(out).height == 4


def test_bad_input_is_one_error_line(tiny, tmp_path):
    for args, words in ((["--grid", "num_speculative_tokens"], "KEY=V1"), (["--max-num-seqs", "0,2"], "≥ 1"),
                        (["--hardware", "no-such-gpu"], "no-such-gpu"), (["--drafter", "nope"], "nope")):
        result = subprocess.run(_cli("sweep", str(tiny), "-o", str(tmp_path / "x.parquet"), *args),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(SweepError, match="not a sweep results file"):
        pl.DataFrame({"a": [1]}).write_parquet(tmp_path / "other.parquet")
        read_results(tmp_path / "other.parquet")


# -- a drafter that fails, to check a failing cell is named and the finished ones are kept
from agentspec_sim.drafters.registry import register_drafter  # noqa: E402
from agentspec_sim.engine.drafting import BaseDrafter  # noqa: E402


@register_drafter("test-broken")
class BrokenDrafter(BaseDrafter):
    def propose(self, rows, max_lens):
        raise RuntimeError("broken on purpose")


def test_a_failing_cell_is_named_and_finished_cells_are_kept(tiny, tmp_path):
    out = tmp_path / "r.parquet"
    # Slowest first: suffix (finishes), then the broken cell (fails); normal never starts.
    with pytest.raises(SweepError, match=r"cell test-broken k=2 at max_num_seqs 2 .*broken on purpose"):
        run_sweep(tiny, ["suffix"], speculative_configs=['{"method": "test-broken", "num_speculative_tokens": 2}'],
                  max_num_seqs=[2], output=out, jobs=1)
    assert not journal_path(out).exists()
    kept = read_results(out)
    assert kept["drafter"].to_list() == ["suffix"] and kept["speedup"].to_list() == [None]


def test_a_failing_cell_in_a_worker_process_is_named(tiny, tmp_path):
    # A KV cache too small for the trace's calls fails every cell, inside the workers.
    with pytest.raises(SweepError, match=r"cell (normal|ngram) at max_num_seqs [12] .*SimulationError"):
        run_sweep(tiny, ["ngram"], max_num_seqs=[1, 2], engine=EngineConfig(num_kv_blocks=3),
                  output=tmp_path / "r.parquet", jobs=2)
    assert list(tmp_path.iterdir()) == []  # no cell finished: nothing written, no journal left


def test_ray_missing_is_one_clear_error(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the `ray` extra were not installed
    with pytest.raises(SweepError, match=r"needs Ray: pip install 'agentspec-sim\[ray\]'"):
        run_sweep(tiny, ["ngram"], max_num_seqs=[1], executor="ray")


@pytest.mark.extra("ray")
def test_ray_executor_matches_inline(tiny, tmp_path):
    pytest.importorskip("ray")
    args = dict(drafters=["ngram"], max_num_seqs=[1, 4])
    inline = run_sweep(tiny, jobs=1, **args)
    on_ray = run_sweep(tiny, jobs=2, executor="ray", **args)
    assert _sans_wall(inline).equals(_sans_wall(on_ray))


def _capacity_args() -> dict:
    from agentspec_sim.capacity import CapacitySearch
    from agentspec_sim.slo import LatencySLO

    return dict(drafters=["ngram"], max_num_seqs=[1, 4],
                capacity=CapacitySearch(LatencySLO(ttft_s=0.1, tpot_s=0.02), tolerance=0.1))


def test_capacity_searches_on_worker_processes_equal_inline(tiny):
    inline = run_sweep(tiny, jobs=1, **_capacity_args())
    workers = run_sweep(tiny, jobs=2, **_capacity_args())
    assert inline["capacity_probes"].min() >= 2
    assert _sans_wall(inline).equals(_sans_wall(workers))


@pytest.mark.extra("ray")
def test_capacity_searches_on_ray_equal_inline(tiny):
    pytest.importorskip("ray")
    inline = run_sweep(tiny, jobs=1, **_capacity_args())
    on_ray = run_sweep(tiny, jobs=2, executor="ray", **_capacity_args())
    assert _sans_wall(inline).equals(_sans_wall(on_ray))


def test_process_workers_do_not_outlive_a_killed_parent(slow_trace, tmp_path):
    out = tmp_path / "orphans.parquet"
    process = subprocess.Popen(_cli("sweep", str(slow_trace), "-o", str(out), *SWEEP_ARGS), stderr=subprocess.PIPE)
    try:
        _wait_for_lines(journal_path(out), 1, process)
        children = _children(process.pid)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    assert children  # the workers were there
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    if not path.exists():
        pytest.skip("needs Linux /proc")
    return [int(x) for x in path.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z" and os.path.exists(f"/proc/{pid}")
