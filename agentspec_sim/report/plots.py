"""The report's figures (matplotlib, Agg): one function per paper figure, each writing one PNG atomically.

Every function takes the seed-averaged results of one setting (trace, hardware, model; see
`results.seed_means`) and a `Style` that gives each drafter the same colour and marker in every figure.
PNGs carry no software-version metadata, so the same results give byte-identical files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display (CI machines have none)

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from agentspec_sim.io.atomic import atomic_binary

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h")
_DPI = 120


@dataclass(frozen=True)
class Style:
    """Colour and marker per drafter, fixed for the whole report (`normal` is always black)."""

    drafters: tuple[str, ...]

    def color(self, drafter: str) -> str:
        if drafter == "normal":
            return "black"
        others = [d for d in self.drafters if d != "normal"]
        return f"C{others.index(drafter) % 10}" if drafter in others else "grey"

    def marker(self, drafter: str) -> str:
        return _MARKERS[self.drafters.index(drafter) % len(_MARKERS)] if drafter in self.drafters else "."


def _save(fig: Figure, path: Path) -> Path:
    with atomic_binary(path, compress=False) as out:
        fig.savefig(out, format="png", dpi=_DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def _outside_legend(ax) -> None:
    """The legend right of the axes, where it never hides a line."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _batch_axis(ax, sizes: Sequence[int]) -> None:
    """Log-2 x axis labelled with the batch sizes actually swept."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(sizes))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(s) for s in sorted(set(sizes))])
    ax.set_xlabel("max batch size (max_num_seqs, log₂ scale)")


def speedup_vs_batch(setting: pl.DataFrame, style: Style, title: str, path: Path) -> Path:
    """Paper Figure 1 / 9a: goodput speedup over `normal` against the max batch size, one line per drafter."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    sizes = setting["max_num_seqs"].unique().sort().to_list()
    ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--", label="normal (1.0×)")
    for drafter in style.drafters:
        rows = setting.filter((pl.col("drafter") == drafter) & pl.col("speedup").is_not_null()).sort("max_num_seqs")
        if drafter == "normal" or rows.height == 0:
            continue
        ax.plot(rows["max_num_seqs"], rows["speedup"], marker=style.marker(drafter), color=style.color(drafter),
                label=drafter)
        _band(ax, rows, style.color(drafter), f"{drafter}: acceptance band")
    _batch_axis(ax, sizes)
    ax.set_ylabel("speedup in goodput (× normal)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _outside_legend(ax)
    fig.tight_layout()
    return _save(fig, path)


def _band(ax, rows: pl.DataFrame, color: str, label: str) -> None:
    """A drafter's uncertainty band (its runs at the acceptance model's low and high bound, agentspec_sim.run.band),
    shaded between them at the batch sizes that have one; nothing for a drafter without a band."""
    if "speedup_low" not in rows.columns or "speedup_high" not in rows.columns:
        return
    banded = rows.filter(pl.col("speedup_low").is_not_null() & pl.col("speedup_high").is_not_null())
    if banded.height == 0:
        return
    low, high = banded["speedup_low"].to_numpy(), banded["speedup_high"].to_numpy()
    ax.fill_between(banded["max_num_seqs"].to_numpy(), np.minimum(low, high), np.maximum(low, high), color=color,
                    alpha=0.15, linewidth=0, label=label)


def drafts_vs_budget(setting: pl.DataFrame, style: Style, title: str, path: Path) -> Path:
    """Paper Figure 3: mean draft tokens per engine step against the budget M(b) = AI − b, per max batch size.

    M(b) is the mean budget over the same steps (the engine logs it at each step's real batch size),
    taken from the speculative runs."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    spec = setting.filter(pl.col("drafter") != "normal")
    sizes = setting["max_num_seqs"].unique().sort().to_list()
    budget = (spec.group_by("max_num_seqs").agg(pl.col("token_budget_mean").mean()).sort("max_num_seqs")
              .drop_nulls())
    if budget.height:
        ax.plot(budget["max_num_seqs"], budget["token_budget_mean"], color="black", linestyle="--", linewidth=1.5,
                label="budget M(b) = AI − b")
    for drafter in style.drafters:
        rows = spec.filter((pl.col("drafter") == drafter) & pl.col("draft_tokens_per_step").is_not_null())
        if rows.height == 0:
            continue
        rows = rows.sort("max_num_seqs")
        ax.plot(rows["max_num_seqs"], rows["draft_tokens_per_step"], marker=style.marker(drafter),
                color=style.color(drafter), label=drafter)
    _batch_axis(ax, sizes)
    _token_axis(ax)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _outside_legend(ax)
    fig.tight_layout()
    return _save(fig, path)


def _token_axis(ax) -> None:
    """Log y axis for token counts (drafts span 0.1 to hundreds); zeros are left off a log axis, so fall back
    to linear when nothing positive was drawn."""
    values = np.concatenate([np.asarray(line.get_ydata(), dtype=np.float64) for line in ax.get_lines()] or [[0.0]])
    positive = values[values > 0]
    ax.set_ylabel("draft tokens per engine step (tokens)")
    if positive.size == 0:
        return
    ax.set_yscale("log")
    ax.set_ylim(positive.min() / 1.6, positive.max() * 2.5)
    # Plain numbers (0.5, 20, 300), not 3×10²; on a narrow range the 2s and 5s between decades too.
    narrow = positive.max() / positive.min() < 10
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda value, _: f"{value:g}" if narrow and _leading_digit(value) in (2, 5) else ""))


def _leading_digit(value: float) -> int:
    return round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0


def latency_cdf(setting: pl.DataFrame, style: Style, batch: int, title: str, path: Path) -> Path:
    """Paper Figure 8: the CDF of end-to-end query latency at one max batch size, one curve per drafter."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    rows = setting.filter(pl.col("max_num_seqs") == batch)
    positive = []
    for drafter in style.drafters:
        row = rows.filter(pl.col("drafter") == drafter)
        if row.height == 0:
            continue
        latencies = np.sort(np.asarray(row["query_latencies_s"][0].to_list(), dtype=np.float64))
        if latencies.size == 0:
            continue
        positive.append(latencies[latencies > 0])
        # The empirical CDF, starting from 0 at the fastest query so the first step is drawn.
        xs = np.concatenate([latencies[:1], latencies])
        fraction = np.arange(0, latencies.size + 1) / latencies.size
        ax.step(xs, fraction, where="post", color=style.color(drafter), label=drafter,
                linewidth=2.0 if drafter == "normal" else 1.5)
    values = np.concatenate(positive) if positive else np.zeros(0)
    # Query latencies span orders of magnitude on agent traces; a log axis keeps the body readable.
    if values.size and values.max() / max(values.min(), 1e-9) > 50:
        ax.set_xscale("log")
        ax.set_xlabel("query latency (s, log scale)")
    else:
        ax.set_xlabel("query latency (s)")
    for p in (0.9, 0.99):
        ax.axhline(p, color="grey", linewidth=0.8, linestyle=":")
        ax.text(0.01, p, f"P{round(p * 100)}", transform=ax.get_yaxis_transform(), va="bottom", ha="left",
                fontsize="small", color="grey")
    ax.set_ylabel("fraction of queries completed")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _outside_legend(ax)
    fig.tight_layout()
    return _save(fig, path)


def time_breakdown(setting: pl.DataFrame, style: Style, batch: int, title: str, path: Path) -> Path:
    """Paper Table 5 as a chart: simulated drafting vs forward (verification) time per drafter at one batch size."""
    rows = setting.filter(pl.col("max_num_seqs") == batch)
    names = [d for d in style.drafters if rows.filter(pl.col("drafter") == d).height]
    draft = np.array([rows.filter(pl.col("drafter") == d)["draft_time_s"][0] for d in names], dtype=np.float64)
    forward = np.array([rows.filter(pl.col("drafter") == d)["forward_time_s"][0] for d in names], dtype=np.float64)
    scale, unit = (60.0, "min") if max(forward.max(initial=0) + draft.max(initial=0), 0) >= 600 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    x = np.arange(len(names))
    ax.bar(x, forward / scale, color="#4C72B0", label="forward pass (verification)")
    ax.bar(x, draft / scale, bottom=forward / scale, color="#DD8452", label="drafting")
    for i, (f, d) in enumerate(zip(forward, draft, strict=True)):
        ax.text(i, (f + d) / scale, f"{(f + d) / scale:,.1f}", ha="center", va="bottom", fontsize="small")
    ax.set_xticks(x, names, rotation=20 if len(names) > 5 else 0)
    ax.set_xlabel("drafter")
    ax.set_ylabel(f"simulated GPU time ({unit})")
    ax.set_ylim(0, max((forward + draft).max(initial=0) / scale * 1.25, 1e-9))
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper right", ncols=2)
    fig.tight_layout()
    return _save(fig, path)


def step_drafts_vs_batch(per_step: pl.DataFrame, budget: Sequence[tuple[int, int]], style: Style, title: str,
                         path: Path) -> Path:
    """Figure 3 from run step logs: mean draft tokens per engine step against the step's real batch size.

    `per_step`: one row per (drafter, step) with `batch_size` and `D`; `budget`: (b, M(b)) points."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    if budget:
        b, m = zip(*budget, strict=True)
        ax.plot(b, m, color="black", linestyle="--", linewidth=1.5, label="budget M(b) = AI − b")
    binned = per_step.with_columns(
        (pl.col("batch_size").cast(pl.Float64).log(2).floor().cast(pl.Int64)).alias("_bin"))
    sizes: list[int] = []
    for drafter in style.drafters:
        rows = binned.filter(pl.col("drafter") == drafter)
        if rows.height == 0 or drafter == "normal":
            continue
        means = rows.group_by("_bin").agg(pl.col("batch_size").mean(), pl.col("D").mean()).sort("_bin")
        sizes += [2 ** int(v) for v in means["_bin"]]
        ax.plot(means["batch_size"], means["D"], marker=style.marker(drafter), color=style.color(drafter),
                label=drafter)
    _batch_axis(ax, sizes or [1])
    ax.set_xlabel("batch size of the engine step (calls, log₂ bins)")
    _token_axis(ax)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _outside_legend(ax)
    fig.tight_layout()
    return _save(fig, path)


_LATENCY_PANELS = (("ttft", "TTFT", "ttft_s"), ("tpot", "TPOT", "tpot_s"), ("query_latency", "query latency",
                                                                             "query_latency_s"))


def latency_vs_load(rows: Sequence[dict], style: Style, slo: dict, title: str, path: Path) -> Path:
    """Latency against offered load, one line per drafter (its probes at its best max_num_seqs, `rows`: capacity
    rows with the probe_* list columns): TTFT, TPOT and query latency, p99 solid and p50 dashed; each SLO a
    horizontal line, each drafter's capacity a dotted vertical line in its colour. Probes at rate 0 (each query
    alone) have no place on a rate axis and are left out; of a search over several seeds, the first seed's probes
    are drawn. A probe ended once its failure was certain (`probe_stopped_s`) has no latencies: it is marked with
    an x at the foot of each panel, at its rate, and the lines join the probes that ran to their end."""
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 4.0))
    for ax, (key, name, slo_key) in zip(axes, _LATENCY_PANELS, strict=True):
        for row in rows:
            drafter, color = row["drafter"], style.color(row["drafter"])
            rates = np.array([np.nan if r is None else r for r in row["probe_rate"]], dtype=float)
            keep = np.isfinite(rates) & (rates > 0)
            seeds = row.get("probe_seed")
            if seeds:  # one seed's probes make one curve (each seed draws its own send times)
                seeds = np.array([np.nan if x is None else x for x in seeds], dtype=float)
                keep &= seeds == np.nanmin(seeds)
            stopped = row.get("probe_stopped_s")
            if stopped:
                partial = np.isfinite(np.array([np.nan if x is None else x for x in stopped], dtype=float))
                ax.plot(rates[keep & partial], np.full(int((keep & partial).sum()), 0.03), "x", color=color,
                        markersize=5, transform=ax.get_xaxis_transform())
                keep &= ~partial
            order = np.argsort(rates[keep])
            for pct, line in (("p99", "-"), ("p50", "--")):
                values = np.array([np.nan if v is None else v for v in row[f"probe_{key}_{pct}"]], dtype=float)
                ax.plot(rates[keep][order], values[keep][order], line, marker=style.marker(drafter) if pct == "p99"
                        else None, color=color, markersize=4,
                        label=f"{drafter} (max_num_seqs {row['max_num_seqs']})" if pct == "p99" else None)
            if row.get("capacity_rate"):
                ax.axvline(row["capacity_rate"], color=color, linestyle=":", linewidth=1.2)
        if slo.get(slo_key):
            ax.axhline(slo[slo_key], color="red", linewidth=1.2, label=f"SLO {slo[slo_key]:g} s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (queries/s, log)")
        ax.set_ylabel(f"{name} (s, log): p99 solid, p50 dashed")
        ax.grid(True, alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, fontsize="small", loc="lower center", ncol=min(4, len(labels)),
               bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(title + "\n(dotted verticals: each drafter's capacity; x at the foot: a probe stopped once it "
                 "had certainly failed)", fontsize="medium")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return _save(fig, path)


def capacity_vs_batch(setting: pl.DataFrame, style: Style, title: str, path: Path) -> Path:
    """Capacity (steady-state queries/s at the attainment target, with its interval as an error bar; an
    inconclusive cell drawn as a hollow marker at the floor it reached) against max_num_seqs, one line per
    drafter."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    sizes = setting["max_num_seqs"].unique().sort().to_list()
    for drafter in style.drafters:
        rows = setting.filter(pl.col("drafter") == drafter).sort("max_num_seqs")
        if rows.height == 0:
            continue
        x = rows["max_num_seqs"].to_numpy()
        lost = rows["capacity_inconclusive"].is_not_null().to_numpy()
        y = np.where(lost, rows["capacity_at_least"].fill_null(0.0).to_numpy(),
                     rows["capacity_rate"].fill_null(0.0).to_numpy())
        low = rows["capacity_low"].fill_null(strategy="zero").to_numpy()
        high = rows["capacity_high"].fill_null(strategy="zero").to_numpy()
        err = np.where(lost, 0.0, np.vstack([np.clip(y - low, 0, None), np.clip(high - y, 0, None)]))
        ax.errorbar(x, y, yerr=err, marker=style.marker(drafter), color=style.color(drafter), label=drafter,
                    capsize=3)
        if lost.any():
            ax.scatter(x[lost], y[lost], s=80, facecolors="none", edgecolors=style.color(drafter))
    _batch_axis(ax, sizes)
    ax.set_ylim(bottom=0)  # ratios between drafters read true only from zero
    ax.set_ylabel("capacity, queries/s\n(bars: 95 % interval; hollow: ≥, inconclusive)")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, alpha=0.3)
    _outside_legend(ax)
    fig.tight_layout()
    return _save(fig, path)


def pareto(points: Sequence, style: Style, title: str, path: Path) -> Path:
    """Output tokens/s per GPU against tokens/s per user (`sweep.pareto` points of one trace and model): every
    configuration a dot in its drafter's colour, the frontier joined; both axes from zero."""
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for drafter in style.drafters:
        mine = [p for p in points if p.drafter == drafter]
        if mine:
            ax.scatter([p.tok_s_per_user for p in mine], [p.tok_s_per_gpu for p in mine], s=28,
                       marker=style.marker(drafter), color=style.color(drafter), label=drafter, alpha=0.85)
    front = sorted((p for p in points if p.on_frontier), key=lambda p: p.tok_s_per_user)
    ax.plot([p.tok_s_per_user for p in front], [p.tok_s_per_gpu for p in front], "-", color="black", linewidth=1.0,
            label="frontier", zorder=0)
    for p in front:
        ax.annotate(f"{p.hardware} {p.layout} b{p.max_num_seqs}", (p.tok_s_per_user, p.tok_s_per_gpu), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens/s per user (1 / mean TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, alpha=0.3)
    _outside_legend(ax)
    fig.tight_layout()
    return _save(fig, path)
