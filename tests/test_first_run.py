"""A first run says what it is doing: the one-time kernel compile is announced, and progress shows as
plain lines when stderr is a pipe or a log (a live bar cannot redraw there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from agentspec_sim.host.kernel_cache import is_compiled


def test_is_compiled_reads_numbas_cache_index(tmp_path):
    (tmp_path / "tiny_kernel.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return 2 * x
    """))
    probe = textwrap.dedent("""
        import sys
        from agentspec_sim.host.kernel_cache import is_compiled
        import tiny_kernel
        before = is_compiled(tiny_kernel.twice)
        tiny_kernel.twice(3)
        print(before, is_compiled(tiny_kernel.twice))
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert first.stdout.split() == ["False", "True"]  # compiled during the first process
    again = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert again.stdout.split() == ["True", "True"]  # a later process finds it cached
    (tmp_path / "tiny_kernel.py").write_text((tmp_path / "tiny_kernel.py").read_text() + "\n# edited\n")
    edited = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert edited.stdout.split()[0] == "False"  # an edited source is stale: numba compiles it again
    assert is_compiled(len) is None  # not a numba function: cannot tell


def _trace(path):
    lines = [json.dumps({"type": "meta", "version": 1, "tokenizer": None, "vocab_size": 50})]
    lines += [json.dumps({"type": "call", "id": f"c{i}", "agent_id": 0, "query_id": i, "seq": 0,
                          "prompt_tokens": list(range(1, 20)), "output_tokens": list(range(5, 15))})
              for i in range(3)]
    path.write_text("\n".join(lines) + "\n")


def test_piped_replay_shows_progress_as_lines(tmp_path):
    trace = tmp_path / "t.jsonl"
    _trace(trace)
    env = {**os.environ, "AGENTSPEC_SIM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "replay", str(trace), "--drafter", "ngram"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    err = [line for line in done.stderr.splitlines() if not line.startswith("compiling")]
    assert err[0].startswith("normal: 0/3 calls (") and err[1].startswith("finished normal: 3 calls in ")
    assert err[2].startswith("ngram: 0/3 calls (") and err[3].startswith("finished ngram: 3 calls in ")
    assert "\x1b[" not in done.stderr  # no terminal control sequences in a log


def test_the_first_compile_is_announced_once(tmp_path, monkeypatch, capsys):
    import agentspec_sim.run.simulation as engine_run
    from agentspec_sim.cli.app import app
    from agentspec_sim.cli.errors import run_guarded

    trace = tmp_path / "t.jsonl"
    _trace(trace)
    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path / "cache"))
    for compiled in (False, True):
        monkeypatch.setattr(engine_run, "kernels_compiled", lambda compiled=compiled: compiled)
        monkeypatch.setattr(sys, "argv", ["agentspec-sim", "replay", str(trace), "--json"])
        assert run_guarded(app) == 0
        err = capsys.readouterr().err
        notices = [line for line in err.splitlines() if line.startswith("compiling the simulator's kernels")]
        assert len(notices) == (0 if compiled else 1), err
