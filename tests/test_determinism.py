"""Determinism (invariant DETERMINISM): the same trace, config and seed give byte-identical outputs.

Runs the command line twice in separate processes (fresh interpreters: no state shared through
module caches, hash seeds or numba's compilation) on a bundled trace with seeded Poisson arrivals,
replicated tenants and several drafters, and compares the --json -o document and the --steps parquet
byte for byte; a different seed must change the arrivals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentspec_sim.trace.bundled import bundled_trace


def replay(tmp_path, name: str, seed: int) -> tuple[bytes, bytes]:
    out, steps = tmp_path / f"{name}.json", tmp_path / f"{name}.parquet"
    env = {**os.environ, "PYTHONHASHSEED": str(abs(hash(name)) % 1000)}  # differ on purpose
    proc = subprocess.run(
        [sys.executable, "-m", "agentspec_sim.cli", "replay", str(bundled_trace("swe-agent.jsonl.zst")),
         "--drafter", "normal,ngram,suffix,agentspec", "--rate", "4", "--replicate", "2", "--max-num-seqs", "16",
         "--seed", str(seed), "--json", "-o", str(out), "--steps", str(steps), "--check-invariants"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(out.read_text())
    return out.read_bytes(), steps.read_bytes()


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    return replay(tmp_path_factory.mktemp("det"), "first", seed=11)


def test_same_seed_gives_byte_identical_json_and_parquet(first, tmp_path):
    again = replay(tmp_path, "second", seed=11)
    assert again[0] == first[0], "replay --json -o differs between two runs with the same seed"
    assert again[1] == first[1], "replay --steps parquet differs between two runs with the same seed"


def test_another_seed_changes_the_arrivals(first, tmp_path):
    other = replay(tmp_path, "other", seed=12)
    assert other[0] != first[0] and other[1] != first[1]
    runs = json.loads(first[0])["runs"]
    assert [r["drafter"] for r in runs] == ["normal", "ngram", "suffix", "agentspec"]
    assert all("wall_s" not in r for r in runs)  # host timing would break byte identity
