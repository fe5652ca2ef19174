"""The report's Markdown tables, laid out as the paper's Tables 1, 2 and 5 (plus the numbers behind Figure 1).

Inputs are seed-averaged results (`results.seed_means`); every function returns Markdown text. A drafter with
an uncertainty band (its runs at the acceptance model's low and high bound, agentspec_sim.run.band) shows its
interval after the value: `1.52× [1.40–1.61×]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from agentspec_sim.report.results import workload_name
from agentspec_sim.run.band import format_interval, row_values


def _cell(frame: pl.DataFrame, drafter: str, batch: int, column: str) -> float | None:
    row = frame.filter((pl.col("drafter") == drafter) & (pl.col("max_num_seqs") == batch))
    return None if row.height == 0 else row[column][0]


def _band(frame: pl.DataFrame, drafter: str, batch: int, metric: str) -> list[float] | None:
    """[low, high] of `metric` at one cell from its band columns (agentspec_sim.run.band); None without a band."""
    if f"{metric}_low" not in frame.columns:
        return None

    rows = frame.filter((pl.col("drafter") == drafter) & (pl.col("max_num_seqs") == batch))
    return None if rows.height == 0 else row_values(rows.row(0, named=True), metric)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def rejection_table(setting: pl.DataFrame, drafters: Sequence[str], column: str = "rejection_rate") -> str:
    """Table 1: a rejection rate per drafter (rows) and max batch size (columns), plus the mean. `column`:
    `rejection_rate` (the paper's call mean) or `rejection_rate_tokens` (1 − vLLM's draft acceptance rate)."""
    sizes = setting["max_num_seqs"].unique().sort().to_list()
    rows = []
    for drafter in drafters:
        if drafter == "normal" or setting.filter(pl.col("drafter") == drafter).height == 0:
            continue
        values = [_cell(setting, drafter, b, column) for b in sizes]
        present = [v for v in values if v is not None]
        mean = sum(present) / len(present) if present else None
        rows.append([drafter, *map(_pct, values), _pct(mean)])
    return _table(["drafter", *[f"b={b}" for b in sizes], "mean"], rows, ["---", *["---:"] * (len(sizes) + 1)])


def speedup_table(setting: pl.DataFrame, drafters: Sequence[str]) -> str:
    """The numbers behind Figure 1 / 9a: goodput speedup per drafter and max batch size."""
    sizes = setting["max_num_seqs"].unique().sort().to_list()
    rows = []
    for drafter in drafters:
        if drafter == "normal" or setting.filter(pl.col("drafter") == drafter).height == 0:
            continue
        values = [_cell(setting, drafter, b, "speedup") for b in sizes]
        rows.append([drafter, *(format_interval(v, _band(setting, drafter, b, "speedup"), ".2f", "×")
                                for v, b in zip(values, sizes, strict=True))])
    normal = [_cell(setting, "normal", b, "goodput_tok_s") for b in sizes]
    rows.append(["*normal goodput (tok/s)*", *("—" if v is None else f"{v:,.0f}" for v in normal)])
    if "running_max" in setting.columns:
        # How many calls actually ran at once: past it a larger max_num_seqs changes nothing.
        running = [_cell(setting, "normal", b, "running_max") for b in sizes]
        rows.append(["*normal: most calls running*", *("—" if v is None else f"{v:,.0f}" for v in running)])
    return _table(["drafter", *[f"b={b}" for b in sizes]], rows, ["---", *["---:"] * len(sizes)])


def goodput_table(frame: pl.DataFrame, batches: dict[tuple[str, str, str], int], drafters: Sequence[str]) -> str:
    """Table 2's layout: per model, one row per drafter; per workload, goodput (tokens/s) and speedup.

    `batches` gives the max batch size used for each (trace, hardware, model); the best goodput of each
    workload column is bold."""
    settings = list(batches)  # the report's order: the order the results list them
    traces = list(dict.fromkeys(t for t, _, _ in settings))
    groups = list(dict.fromkeys((h, m) for _, h, m in settings))
    header = ["model (GPU)", "drafter"]
    for trace in traces:
        header += [f"{workload_name(trace)} tok/s", "speedup"]
    rows = []
    for hardware, model in groups:
        best: dict[str, float] = {}
        for trace in traces:
            if (trace, hardware, model) in batches:
                sub = frame.filter((pl.col("trace") == trace) & (pl.col("hardware") == hardware)
                                   & (pl.col("model") == model)
                                   & (pl.col("max_num_seqs") == batches[(trace, hardware, model)]))
                best[trace] = sub["goodput_tok_s"].max()
        for i, drafter in enumerate(drafters):
            row = [f"{model} ({hardware})" if i == 0 else "", drafter]
            for trace in traces:
                key = (trace, hardware, model)
                sub = frame.filter((pl.col("trace") == trace) & (pl.col("hardware") == hardware)
                                   & (pl.col("model") == model) & (pl.col("drafter") == drafter)
                                   & (pl.col("max_num_seqs") == batches.get(key, -1)))
                if sub.height == 0:
                    row += ["—", "—"]
                    continue
                goodput, speedup = sub["goodput_tok_s"][0], sub["speedup"][0]
                text = f"{goodput:,.1f}"
                batch = batches[key]
                goodput_band = _band(sub, drafter, batch, "goodput_tok_s")
                speedup_band = _band(sub, drafter, batch, "speedup")
                row += [(f"**{text}**" if goodput == best.get(trace) else text)
                        + (f" [{goodput_band[0]:,.1f}–{goodput_band[1]:,.1f}]" if goodput_band else ""),
                        "—" if speedup is None else f"×{speedup:.2f}"
                        + (f" [×{speedup_band[0]:.2f}–×{speedup_band[1]:.2f}]" if speedup_band else "")]
            rows.append(row)
    return _table(header, rows, ["---", "---", *["---:"] * (2 * len(traces))])


def breakdown_table(setting: pl.DataFrame, drafters: Sequence[str], batch: int) -> str:
    """Table 5: simulated drafting, verification (forward) and overall time per drafter at one batch size."""
    names = [d for d in drafters if _cell(setting, d, batch, "forward_time_s") is not None]
    draft = [_cell(setting, d, batch, "draft_time_s") or 0.0 for d in names]
    forward = [_cell(setting, d, batch, "forward_time_s") or 0.0 for d in names]
    total = [d + f for d, f in zip(draft, forward, strict=True)]
    minutes = max(total, default=0.0) >= 600
    scale, unit = (60.0, "minutes") if minutes else (1.0, "seconds")

    def fmt(values: list[float]) -> list[str]:
        return [f"{v / scale:,.2f}" for v in values]

    rows = [["Draft", *fmt(draft)], ["Verification (forward)", *fmt(forward)], ["Overall", *fmt(total)]]
    return _table([f"time ({unit})", *names], rows, ["---", *["---:"] * len(names)])
