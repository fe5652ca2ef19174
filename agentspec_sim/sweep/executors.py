"""Where a sweep's cells run: in this process, in local worker processes, or on a Ray cluster.

Executors register by name (`register_executor`) and share one contract, so `run_sweep` has a
single code path whichever runs the cells:

    with make_executor(name, jobs, workload, task, address) as executor:  # workers start here
        for index, row in executor.run(cells):                             # slowest-first order in
            ...                                                            # any order out

Pre:  `task(workload, cell)` is a module-level function (it travels to workers by reference) and
      returns the cell's row; `cells` come in the order they should start.
Post: `run` yields `(index into cells, row)` exactly once per cell; a cell whose task raises ends
      the run with `SweepError` naming the cell; leaving the `with` block, normally or by any
      exception (KeyboardInterrupt included), stops every worker the executor started.

Every worker loads the workload once, from a `WorkloadSource`: local workers read the trace file
(the loader's content-hash cache makes that a cache read), Ray actors get the file's bytes (a few
MB) from the object store. Neither gets the loaded Workload pickled: its calls are views into one
token arena that pickle would copy call by call (507 MiB for the default trace, whose arena is
21 MB). Local workers are spawned, not forked: polars' thread pool (used by every run's summary)
deadlocks in a child forked after the parent used it, which a resumed sweep always has.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from agentspec_sim.sweep.cells import Cell, SweepError
from agentspec_sim.trace.schema import Workload

Task = Callable[[Workload, Cell], dict[str, Any]]
EXECUTORS: dict[str, type[CellExecutor]] = {}


@dataclass
class WorkloadSource:
    """How a worker gets the sweep's workload: `loaded` in this process; elsewhere the trace file at
    `path`, or its bytes in `data` (a worker on another machine, or standard input's trace: `stdin`), or
    `given` (a Workload the caller built in memory, the one case it is pickled whole)."""

    path: str
    skip_bad_lines: bool = False
    loaded: Workload | None = field(default=None, repr=False)
    given: bool = False
    data: bytes | None = field(default=None, repr=False)
    stdin: bool = False  # `data` is standard input's trace: parsed as it is, never through the file cache

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if not self.given:
            state["loaded"] = None  # the worker loads it itself (see the module docstring)
        return state

    @classmethod
    def from_stdin(cls, skip_bad_lines: bool = False) -> WorkloadSource:
        """The trace on standard input: its bytes travel to every worker (a spawned worker's stdin is not the
        parent's), each parses them uncached, and errors name `<stdin>`."""
        from agentspec_sim.trace.io import STDIN_NAME, read_stdin_bytes

        return cls(STDIN_NAME, skip_bad_lines, data=read_stdin_bytes(), stdin=True)

    def with_bytes(self) -> WorkloadSource:
        """A copy that carries the trace file's bytes, for workers that cannot read `path`."""
        return self if self.given or self.data is not None else replace(self, data=Path(self.path).read_bytes())

    def load(self) -> Workload:
        from agentspec_sim.trace.io import load_trace, parse_trace_bytes

        if self.loaded is None and self.stdin:
            self.loaded = parse_trace_bytes(self.data or b"", self.path, skip_bad_lines=self.skip_bad_lines)
        if self.loaded is None:
            path = Path(self.path)
            if self.data is not None:
                # Same bytes, same name → the same file each time, so the loader's cache hits after the first.
                digest = hashlib.sha256(self.data).hexdigest()[:16]
                from agentspec_sim.trace.cache import cache_root

                path = cache_root() / "sweep-traces" / digest / Path(self.path).name
                if not path.exists():
                    from agentspec_sim.io.atomic import write_bytes_atomic

                    write_bytes_atomic(path, self.data, sync=False)
            self.loaded = load_trace(path, skip_bad_lines=self.skip_bad_lines)
        return self.loaded


def register_executor(name: str) -> Callable[[type[CellExecutor]], type[CellExecutor]]:
    def decorate(cls: type[CellExecutor]) -> type[CellExecutor]:
        cls.name = name
        EXECUTORS[name] = cls
        return cls

    return decorate


def make_executor(name: str, jobs: int | None, source: WorkloadSource, task: Task, address: str | None = None
                  ) -> CellExecutor:
    """The executor registered as `name`; `process` with one job runs the cells in this process."""
    if name not in EXECUTORS:
        raise SweepError(f"unknown executor {name!r} (known: {', '.join(sorted(EXECUTORS))})")
    if jobs is not None and jobs < 1:
        raise SweepError(f"jobs must be ≥ 1, got {jobs}")
    if address is not None and name != "ray":
        raise SweepError("--address is for --executor ray")
    if name == "process" and jobs == 1:
        name = "inline"
    return EXECUTORS[name](jobs, source, task, address)


def _failure(cell: Cell, message: str) -> SweepError:
    return SweepError(f"cell {cell.label} at max_num_seqs {cell.config.max_num_seqs} on {cell.config.hardware}/"
                      f"{cell.config.model}, seed {cell.config.seed} failed: {message}")


class CellExecutor:
    """Base of the executors: the context-manager protocol above."""

    name: ClassVar[str] = ""

    def __init__(self, jobs: int | None, source: WorkloadSource, task: Task, address: str | None) -> None:
        self.jobs, self.source, self.task, self.address = jobs, source, task, address

    def __enter__(self) -> CellExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, cells: Sequence[Cell]) -> Iterator[tuple[int, dict[str, Any]]]:
        raise NotImplementedError


@register_executor("inline")
class InlineExecutor(CellExecutor):
    """One cell after another in this process (`-j 1`)."""

    def run(self, cells: Sequence[Cell]) -> Iterator[tuple[int, dict[str, Any]]]:
        workload = self.source.load()
        for index, cell in enumerate(cells):
            try:
                row = self.task(workload, cell)
            except Exception as exc:
                raise _failure(cell, f"{type(exc).__name__}: {exc}") from exc
            yield index, row


def _die_with_parent() -> None:
    # Linux: a worker gets SIGKILL when its parent dies, even by SIGKILL, instead of finishing its cell
    # as an orphan. PR_SET_PDEATHSIG = 1.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _keep_freed_memory() -> None:
    # A worker runs cell after cell, each allocating and freeing the same few hundred MB (suffix trees, step
    # logs). glibc returns large blocks to the kernel when they are freed (mmap'd chunks, heap trimming), so
    # every cell paid again to fault in and zero fresh pages: ~1 s of system time per suffix cell on the
    # default trace. Taking large blocks from the heap and never trimming it keeps those pages for the next
    # cell; a worker stays at its largest cell's size.
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's mallopt parameters
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None)
            libc.mallopt(m_mmap_max, 0)
            libc.mallopt(m_trim_threshold, 2**31 - 1)


def _process_worker(conn: Any, source: WorkloadSource, task: Task) -> None:
    """A worker process: receive `(index, cell)`, send back `(index, ok, row or message)`; None ends it."""
    _die_with_parent()
    _keep_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stop at once when the parent terminates the worker
    try:
        try:
            workload, failed = source.load(), None
        except Exception as exc:  # reported with the first cell, as one line, not a worker traceback
            workload, failed = None, f"loading the trace failed: {type(exc).__name__}: {exc}"
        while (message := conn.recv()) is not None:
            index, cell = message
            if failed is not None:
                conn.send((index, False, failed))
                continue
            try:
                reply = (index, True, task(workload, cell))
            except Exception as exc:
                reply = (index, False, f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone


@register_executor("process")
class ProcessExecutor(CellExecutor):
    """`jobs` local worker processes (default: one per CPU), spawned; each loads the workload once
    from the `WorkloadSource` and is fed one cell at a time in the given order."""

    def __enter__(self) -> ProcessExecutor:
        import multiprocessing as mp

        context = mp.get_context("spawn")
        self.workers: list[tuple[Any, Any]] = []
        try:
            for _ in range(self.jobs or os.cpu_count() or 1):
                parent_end, child_end = context.Pipe()
                process = context.Process(target=_process_worker, args=(child_end, self.source, self.task),
                                          daemon=True, name="agentspec-sim sweep worker")
                process.start()
                child_end.close()
                self.workers.append((process, parent_end))
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        for process, conn in self.workers:
            conn.close()
            if process.is_alive():
                process.terminate()
        for process, _ in self.workers:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()

    def run(self, cells: Sequence[Cell]) -> Iterator[tuple[int, dict[str, Any]]]:
        from multiprocessing.connection import wait

        pending = deque(enumerate(cells))
        busy: dict[Any, tuple[Any, int]] = {}  # connection → (process, index of its cell)

        def feed(process: Any, conn: Any) -> None:
            if pending:
                index, cell = pending.popleft()
                conn.send((index, cell))
                busy[conn] = (process, index)

        for process, conn in self.workers:
            feed(process, conn)
        while busy:
            sentinels = {process.sentinel: conn for conn, (process, _) in busy.items()}
            for ready in wait([*busy, *sentinels]):
                conn = sentinels.get(ready, ready)
                if conn not in busy:
                    continue  # handled via its other handle in this round
                process, index = busy[conn]
                try:
                    if not conn.poll():  # the sentinel fired and nothing was sent: the worker died mid-cell
                        raise EOFError
                    got, ok, payload = conn.recv()
                except EOFError:
                    process.join(1)
                    raise _failure(cells[index], f"its worker process died (exit code {process.exitcode})") from None
                if not ok:
                    raise _failure(cells[got], payload)
                del busy[conn]
                feed(process, conn)
                yield got, payload


class _RayWorker:
    """A Ray actor holding the workload; runs one cell per call."""

    def __init__(self, source: WorkloadSource, task: Task) -> None:
        self.workload, self.task = source.load(), task

    def run(self, index: int, cell: Cell) -> tuple[int, bool, Any]:
        try:
            return index, True, self.task(self.workload, cell)
        except Exception as exc:
            return index, False, f"{type(exc).__name__}: {exc}"


@register_executor("ray")
class RayExecutor(CellExecutor):
    """Ray actors (default: one per CPU of the cluster) on the cluster at `address` (None: start a
    local Ray instance, or use the one already initialised). Ray is the optional extra `ray`."""

    def __enter__(self) -> RayExecutor:
        try:
            import ray
        except ImportError:
            raise SweepError("--executor ray needs Ray: pip install 'agentspec-sim[ray]'") from None
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            import logging

            ray.init(address=self.address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                     **({} if self.address else {"num_cpus": self.jobs or os.cpu_count() or 1}))
        jobs = self.jobs or max(1, int(ray.cluster_resources().get("CPU", 1)))
        source_ref = ray.put(self.source.with_bytes())  # nodes need not see the trace's path
        actor = ray.remote(num_cpus=1)(_RayWorker)
        self.actors = [actor.remote(source_ref, self.task) for _ in range(jobs)]
        return self

    def __exit__(self, *exc: object) -> None:
        for actor in getattr(self, "actors", []):
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        if self.owns_ray:
            self.ray.shutdown()

    def run(self, cells: Sequence[Cell]) -> Iterator[tuple[int, dict[str, Any]]]:
        pending = deque(enumerate(cells))
        busy: dict[Any, Any] = {}  # object ref → actor

        def feed(actor: Any) -> None:
            if pending:
                index, cell = pending.popleft()
                busy[actor.run.remote(index, cell)] = actor

        for actor in self.actors:
            feed(actor)
        while busy:
            (ref,), _ = self.ray.wait(list(busy), num_returns=1)
            actor = busy.pop(ref)
            try:
                index, ok, payload = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                raise SweepError(f"a Ray worker failed: {exc}") from None
            if not ok:
                raise _failure(cells[index], payload)
            feed(actor)
            yield index, payload
