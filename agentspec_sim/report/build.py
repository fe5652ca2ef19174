"""`write_report`: sweep results (and optional step logs) → a Markdown report with PNG plots in one folder.

One section per setting (trace, hardware, model) with the paper's views: speedup vs max batch size
(Figure 1 / 9a), draft tokens per step vs the budget M(b) (Figure 3), query-latency CDF (Figure 8),
drafting vs verification time (Table 5), rejection rates (Table 1); then one goodput table over all
settings (Table 2's layout). Files are written atomically; the same inputs give identical files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from agentspec_sim.io.atomic import atomic_text
from agentspec_sim.report import plots, tables
from agentspec_sim.report.results import SETTING, ResultsError, seed_means, workload_name

STEP_LOG_COLUMNS = ("step", "drafter", "batch_size", "D")


@dataclass
class Report:
    """What `write_report` wrote: the Markdown file and every PNG it links."""

    markdown: Path
    figures: list[Path] = field(default_factory=list)


def _slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def _drafter_order(frame: pl.DataFrame) -> tuple[str, ...]:
    names = list(dict.fromkeys(frame["drafter"].to_list()))
    return tuple(["normal"] * ("normal" in names) + [n for n in names if n != "normal"])


def _batch_for(setting: pl.DataFrame, batch: int | None, label: str) -> int:
    sizes = setting["max_num_seqs"].unique().sort().to_list()
    if batch is None:
        return sizes[-1]
    if batch not in sizes:
        raise ResultsError(f"--batch-size {batch}: {label} has no cells at that max_num_seqs "
                           f"(it has {', '.join(map(str, sizes))})")
    return batch


def load_step_logs(paths: Sequence[str | Path]) -> pl.DataFrame:
    """One row per (log, drafter, engine step) with its batch size and draft tokens D, from `replay --steps` logs."""
    frames = []
    for index, path in enumerate(paths):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(2, "No such file or directory", str(path))
        try:
            frame = pl.read_parquet(path, columns=None)
        except Exception as exc:  # polars raises several types for a damaged file
            raise ResultsError(f"{path}: not a readable parquet step log ({type(exc).__name__}: {exc})") from None
        missing = [c for c in STEP_LOG_COLUMNS if c not in frame.columns]
        if missing:
            raise ResultsError(f"{path}: missing column(s) {', '.join(missing)} (expected a `replay --steps` log)")
        frames.append(frame.select(STEP_LOG_COLUMNS).unique(subset=["drafter", "step"], keep="first")
                      .with_columns(pl.lit(index).alias("log")))
    return pl.concat(frames).with_columns(pl.col("D").fill_null(0)).sort(["log", "drafter", "step"])


def _budget_curve(hardware: str, model: str, largest: int) -> list[tuple[int, int]]:
    from agentspec_sim.cost import build_cost_model

    cost = build_cost_model(hardware=hardware, model=model)
    points = sorted({1, largest, *[2**i for i in range(0, largest.bit_length() + 1) if 2**i <= largest]})
    return [(b, cost.token_budget(b)) for b in points]


def write_report(results: pl.DataFrame, out_dir: str | Path, *, batch: int | None = None,
                 step_logs: Sequence[str | Path] = (), title: str = "agentspec-sim report",
                 sources: Sequence[str] = ()) -> Report:
    """Write `report.md` and its PNGs into `out_dir` from sweep `results` (the sweep schema).

    `batch`: the max batch size of the CDF, the time breakdown and the goodput table (default: each
    setting's largest). `step_logs`: `replay --steps` parquet files for a per-step Figure 3.
    `sources`: how the results were made (shown verbatim under the title). Raises ResultsError when
    `batch` is missing from a setting or a step log lacks its columns."""
    out = Path(out_dir)
    from agentspec_sim.sweep.capacity_plan import is_capacity_results
    from agentspec_sim.sweep.cells import SweepError

    try:
        by_capacity = is_capacity_results(results)
    except SweepError as exc:
        raise ResultsError(str(exc)) from None
    if by_capacity:
        return write_capacity_report(results, out, title=title, sources=sources)
    means = seed_means(results)
    drafters = _drafter_order(results)
    style = plots.Style(drafters)
    report = Report(markdown=out / "report.md")
    settings = means.select(SETTING).unique(maintain_order=True).rows()
    seeds = sorted(set(results["seed"].to_list()))
    lines = [f"# {title}", ""]
    lines += [f"    {s}" for s in sources] + ([""] if sources else [])
    lines += [f"{results.height} cells: {len(settings)} setting(s) × drafters {', '.join(drafters)} × max batch "
              f"sizes {', '.join(map(str, sorted(set(results['max_num_seqs'].to_list()))))}; seeds "
              f"{', '.join(map(str, seeds))} (metrics are means over seeds, latencies pooled). Speedup is goodput "
              "over `normal`'s on the same trace, GPU, model and max batch size; the rejection rate is given both "
              "ways: the paper's (Table 1), the mean over calls of a call's rejected / drafted tokens, and "
              "token-level, rejected / drafted tokens over the run = 1 − vLLM's draft acceptance rate "
              "(`vllm:spec_decode_num_accepted_tokens` / `num_draft_tokens`); times are simulated GPU time.", ""]
    if _has_band(results):
        lines += ["Drafters whose acceptance model has an uncertainty band (eagle3/mtp parameter files with a `band`) "
                  "were also run at its low and high bound, with the same trace, engine and seed: the plots shade "
                  "the band between those runs and the tables give it after the value as [low–high], the low "
                  "bound's run first.", ""]
    # Where each trace was when the sweep ran (its absolute path), so a report run elsewhere still finds it.
    files = (dict(results.select("trace", "trace_file").drop_nulls().unique(subset="trace", keep="first").rows())
             if "trace_file" in results.columns else {})
    batches: dict[tuple[str, str, str], int] = {}
    premises: dict[str, list[str]] = {}  # trace → its Figure-5 lines (one analysis per trace, not per setting)
    for trace, hardware, model in settings:
        setting = means.filter((pl.col("trace") == trace) & (pl.col("hardware") == hardware)
                               & (pl.col("model") == model))
        name = workload_name(trace)
        label = f"{name} · {model} · {hardware}"
        chosen = _batch_for(setting, batch, f"{trace} on {hardware}/{model}")
        batches[(trace, hardware, model)] = chosen
        slug = _slug(name, hardware, model)
        figures = [
            ("Speedup vs max batch size (paper Figure 1 / 9a)",
             plots.speedup_vs_batch(setting, style, f"Speedup vs max batch size — {label}",
                                    out / f"speedup-{slug}.png")),
            ("Draft tokens per step vs the budget M(b) (paper Figure 3)",
             plots.drafts_vs_budget(setting, style, f"Draft tokens per step vs budget M(b) — {label}",
                                    out / f"drafts-budget-{slug}.png")),
            (f"Query latency CDF at max batch size {chosen} (paper Figure 8)",
             plots.latency_cdf(setting, style, chosen, f"Query latency CDF, max batch {chosen} — {label}",
                               out / f"latency-cdf-{slug}.png")),
            (f"Drafting vs verification time at max batch size {chosen} (paper Table 5)",
             plots.time_breakdown(setting, style, chosen, f"Time breakdown, max batch {chosen} — {label}",
                                  out / f"time-breakdown-{slug}.png")),
        ]
        if trace not in premises:
            premises[trace] = ["### Where repeated output comes from (paper Figure 5)", "",
                               *_premise_lines(trace, files.get(trace)), ""]
        lines += [f"## {label}", "", f"Trace `{trace}`.", "", *premises[trace]]
        for caption, path in figures:
            report.figures.append(path)
            lines += [f"### {caption}", "", f"![{caption}]({path.name})", ""]
        lines += ["Speedup per max batch size (the numbers behind the first plot):", "",
                  tables.speedup_table(setting, drafters), "",
                  "### Rejection rate (paper Table 1)", "",
                  tables.rejection_table(setting, drafters), "",
                  *(["### Token rejection rate (1 − vLLM's draft acceptance rate)", "",
                     tables.rejection_table(setting, drafters, "rejection_rate_tokens"), ""]
                    if "rejection_rate_tokens" in setting.columns else []),
                  f"### Time breakdown at max batch size {chosen} (paper Table 5)", "",
                  tables.breakdown_table(setting, drafters, chosen), ""]
        latency = _latency_lines(setting, drafters, chosen)
        if latency:
            lines += [f"Query latency P50 / P90 / P99 (s) at max batch size {chosen}: {latency}.", ""]
    lines += ["## Goodput (paper Table 2 layout)", "",
              "Goodput in output tokens per second of simulated time at max batch size "
              + ", ".join(f"{b} ({workload_name(t)})" for (t, _, _), b in batches.items())
              + "; best per workload in bold.", "", tables.goodput_table(means, batches, drafters), ""]
    if step_logs:
        per_step = load_step_logs(step_logs)
        hardware, model = settings[0][1], settings[0][2]
        largest = max(int(per_step["batch_size"].max() or 1), 1)
        path = plots.step_drafts_vs_batch(per_step, _budget_curve(hardware, model, largest), style,
                                          f"Draft tokens per engine step (step logs) — {model} · {hardware}",
                                          out / "step-drafts-budget.png")
        report.figures.append(path)
        names = ", ".join(f"`{Path(p).name}`" for p in step_logs)
        lines += ["## Draft tokens per engine step from step logs (paper Figure 3)", "",
                  f"From {names}: engine steps binned by their real batch size (powers of two); M(b) for "
                  f"{model} on {hardware}.", "", f"![Draft tokens per engine step]({path.name})", ""]
    if "tpot_mean" in results.columns:  # results written before TPOT means were recorded have no Pareto view
        lines += _pareto_section(results, style, out, report)
    with atomic_text(report.markdown) as handle:
        handle.write("\n".join(lines).rstrip() + "\n")
    return report


def _premise_lines(trace: str, absolute: str | None = None) -> list[str]:
    """The trace's repeated-span profile (paper Figure 5) and AgentSpec's premise verdict
    (`analysis.repetition.isolation_premise`), when the trace file is where the results say: the path as given
    (from here), else its absolute path when the sweep ran."""
    from agentspec_sim.analysis.repetition import isolation_premise, premise_sentence, workload_repetition
    from agentspec_sim.trace.io import load_trace

    if not Path(trace).is_file() and absolute is not None and Path(absolute).is_file():
        trace = absolute
    if not Path(trace).is_file():
        return [f"Not computed: `{trace}` is not a file here (run the report where the trace is)."]
    try:
        profile = workload_repetition(load_trace(trace))
    except (OSError, ValueError) as exc:  # TraceError and an unknown tokenizer are ValueErrors
        return [f"Not computed: `{trace}` did not load ({exc})."]
    rows = ["| k | same block | same query, other block | other query | total |", "|---|---|---|---|---|"]
    rows += [f"| {k} | " + " | ".join(f"{100 * row[c]:.1f}%" for c in
                                       ("same_block", "same_query_other_block", "other_query", "total")) + " |"
             for k, row in profile["by_k"].items()]
    return ["Share of output tokens in spans of ≥ k tokens seen earlier, by where the earlier occurrence is "
            "(`agentspec-sim inspect`):", "", *rows, "",
            f"AgentSpec's premise {premise_sentence(isolation_premise(profile))}"]


def _has_band(results: pl.DataFrame) -> bool:
    return "speedup_low" in results.columns and results["speedup_low"].null_count() < results.height


def _latency_lines(setting: pl.DataFrame, drafters: Sequence[str], batch: int) -> str:
    import numpy as np

    parts = []
    for drafter in drafters:
        row = setting.filter((pl.col("drafter") == drafter) & (pl.col("max_num_seqs") == batch))
        if row.height == 0:
            continue
        values = np.asarray(row["query_latencies_s"][0].to_list(), dtype=np.float64)
        if values.size:
            p50, p90, p99 = np.percentile(values, (50, 90, 99))
            parts.append(f"{drafter} {p50:,.1f} / {p90:,.1f} / {p99:,.1f}")
    return "; ".join(parts)


def _capacity_cell(d, size: int) -> str:
    """One drafter's capacity at one max_num_seqs for the report's table: rate [low, high], or ≥ floor."""
    if size not in d.by_batch:
        return "—"
    if size in d.at_least:
        return f"≥ {d.at_least[size]:.3g} (inconclusive)"
    rate, (low, high) = d.by_batch[size], d.intervals.get(size, (None, None))
    if not rate or low is None or high is None:
        return f"{rate or 0:.3g}"
    return f"{rate:.3g} [{low:.3g}, {high:.3g}]"


# What the capacity report's tables and plots read beyond what `plan_capacity` checks, by the kind they must be.
_CAPACITY_NUMBERS = ("seed",)
_CAPACITY_LISTS = ("probe_rate", *(f"probe_{k}_{p}" for k in ("ttft", "tpot", "query_latency") for p in ("p50", "p99")))


def _check_capacity_columns(results: pl.DataFrame) -> None:
    """ResultsError naming the first column the capacity report needs that is missing or of another kind (a file
    edited or written by something else), as `plan` names a missing column."""
    missing = [c for c in (*_CAPACITY_NUMBERS, *_CAPACITY_LISTS) if c not in results.columns]
    if missing:
        raise ResultsError(f"capacity results lack column(s) {', '.join(missing)} (written by sweep --capacity)")
    from agentspec_sim.sweep.capacity_plan import column_kind_error

    why = column_kind_error(results, _CAPACITY_NUMBERS, _CAPACITY_LISTS)
    if why:
        raise ResultsError(why)


def write_capacity_report(results: pl.DataFrame, out: Path, *, title: str = "agentspec-sim report",
                          sources: Sequence[str] = ()) -> Report:
    """`report.md` and its PNGs for capacity-search results (`sweep --capacity`): per setting, the capacity
    table, latency against offered load at each drafter's best max_num_seqs with the SLO and each capacity
    marked, and capacity against max_num_seqs; the load protocol in every title."""
    from agentspec_sim.sweep.capacity_plan import plan_capacity
    from agentspec_sim.sweep.cells import SweepError

    try:
        plans = plan_capacity(results)
    except SweepError as exc:
        raise ResultsError(str(exc)) from None
    _check_capacity_columns(results)
    drafters = _drafter_order(results)
    style = plots.Style(drafters)
    report = Report(markdown=out / "report.md")
    lines = [f"# {title}", ""]
    lines += [f"    {s}" for s in sources] + ([""] if sources else [])
    lines += [f"{results.height} capacity searches. A configuration's capacity is the highest steady request rate "
              "(queries/s, sent as `vllm bench serve --request-rate` sends them) at which the engine keeps up and "
              "the SLO attainment target holds over the steady window, the mean over seeds with its 95 % interval; "
              "≥ x: inconclusive, the trace too short to load it; docs/sweep-and-plan.md.", ""]
    from agentspec_sim.cost.layout import Layout
    from agentspec_sim.sweep.plan import with_layout

    laid_out = with_layout(results)
    several = laid_out.select("tensor_parallel_size", "expert_parallel", "data_parallel_size").n_unique() > 1
    for plan in plans:
        name = workload_name(plan.trace)
        layout = Layout.of(plan.engine)
        # Each layout its own section, plots and file names (they overwrote each other under one name).
        label = f"{name} · {plan.model} · {plan.hardware}" + (f" · {layout.label}" if several else "")
        slug = _slug(name, plan.hardware, plan.model, *([layout.tag or "tp1"] if several else []))
        setting = laid_out.filter((pl.col("trace") == plan.trace) & (pl.col("hardware") == plan.hardware)
                                  & (pl.col("model") == plan.model) & (pl.col("seed") == results["seed"].min())
                                  & (pl.col("tensor_parallel_size") == layout.tensor_parallel_size)
                                  & (pl.col("expert_parallel") == layout.expert_parallel)
                                  & (pl.col("data_parallel_size") == layout.data_parallel_size))
        slo = plan.search["slo"]
        best_rows = []
        for d in plan.drafters:
            if d.best is None:
                continue
            match = setting.filter((pl.col("drafter") == d.drafter) & (pl.col("max_num_seqs") == d.best.max_num_seqs))
            if match.height:
                best_rows.append(match.row(0, named=True))
        load = f"load: {plan.protocol}, ≥ {plan.search['target']:.0%} attainment"
        latency = plots.latency_vs_load(best_rows, style, slo, f"Latency vs offered load — {label} — {load}",
                                        out / f"latency-load-{slug}.png")
        capacity = plots.capacity_vs_batch(setting, style, f"Capacity vs max batch size — {label}\n{load}",
                                           out / f"capacity-batch-{slug}.png")
        report.figures += [latency, capacity]
        sizes = sorted({size for d in plan.drafters for size in d.by_batch})
        header = "| drafter | " + " | ".join(str(s) for s in sizes) + " |"
        table = [header, "|" + "---|" * (len(sizes) + 1)]
        for d in plan.drafters:
            cells = [_capacity_cell(d, s) for s in sizes]
            table.append(f"| {d.drafter} | " + " | ".join(cells) + " |")
        lines += [f"## {label}", "", f"Trace `{plan.trace}`; {load}; SLO "
                  + ", ".join(f"{k} ≤ {v:g} s" for k, v in slo.items() if v) + ".", "",
                  "Capacity (queries/s) by max_num_seqs:", "", *table, "", f"**Pick:** {plan.reason}", "",
                  *_price_line(plan),
                  f"![Latency vs offered load]({latency.name})", "", f"![Capacity vs max batch size]({capacity.name})",
                  ""]
    lines += _summary_tables(plans)
    lines += _pareto_section(results, style, out, report)
    sources = sorted({p.price_source for p in plans if p.price_source})
    lines += [f"Prices: {text}" for text in sources] + ([""] if sources else [])
    with atomic_text(report.markdown) as handle:
        handle.write("\n".join(lines).rstrip() + "\n")
    return report


def _pareto_section(results: pl.DataFrame, style: plots.Style, out: Path, report: Report) -> list[str]:
    """Per (trace, model) with more than one configuration: the Pareto plot of output tok/s per GPU against tok/s
    per user (`sweep.pareto`) and its frontier as a table."""
    from agentspec_sim.sweep.pareto import pareto_points

    groups: dict[tuple[str, str], list] = {}
    for point in pareto_points(results):
        groups.setdefault((point.trace, point.model), []).append(point)
    lines: list[str] = []
    for (trace, model), points in groups.items():
        if len(points) < 2:
            continue
        name = workload_name(trace)
        figure = plots.pareto(points, style, f"Throughput per GPU vs speed per user — {name} · {model}",
                              out / f"pareto-{_slug(name, model)}.png")
        report.figures.append(figure)
        lines += [f"## Pareto frontier · {name} · {model}", "",
                  "Every configuration (drafter, max_num_seqs, layout, GPU) as output tokens/s per GPU against "
                  "tokens/s per user (1 / mean TPOT); the frontier holds those no other beats on both.", "",
                  "| GPU | layout | drafter | batch | tok/s/GPU | tok/s/user |", "|---|---|---|---:|---:|---:|",
                  *(f"| {p.hardware} | {p.layout} | {p.drafter} | {p.max_num_seqs} | {p.tok_s_per_gpu:,.1f} | "
                    f"{p.tok_s_per_user:,.1f} |" for p in points if p.on_frontier),
                  "", f"![Pareto frontier]({figure.name})", ""]
    return lines


def _price_line(plan) -> list[str]:
    """The pick's $ per million output tokens and per thousand queries, where its GPU has a price."""
    best = plan.best
    if best is None or best.usd_per_million_tokens is None:
        return []
    return [f"At ${plan.usd_per_gpu_hour:g} per GPU-hour (prices: below): ${best.usd_per_million_tokens:.3f} per "
            f"million output tokens, ${1000 * best.usd_per_query:.3g} per thousand queries.", ""]


def _summary_tables(plans: list) -> list[str]:
    """What `plan` answers across layouts and GPUs, as Markdown: per (trace, hardware, model) the layouts, best
    first; per (trace, model) the GPUs, least $ per query first where every GPU has a price."""
    from agentspec_sim.sweep.plan import hardware_summary, layout_summary

    def cell(value: float | None, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    lines: list[str] = []
    for pair in layout_summary(plans):
        rows = pair["layouts"]
        lines += [f"## Layouts · {workload_name(pair['trace'])} · {pair['model']} · {pair['hardware']}", "",
                  f"Each layout's best drafter and max_num_seqs, {rows[0]['unit']}, best first "
                  "(≈: not told apart from the best).", "",
                  "| layout | GPUs | drafter | batch | per GPU | $/Mtok |", "|---|---:|---|---:|---:|---:|"]
        for r in rows:
            mark = " ≈" if r.get("told_apart_from_best") is False else ""
            lines.append(f"| {r['layout']} | {r['gpus']} | {r['drafter'] or 'none'} | {r['max_num_seqs'] or '—'} | "
                         f"{cell(r['per_gpu'], '.4g')}{mark} | {cell(r['usd_per_million_tokens'], '.3f')} |")
        lines.append("")
    for model in hardware_summary(plans):
        rows = model["hardware"]
        lines += [f"## GPUs · {workload_name(model['trace'])} · {model['model']}", "",
                  f"Each GPU's best layout, drafter and max_num_seqs, {rows[0]['unit']}; $ where the GPU has a "
                  "price (the bundled table or --prices).", "",
                  "| GPU | layout | drafter | batch | per GPU | $/Mtok | $/kq |", "|---|---|---|---:|---:|---:|---:|"]
        for r in rows:
            per_kq = None if r["usd_per_query"] is None else 1000 * r["usd_per_query"]
            lines.append(f"| {r['hardware']} | {r['layout']} | {r['drafter'] or 'none'} | {r['max_num_seqs'] or '—'} | "
                         f"{cell(r['per_gpu'], '.4g')} | {cell(r['usd_per_million_tokens'], '.3f')} | "
                         f"{cell(per_kq, '.3g')} |")
        lines.append("")
    return lines
