"""No output ever destroys a file (agentspec_sim/io/outputs.py, agentspec_sim/io/atomic.py, cli/errors.py).

Every command's output is refused when it resolves to one of the command's inputs (by name, through a
symlink, as a hard link, inside an input folder) or has a suffix its writer does not honour; a device
or FIFO is written through, never replaced; a symlink is followed and kept; a failed write (a full disk
on a file, on a device, on standard output) is one line naming the target, and leaves nothing behind;
two sweeps of one output cannot run at once. Most cases run the real entry point in-process
(`run_guarded`, as tests/test_bad_inputs.py does); those where the process's own file descriptors
matter run in a fresh subprocess.
"""

from __future__ import annotations

import errno
import gc
import gzip
import io
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
from simhelpers import not_progress
from test_bad_inputs import GOOD, META, call, jsonl, run_cli

from agentspec_sim.io import atomic
from agentspec_sim.io.atomic import write_json_atomic
from agentspec_sim.io.outputs import Output, OutputError, check_outputs, command_scope
from agentspec_sim.sweep.results import journal_path

FAST = ["--drafter", "normal", "--max-num-seqs", "2"]
REAL_SINK_WRITE = atomic._Sink.write
REAL_OS_WRITE = os.write
SWEEP = ["--drafter", "normal,ngram", "--max-num-seqs", "1,2", "--executor", "inline", "-q"]


@pytest.fixture
def d(tmp_path, monkeypatch) -> Path:
    (tmp_path / "t.jsonl").write_text(GOOD)
    (tmp_path / "chat.jsonl").write_text(jsonl({"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yo"}]}))
    (tmp_path / "c.json").write_text('{"format": "agentspec-sim/cost-calibration", "version": 1, "factors": {}}\n')
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))
    monkeypatch.setenv("COLUMNS", "300")
    return tmp_path


def one_error_line(code: int, err: str) -> str:
    lines = not_progress(err)
    assert code == 2, err
    assert "Traceback" not in err and ".tmp" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry of `folder`: a file's bytes, a link's target, a special file's kind."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.iterdir()):
        if p.is_symlink():
            out[p.name] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[p.name] = p.read_bytes()
        else:
            out[p.name] = stat.filemode(p.lstat().st_mode)
    return out


def make_char_device(path: Path, minor: int) -> Path:
    """A private twin of /dev/null (minor 3) or /dev/full (minor 7); skip where mknod is not allowed."""
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, minor))
    except (OSError, AttributeError) as exc:
        pytest.skip(f"cannot make a character device here: {exc}")
    return path


# -- an output that is an input ---------------------------------------------------------------------


def _links(d: Path) -> None:
    (d / "link.json").symlink_to(d / "t.jsonl")
    os.link(d / "t.jsonl", d / "hard.json")
    (d / "logs").mkdir()
    (d / "logs" / "chat.jsonl").write_text((d / "chat.jsonl").read_text())


REFUSED = [
    pytest.param("replay {d}/t.jsonl -o {d}/t.jsonl", "--output: is the input TRACE", id="replay -o trace"),
    pytest.param("replay {d}/t.jsonl --steps {d}/t.jsonl", "--steps: is the input TRACE", id="replay --steps trace"),
    pytest.param("replay {d}/t.jsonl -o {d}/c.json --calibration {d}/c.json", "is the input --calibration",
                 id="replay -o calibration"),
    pytest.param("replay {d}/t.jsonl -o {d}/link.json", "is the input TRACE", id="symlink to the trace"),
    pytest.param("replay {d}/t.jsonl -o {d}/hard.json", "is the input TRACE", id="hard link to the trace"),
    pytest.param("replay {d}/link.json -o {d}/t.jsonl", "is the input TRACE", id="trace through a symlink"),
    pytest.param("synth --like {d}/t.jsonl -o {d}/t.jsonl --queries 1", "is the input --like", id="synth -o like"),
    pytest.param("convert openai-chat {d}/chat.jsonl -o {d}/chat.jsonl", "is the input INPUT", id="convert -o log"),
    pytest.param("convert openai-chat {d}/logs -o {d}/logs/chat.jsonl", "is inside the input INPUT",
                 id="convert -o inside the log folder"),
    pytest.param("sweep {d}/t.jsonl -o {d}/t.jsonl --max-num-seqs 1", "is the input TRACE", id="sweep -o trace"),
    pytest.param("analyze roles {d}/t.jsonl -o {d}/t.jsonl", "is the input TRACE", id="analyze roles -o trace"),
    pytest.param("analyze redundancy {d}/t.jsonl -o {d}/t.jsonl", "is the input TRACE", id="redundancy -o trace"),
    pytest.param("calibrate cost {d}/c.json -o {d}/c.json", "is the input FILE", id="calibrate cost -o input"),
    pytest.param("calibrate acceptance {d}/t.jsonl -o {d}/t.jsonl", "is the input FILE",
                 id="calibrate acceptance -o input"),
    pytest.param("check --baseline {d}/c.json --junit {d}/c.json", "--junit: is the input --baseline",
                 id="check --junit baseline"),
    pytest.param("report {d}/report.md -o {d}", "is the input RESULTS", id="report folder holding its input"),
    pytest.param("record {d}/t.jsonl --model m -o {d}/t.jsonl", "is the input TRACE", id="record -o trace"),
    pytest.param("validate vllm {d}/t.jsonl --model m -o {d}/t.jsonl", "is the input TRACE", id="validate vllm -o"),
    pytest.param("validate vllm {d}/normal.jsonl --model m --method normal --record-dir {d}",
                 "--record-dir: is the input TRACE", id="validate vllm --record-dir"),
]


@pytest.mark.parametrize(("argv", "fragment"), REFUSED)
def test_an_output_that_is_an_input_is_refused(d, monkeypatch, capsys, argv, fragment):
    _links(d)
    (d / "report.md").write_text("results that happen to be named like the report\n")
    (d / "normal.jsonl").write_text(GOOD)  # a trace named like the file `validate vllm` records for normal
    before = snapshot(d)
    code, _, err = run_cli(argv.format(d=d).split(), monkeypatch, capsys)
    assert fragment in one_error_line(code, err)
    assert snapshot(d) == before  # nothing written, nothing replaced, the links kept


def test_a_folder_output_may_hold_an_input_it_does_not_replace(d):
    results = d / "results.parquet"
    results.write_bytes(b"PAR1")
    check_outputs(Output("--output", d, folder=True, names=("report.md", "*.png")), inputs={"RESULTS": [results]})
    with pytest.raises(OutputError, match="is the input RESULTS"):
        check_outputs(Output("--output", d, folder=True, names=("*.parquet",)), inputs={"RESULTS": [results]})


def test_the_writer_refuses_a_declared_input_it_meets_only_while_writing(d):
    # A folder output's files are known only when written: the atomic writer checks them too.
    trace = d / "t.jsonl"
    with command_scope():
        check_outputs(Output("--output", d / "out", folder=True), inputs={"TRACE": trace})
        with pytest.raises(OutputError, match="is the input TRACE"):
            write_json_atomic(trace, {"overwritten": True})
    assert trace.read_text() == GOOD
    write_json_atomic(d / "free.json", {})  # outside a command nothing is declared


# -- suffixes ---------------------------------------------------------------------------------------


SUFFIXES = [
    pytest.param("replay {d}/t.jsonl -o {d}/r.bz2", "--output", ".json.zst", id="replay -o .bz2"),
    pytest.param("replay {d}/t.jsonl --steps {d}/s.csv", "--steps", ".parquet", id="replay --steps .csv"),
    pytest.param("convert openai-chat {d}/chat.jsonl -o {d}/x.parquet", "--output", ".jsonl.gz", id="convert"),
    pytest.param("synth --like {d}/t.jsonl -o {d}/x.txt --queries 1", "--output", ".jsonl", id="synth"),
    pytest.param("sweep {d}/t.jsonl -o {d}/x.csv --max-num-seqs 1", "--output", ".parquet", id="sweep"),
    pytest.param("analyze roles {d}/t.jsonl -o {d}/caps.yaml", "--output", ".json", id="roles"),
    pytest.param("analyze redundancy {d}/t.jsonl -o {d}/fig.jpg", "--output", ".png", id="redundancy"),
    pytest.param("calibrate cost {d}/c.json -o {d}/cal.json.gz", "--output", ".json", id="calibrate cost .gz"),
    pytest.param("check --baseline {d}/c.json --junit {d}/j.json", "--junit", ".xml", id="check --junit"),
]


@pytest.mark.parametrize(("argv", "flag", "accepted"), SUFFIXES)
def test_a_suffix_the_writer_does_not_honour_is_refused(d, monkeypatch, capsys, argv, flag, accepted):
    before = snapshot(d)
    code, _, err = run_cli(argv.format(d=d).split(), monkeypatch, capsys)
    line = one_error_line(code, err)
    assert f"{flag}: '" in line and "is not a format" in line and accepted in line, line
    assert snapshot(d) == before


def test_suffixes_are_honoured(d, monkeypatch, capsys):
    import zstandard

    out, steps = d / "r.json.zst", d / "s.parquet"
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(out), "--steps", str(steps), *FAST],
                           monkeypatch, capsys)
    assert code == 0, err
    document = json.loads(zstandard.ZstdDecompressor().stream_reader(out.open("rb")).read())
    assert document["runs"][0]["drafter"] == "normal"
    assert pl.read_parquet(steps).height > 0


# -- special files and symlinks ---------------------------------------------------------------------


def test_a_device_is_written_through_never_replaced(d, monkeypatch, capsys):
    null = make_char_device(d / "null", 3)
    for argv in (["replay", str(d / "t.jsonl"), "--steps", str(null), "-o", str(d / "r.json"), *FAST],
                 ["replay", str(d / "t.jsonl"), "-o", str(null), *FAST],
                 ["sweep", str(d / "t.jsonl"), "-o", str(null), *SWEEP]):
        code, _, err = run_cli(argv, monkeypatch, capsys)
        assert code == 0, err
        assert stat.S_ISCHR(null.lstat().st_mode) and null.stat().st_rdev == os.makedev(1, 3)
    # No journal, lock or temporary file beside a device.
    assert sorted(p.name for p in d.iterdir()) == ["c.json", "chat.jsonl", "null", "r.json", "t.jsonl"]


def test_resume_into_a_device_is_refused(d, monkeypatch, capsys):
    null = make_char_device(d / "null", 3)
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(null), "--resume", *SWEEP], monkeypatch, capsys)
    assert "not a regular file" in one_error_line(code, err)


def test_a_fifo_is_written_through(d, monkeypatch, capsys):
    fifo = d / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(fifo), *FAST], monkeypatch, capsys)
    reader.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert json.loads(received[0])["runs"][0]["drafter"] == "normal"


def test_a_symlink_is_followed_and_kept(d, monkeypatch, capsys):
    (d / "real").mkdir()
    target = d / "real" / "r.json"
    target.write_text("old\n")
    target.chmod(0o640)
    link = d / "r.json"
    link.symlink_to(target)
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(link), *FAST], monkeypatch, capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["runs"][0]["drafter"] == "normal"  # the file it points to, rewritten
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # and its permissions kept
    assert sorted(p.name for p in (d / "real").iterdir()) == ["r.json"]


def test_a_symlink_without_a_suffix_writes_its_targets_format(d, monkeypatch, capsys):
    target = d / "summary.json.gz"
    target.write_bytes(b"")
    link = d / "latest"  # no suffix of its own: the file it points to says the format
    link.symlink_to(target)
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(link), *FAST], monkeypatch, capsys)
    assert code == 0, err
    assert link.is_symlink() and json.loads(gzip.decompress(target.read_bytes()))["runs"][0]["drafter"] == "normal"
    (d / "plain").symlink_to(d / "notes.txt")
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(d / "plain"), *FAST], monkeypatch, capsys)
    assert "'.txt' is not a format --output writes" in one_error_line(code, err)


def test_a_symlink_loop_is_refused(d, monkeypatch, capsys):
    (d / "a.json").symlink_to(d / "b.json")
    (d / "b.json").symlink_to(d / "a.json")
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(d / "a.json"), *FAST], monkeypatch, capsys)
    assert "a.json: a loop of symlinks, not a file to write" in one_error_line(code, err)
    assert os.readlink(d / "a.json") == str(d / "b.json")


# -- failed writes ----------------------------------------------------------------------------------


@pytest.fixture
def disk_full_at(monkeypatch):
    """disk_full_at(name): every write of the atomic writer to the output `name` fails with ENOSPC after
    the first 100 bytes (as a file system filling up mid-write)."""

    real = REAL_SINK_WRITE

    def arm(name: str) -> None:
        def write(self, data):
            if Path(self.name).name == name and not self.discard:
                self.written = getattr(self, "written", 0) + len(data)
                if self.written > 100:
                    self.error = self.error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    raise self.error
            return real(self, data)

        monkeypatch.setattr(atomic._Sink, "write", write)

    return arm


FULL = [
    pytest.param("replay {d}/t.jsonl --steps {d}/s.parquet", "s.parquet", "--steps", id="replay --steps (polars)"),
    pytest.param("replay {d}/t.jsonl -o {d}/r.json", "r.json", "--output", id="replay -o"),
    pytest.param("replay {d}/t.jsonl -o {d}/r.json.gz", "r.json.gz", "--output", id="replay -o gzip"),
    pytest.param("synth --like {d}/t.jsonl -o {d}/s.jsonl.xz --queries 40", "s.jsonl.xz", "--output", id="synth"),
]


@pytest.mark.parametrize(("argv", "name", "flag"), FULL)
def test_a_full_disk_is_one_line_and_leaves_nothing(d, monkeypatch, capsys, disk_full_at, argv, name, flag):
    (d / name).write_bytes(b"an earlier result\n")  # kept as it was
    before = snapshot(d)
    disk_full_at(name)
    extra = FAST if argv.startswith("replay") else []
    code, _, err = run_cli([*argv.format(d=d).split(), *extra], monkeypatch, capsys)
    gc.collect()  # an abandoned compressor or text layer must not complain when collected
    err += capsys.readouterr().err
    line = one_error_line(code, err)
    assert f"{name}: {flag}: cannot write: No space left on device; nothing was written" in line, line
    assert snapshot(d) == before  # the input and the old output untouched; no temporary file left


def test_a_sweep_whose_results_cannot_be_written_keeps_its_journal_for_resume(d, monkeypatch, capsys, disk_full_at):
    out = d / "s.parquet"
    disk_full_at("s.parquet")
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(out), *SWEEP], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "s.parquet: --output: cannot write: No space left on device" in line, line
    assert "4 finished cell(s) kept in" in line and "s.parquet.partial: rerun with --resume" in line, line
    assert sorted(p.name for p in d.iterdir()) == ["c.json", "chat.jsonl", "s.parquet.partial", "t.jsonl"]
    journaled = {row["cell_id"]: row["wall_s"] for row in map(json.loads, journal_path(out).read_text().splitlines())}
    monkeypatch.setattr(atomic._Sink, "write", REAL_SINK_WRITE)
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(out), "--resume", *SWEEP], monkeypatch, capsys)
    assert code == 0, err
    written = pl.read_parquet(out)
    assert dict(zip(written["cell_id"], written["wall_s"], strict=True)) == journaled  # no cell ran again
    assert not journal_path(out).exists()


def test_a_full_device_is_one_line(d, monkeypatch, capsys):
    full = make_char_device(d / "full", 7)
    for argv in (["replay", str(d / "t.jsonl"), "--steps", str(full), *FAST],
                 ["sweep", str(d / "t.jsonl"), "-o", str(full), *SWEEP]):
        code, _, err = run_cli(argv, monkeypatch, capsys)
        assert "full: " in one_error_line(code, err) and "No space left on device" in err
        assert stat.S_ISCHR(full.lstat().st_mode)


def test_an_unwritable_folder_is_refused_before_the_work(d, monkeypatch, capsys):
    # As root every folder is writable: refuse access to one, as a read-only mount would.
    locked = d / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real_access(p, mode, **kw))
    code, _, err = run_cli(["replay", str(d / "t.jsonl"), "--steps", str(locked / "new" / "s.parquet"), *FAST],
                           monkeypatch, capsys)
    line = one_error_line(code, err)
    assert f"--steps: cannot write in {locked}" in line and "finished" not in err  # no run started
    assert list(locked.iterdir()) == []


def _journal_fails(monkeypatch, journal: Path, after_lines: int) -> None:
    """os.write to the sweep journal fails with ENOSPC once it holds `after_lines` lines (half a line lands)."""
    real = REAL_OS_WRITE

    def write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name == str(journal) and journal.read_bytes().count(b"\n") >= after_lines:
            real(fd, bytes(data)[: len(data) // 2])  # a torn line, as a disk filling up mid-write leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_journal_that_cannot_grow_stops_the_sweep_and_keeps_the_finished_cells(d, monkeypatch, capsys):
    out = d / "s.parquet"
    _journal_fails(monkeypatch, journal_path(out), after_lines=2)
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(out), *SWEEP], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "s.parquet: --output: cannot write its journal" in line and "rerun with --resume" in line, line
    assert pl.read_parquet(out).height == 3  # the finished cells (the third's line tore; its row is kept)
    assert sorted(p.name for p in d.iterdir()) == ["c.json", "chat.jsonl", "s.parquet", "t.jsonl"]


def test_when_nothing_can_be_written_an_intact_journal_is_kept_for_resume(d, monkeypatch, capsys, disk_full_at):
    out = d / "s.parquet"
    _journal_fails(monkeypatch, journal_path(out), after_lines=2)
    disk_full_at("s.parquet")
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(out), *SWEEP], monkeypatch, capsys)
    line = one_error_line(code, err)
    assert "kept in" in line and "s.parquet.partial: rerun with --resume" in line, line
    assert sorted(p.name for p in d.iterdir()) == ["c.json", "chat.jsonl", "s.parquet.partial", "t.jsonl"]
    kept = journal_path(out).read_text()
    assert kept.endswith("\n") and len([json.loads(x) for x in kept.splitlines()]) == 2  # the torn line cut back
    monkeypatch.setattr(os, "write", REAL_OS_WRITE)
    monkeypatch.setattr(atomic._Sink, "write", REAL_SINK_WRITE)
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(out), "--resume", *SWEEP], monkeypatch, capsys)
    assert code == 0, err
    assert pl.read_parquet(out).height == 4 and not journal_path(out).exists()


# -- standard output --------------------------------------------------------------------------------


class _FailingStdout(io.TextIOWrapper):
    """A stdout on a private file whose writes fail with `error` (ENOSPC, EPIPE…)."""

    def __init__(self, path: Path, error: int) -> None:
        super().__init__(open(path, "wb"), encoding="utf-8")  # noqa: SIM115 (closed by the test's end)
        self.errno = error

    def write(self, text):
        raise OSError(self.errno, os.strerror(self.errno))


@pytest.mark.parametrize("argv", [["inspect", "{d}/t.jsonl", "--json"], ["inspect", "{d}/t.jsonl"],
                                  ["replay", "{d}/t.jsonl", "--json", *FAST]], ids=["json", "table", "replay json"])
def test_a_full_stdout_is_one_line(d, monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "stdout", _FailingStdout(d / "stdout", errno.ENOSPC))
    code, _, err = run_cli([a.format(d=d) for a in argv], monkeypatch, capsys)
    assert one_error_line(code, err) == "error: standard output: No space left on device"


def test_a_closed_pipe_on_stdout_ends_quietly(d, monkeypatch, capsys):
    for argv in (["inspect", str(d / "t.jsonl"), "--json"], ["inspect", str(d / "t.jsonl")]):
        monkeypatch.setattr(sys, "stdout", _FailingStdout(d / "stdout", errno.EPIPE))
        code, _, err = run_cli(argv, monkeypatch, capsys)
        assert code == 1 and err == "", err


def test_a_full_stdout_in_a_real_process(d):
    """fd 1 on a /dev/full twin: the error is one line and the interpreter's final flush stays quiet."""
    full = make_char_device(d / "full", 7)
    for args in (["inspect", str(d / "t.jsonl"), "--json"], ["replay", str(d / "t.jsonl"), *FAST]):
        with full.open("wb") as stdout:
            proc = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", *args], stdout=stdout,
                                  stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
        assert one_error_line(proc.returncode, proc.stderr) == "error: standard output: No space left on device"


def test_a_closed_stdout_is_one_line_when_there_is_something_to_print(d):
    closed = ["sh", "-c", 'exec "$0" "$@" >&-', sys.executable, "-m", "agentspec_sim.cli"]
    proc = subprocess.run([*closed, "inspect", str(d / "t.jsonl"), "--json"], capture_output=True, text=True,
                          timeout=120)
    assert one_error_line(proc.returncode, proc.stderr) == "error: standard output: Bad file descriptor"
    proc = subprocess.run([*closed, "synth", "--like", str(d / "t.jsonl"), "--queries", "1", "-o", str(d / "s.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (d / "s.jsonl").exists(), proc.stderr  # nothing for stdout: no error


# -- one sweep per output ---------------------------------------------------------------------------


def test_a_sweeps_journal_and_lock_destroy_no_file(d, monkeypatch, capsys):
    trace = d / "s.parquet.lock"  # a trace where the sweep's lock file would go
    trace.write_text(GOOD)
    code, _, err = run_cli(["sweep", str(trace), "-o", str(d / "s.parquet"), *SWEEP], monkeypatch, capsys)
    assert "s.parquet.lock: is the input TRACE" in one_error_line(code, err)
    assert trace.read_text() == GOOD
    (d / "notes.txt").write_text("keep me\n")
    (d / "s.parquet.partial").symlink_to(d / "notes.txt")  # a link where the journal would go
    code, _, err = run_cli(["sweep", str(d / "t.jsonl"), "-o", str(d / "s.parquet"), *SWEEP], monkeypatch, capsys)
    assert "s.parquet.partial is in the way of its journal" in one_error_line(code, err)
    assert (d / "notes.txt").read_text() == "keep me\n" and (d / "s.parquet.partial").is_symlink()


def test_a_second_sweep_of_the_same_output_is_refused_at_once(d, monkeypatch, capsys):
    trace = d / "long.jsonl"
    trace.write_text(jsonl(META, *[call(i, output_tokens=[4, 5, 6] * 200) for i in range(12)]))
    out = d / "s.parquet"
    # ~3 s of cells (inline: in the first process itself) after its journal appears; the second sweep runs
    # in this process, where nothing is left to import, so it meets the first one mid-way.
    args = ["sweep", str(trace), "-o", str(out), "-q", "--executor", "inline", "--drafter", "normal,ngram,suffix",
            "--max-num-seqs", "1,2,4", "--replicate", "6"]
    first = subprocess.Popen([sys.executable, "-m", "agentspec_sim.cli", *args], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not journal_path(out).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code, _, err = run_cli(args, monkeypatch, capsys)
        # The first is still running: the second was refused at once, it did not wait for the lock.
        assert first.poll() is None, "the first sweep ended before the second one started"
        line = one_error_line(code, err)
        assert line.startswith(f"error: {out}: --output: another process is writing it now"), line
        assert first.wait(120) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    assert pl.read_parquet(out).height == 9  # every cell of the first sweep
    assert sorted(p.name for p in d.iterdir()) == ["c.json", "chat.jsonl", "long.jsonl", "s.parquet", "t.jsonl"]


def test_gzip_output_is_byte_identical_across_runs(d, monkeypatch, capsys):
    # Same input, same bytes, whatever the output's name (no name nor time in the gzip header).
    outputs = []
    for name in ("a.json.gz", "b.json.gz"):
        code, _, err = run_cli(["replay", str(d / "t.jsonl"), "-o", str(d / name), *FAST], monkeypatch, capsys)
        assert code == 0, err
        outputs.append((d / name).read_bytes())
    assert outputs[0] == outputs[1] and json.loads(gzip.decompress(outputs[0]))["runs"]


def test_dash_is_standard_output(d):
    """`-o -` writes to standard output (through it, like any device), for a file or a pipe on the other end."""
    cli = [sys.executable, "-m", "agentspec_sim.cli"]
    env = {**os.environ, "AGENTSPEC_SIM_CACHE": str(d / "cache")}
    piped = subprocess.run([*cli, "synth", "--like", str(d / "t.jsonl"), "--queries", "2", "-o", "-"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout.splitlines()[0])["type"] == "meta" and "wrote -: 2 queries" in piped.stderr
    (d / "log.jsonl").write_text(jsonl({"messages": [{"role": "user", "content": "hi"}], "response": "yo"}))
    with open(d / "out.jsonl", "w") as out:  # standard output a regular file: written through, not replaced
        done = subprocess.run([*cli, "convert", "openai-chat", str(d / "log.jsonl"), "-o", "-"], stdout=out,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads((d / "out.jsonl").read_text().splitlines()[0])["type"] == "meta"
    assert not (d / "-").exists()
