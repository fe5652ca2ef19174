"""`check`: re-run the configurations a baseline file records and flag regressions against its metrics.

A baseline (JSON, version 1) records the trace(s) with a SHA-256 of their bytes (a changed trace is bad
input, not a regression), the engine config, the drafter configs (vLLM `--speculative-config` JSON, as
given, before the run binds model or seed), the max batch sizes, and per cell (trace × max batch size ×
drafter, `normal` included) the expected rejection rate, goodput and speedup. Trace paths are stored
relative to the baseline's folder, so the file works from any working directory.

A cell regresses when its rejection rate rises by more than `tolerance` (absolute, in rate units) or its
goodput or speedup falls by more than `goodput_tolerance` (relative). Which rejection rate gates is the
caller's choice (`REJECTION`): the paper's call-mean `rejection_rate` (the default, what every baseline
records) or the token-level `rejection_rate_tokens` = 1 − vLLM's draft acceptance rate (recorded by
baselines written since; an older file still reads, and gating it by tokens asks for --update). The
simulator is deterministic, so tight tolerances only absorb floating-point differences between machines.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from agentspec_sim.drafters.registry import speculative_config
from agentspec_sim.io import strict_json
from agentspec_sim.io.atomic import atomic_text

BASELINE_VERSION = 1
METRICS = ("rejection_rate", "goodput_tok_s", "speedup")  # every baseline's cells hold these
TOKEN_REJECTION = "rejection_rate_tokens"  # the field a baseline gained: optional when read
RECORDED = (*METRICS, TOKEN_REJECTION)  # what a new baseline records per cell
# The rejection rate a check gates, by `check --rejection` (definitions: agentspec_sim/metrics.py).
REJECTION = {"call": "rejection_rate", "token": TOKEN_REJECTION}
REJECTION_LABEL = {"call": "call-mean rejection rate", "token": "token rejection rate"}


class BaselineError(ValueError):
    """A baseline file that cannot be used, or a trace that no longer matches it (names file and field)."""


@dataclass(frozen=True)
class TraceRecord:
    path: str  # as stored: relative to the baseline's folder, POSIX separators
    sha256: str


@dataclass(frozen=True)
class Baseline:
    """What `check` re-runs and the metrics it expects (see the module docstring)."""

    traces: tuple[TraceRecord, ...]
    engine: dict[str, Any]
    max_num_seqs: tuple[int, ...]
    drafters: tuple[dict[str, Any], ...]  # {"label": …, "speculative_config": {…}}
    cells: tuple[dict[str, Any], ...]  # {"trace", "max_num_seqs", "drafter", *METRICS[, TOKEN_REJECTION]}

    def to_json(self) -> dict[str, Any]:
        return {"version": BASELINE_VERSION, "traces": [{"path": t.path, "sha256": t.sha256} for t in self.traces],
                "engine": self.engine, "max_num_seqs": list(self.max_num_seqs), "drafters": list(self.drafters),
                "cells": list(self.cells)}


@dataclass(frozen=True)
class CellDiff:
    """One cell's baseline and current metrics, and why it fails (empty: within tolerance)."""

    trace: str
    max_num_seqs: int
    drafter: str
    baseline: dict[str, float | None]
    current: dict[str, float | None]
    regressions: tuple[str, ...] = ()
    improvements: tuple[str, ...] = ()

    @property
    def status(self) -> str:
        if self.regressions:
            return "REGRESSION"
        return "improved" if self.improvements else "ok"


@dataclass(frozen=True)
class CheckResult:
    diffs: list[CellDiff]
    tolerance: float
    goodput_tolerance: float
    unexpected: list[str] = field(default_factory=list)  # cells run now that the baseline does not list
    rejection: str = "call"  # which rejection rate gated (a key of REJECTION)

    @property
    def failed(self) -> list[CellDiff]:
        return [d for d in self.diffs if d.regressions]


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- reading and writing ------------------------------------------------------------------------------------------

def load_baseline(path: str | Path) -> Baseline:
    """Parse and validate a baseline file; every problem raises BaselineError naming the file and field."""
    path = Path(path)
    try:
        data = strict_json.load_path(path)
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else f" in {Path.cwd()} (a relative path: give --baseline PATH from " \
                                                    "elsewhere)"
        raise BaselineError(f"{path}: no such baseline{where}; create it with --update") from None
    except UnicodeDecodeError as exc:
        raise BaselineError(f"{path}: not UTF-8 text (byte {exc.start}); a baseline is a JSON file") from None
    except json.JSONDecodeError as exc:
        raise BaselineError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    where = str(path)
    if not isinstance(data, dict):
        raise BaselineError(f"{where}: a baseline is a JSON object")
    if data.get("version") != BASELINE_VERSION:
        raise BaselineError(f"{where}: version: expected {BASELINE_VERSION}, got {data.get('version')!r}")
    for key, kind in (("traces", list), ("engine", dict), ("max_num_seqs", list), ("drafters", list),
                      ("cells", list)):
        if not isinstance(data.get(key), kind):
            raise BaselineError(f"{where}: {key}: missing or not a JSON {kind.__name__.replace('dict', 'object')}")
    traces = []
    for i, item in enumerate(data["traces"]):
        if not (isinstance(item, dict) and isinstance(item.get("path"), str) and isinstance(item.get("sha256"), str)):
            raise BaselineError(f"{where}: traces[{i}]: needs string fields path and sha256")
        traces.append(TraceRecord(item["path"], item["sha256"]))
    if not traces:
        raise BaselineError(f"{where}: traces: empty")
    _engine_config(data["engine"], where)
    sizes = data["max_num_seqs"]
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise BaselineError(f"{where}: max_num_seqs: a non-empty list of positive integers, got {sizes!r}")
    for i, item in enumerate(data["drafters"]):
        if not (isinstance(item, dict) and isinstance(item.get("label"), str)
                and isinstance(item.get("speculative_config"), dict)):
            raise BaselineError(f"{where}: drafters[{i}]: needs label (string) and speculative_config (object)")
        _spec(item, f"{where}: drafters[{i}].speculative_config")
    known = {t.path for t in traces}
    for i, cell in enumerate(data["cells"]):
        if not isinstance(cell, dict):
            raise BaselineError(f"{where}: cells[{i}]: not an object")
        for key in ("trace", "max_num_seqs", "drafter", *METRICS):
            if key not in cell:
                raise BaselineError(f"{where}: cells[{i}].{key}: missing")
        if cell["trace"] not in known:
            raise BaselineError(f"{where}: cells[{i}].trace: {cell['trace']!r} is not among traces")
        for key in (k for k in RECORDED if k in cell):
            value = cell[key]
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)
                                      or not math.isfinite(value)):
                raise BaselineError(f"{where}: cells[{i}].{key}: a number or null, got {value!r}")
    return Baseline(tuple(traces), dict(data["engine"]), tuple(sizes), tuple(data["drafters"]),
                    tuple(data["cells"]))


def save_baseline(baseline: Baseline, path: str | Path) -> None:
    with atomic_text(path) as out:
        out.write(json.dumps(baseline.to_json(), indent=2, sort_keys=False) + "\n")


def _engine_config(engine: dict[str, Any], where: str):
    from agentspec_sim.engine.config import EngineConfig, EngineConfigError

    names = {f.name for f in fields(EngineConfig)} - {"max_num_seqs"}
    unknown = sorted(set(engine) - names)
    if unknown:
        raise BaselineError(f"{where}: engine.{unknown[0]}: not an engine setting")
    try:
        return EngineConfig(**engine)
    except (EngineConfigError, TypeError) as exc:
        raise BaselineError(f"{where}: engine: {exc}") from None


def _spec(item: dict[str, Any], where: str):
    from agentspec_sim.engine.drafting import SpecConfigError

    try:
        return speculative_config(item["speculative_config"], label=item["label"])
    except (SpecConfigError, ValueError) as exc:
        raise BaselineError(f"{where}: {exc}") from None


def _stored_path(trace: Path, base_dir: Path) -> str:
    return Path(os.path.relpath(trace.resolve(), base_dir.resolve())).as_posix()


# -- running ------------------------------------------------------------------------------------------------------

def resolve_traces(baseline: Baseline, baseline_path: str | Path,
                   given: Sequence[str | Path] = ()) -> list[tuple[TraceRecord, Path]]:
    """Pair each trace to run with its record: the recorded paths (relative to the baseline), or the `given`
    files matched by content hash. A recorded trace whose bytes changed, or a given trace the baseline
    does not record, raises BaselineError."""
    base_dir = Path(baseline_path).parent
    pairs = []
    if given:
        by_hash = {t.sha256: t for t in baseline.traces}
        for path in map(Path, given):
            digest = file_sha256(path)
            if digest not in by_hash:
                recorded = ", ".join(f"{t.path} (sha256 {t.sha256[:12]})" for t in baseline.traces)
                raise BaselineError(f"{path}: content (sha256 {digest[:12]}) matches no trace in {baseline_path} "
                                    f"({recorded}); re-record with --update if the change is intended")
            pairs.append((by_hash[digest], path))
        return pairs
    for record in baseline.traces:
        path = base_dir / record.path
        digest = file_sha256(path)
        if digest != record.sha256:
            raise BaselineError(f"{path}: trace changed since the baseline was recorded (sha256 {digest[:12]}, "
                                f"baseline {record.sha256[:12]}); re-record with --update if the change is intended")
        pairs.append((record, path))
    return pairs


def measure(baseline: Baseline, traces: Sequence[tuple[TraceRecord, Path]]) -> list[dict[str, Any]]:
    """Run every recorded configuration on each trace; one cell dict per (trace, max batch size, drafter)."""
    from agentspec_sim.report.results import compare_rows
    from agentspec_sim.trace.io import load_trace

    config = _engine_config(baseline.engine, "baseline")
    specs = baseline_specs(baseline)
    cells = []
    for record, path in traces:
        rows = compare_rows(load_trace(path), record.path, specs, baseline.max_num_seqs, config)
        cells += [{"trace": record.path, "max_num_seqs": row["max_num_seqs"], "drafter": row["drafter"],
                   **{k: row[k] for k in RECORDED}} for row in rows]
    return cells


def baseline_specs(baseline: Baseline) -> list:
    """The recorded drafters as SpeculativeConfigs, labelled as recorded."""
    return [_spec(d, f"drafters[{i}].speculative_config") for i, d in enumerate(baseline.drafters)]


def record_baseline(traces: Sequence[str | Path], baseline_path: str | Path, drafters: Sequence[Any],
                    max_num_seqs: Sequence[int], engine: dict[str, Any]) -> Baseline:
    """Measure `drafters` (names, speculative-config JSON or SpeculativeConfigs) at `max_num_seqs` on `traces`:
    a new baseline to be saved at `baseline_path` (trace paths are stored relative to its folder)."""
    from agentspec_sim.drafters.registry import parse_drafter, unique_labels

    specs = unique_labels([parse_drafter(d) for d in drafters if parse_drafter(d).method != "normal"])
    base_dir = Path(baseline_path).parent
    records = tuple(TraceRecord(_stored_path(Path(t), base_dir), file_sha256(t)) for t in traces)
    draft = Baseline(records, dict(engine), tuple(int(s) for s in max_num_seqs),
                     tuple({"label": s.name, "speculative_config": s.to_json()} for s in specs), ())
    _engine_config(draft.engine, str(baseline_path))
    cells = measure(draft, [(r, Path(t)) for r, t in zip(records, traces, strict=True)])
    return Baseline(draft.traces, draft.engine, draft.max_num_seqs, draft.drafters, tuple(cells))


# -- comparing ----------------------------------------------------------------------------------------------------

def require_rejection(baseline: Baseline, path: str | Path, rejection: str) -> None:
    """BaselineError unless every cell of `baseline` records the rejection rate `rejection` gates on
    (a baseline written before token-level rejection was recorded has only the call-mean one)."""
    if rejection not in REJECTION:
        raise BaselineError(f"--rejection: expected {' or '.join(REJECTION)}, got {rejection!r}")
    metric = REJECTION[rejection]
    for i, cell in enumerate(baseline.cells):
        if metric not in cell:
            raise BaselineError(f"{path}: cells[{i}].{metric}: not recorded (the baseline predates it); re-record "
                                f"it with --update, or gate the call-mean rate with --rejection call")


def _key(cell: dict[str, Any]) -> tuple[str, int, str]:
    return cell["trace"], int(cell["max_num_seqs"]), cell["drafter"]


def compare_cells(expected: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]], tolerance: float = 0.01,
                  goodput_tolerance: float = 0.02, only_traces: Sequence[str] | None = None,
                  rejection: str = "call") -> CheckResult:
    """Diff current cells against the baseline's. `only_traces`: compare the baseline's cells of these traces only.
    `rejection`: which rejection rate gates ("call" or "token", `REJECTION`); a metric a cell does not record
    reads as None (`require_rejection` checks the gated one is there)."""
    now = {_key(c): c for c in current}
    diffs = []
    for cell in expected:
        if only_traces is not None and cell["trace"] not in only_traces:
            continue
        key = _key(cell)
        got = now.get(key)
        base = {k: cell.get(k) for k in RECORDED}
        if got is None:
            diffs.append(CellDiff(*key, base, dict.fromkeys(RECORDED), ("cell no longer produced",)))
            continue
        diffs.append(_diff_cell(key, base, {k: got.get(k) for k in RECORDED}, tolerance, goodput_tolerance,
                                rejection))
    recorded = {_key(c) for c in expected}
    unexpected = [f"{t} · max_num_seqs {n} · {d}" for (t, n, d) in now if (t, n, d) not in recorded]
    return CheckResult(diffs, tolerance, goodput_tolerance, unexpected, rejection)


def _diff_cell(key, base: dict, cur: dict, tolerance: float, goodput_tolerance: float,
               rejection: str = "call") -> CellDiff:
    bad, good = [], []
    metric, label = REJECTION[rejection], REJECTION_LABEL[rejection]
    old, new = base[metric], cur[metric]
    if (old is None) != (new is None):
        bad.append(f"{label} {_pct(old)} → {_pct(new)}")
    elif old is not None:
        if new - old > tolerance:
            bad.append(f"{label} +{(new - old) * 100:.2f} pp > {tolerance * 100:.2f} pp")
        elif old - new > tolerance:
            good.append(f"{label} −{(old - new) * 100:.2f} pp")
    for name, label in (("goodput_tok_s", "goodput"), ("speedup", "speedup")):
        old, new = base[name], cur[name]
        if old is None or old == 0:
            if new is None and old is not None:
                bad.append(f"{label} no longer defined")
            continue
        if new is None:
            bad.append(f"{label} no longer defined")
            continue
        change = (new - old) / old
        if change < -goodput_tolerance:
            bad.append(f"{label} {change * 100:+.2f}% < −{goodput_tolerance * 100:.2f}%")
        elif change > goodput_tolerance:
            good.append(f"{label} {change * 100:+.2f}%")
    return CellDiff(*key, base, cur, tuple(bad), tuple(good))


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.2f}%"


def junit_xml(result: CheckResult) -> str:
    """The check as a JUnit XML test suite: one test case per cell, a <failure> per regressed cell."""
    suite = ElementTree.Element("testsuite", {
        "name": "agentspec-sim check", "tests": str(len(result.diffs)), "failures": str(len(result.failed)),
        "errors": "0", "skipped": "0"})
    props = ElementTree.SubElement(suite, "properties")
    for name, value in (("tolerance", result.tolerance), ("goodput_tolerance", result.goodput_tolerance),
                        ("rejection", result.rejection)):
        ElementTree.SubElement(props, "property", {"name": name, "value": repr(value)})
    for diff in result.diffs:
        case = ElementTree.SubElement(suite, "testcase", {"classname": f"check.{Path(diff.trace).name}",
                                                          "name": f"{diff.drafter} @ max_num_seqs={diff.max_num_seqs}"})
        detail = ", ".join(f"{k}: {diff.baseline.get(k)!r} → {diff.current.get(k)!r}" for k in RECORDED)
        if diff.regressions:
            failure = ElementTree.SubElement(case, "failure", {"message": "; ".join(diff.regressions),
                                                               "type": "regression"})
            failure.text = detail
        else:
            ElementTree.SubElement(case, "system-out").text = detail
    ElementTree.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ElementTree.tostring(suite, encoding="unicode") + "\n"


def write_junit(result: CheckResult, path: str | Path) -> None:
    with atomic_text(path) as out:
        out.write(junit_xml(result))
