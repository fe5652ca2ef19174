"""Interrupts: Ctrl-C (SIGINT) or SIGTERM during `agentspec-sim replay` writes the runs that finished, leaves
no partial or temporary file, and exits 130 / 143 with one line saying what was written."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import polars as pl
import pytest
from simhelpers import PROGRESS_LINE, not_progress

from agentspec_sim.cli.errors import Interrupted, exit_code_for_signal, interrupt_signals
from agentspec_sim.trace.bundled import bundled_trace

# `normal` over 60 copies of the SWE-agent trace finishes in well under a second; agentspec over them
# takes many seconds: the signal lands in the second run.
LONG_REPLAY = ["replay", str(bundled_trace("swe-agent.jsonl.zst")), "--replicate", "60",
               "--drafter", "normal,agentspec"]


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentspec_sim.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def interrupt_after_first_run(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    seen = []
    while not (line := proc.stderr.readline()).startswith("finished normal"):  # progress lines come first
        assert line and PROGRESS_LINE.match(line.rstrip("\n")), "".join(seen) + line + proc.stderr.read()
        seen.append(line)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize(("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                   (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_signal_writes_finished_runs_and_no_partial_file(tmp_path, sig, code, word):
    out, steps = tmp_path / "summary.json", tmp_path / "steps.parquet"
    proc = start([*LONG_REPLAY, "-o", str(out), "--steps", str(steps)])
    returncode, err = interrupt_after_first_run(proc, sig)
    assert returncode == code, err
    lines = not_progress(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == f"{word}; wrote the 1 finished run(s) (normal) to {steps} and {out}"
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and [r["drafter"] for r in document["runs"]] == ["normal"]
    assert set(pl.read_parquet(steps)["drafter"].unique()) == {"normal"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.parquet", "summary.json"]  # no .tmp left


def test_signal_without_outputs_says_what_finished(tmp_path):
    proc = start(LONG_REPLAY)
    returncode, err = interrupt_after_first_run(proc, signal.SIGTERM)
    assert returncode == 143
    assert err.strip() == "terminated (SIGTERM); finished runs: normal (nothing written: no --output or --steps)"


def test_interrupt_signals_raise_once_and_restore_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info, interrupt_signals() as handler:
        signal.raise_signal(signal.SIGTERM)
    assert info.value.signum == signal.SIGTERM and handler.raised is info.value
    assert signal.getsignal(signal.SIGTERM) is before
    assert exit_code_for_signal(signal.SIGINT) == 130 and exit_code_for_signal(signal.SIGTERM) == 143


def test_an_interrupted_atomic_write_leaves_nothing(tmp_path):
    from agentspec_sim.io.atomic import atomic_text

    target = tmp_path / "out.json.gz"
    with pytest.raises(KeyboardInterrupt), atomic_text(target) as f:
        f.write("half of it")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
