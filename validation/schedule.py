"""Step shapes: the batch of every engine step of a run, read from its per-call-step log, sampled, saved.

A `StepShapes` holds steps as flat per-call arrays (query_lens, context_lens, is_prefill) with step
offsets, like the cost model's batched `step_times`. It comes from

  * a step log (`replay --steps`, or a vLLM export with the same columns): one row per call-step with
    step, phase ('prefill' | 'decode'), context_len, scheduled_tokens, and optional timing columns;
  * a schedule file (`agentspec-sim/step-shapes` JSON, gzip allowed): the small committed samples in
    validation/schedules/ that the GPU check replays without polars or the simulator.

`stratified_sample` picks steps spread over batch-size buckets (powers of two) and step kinds (decode,
verify, prefill), seeded, so a few dozen steps cover decode and verify at every batch size and
prefill chunks.
Nothing here imports polars at module level (the GPU path has none): tables are read with polars
when it is installed, else with pyarrow.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentspec_sim.io import strict_json

SCHEDULE_FORMAT = "agentspec-sim/step-shapes"
SCHEDULE_VERSION = 1
SCHEDULE_DIR = Path(__file__).resolve().parent / "schedules"
REQUIRED_COLUMNS = ("step", "phase", "context_len", "scheduled_tokens")


class ScheduleError(ValueError):
    """A step log or schedule file that cannot be used: names the file and the field."""


@dataclass
class StepShapes:
    """Steps as flat call rows: step k is rows offsets[k]:offsets[k + 1].

    step_ids: the run's step numbers; times: optional named per-step arrays (e.g. the log's
    `forward_s`, a measured `measured_s`); meta: where the steps came from.
    """

    step_ids: np.ndarray
    offsets: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    is_prefill: np.ndarray
    times: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.step_ids.shape[0])

    @property
    def batch_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> np.ndarray:
        return np.add.reduceat(self.query_lens, self.offsets[:-1]) if len(self) else np.zeros(0, np.int64)

    def step(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        return self.query_lens[a:b], self.context_lens[a:b], self.is_prefill[a:b]

    def select(self, picks: np.ndarray) -> StepShapes:
        """The steps at indices `picks`, in that order."""
        picks = np.asarray(picks, dtype=np.int64)
        parts = [self.step(int(k)) for k in picks]
        sizes = np.array([p[0].shape[0] for p in parts], dtype=np.int64)
        cat = (lambda i, dt: np.concatenate([p[i] for p in parts]).astype(dt)) if parts else (
            lambda i, dt: np.zeros(0, dt))
        return StepShapes(self.step_ids[picks], np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                          cat(0, np.int64), cat(1, np.int64), cat(2, bool),
                          {name: values[picks] for name, values in self.times.items()}, dict(self.meta))

    # ---- files ----

    def to_file(self, path: str | Path, **meta) -> None:
        """Write the schedule JSON (gzip when the name ends in .gz), atomically and byte-reproducibly."""
        from agentspec_sim.io.atomic import atomic_text

        steps = []
        for k in range(len(self)):
            q, c, p = self.step(k)
            steps.append({"step": int(self.step_ids[k]), "query_lens": q.tolist(), "context_lens": c.tolist(),
                          "prefill": [int(x) for x in p.tolist()]})
        record = {"format": SCHEDULE_FORMAT, "version": SCHEDULE_VERSION, **self.meta, **meta, "steps": steps}
        with atomic_text(path) as out:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")

    @classmethod
    def from_file(cls, path: str | Path) -> StepShapes:
        path = Path(path)
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as src:
                data = strict_json.loads(src.read())
        except FileNotFoundError:
            raise ScheduleError(f"{path}: no such schedule file") from None
        except (json.JSONDecodeError, OSError, EOFError) as exc:
            raise ScheduleError(f"{path}: not a schedule JSON file ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != SCHEDULE_FORMAT:
            raise ScheduleError(f"{path}: format: expected {SCHEDULE_FORMAT!r}")
        if data.get("version") != SCHEDULE_VERSION:
            raise ScheduleError(f"{path}: version: expected {SCHEDULE_VERSION}, got {data.get('version')!r}")
        steps = data.get("steps")
        if not isinstance(steps, list) or not steps:
            raise ScheduleError(f"{path}: steps: expected a non-empty list")
        ids, q, c, p, sizes = [], [], [], [], []
        for i, s in enumerate(steps):
            try:
                qs, cs, ps = s["query_lens"], s["context_lens"], s["prefill"]
                if not (len(qs) == len(cs) == len(ps) > 0) or min(qs) < 1 or min(cs) < 0:
                    raise ValueError("needs equal-length query_lens ≥ 1, context_lens ≥ 0, prefill")
                ids.append(int(s["step"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ScheduleError(f"{path}: steps[{i}]: {exc}") from None
            q += qs
            c += cs
            p += ps
            sizes.append(len(qs))
        meta = {k: v for k, v in data.items() if k not in ("format", "version", "steps")}
        return cls(np.array(ids, dtype=np.int64), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                   np.array(q, dtype=np.int64), np.array(c, dtype=np.int64), np.array(p, dtype=bool), {}, meta)


def shapes_from_columns(columns: Mapping[str, np.ndarray], where: str = "<table>",
                        time_columns: tuple[str, ...] = ("forward_s", "draft_s", "step_time_s", "measured_s"),
                        drafter: str | None = None) -> StepShapes:
    """Group a per-call-step table (see the module docstring) into steps, in step order.

    A step-level time column (the same value on every row of a step) is kept under its name. A log
    of several runs (`replay` writes normal and each drafter, with a `drafter` column) is cut to the
    run of `drafter`, by default the last one in the log.
    """
    for name in REQUIRED_COLUMNS:
        if name not in columns:
            raise ScheduleError(f"{where}: column {name!r} missing (need {', '.join(REQUIRED_COLUMNS)})")
    if "drafter" in columns:
        names = np.asarray(columns["drafter"]).astype(str)
        present = list(dict.fromkeys(names.tolist()))
        chosen = drafter if drafter is not None else (present[-1] if present else None)
        if chosen not in present:
            raise ScheduleError(f"{where}: drafter {chosen!r} not in the log (runs: {', '.join(present)})")
        if len(present) > 1:
            keep = names == chosen
            columns = {k: np.asarray(v)[keep] for k, v in columns.items()}
        where = f"{where} [{chosen}]"
    elif drafter is not None:
        raise ScheduleError(f"{where}: no drafter column to select {drafter!r} with")
    step = np.asarray(columns["step"], dtype=np.int64)
    if step.shape[0] == 0:
        raise ScheduleError(f"{where}: no rows")
    phase = np.asarray(columns["phase"]).astype(str)
    bad = ~np.isin(phase, ("prefill", "decode"))
    if bad.any():
        row = int(bad.nonzero()[0][0])
        raise ScheduleError(f"{where}: row {row}: phase: expected 'prefill' or 'decode', got {phase[row]!r}")
    q = np.asarray(columns["scheduled_tokens"], dtype=np.int64)
    c = np.asarray(columns["context_len"], dtype=np.int64)
    for name, arr, low in (("scheduled_tokens", q, 1), ("context_len", c, 0)):
        below = arr < low
        if below.any():
            row = int(below.nonzero()[0][0])
            raise ScheduleError(f"{where}: row {row}: {name}: expected ≥ {low}, got {int(arr[row])}")
    order = np.argsort(step, kind="stable")
    step, q, c, pf = step[order], q[order], c[order], (phase[order] == "prefill")
    starts = np.concatenate([[0], (np.diff(step) != 0).nonzero()[0] + 1])
    offsets = np.concatenate([starts, [step.shape[0]]]).astype(np.int64)
    times = {}
    for name in time_columns:
        if name in columns:
            values = np.asarray(columns[name], dtype=np.float64)[order]
            per_step = values[starts]
            if not np.allclose(np.maximum.reduceat(values, starts), per_step, rtol=1e-9, atol=0.0, equal_nan=True):
                raise ScheduleError(f"{where}: column {name!r} differs between rows of one step")
            times[name] = per_step
    return StepShapes(step[starts], offsets, q, c, pf, times, {"source": where})


def read_table(path: str | Path) -> dict[str, np.ndarray]:
    """A parquet or CSV file's columns as numpy arrays (list columns skipped): polars when installed,
    else pyarrow; CSV also without either."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "no such file", str(path))
    csv = path.suffix.lower() == ".csv"
    try:
        import polars as pl
    except ImportError:
        pl = None
    try:
        if pl is not None:
            frame = pl.read_csv(path) if csv else pl.read_parquet(path)
            return {name: frame[name].to_numpy() for name in frame.columns if frame[name].dtype != pl.List}
        if csv:
            return _read_csv(path)
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return {name: table[name].to_numpy() for name in table.column_names
                if not pa.types.is_list(table.schema.field(name).type)}
    except (OSError, ValueError) as exc:
        raise ScheduleError(f"{path}: cannot read as {'CSV' if csv else 'parquet'}: {exc}") from None
    except Exception as exc:  # polars' and pyarrow's own errors
        if type(exc).__module__.split(".")[0] in ("polars", "pyarrow"):
            raise ScheduleError(f"{path}: cannot read as {'CSV' if csv else 'parquet'}: {exc}") from None
        raise


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    import csv

    with open(path, newline="", encoding="utf-8") as src:
        rows = list(csv.reader(src))
    if not rows:
        raise ValueError("empty file")
    out: dict[str, np.ndarray] = {}
    for j, name in enumerate(rows[0]):
        values = [r[j] for r in rows[1:]]
        for kind in (np.int64, np.float64):
            try:
                out[name] = np.array(values, dtype=kind)
                break
            except ValueError:
                continue
        else:
            out[name] = np.array(values, dtype=str)
    return out


def write_table(path: str | Path, columns: Mapping[str, np.ndarray]) -> None:
    """Write columns atomically: parquet (polars when installed, else pyarrow), or CSV when the name
    ends in .csv (no library needed)."""
    from agentspec_sim.io.atomic import atomic_binary, atomic_text

    arrays = {k: np.asarray(v) for k, v in columns.items()}
    if str(path).lower().endswith(".csv"):
        import csv

        with atomic_text(path) as out:
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(list(arrays))
            writer.writerows(zip(*(a.tolist() for a in arrays.values()), strict=True))
        return
    try:
        import polars as pl
    except ImportError:
        pl = None
    with atomic_binary(path, compress=False) as out:
        if pl is not None:
            pl.DataFrame(arrays).write_parquet(out)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table(arrays), out)


def read_step_log(path: str | Path, drafter: str | None = None) -> StepShapes:
    """Step shapes (and step-level time columns) from a per-call-step log file."""
    return shapes_from_columns(read_table(path), where=str(path), drafter=drafter)


def load_shapes(path: str | Path, drafter: str | None = None) -> StepShapes:
    """A schedule file (.json / .json.gz) or a step log (.parquet / .csv; one drafter's run)."""
    name = str(path).lower()
    if name.endswith((".json", ".json.gz")):
        return StepShapes.from_file(path)
    return read_step_log(path, drafter)


def bucket_of(values: np.ndarray) -> np.ndarray:
    """Power-of-two bucket index: 1 → 0, 2-3 → 1, 4-7 → 2, …"""
    return np.floor(np.log2(np.maximum(np.asarray(values, dtype=np.float64), 1.0))).astype(np.int64)


def bucket_label(bucket: int) -> str:
    lo, hi = 1 << bucket, (1 << (bucket + 1)) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def step_kinds(shapes: StepShapes) -> np.ndarray:
    """Per step: 0 = plain decode (every call 1 token), 1 = verify (some call 1 + draft tokens, no
    prefill), 2 = has a prefill chunk."""
    starts = shapes.offsets[:-1]
    has_prefill = np.add.reduceat(shapes.is_prefill.astype(np.int64), starts) > 0
    max_q = np.maximum.reduceat(shapes.query_lens, starts)
    return np.where(has_prefill, 2, np.where(max_q > 1, 1, 0))


def stratified_sample(shapes: StepShapes, count: int, seed: int = 0) -> StepShapes:
    """Up to `count` steps spread over strata of (batch-size power-of-two bucket, step kind: decode /
    verify / prefill): each round takes one unused step from every stratum, strata in a seeded order,
    so rare strata (the largest batches, prefill chunks) are covered before common ones repeat.
    Returned in step order."""
    n = len(shapes)
    if count >= n:
        return shapes
    if count < 1:
        raise ValueError("a sample needs at least one step")
    rng = np.random.default_rng(seed)
    key = bucket_of(shapes.batch_sizes) * 4 + step_kinds(shapes)
    strata = [rng.permutation((key == k).nonzero()[0]) for k in np.unique(key)]
    strata = [strata[i] for i in rng.permutation(len(strata))]
    picks: list[int] = []
    depth = 0
    while len(picks) < count:
        for members in strata:
            if depth < members.shape[0] and len(picks) < count:
                picks.append(int(members[depth]))
        depth += 1
    return shapes.select(np.sort(np.array(picks, dtype=np.int64)))


def bundled_schedule(model: str, max_num_seqs: int) -> Path:
    """The committed schedule sample for a model id at a max batch size (see validation/schedules/README.md)."""
    path = SCHEDULE_DIR / f"{model}_seqs{max_num_seqs}.json.gz"
    if not path.exists():
        have = ", ".join(sorted(p.name for p in SCHEDULE_DIR.glob("*.json.gz")))
        raise ScheduleError(f"no bundled schedule for {model} at max_num_seqs {max_num_seqs} (have: {have})")
    return path
