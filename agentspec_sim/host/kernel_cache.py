"""Numba's on-disk cache of the package's compiled functions: where it lives, and keeping it honest.

Where. In a checkout (the package's folder has the project's pyproject.toml beside it) numba's own place: each
module's `__pycache__`. In an installed copy (pip install, wheel, --target) a per-user folder shared by every
install of the same sources, so a fresh install of a version this machine has run before compiles nothing:
`AGENTSPEC_SIM_KERNEL_CACHE`, else ~/.cache/agentspec-sim/kernels, then one folder per content hash of the
package's Python sources (`SourceCacheLocator`). A changed source — any file of the package — is another
hash, so another folder: nothing compiled for other sources is ever read. NUMBA_CACHE_DIR, when set, wins
(numba's own locator), as does a cache folder that cannot be written (numba's fallbacks).

Honest.
Numba decides whether a cached compiled function is stale by looking at the file that defines it,
and nothing else. The engine's kernels call compiled functions of other files (scheduler.py's call
kv.py's; batched.py's call drafters/ngram/rule.py's `ngram_match`), and numba compiles those callees into
the caller's cache entry: an edit of kv.py alone would leave scheduler.py's cached machine code
running the old kv.py. `clear_if_changed` keeps, next to a module's cache entries, a stamp of the
sources it depends on, and deletes that module's entries when the stamp no longer matches, so numba
compiles them afresh.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # agentspec_sim/
KERNEL_CACHE_ENV = "AGENTSPEC_SIM_KERNEL_CACHE"


def install_locator() -> None:
    """Put `SourceCacheLocator` first among numba's cache locators, without importing numba (the package's
    `__init__` calls this): at once if numba's caching module is loaded, else as it loads (an import hook)."""
    caching = sys.modules.get("numba.core.caching")
    if caching is not None:
        _prepend(caching)
    elif not any(isinstance(finder, _CachingHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CachingHook())


def _prepend(caching) -> None:
    # The class is CacheImpl in numba 0.68, _CacheImpl in older ones.
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if impl is None:  # a numba this does not know: its own locators
        return
    locators = impl._locator_classes
    if not any(getattr(cls, "__name__", "") == "SourceCacheLocator" for cls in locators):
        locators.insert(0, __getattr__("SourceCacheLocator"))


class _CachingHook:
    """Finds nothing itself; when numba.core.caching is imported, runs `_prepend` right after it loads."""

    def find_spec(self, name, path=None, target=None):
        if name != "numba.core.caching":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_prepend(module) -> None:
            exec_module(module)
            _prepend(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_and_prepend
        return spec


def is_checkout() -> bool:
    """The package runs from a source checkout (its pyproject.toml beside it), not from an installed copy."""
    return (PACKAGE_ROOT.parent / "pyproject.toml").is_file()


@functools.cache
def sources_hash() -> str:
    """Content hash of every Python source of the installed package (names and bytes), 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def shared_cache_dir(py_file: str | Path) -> Path | None:
    """The per-user cache folder of an installed copy's module `py_file` (module docstring), None where numba's
    own place applies (a checkout, NUMBA_CACHE_DIR, a file outside the package)."""
    if os.environ.get("NUMBA_CACHE_DIR") or is_checkout():
        return None
    path = Path(py_file).resolve()
    if PACKAGE_ROOT not in path.parents:
        return None
    root = os.environ.get(KERNEL_CACHE_ENV) or str(Path.home() / ".cache" / "agentspec-sim" / "kernels")
    return _in_use(Path(root)) / path.parent.relative_to(PACKAGE_ROOT.parent)


KEEP_SOURCES = 4  # source versions whose kernels stay however old
STALE_DAYS = 30  # other versions' kernels go once unused this long


@functools.cache
def _in_use(root: Path) -> Path:
    """This version's folder under `root`, marked used now; other versions' folders unused for STALE_DAYS go,
    the KEEP_SOURCES most recently used aside (once per process: the first compiled function asks)."""
    here = root / sources_hash()
    with contextlib.suppress(OSError):  # an unwritable folder: numba's locator finds that out and falls back
        here.mkdir(parents=True, exist_ok=True)
        os.utime(here)
        others = sorted((p for p in root.iterdir() if p.is_dir() and p != here), key=lambda p: p.stat().st_mtime,
                        reverse=True)
        cutoff = time.time() - STALE_DAYS * 86400
        for old in others[KEEP_SOURCES - 1:]:
            if old.stat().st_mtime < cutoff:
                shutil.rmtree(old, ignore_errors=True)
    return here


def _numba_locator_base() -> tuple[type, ...]:
    from numba.core.caching import _CacheLocator, _SourceFileBackedLocatorMixin

    return _SourceFileBackedLocatorMixin, _CacheLocator


def __getattr__(name: str):
    # The locator subclasses numba's, so it is made when numba first asks for it: importing this module (the
    # package's __init__ does) must not import numba.
    if name != "SourceCacheLocator":
        raise AttributeError(name)
    mixin, base = _numba_locator_base()

    class SourceCacheLocator(mixin, base):
        """numba's locator for the package's functions in an installed copy: the shared per-user folder of its
        sources' hash (`shared_cache_dir`); numba's content stamp per file as always."""

        def __init__(self, py_func, py_file: str, path: Path) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(path)

        def get_cache_path(self) -> str:
            return self._cache_path

        @classmethod
        def from_function(cls, py_func, py_file):
            path = shared_cache_dir(py_file) if os.path.exists(py_file) else None
            if path is None:
                return None
            locator = cls(py_func, py_file, path)
            try:
                locator.ensure_cache_path()
            except OSError:  # not writable: numba's own fallbacks
                return None
            return locator

    globals()["SourceCacheLocator"] = SourceCacheLocator
    return SourceCacheLocator


def cache_dir(module_file: str | Path) -> Path:
    """The folder numba keeps `module_file`'s compiled functions in (as the locators above choose it)."""
    return shared_cache_dir(module_file) or Path(module_file).parent / "__pycache__"


def clear_if_changed(module_file: str, dependencies: Sequence[str], stamp: str = "") -> None:
    """Delete `module_file`'s numba cache entries (in its `__pycache__`) if any of `dependencies`
    (source files whose compiled functions it calls) changed since the entries were written.

    Call it at import time, before the module's compiled functions are first used (`cache_dir`: where).
    `stamp` names one set of dependencies among several kept for the module (a compiled loop that compiles
    in each drafter's step). A cache numba keeps elsewhere (NUMBA_CACHE_DIR, or a folder that cannot be
    written) is left alone.
    """
    module = Path(module_file)
    cache = cache_dir(module)
    digest = hashlib.sha256()
    for dep in dependencies:
        try:
            digest.update(Path(dep).read_bytes())
        except OSError:
            return
    stamp_file = cache / f"{module.stem}{'.' + stamp if stamp else ''}.kernel-deps"
    try:
        if stamp_file.read_text() == digest.hexdigest():
            return
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for entry in list(cache.glob(f"{module.stem}.*.nbi")) + list(cache.glob(f"{module.stem}.*.nbc")):
            entry.unlink(missing_ok=True)
        stamp_file.write_text(digest.hexdigest())
    except OSError:
        return


def package_sources(package: str) -> list[str]:
    """The source files of `package` (a dotted name), sorted: the dependencies of a kernel that compiles in
    whichever of its modules' functions a run picks (engine/scheduler.py `run_steps` and the drafters)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return []
    return sorted(str(path) for path in Path(spec.origin).parent.glob("*.py"))


def is_compiled(dispatcher: object) -> bool | None:
    """Whether numba's on-disk cache holds a current compiled version of `dispatcher` (an `njit(cache=True)`
    function): True, False, or None when that cannot be told (not a caching dispatcher, another numba).

    "Current" is numba's own test: the index exists and was written for today's source file (its stamp)
    and numba version. Reads only the small index file, never the machine code.
    """
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(cache, "_cache_file", None)
    load_index = getattr(index, "_load_index", None)
    if load_index is None:
        return None
    try:
        return bool(load_index())
    except Exception:  # a damaged or foreign index: numba recompiles, and so it is not compiled
        return False
