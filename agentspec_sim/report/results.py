"""Sweep results as the report reads them: loading and checking the result table, building rows, averaging seeds.

The schema is the sweep's (docs/sweep-and-plan.md): one row per cell with `cell_id`, `trace`, `drafter`,
`speculative_config` (JSON text), `max_num_seqs`, `hardware`, `model`, `seed`, every field of
`RunSummary.to_row()`, and `query_latencies_s` (every completed query's latency). `cell_row` builds such a
row from a `compare` result, so tests and the reference-report script produce the same table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from agentspec_sim.io import strict_json
from agentspec_sim.run.band import COLUMNS as BAND_COLUMNS
from agentspec_sim.run.simulation import compare

if TYPE_CHECKING:
    from agentspec_sim.engine.config import EngineConfig
    from agentspec_sim.engine.result import RunResult
    from agentspec_sim.metrics import RunSummary
    from agentspec_sim.trace.schema import Workload

KEY_COLUMNS = ("cell_id", "trace", "drafter", "speculative_config", "max_num_seqs", "hardware", "model", "seed")
# The summary fields the report draws on; a results file without them cannot make the report.
METRIC_COLUMNS = ("goodput_tok_s", "speedup", "rejection_rate", "draft_tokens_per_step", "token_budget_mean",
                  "draft_time_s", "forward_time_s", "query_latencies_s")
# One setting = one line of the paper's plots: the same trace, GPU and model.
SETTING = ("trace", "hardware", "model")
# Columns the host measures (wall-clock seconds): two runs of one cell differ in them and nothing else.
HOST_COLUMNS = ("wall_s",)
_SOURCE = "_results_file"


class ResultsError(ValueError):
    """A results file the report cannot use (names the file, and the line or column)."""


def load_results(paths: Sequence[str | Path]) -> pl.DataFrame:
    """Read and concatenate sweep results (`.parquet`, or `.jsonl` with one row per line); check the columns.

    A cell is counted once: rows with the same `cell_id` (the same file given twice, two files holding
    the same cells) are one row, the first; where they hold different results — two different runs
    under one cell identity — it is refused, naming both files and a column that differs (`_dedupe`)."""
    if not paths:
        raise ResultsError("no results file given")
    frames = [_read_one(Path(p)).with_columns(pl.lit(str(p)).alias(_SOURCE)) for p in paths]
    frame = pl.concat(frames, how="diagonal_relaxed") if len(frames) > 1 else frames[0]
    if frame.height == 0:
        raise ResultsError(f"{paths[0]}: no result rows")
    common = set.intersection(*(set(f.columns) for f in frames))
    return _dedupe(frame, [c for c in frame.columns if c in common and c not in (_SOURCE, *HOST_COLUMNS)])


def _dedupe(frame: pl.DataFrame, compared: Sequence[str]) -> pl.DataFrame:
    """One row per cell_id (the first); ResultsError where rows of one cell_id differ in a `compared` column."""
    if frame["cell_id"].n_unique() == frame.height:
        return frame.drop(_SOURCE)
    hashed = frame.with_columns(frame.select(compared).hash_rows().alias("_hash"))
    conflict = (hashed.group_by("cell_id", maintain_order=True).agg(pl.col("_hash").n_unique().alias("n"))
                .filter(pl.col("n") > 1))
    if conflict.height:
        cell = conflict["cell_id"][0]
        rows = hashed.filter(pl.col("cell_id") == cell)
        first = rows.row(0, named=True)
        other = next(r for r in rows.iter_rows(named=True) if r["_hash"] != first["_hash"])
        column = next(c for c in compared if first[c] != other[c])
        raise ResultsError(
            f"{other[_SOURCE]}: cell {cell} ({first['drafter']} at max_num_seqs {first['max_num_seqs']}, seed "
            f"{first['seed']}) is also in {first[_SOURCE]} with different results ({column} {first[column]!r} vs "
            f"{other[column]!r}): two different runs of one cell; report one of them")
    return frame.unique(subset=["cell_id"], keep="first", maintain_order=True).drop(_SOURCE)


def _read_one(path: Path) -> pl.DataFrame:
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    if path.suffix == ".parquet":
        try:
            frame = pl.read_parquet(path)
        except Exception as exc:  # polars raises several types for a damaged file
            raise ResultsError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
    elif path.suffix in (".jsonl", ".ndjson"):
        rows = []
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ResultsError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        for number, row in strict_json.json_lines(text, lambda n, e: ResultsError(f"{path}:{n}: not JSON ({e.msg})")):
            if not isinstance(row, dict):
                raise ResultsError(f"{path}:{number}: a result row must be a JSON object")
            rows.append(row)
        frame = pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()
    else:
        raise ResultsError(f"{path}: results must be .parquet or .jsonl (a sweep's output)")
    _check_columns(path, frame)
    return frame


def _check_columns(path: Path, frame: pl.DataFrame) -> None:
    missing = [c for c in (*KEY_COLUMNS, *METRIC_COLUMNS) if c not in frame.columns]
    if missing:
        raise ResultsError(f"{path}: missing column(s) {', '.join(missing)} (expected a sweep's results)")
    for name in ("max_num_seqs", "seed"):
        dtype = frame.schema[name]
        if not dtype.is_integer():
            raise ResultsError(f"{path}: column {name} must hold integers, found {dtype}")
    if not isinstance(frame.schema["query_latencies_s"], pl.List):
        raise ResultsError(f"{path}: column query_latencies_s must hold lists of seconds")
    bad = frame.filter(pl.col("max_num_seqs") < 1)
    if bad.height:
        raise ResultsError(f"{path}: max_num_seqs must be ≥ 1 (cell {bad['cell_id'][0]})")


def cell_id(trace: str, drafter_config: str, max_num_seqs: int, hardware: str, model: str, seed: int) -> str:
    """A stable short hash of a cell's parameters."""
    text = json.dumps([trace, drafter_config, max_num_seqs, hardware, model, seed])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cell_row(trace: str, config: EngineConfig, result: RunResult, summary: RunSummary) -> dict[str, Any]:
    """One results row in the sweep schema for one run of `compare` (engine `config` with max_num_seqs set)."""
    row = summary.to_row()
    spec_text = row["speculative_config"]
    max_num_seqs = int(result.limits.max_num_seqs)
    keys = {
        "cell_id": cell_id(trace, spec_text, max_num_seqs, config.hardware, config.model, config.seed),
        "trace": trace, "drafter": summary.drafter, "speculative_config": spec_text, "max_num_seqs": max_num_seqs,
        "hardware": config.hardware, "model": config.model, "seed": config.seed,
    }
    done = result.queries.filter(pl.col("completed"))
    latencies = [float(x) for x in done["latency_s"].to_list()]
    return {**keys, **{k: v for k, v in row.items() if k not in keys}, "query_latencies_s": latencies}


def compare_rows(workload: Workload, trace: str, drafters: Sequence[Any], max_num_seqs: Sequence[int],
                 config: EngineConfig) -> list[dict[str, Any]]:
    """Run `compare` (normal + `drafters`) at each max batch size on `config`; one sweep-schema row per run."""
    from dataclasses import replace


    rows = []
    for size in max_num_seqs:
        sized = replace(config, max_num_seqs=int(size))
        rows += [cell_row(trace, sized, result, summary) for result, summary in compare(workload, drafters, sized)]
    return rows


def rows_frame(rows: Sequence[dict[str, Any]]) -> pl.DataFrame:
    """The rows as a frame with the schema's types (query latencies as list[f64])."""
    frame = pl.from_dicts(list(rows), infer_schema_length=None)
    return frame.with_columns(pl.col("query_latencies_s").cast(pl.List(pl.Float64)),
                              pl.col("max_num_seqs").cast(pl.Int64), pl.col("seed").cast(pl.Int64))


def engine_dict(config: EngineConfig) -> dict[str, Any]:
    """The engine config as plain JSON values."""
    return asdict(config)


def workload_name(trace: str) -> str:
    """`traces/reflexion.jsonl.zst` → `reflexion`: the name tables and plots show."""
    name = Path(trace).name
    for suffix in (".zst", ".gz", ".xz"):
        name = name.removesuffix(suffix)
    return name.removesuffix(".jsonl").removesuffix(".json")


def seed_means(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per (trace, hardware, model, drafter, max_num_seqs): metrics averaged over seeds (the paper
    averages five), query latencies pooled; `seeds` counts them. Settings and drafters in the order they
    first appear, batch sizes ascending (deterministic for the same input)."""
    numeric = [c for c in METRIC_COLUMNS if c != "query_latencies_s"]

    # The band columns (agentspec_sim.run.band) only in results written since they were recorded.
    extra = [c for c in ("rejection_rate_tokens", "mean_acceptance_length", "budget_utilisation", "output_tokens",
                         "makespan_s", "running_max", *BAND_COLUMNS) if c in frame.columns]
    keys = [*SETTING, "drafter", "max_num_seqs"]
    indexed = frame.with_row_index("_order")
    order = indexed.group_by("drafter").agg(pl.col("_order").min().alias("_first"))
    setting_order = indexed.group_by(SETTING).agg(pl.col("_order").min().alias("_setting"))
    out = frame.group_by(keys).agg(
        *[pl.col(c).cast(pl.Float64).mean() for c in numeric + extra],
        pl.col("query_latencies_s").explode().drop_nulls().sort().alias("query_latencies_s"),
        pl.col("seed").n_unique().alias("seeds"),
    )
    # Settings and drafters keep the order they first appear in (normal first, as sweeps and compare write them).
    return (out.join(order, on="drafter").join(setting_order, on=SETTING)
            .sort(["_setting", "_first", "max_num_seqs"]).drop("_first", "_setting"))
