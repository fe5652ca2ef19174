"""The sweep results file: its schema, the journal that makes it resumable, and its reader.

Schema (one row per cell; docs/sweep-and-plan.md): the cell's key columns `KEY_COLUMNS`, then every
field of `RunSummary.to_row()` in its order, then the band columns (`agentspec_sim.run.band.COLUMNS`:
`mean_acceptance_length_low`, `…_high`, `goodput_tok_s_low`, …, `speedup_high`; null but for an eagle3/mtp
cell with an acceptance band; absent in files written before bands were recorded), then `engine_config`
(the engine settings every cell shares, as JSON) and `query_latencies_s` (every completed query's
latency). `speedup` (and `speedup_low` / `_high`) is goodput over the goodput of the `normal` cell of the
same (trace, engine config) group, filled in when the rows are written (null while that cell is missing).

Durability: each finished cell is appended to a journal beside the results, `<results>.partial`
(one JSON line, written with one `write` and fsynced), so a killed sweep loses at most the cells in
flight. The parquet file itself is only ever replaced atomically (agentspec_sim.io.atomic): when the
sweep ends, or is interrupted, it is written from every finished row and the journal is removed. A
resumed sweep reads both (the journal wins where both hold a cell) and discards a torn last line.

One writer: a sweep holds an exclusive lock (`<results>.lock`, agentspec_sim.io.outputs.sole_writer) from
before it reads an earlier run until its parquet is written; a second sweep of the same output is
refused at once. A symlinked output's journal and lock sit beside the file it points to; a device or
FIFO output gets the parquet written through at the end, with no journal and no lock (nothing to resume).

A failed write: when the journal cannot be appended to (a full disk, an I/O error), it is cut back to
its last whole line, so it is intact. When the parquet then cannot be written either, the journal is
kept for --resume only if it is intact — whole lines, each fsynced — and removed otherwise; the error
says which. No temporary file and no torn parquet is ever left (io/atomic.py removes its temporary file).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from agentspec_sim.io import outputs, strict_json
from agentspec_sim.io.atomic import atomic_binary, atomic_text
from agentspec_sim.sweep.cells import SweepError

KEY_COLUMNS = ("cell_id", "trace", "drafter", "speculative_config", "max_num_seqs", "hardware", "model", "seed")
LATENCIES = "query_latencies_s"
# The trace file's absolute path when the sweep ran (the `trace` column is the path as given, part of each cell's
# identity): what `report` reads the trace from when it runs in another folder. Absent in older files.
TRACE_FILE = "trace_file"


def trace_file(trace: str) -> str | None:
    """The absolute path of a sweep's trace as given (None for standard input)."""
    from agentspec_sim.trace.io import is_stdin

    return None if is_stdin(trace) else os.path.abspath(trace)


# Under --copies: each trace query's batch time (its copies' send to the last one's finish), for the per-query
# speedup (`speedup_mean_per_query`, agentspec_sim/metrics.py).
BATCH_TIMES = "query_batch_s"
# A capacity search's probes, one list entry per probe (`sweep.run.run_capacity_cell`).
PROBE_COLUMNS = ("probe_rate", "probe_met", "probe_output_tok_s", "probe_ttft_p50", "probe_ttft_p99",
                 "probe_tpot_p50", "probe_tpot_p99", "probe_query_latency_p50", "probe_query_latency_p99",
                 "probe_seed", "probe_tenants", "probe_served_share", "probe_stopped_s")
# The engine settings the sweep's cells share, as JSON (`Cell.engine_config`); absent in files written before
# it was recorded.
ENGINE_CONFIG = "engine_config"
_FIXED_DTYPES: dict[str, pl.DataType] = {
    "cell_id": pl.Utf8(), "trace": pl.Utf8(), "drafter": pl.Utf8(), "speculative_config": pl.Utf8(),
    "max_num_seqs": pl.Int64(), "hardware": pl.Utf8(), "model": pl.Utf8(), "seed": pl.Int64(),
    "speedup": pl.Float64(), ENGINE_CONFIG: pl.Utf8(), LATENCIES: pl.List(pl.Float64()), TRACE_FILE: pl.Utf8(),
    BATCH_TIMES: pl.List(pl.Float64()), "speedup_mean_per_query": pl.Float64(),
    "capacity_rate": pl.Float64(), "capacity_per_gpu": pl.Float64(), "capacity_vs_normal": pl.Float64(),
    "capacity_bracket_low": pl.Float64(), "capacity_bracket_high": pl.Float64(), "capacity_low": pl.Float64(),
    "capacity_high": pl.Float64(), "capacity_at_least": pl.Float64(), "capacity_inconclusive": pl.Utf8(),
    "capacity_output_tok_s": pl.Float64(), "capacity_seed_rates": pl.List(pl.Float64()),
    "capacity_band_low": pl.Float64(), "capacity_band_high": pl.Float64(),
    **{name: pl.List(pl.Float64()) for name in PROBE_COLUMNS}, "probe_stable": pl.List(pl.Boolean()),
}
Row = dict[str, Any]


def journal_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".partial")


def fill_speedups(rows: Sequence[Row], baseline_of: Mapping[str, str]) -> list[Row]:
    """Rows with `speedup` = goodput / goodput of their group's `normal` row (None where that row is
    missing or its goodput is 0), and likewise `speedup_low` / `speedup_high` from `goodput_tok_s_low` /
    `_high` (the band's runs, agentspec_sim.run.band) in rows that have those columns. `baseline_of` maps each
    cell_id to its group's normal cell_id."""
    goodput = {row["cell_id"]: row["goodput_tok_s"] for row in rows}
    by_id = {row["cell_id"]: row for row in rows}
    capacity = {row["cell_id"]: _capacity(row) for row in rows if "capacity_rate" in row}
    out = []
    for row in rows:
        base = goodput.get(baseline_of.get(row["cell_id"], ""))
        filled = {**row, "speedup": (row["goodput_tok_s"] / base) if base else None}
        if BATCH_TIMES in row:  # --copies: the mean over queries of normal's batch time over this one's
            from agentspec_sim.metrics import speedup_mean_per_query

            base_row = by_id.get(baseline_of.get(row["cell_id"], ""))
            mine = _times(row[BATCH_TIMES])
            theirs = (_times(base_row[BATCH_TIMES]) if base_row is not None and base_row.get(BATCH_TIMES) is not None
                      else None)
            filled["speedup_mean_per_query"] = (speedup_mean_per_query(mine, theirs) if theirs is not None
                                                and theirs.shape == mine.shape else None)
        if "capacity_rate" in row:  # a capacity search's row: its capacity over normal's
            mine, theirs = _capacity(row), capacity.get(baseline_of.get(row["cell_id"], ""))
            filled["capacity_vs_normal"] = (mine / theirs if theirs and math.isfinite(mine / theirs) else None)
        for bound in ("low", "high"):
            if f"goodput_tok_s_{bound}" in row:
                value = row[f"goodput_tok_s_{bound}"]
                filled[f"speedup_{bound}"] = value / base if base and value is not None else None
        out.append(filled)
    return out


def _times(values: Sequence[float | None]) -> np.ndarray:
    """A list column of seconds (null: a batch that did not complete) as floats, NaN for null."""
    return np.array([np.nan if x is None else x for x in values], dtype=float)


def _capacity(row: Row) -> float:
    """A row's capacity for comparing drafters (NaN: inconclusive, no figure to compare)."""
    return math.nan if row.get("capacity_inconclusive") else float(row.get("capacity_rate") or 0.0)


def to_frame(rows: Sequence[Row]) -> pl.DataFrame:
    """Rows → a DataFrame with the fixed dtypes for key columns; all-null columns become Float64."""
    if not rows:
        return pl.DataFrame(schema={name: _FIXED_DTYPES.get(name, pl.Float64()) for name in KEY_COLUMNS})
    columns = list(dict.fromkeys(name for row in rows for name in row))  # union, first-seen order
    frame = pl.DataFrame([{c: row.get(c) for c in columns} for row in rows], infer_schema_length=None)
    casts = [pl.col(name).cast(dtype) for name, dtype in _FIXED_DTYPES.items() if name in frame.columns]
    casts += [pl.col(name).cast(pl.Float64) for name, dtype in frame.schema.items()
              if dtype == pl.Null and name not in _FIXED_DTYPES]
    return frame.with_columns(casts)


def write_results(path: str | Path, rows: Sequence[Row]) -> pl.DataFrame:
    """Write `rows` (already in their final order) as the results parquet, atomically."""
    frame = to_frame(rows)
    with atomic_binary(path, compress=False) as out:
        frame.write_parquet(out)
    return frame


def read_results(path: str | Path) -> pl.DataFrame:
    """A sweep's results file as a DataFrame (the schema above); SweepError if it is not one."""
    path = Path(path)
    if not path.exists():
        raise SweepError(f"{path}: no such file")
    if path.is_dir():
        raise SweepError(f"{path}: is a directory, not a results file")
    try:
        frame = pl.read_parquet(path)
    except (pl.exceptions.ComputeError, OSError) as exc:
        if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
            raise
        raise SweepError(f"{path}: not a parquet file ({exc})") from None
    missing = [c for c in (*KEY_COLUMNS, "goodput_tok_s", "speedup", LATENCIES) if c not in frame.columns]
    if missing:
        raise SweepError(f"{path}: not a sweep results file (missing column(s) {', '.join(missing)})")
    return frame


class ResultStore:
    """The results parquet and its journal for one sweep run.

    `lock()` makes the output this process's (released by `close` / `abort`); `previous()` reads what
    an earlier run left (parquet, then journal); `open(kept)` starts the journal with the rows being
    kept; `append(row)` records one finished cell durably; `close(rows)` writes the parquet and removes
    the journal; `abort(rows)`, after a failure, writes what finished and keeps the journal only where
    the parquet could not be written and the journal is intact. Nothing is ever written to the
    parquet's own name except by an atomic replace (or, for a device or FIFO, written through once).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        real = Path(os.path.realpath(self.path))  # a symlink: the journal and lock go beside its file
        self.journaled = not outputs.is_special(self.path)  # a device or FIFO: no journal, nothing to resume
        self.journal = journal_path(real)
        self._lock_path = real.with_name(real.name + ".lock")
        self._lock: contextlib.ExitStack | None = None
        self._fd: int | None = None
        self._whole = 0  # bytes of whole, fsynced lines in the journal
        self._lines = 0  # and how many lines
        self._intact = True

    def lock(self) -> None:
        """Refuse at once (OutputError) if another process is writing this output; else hold it."""
        if not self.journaled or self._lock is not None:
            return
        if os.path.islink(self.journal) or (os.path.lexists(self.journal) and not self.journal.is_file()):
            # The journal is the sweep's own file, replaced and removed as it goes: never written through a link.
            lead = f"{flag}: " if (flag := outputs.flag_of(self.path)) else ""
            raise outputs.OutputError(self.path, f"{lead}{self.journal} is in the way of its journal (a symlink or "
                                                 "not a regular file): remove it", errno.EEXIST)
        stack = contextlib.ExitStack()
        stack.enter_context(outputs.sole_writer(self.path, self._lock_path))
        self._lock = stack

    def previous(self) -> dict[str, Row]:
        """Finished rows from an earlier run of this output, by cell_id (the journal's win)."""
        rows: dict[str, Row] = {}
        if not self.journaled:
            return rows
        if self.path.exists():
            for row in read_results(self.path).to_dicts():
                rows[row["cell_id"]] = row
        if self.journal.exists():
            for row in _read_journal(self.journal):
                rows[row["cell_id"]] = row
        return rows

    def open(self, kept: Iterable[Row]) -> None:
        """Start the journal afresh (atomically) holding `kept`, then keep it open for appends."""
        if not self.journaled:
            return
        with atomic_text(self.journal) as out:
            for row in kept:
                out.write(_line(row))
                self._lines += 1
        try:
            self._fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)
            self._whole = os.fstat(self._fd).st_size
        except OSError as exc:
            raise self._journal_error(exc) from exc

    def append(self, row: Row) -> None:
        """Add one finished cell to the journal: one write, then fsync. On failure the journal is cut back to
        its last whole line (or marked damaged if it cannot be) and an OutputError names the output."""
        if not self.journaled:
            return
        assert self._fd is not None, "ResultStore.append before open"
        data = _line(row).encode()
        try:
            written = os.write(self._fd, data)  # one write: a kill leaves the line whole or absent
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._whole)
                os.fsync(self._fd)
            except OSError:
                self._intact = False
            if exc.errno == errno.EIO:  # written pages may have been lost: no line can be trusted
                self._intact = False
            raise self._journal_error(exc) from exc
        self._whole += len(data)
        self._lines += 1

    def close(self, rows: Sequence[Row]) -> pl.DataFrame:
        """Write every finished row to the parquet (atomically), then drop the journal. With no row
        finished nothing is written (a results file always has the whole schema)."""
        try:
            self._close_fd()
            frame = write_results(self.path, rows) if rows else to_frame(rows)
        except OSError as exc:
            raise self._not_written(exc) from exc
        finally:
            self._unlock()
        self._drop_journal()
        return frame

    def abort(self, rows: Sequence[Row], cause: BaseException) -> None:
        """After `cause` stopped the sweep: write what finished and drop the journal, as `close` does (an
        error then says what was kept). If the journal was what failed, raise its error saying that the
        parquet holds the finished rows."""
        self.close(rows)
        if isinstance(cause, outputs.OutputError) and rows:
            raise outputs.OutputError(cause.filename, f"{cause.strerror} (the {len(rows)} finished cell(s) are "
                                                      f"written to {self.path}: rerun with --resume to finish)",
                                      cause.errno or errno.EIO) from cause

    def _not_written(self, exc: OSError) -> OSError:
        """The parquet could not be written: keep the journal for --resume if it is intact, else remove it,
        and say which in the error."""
        if not self.journaled:
            return exc
        kept = self._intact and self._lines > 0 and self.journal.exists()
        if not kept:
            self._drop_journal()
        what = (f"{self._lines} finished cell(s) kept in {self.journal}: rerun with --resume" if kept
                else "no journal kept")
        return outputs.OutputError(exc.filename or self.path, f"{exc.strerror or exc} ({what})",
                                   exc.errno or errno.EIO)

    def _journal_error(self, exc: OSError) -> outputs.OutputError:
        lead = f"{flag}: " if (flag := outputs.flag_of(self.path)) else ""
        return outputs.OutputError(self.path, f"{lead}cannot write its journal {self.journal}: "
                                              f"{exc.strerror or exc}", exc.errno or errno.EIO)

    def _drop_journal(self) -> None:
        if self.journaled:
            with contextlib.suppress(FileNotFoundError):
                self.journal.unlink()

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:  # an error the journal's fsyncs did not see: it is not to be trusted for --resume
                self._intact = False

    def release(self) -> None:
        """Give the output up without writing (a failure before the journal was started)."""
        self._close_fd()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.close()


def _line(row: Row) -> str:
    return json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n"


def _read_journal(path: Path) -> list[Row]:
    """Complete lines only: a line cut short by a crash (no newline, or not JSON) ends the journal."""
    rows = []
    data = path.read_bytes()
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):  # the last: empty, or cut short by a crash
        try:
            row = strict_json.loads(line)
        except json.JSONDecodeError:
            break
        except UnicodeDecodeError:
            raise SweepError(f"{path}:{number}: the resume journal holds a line that is not UTF-8 text (not "
                             "what a sweep writes): remove the journal to run the sweep without resuming") from None
        if not isinstance(row, dict) or "cell_id" not in row:
            break
        rows.append(row)
    return rows
