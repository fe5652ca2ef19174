"""Call a compiled kernel step after step without numba's per-call argument typing.

Numba's dispatcher types every argument of every call to pick the compiled overload: ~6 µs for the
scheduler's `run_steps`, whose arguments are a dozen named tuples of arrays — as much as a whole
engine step of a small batch. The engine passes the same containers call after call (they change
only when a buffer grows), so `FastCall` resolves the overload once per set of containers and then
calls its compiled entry point directly (~1 µs). Anything new — another container object, or a
scalar of another Python type — goes through the dispatcher again, which compiles if it must; an
overload that cannot be matched exactly keeps every call on the dispatcher. Results are the same
either way: it is the same compiled function.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import is_, itemgetter
from typing import Any


class FastCall:
    """`dispatcher(*args)` with the overload resolved once per set of containers.

    The arguments at positions `containers` must be objects the caller keeps (named tuples of arrays,
    arrays): they are compared by identity. The others must be Python scalars: compared by type.
    """

    __slots__ = ("_containers", "_dispatcher", "_entry", "_held", "_pick", "_pick_scalars", "_scalar_types")

    def __init__(self, dispatcher: Any, containers: tuple[int, ...]) -> None:
        self._dispatcher = dispatcher
        self._containers = containers
        self._pick = _picker(containers)
        self._pick_scalars = _picker(())
        self._held: tuple[Any, ...] = ()
        self._scalar_types: tuple[type, ...] = ()
        self._entry: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        entry = self._entry
        if (entry is not None and all(map(is_, self._pick(args), self._held))
                and all(map(is_, map(type, self._pick_scalars(args)), self._scalar_types))):
            return entry(*args)
        result = self._dispatcher(*args)  # compiles if needed
        if not hasattr(self._dispatcher, "overloads"):  # a plain function (a test's stand-in): nothing to resolve
            return result
        signature = tuple(self._dispatcher.typeof_pyval(a) for a in args)
        overload = self._dispatcher.overloads.get(signature)
        self._pick_scalars = _picker(tuple(i for i in range(len(args)) if i not in self._containers))
        self._held = self._pick(args)
        self._scalar_types = tuple(map(type, self._pick_scalars(args)))
        self._entry = overload.entry_point if overload is not None else None
        return result


def _picker(positions: tuple[int, ...]) -> Callable[[tuple], tuple]:
    """args → the tuple of the args at `positions` (`itemgetter`, but always a tuple)."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        one = itemgetter(positions[0])
        return lambda args: (one(args),)
    return lambda args: ()
