"""Keep numba's on-disk cache of the engine's compiled functions honest.

Numba decides whether a cached compiled function is stale by looking at the file that defines it,
and nothing else. The engine's kernels call compiled functions of other files (scheduler.py's call
kv.py's; batched.py's call drafters/ngram/rule.py's `ngram_match`), and numba compiles those callees into
the caller's cache entry: an edit of kv.py alone would leave scheduler.py's cached machine code
running the old kv.py. `clear_if_changed` keeps, next to a module's cache entries, a stamp of the
sources it depends on, and deletes that module's entries when the stamp no longer matches, so numba
compiles them afresh.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path


def clear_if_changed(module_file: str, dependencies: Sequence[str], stamp: str = "") -> None:
    """Delete `module_file`'s numba cache entries (in its `__pycache__`) if any of `dependencies`
    (source files whose compiled functions it calls) changed since the entries were written.

    Call it at import time, before the module's compiled functions are first used. `stamp` names one set
    of dependencies among several kept for the module (a compiled loop that compiles in each drafter's
    step). A cache numba
    keeps elsewhere (NUMBA_CACHE_DIR, or a read-only install) is left alone.
    """
    module = Path(module_file)
    cache = module.parent / "__pycache__"
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
