"""Every library module imports on its own, in a fresh interpreter.

pytest imports modules in its own order, so an import cycle can hide behind a module another test
imported first (`analyze redundancy` once failed on every input in a fresh process: analysis.redundancy →
drafters.agentspec → block_index → engine → engine.simulator → drafters.agentspec). Here a child process
loads only the third-party libraries, then forks once per module: each fork imports that one module of
ours first and alone, as a user's script or a command would.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import pytest

import agentspec_sim

if not hasattr(os, "fork"):
    pytest.skip("needs os.fork to import each module in a fresh interpreter cheaply", allow_module_level=True)

# The child: third-party imports once (shared by every fork), then one fork per module of ours.
CHILD = r"""
import importlib, json, os, sys, traceback
import numpy, numba, polars, rich, scipy, typer  # noqa: F401  (what every module of ours may use)
failures = {}
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-4000:])
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failures[name] = message or f"exit status {status}"
print(json.dumps(failures))
"""


def library_modules() -> list[str]:
    """Every module of the installed package, the folders installed under it (cli, traces, validation) too."""
    names = [m.name for m in pkgutil.walk_packages(agentspec_sim.__path__, "agentspec_sim.")]
    for package in ("agentspec_sim.cli", "agentspec_sim.validation"):
        module = __import__(package, fromlist=["__path__"])
        names += [m.name for m in pkgutil.walk_packages(module.__path__, f"{package}.")]
    return sorted(set(names) - {"agentspec_sim.cli.__main__"})  # __main__ runs the app


def test_every_module_imports_first_and_alone():
    modules = library_modules()
    assert "agentspec_sim.analysis.redundancy" in modules and "agentspec_sim.cli.replay" in modules
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(modules)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "\n\n".join(f"{name}:\n{message}" for name, message in failures.items())
