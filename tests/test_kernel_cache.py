"""Where compiled kernels are cached (agentspec_sim/host/kernel_cache.py): a checkout in its own __pycache__; an
installed copy in a per-user folder named by its sources' hash, so a second install of the same sources compiles
nothing and an install of other sources never reads them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from agentspec_sim.host import kernel_cache

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkout_keeps_numbas_own_place(monkeypatch):
    import agentspec_sim.engine.kv as kv

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert kernel_cache.is_checkout()
    assert kernel_cache.shared_cache_dir(kv.__file__) is None
    assert kernel_cache.cache_dir(kv.__file__) == Path(kv.__file__).parent / "__pycache__"


def test_an_installed_copy_uses_the_shared_folder_of_its_sources(monkeypatch, tmp_path):
    import agentspec_sim.engine.kv as kv

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(kernel_cache, "is_checkout", lambda: False)
    monkeypatch.setenv(kernel_cache.KERNEL_CACHE_ENV, str(tmp_path))
    expected = tmp_path / kernel_cache.sources_hash() / "agentspec_sim" / "engine"
    assert kernel_cache.shared_cache_dir(kv.__file__) == expected == kernel_cache.cache_dir(kv.__file__)
    assert kernel_cache.shared_cache_dir(__file__) is None  # not the package's: numba's own place
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    assert kernel_cache.shared_cache_dir(kv.__file__) is None  # the user's choice wins


PROBE = r"""
import sys
import numpy as np
import agentspec_sim  # installs the locator before numba reads its configuration
from agentspec_sim.engine import drafts
from agentspec_sim.host.kernel_cache import cache_dir, is_compiled
before = is_compiled(drafts.verify)
drafts.verify(np.zeros(3, dtype=np.int32), np.zeros(5, dtype=np.int32), 0, 5)  # compiles (or loads) it
print(before, is_compiled(drafts.verify), cache_dir(drafts.__file__), drafts.__file__)
"""


@pytest.mark.skipif(not hasattr(sys, "executable"), reason="needs a Python to start")
def test_a_second_install_of_the_same_sources_compiles_nothing(tmp_path):
    first, second, shared = tmp_path / "site1", tmp_path / "site2", tmp_path / "kernels"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(first),
                    str(ROOT)], check=True, capture_output=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    shutil.copytree(first, second)

    def probe(site: Path) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
        env.update(PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
                   AGENTSPEC_SIM_KERNEL_CACHE=str(shared))
        done = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    before, after, where, source = probe(first)
    assert (before, after) == ("False", "True") and source.startswith(str(first))
    assert Path(where).is_relative_to(shared) and list(Path(where).glob("drafts.verify-*.nbi"))
    assert not list((first / "agentspec_sim" / "engine" / "__pycache__").glob("*.nbi"))
    before, after, where2, source = probe(second)
    assert before == "True" and where2 == where and source.startswith(str(second))  # nothing to compile
    # Other sources (one byte changed): another folder, compiled afresh.
    drafts_py = second / "agentspec_sim" / "engine" / "drafts.py"
    drafts_py.write_text(drafts_py.read_text() + "\n# changed\n")
    before, after, where3, _ = probe(second)
    assert before == "False" and after == "True" and where3 != where


def test_other_versions_kernels_go_once_stale(monkeypatch, tmp_path):
    import time

    monkeypatch.setattr(kernel_cache, "sources_hash", lambda: "current")
    old = time.time() - (kernel_cache.STALE_DAYS + 1) * 86400
    for i in range(kernel_cache.KEEP_SOURCES + 2):  # older versions, the most recent first
        folder = tmp_path / f"v{i}"
        folder.mkdir()
        os.utime(folder, (old - i, old - i))
    recent = tmp_path / "recent"
    recent.mkdir()
    assert kernel_cache._in_use.__wrapped__(tmp_path) == tmp_path / "current"
    kept = sorted(p.name for p in tmp_path.iterdir())
    # this version, the recent one, and the most recently used stale ones up to KEEP_SOURCES in all besides it
    assert kept == sorted(["current", "recent", *(f"v{i}" for i in range(kernel_cache.KEEP_SOURCES - 2))])
