"""The sweep results file: its schema, the journal that makes it resumable, and its reader.

Schema (one row per cell; docs/sweep-and-plan.md): the cell's key columns `KEY_COLUMNS`, then every
field of `RunSummary.to_row()` in its order, then `engine_config` (the engine settings every cell
shares, as JSON) and `query_latencies_s` (every completed query's latency). `speedup` is goodput
over the goodput of the `normal` cell of the same (trace, engine config) group, filled in when the
rows are written (null while that cell is missing).

Durability: each finished cell is appended to a journal beside the results, `<results>.partial`
(one JSON line, written with one `write` and fsynced), so a killed sweep loses at most the cells in
flight. The parquet file itself is only ever replaced atomically (agentspec_sim.atomic): when the
sweep ends, or is interrupted, it is written from every finished row and the journal is removed. A
resumed sweep reads both (the journal wins where both hold a cell) and discards a torn last line.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from agentspec_sim.atomic import atomic_binary, atomic_text
from agentspec_sim.sweep.cells import SweepError

KEY_COLUMNS = ("cell_id", "trace", "drafter", "speculative_config", "max_num_seqs", "hardware", "model", "seed")
LATENCIES = "query_latencies_s"
# The engine settings the sweep's cells share, as JSON (`Cell.engine_config`); absent in files written before
# it was recorded.
ENGINE_CONFIG = "engine_config"
_FIXED_DTYPES: dict[str, pl.DataType] = {
    "cell_id": pl.Utf8(), "trace": pl.Utf8(), "drafter": pl.Utf8(), "speculative_config": pl.Utf8(),
    "max_num_seqs": pl.Int64(), "hardware": pl.Utf8(), "model": pl.Utf8(), "seed": pl.Int64(),
    "speedup": pl.Float64(), ENGINE_CONFIG: pl.Utf8(), LATENCIES: pl.List(pl.Float64()),
}
Row = dict[str, Any]


def journal_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".partial")


def fill_speedups(rows: Sequence[Row], baseline_of: Mapping[str, str]) -> list[Row]:
    """Rows with `speedup` = goodput / goodput of their group's `normal` row (None where that row is
    missing or its goodput is 0). `baseline_of` maps each cell_id to its group's normal cell_id."""
    goodput = {row["cell_id"]: row["goodput_tok_s"] for row in rows}
    out = []
    for row in rows:
        base = goodput.get(baseline_of.get(row["cell_id"], ""))
        out.append({**row, "speedup": (row["goodput_tok_s"] / base) if base else None})
    return out


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

    `previous()` reads what an earlier run left (parquet, then journal); `open(kept)` starts the
    journal with the rows being kept; `append(row)` records one finished cell durably; `close(rows)`
    writes the parquet and removes the journal. Nothing is ever written to the parquet's own name
    except by an atomic replace.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.journal = journal_path(path)
        self._fd: int | None = None

    def previous(self) -> dict[str, Row]:
        """Finished rows from an earlier run of this output, by cell_id (the journal's win)."""
        rows: dict[str, Row] = {}
        if self.path.exists():
            for row in read_results(self.path).to_dicts():
                rows[row["cell_id"]] = row
        if self.journal.exists():
            for row in _read_journal(self.journal):
                rows[row["cell_id"]] = row
        return rows

    def open(self, kept: Iterable[Row]) -> None:
        """Start the journal afresh (atomically) holding `kept`, then keep it open for appends."""
        with atomic_text(self.journal) as out:
            for row in kept:
                out.write(_line(row))
        self._fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)

    def append(self, row: Row) -> None:
        assert self._fd is not None, "ResultStore.append before open"
        data = _line(row).encode()
        written = os.write(self._fd, data)  # one write: a kill leaves the line whole or absent
        if written != len(data):
            raise OSError(f"{self.journal}: short write ({written} of {len(data)} bytes)")
        os.fsync(self._fd)

    def close(self, rows: Sequence[Row]) -> pl.DataFrame:
        """Write every finished row to the parquet (atomically), then drop the journal. With no row
        finished nothing is written (a results file always has the whole schema)."""
        self._close_fd()
        frame = write_results(self.path, rows) if rows else to_frame(rows)
        with contextlib.suppress(FileNotFoundError):
            self.journal.unlink()
        return frame

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _line(row: Row) -> str:
    return json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n"


def _read_journal(path: Path) -> list[Row]:
    """Complete lines only: a line cut short by a crash (no newline, or not JSON) ends the journal."""
    rows = []
    data = path.read_bytes()
    for line in data.split(b"\n")[:-1]:  # the last piece is empty, or a line the crash cut short
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(row, dict) or "cell_id" not in row:
            break
        rows.append(row)
    return rows
