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

Every worker holds the workload loaded once: local worker processes receive the parent's loaded
workload once, when they start; Ray actors get it once from the object store. Local workers are
spawned, not forked: polars' thread pool (used by every run's summary) deadlocks in a child forked
after the parent used it, which a resumed sweep always has (it reads the old results first).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from agentspec_sim.sweep.cells import Cell, SweepError
from agentspec_sim.trace.schema import Workload

Task = Callable[[Workload, Cell], dict[str, Any]]
EXECUTORS: dict[str, type[CellExecutor]] = {}


def register_executor(name: str) -> Callable[[type[CellExecutor]], type[CellExecutor]]:
    def decorate(cls: type[CellExecutor]) -> type[CellExecutor]:
        cls.name = name
        EXECUTORS[name] = cls
        return cls

    return decorate


def make_executor(name: str, jobs: int | None, workload: Workload, task: Task, address: str | None = None
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
    return EXECUTORS[name](jobs, workload, task, address)


def _failure(cell: Cell, message: str) -> SweepError:
    return SweepError(f"cell {cell.label} at max_num_seqs {cell.config.max_num_seqs} on {cell.config.hardware}/"
                      f"{cell.config.model}, seed {cell.config.seed} failed: {message}")


class CellExecutor:
    """Base of the executors: the context-manager protocol above."""

    name: ClassVar[str] = ""

    def __init__(self, jobs: int | None, workload: Workload, task: Task, address: str | None) -> None:
        self.jobs, self.workload, self.task, self.address = jobs, workload, task, address

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
        for index, cell in enumerate(cells):
            try:
                row = self.task(self.workload, cell)
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


def _process_worker(conn: Any, workload: Workload, task: Task) -> None:
    """A worker process: receive `(index, cell)`, send back `(index, ok, row or message)`; None ends it."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stop at once when the parent terminates the worker
    try:
        while (message := conn.recv()) is not None:
            index, cell = message
            try:
                reply = (index, True, task(workload, cell))
            except Exception as exc:
                reply = (index, False, f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone


@register_executor("process")
class ProcessExecutor(CellExecutor):
    """`jobs` local worker processes (default: one per CPU), spawned with the loaded workload, each
    fed one cell at a time in the given order."""

    def __enter__(self) -> ProcessExecutor:
        import multiprocessing as mp

        context = mp.get_context("spawn")
        self.workers: list[tuple[Any, Any]] = []
        try:
            for _ in range(self.jobs or os.cpu_count() or 1):
                parent_end, child_end = context.Pipe()
                process = context.Process(target=_process_worker, args=(child_end, self.workload, self.task),
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

    def __init__(self, workload: Workload, task: Task) -> None:
        self.workload, self.task = workload, task

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
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                     **({} if self.address else {"num_cpus": self.jobs or os.cpu_count() or 1}))
        jobs = self.jobs or max(1, int(ray.cluster_resources().get("CPU", 1)))
        workload_ref = ray.put(self.workload)
        actor = ray.remote(num_cpus=1)(_RayWorker)
        self.actors = [actor.remote(workload_ref, self.task) for _ in range(jobs)]
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
