"""Capacity planning from sweep results: for each drafter configuration the max_num_seqs that
maximises goodput under the SLOs and the KV cache, the best (drafter, k, max_num_seqs) overall with
the reason in one line, and the vLLM flags that deploy it.

Rules (docs/sweep-and-plan.md):
- Seeds: goodput and speedup are averaged over a cell's seeds; latency percentiles and preemptions
  take the worst seed, so a batch size passes an SLO only if every seed does.
- Feasible: query-latency p99 ≤ `p99_latency_s`, TTFT p99 ≤ `ttft_s`, TPOT p99 ≤ `tpot_s`, goodput ≥
  `min_goodput_tok_s` (each only if set), and the KV cache holds every admitted call: no recompute
  preemption (vLLM preempts exactly when the KV cache runs out), unless `allow_preemption`.
- Per drafter: the feasible max_num_seqs of highest goodput (a tie goes to the smaller batch).
  Overall: the drafter whose best has the highest goodput (ties: `normal`, then the smaller batch).
- The vLLM flags: `--max-num-seqs`, the engine settings the sweep was given that vLLM would not pick by itself
  (`vllm_engine_args`), and the winner's `--speculative-config` with vLLM's keys only; an EAGLE-3 winner
  names its draft head ("model", which vLLM requires), or a marked field to fill in.
- The uncertainty band: where the chosen goodput lies inside another drafter's band (the runs at the low and
  high bound of its acceptance model, agentspec_sim.run.band), or another's goodput inside the chosen one's, the
  plan names those drafters (`band_overlaps`, `band_note`): the simulation does not tell them apart.
- The `num_speculative_tokens_per_batch_size` schedule: for each swept batch size up to the chosen
  one, the k of the winner's method (its configurations that differ only in k, and `normal` as
  k = 0) with the highest goodput at that max_num_seqs; each range runs from the previous swept
  size + 1 to this one. Proposed only for methods vLLM allows it for and when k is not constant.
  It is derived from whole runs at each max_num_seqs, not simulated as one configuration.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from agentspec_sim.sweep.cells import SweepError

# A plan per (trace, hardware, model, parallel layout): a sweep that crossed layouts plans each on its own
# (`with_layout` derives the layout columns from each row's engine settings), and `layout_summary` ranks them.
_GROUP = ("trace", "hardware", "model", "tensor_parallel_size", "expert_parallel", "data_parallel_size")
# How the simulator's methods are deployed in vLLM 0.33 (docs/vllm-engine-facts.md): both n-gram rules
# are `method: ngram`; the V1 rule needs the V1 model runner, V2 is the default. The AgentSpec family
# and AgSpec are research drafters vLLM does not ship.
_VLLM_METHOD = {"ngram-v2": "ngram"}
_VLLM_ENV = {"ngram": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
_NOT_IN_VLLM = frozenset({"agentspec", "agentspec-s", "agentspec-r", "agentspec-n", "agentspec-paper", "agspec"})
_CELL = (*_GROUP, "drafter", "speculative_config", "max_num_seqs")
# The vLLM 0.33 SpeculativeConfig fields (vllm/config/speculative.py) a simulated configuration can carry.
# vLLM forbids any other key, so the simulator's own (target_model, acceptance_params, seed, tokenizer…) are
# left out of the printed --speculative-config.
VLLM_SPECULATIVE_KEYS = frozenset({
    "method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "model", "draft_tensor_parallel_size",
    "quantization", "revision", "code_revision", "prompt_lookup_min", "prompt_lookup_max",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
})
# Methods whose draft weights vLLM 0.33 cannot infer: without "model" it raises "num_speculative_tokens was
# provided but without speculative model" (mtp defaults to the target's own weights; ngram and suffix need none).
_NEEDS_DRAFT_MODEL = frozenset({"eagle3"})
REQUIRED_DRAFT_MODEL = "<REQUIRED: the EAGLE-3 draft head to deploy>"


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a deployment must meet (None: no limit). Times in seconds."""

    p99_latency_s: float | None = None  # query latency, p99
    ttft_s: float | None = None  # time to first token, p99
    tpot_s: float | None = None  # time per output token, p99
    min_goodput_tok_s: float | None = None
    allow_preemption: bool = False

    def violations(self, cell: dict[str, Any]) -> list[str]:
        """Why `cell` (an aggregated row) breaks the objectives; empty when it meets them all."""
        out = []
        for column, limit, name in (("query_latency_p99", self.p99_latency_s, "query p99"),
                                    ("ttft_p99", self.ttft_s, "TTFT p99"), ("tpot_p99", self.tpot_s, "TPOT p99")):
            value = cell[column]
            if limit is not None and (value is None or value > limit):
                shown = "none completed" if value is None else f"{value:.3g} s"
                out.append(f"{name} {shown} > {limit:g} s")
        if self.min_goodput_tok_s is not None and cell["goodput_tok_s"] < self.min_goodput_tok_s:
            out.append(f"goodput {cell['goodput_tok_s']:,.0f} < {self.min_goodput_tok_s:,.0f} tok/s")
        if not self.allow_preemption and cell["preemptions"] > 0:
            out.append(f"KV cache full ({cell['preemptions']} preemptions; "
                       f"{cell['kv_tokens']:,} KV tokens)")
        if cell["incomplete_queries"] > 0:
            out.append(f"{cell['incomplete_queries']} queries did not complete")
        return out


@dataclass(frozen=True)
class Choice:
    """One drafter configuration at one max_num_seqs (averaged over seeds)."""

    drafter: str
    speculative_config: dict[str, Any]
    max_num_seqs: int
    goodput_tok_s: float
    speedup: float | None
    query_latency_p99_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    preemptions: int
    # [low, high]: the runs at the acceptance model's low and high bound (agentspec_sim.run.band), averaged over
    # seeds as the point values are; None for a configuration without a band (or results without the columns).
    goodput_tok_s_band: list[float] | None = None
    speedup_band: list[float] | None = None

    @property
    def k(self) -> int:
        return int(self.speculative_config.get("num_speculative_tokens", 0))


@dataclass(frozen=True)
class DrafterPlan:
    drafter: str
    best: Choice | None  # None: no swept max_num_seqs is feasible
    why: str  # what stops a larger batch size (or why none is feasible)


@dataclass(frozen=True)
class Plan:
    """The plan for one (trace, hardware, model)."""

    trace: str
    hardware: str
    model: str
    slo: SLO
    drafters: list[DrafterPlan]
    best: Choice | None
    reason: str
    vllm_speculative_config: dict[str, Any] | None = None  # None: serve without speculation
    vllm_args: list[str] = field(default_factory=list)  # the flags after `vllm serve MODEL`
    vllm_env: dict[str, str] = field(default_factory=dict)  # environment the method needs
    vllm_note: str | None = None  # what the flags cannot say: a method vLLM does not ship, a field to fill in…
    vllm_model: str | None = None  # the `vllm serve` model argument (the profile's Hugging Face repo)
    engine: dict[str, Any] | None = None  # the sweep's shared engine settings (None: the results predate them)
    # The drafters the choice is not told apart from by the acceptance model's uncertainty band (the chosen
    # goodput inside one's band, or one's goodput inside the chosen band), and the sentence that says so.
    band_overlaps: list[str] = field(default_factory=list)
    band_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def aggregate(results: pl.DataFrame) -> pl.DataFrame:
    """One row per (trace, hardware, model, drafter, config, max_num_seqs), over seeds (rules above)."""
    needed = (*_CELL, "goodput_tok_s", "speedup", "query_latency_p99", "ttft_p99", "tpot_p99", "preemptions",
              "incomplete_queries", "limits_num_kv_blocks", "limits_block_size")
    results = with_layout(results)
    missing = [c for c in needed if c not in results.columns]
    if missing:
        raise SweepError(f"results lack column(s) {', '.join(missing)}")
    bands = [f"{m}_{b}" for m in ("goodput_tok_s", "speedup") for b in ("low", "high")]
    # Results from before bands were recorded: the band columns null.
    results = results.with_columns(pl.lit(None, dtype=pl.Float64).alias(c) for c in bands if c not in results.columns)
    return (results.group_by(list(_CELL), maintain_order=True)
            .agg(pl.col("goodput_tok_s").mean(), pl.col("speedup").mean(), pl.col(*bands).cast(pl.Float64).mean(),
                 pl.col("query_latency_p99", "ttft_p99", "tpot_p99").max(),
                 pl.col("preemptions", "incomplete_queries").max(),
                 (pl.col("limits_num_kv_blocks") * pl.col("limits_block_size")).min().alias("kv_tokens"))
            .sort([*_GROUP, "max_num_seqs"], maintain_order=True))


def plan(results: pl.DataFrame, slo: SLO | None = None) -> list[Plan]:
    """A plan per (trace, hardware, model) in `results` (a sweep's rows, see agentspec_sim.sweep)."""
    slo = slo or SLO()
    cells = aggregate(results)
    if cells.height == 0:
        raise SweepError("no sweep results to plan from")
    engines = _engine_settings(results)
    plans = []
    for key, group in cells.group_by(list(_GROUP), maintain_order=True):
        trace, hardware, model = (str(v) for v in key[:3])
        plans.append(_plan_group(trace, hardware, model, group, slo, engines.get(tuple(key))))
    return plans


def with_layout(results: pl.DataFrame) -> pl.DataFrame:
    """The results with each row's parallel layout as columns `tensor_parallel_size`, `expert_parallel` and
    `data_parallel_size` (from its engine settings; one GPU for files that predate them)."""
    from agentspec_sim.cost.layout import Layout
    from agentspec_sim.sweep.results import ENGINE_CONFIG

    if all(c in results.columns for c in ("tensor_parallel_size", "expert_parallel", "data_parallel_size")):
        return results
    texts = results[ENGINE_CONFIG].to_list() if ENGINE_CONFIG in results.columns else [None] * results.height
    layouts = [Layout.of(json.loads(text) if text else None) for text in texts]
    return results.with_columns(
        pl.Series("tensor_parallel_size", [x.tensor_parallel_size for x in layouts], dtype=pl.Int64),
        pl.Series("expert_parallel", [x.expert_parallel for x in layouts], dtype=pl.Boolean),
        pl.Series("data_parallel_size", [x.data_parallel_size for x in layouts], dtype=pl.Int64))


def _engine_settings(results: pl.DataFrame) -> dict[tuple, dict[str, Any]]:
    """(trace, hardware, model, tensor_parallel_size, expert_parallel, data_parallel_size) → the engine settings
    its cells share (the `engine_config` column). Cells of one group run with different settings would be
    averaged into one answer: refused."""
    from agentspec_sim.sweep.results import ENGINE_CONFIG

    if ENGINE_CONFIG not in results.columns:
        return {}
    out = {}
    for key, group in with_layout(results).group_by(list(_GROUP), maintain_order=True):
        texts = group[ENGINE_CONFIG].unique(maintain_order=True).to_list()
        if len(texts) > 1:
            trace, hardware, model = key[:3]
            raise SweepError(f"results for {trace} on {hardware} / {model} mix {len(texts)} engine configurations "
                             "(sweeps with different engine options): plan each sweep's results file on its own")
        if texts[0] is not None:
            out[tuple(key)] = json.loads(texts[0])
    return out


def _per_gpu_row(p) -> dict[str, Any]:
    """A plan's best choice per GPU of its layout: the load (capacity plans) or goodput (batch plans) one GPU
    carries, its output tokens per GPU and, where priced, $ per million output tokens."""
    from agentspec_sim.cost.layout import Layout

    layout = Layout.of(p.engine)
    best = p.best
    gpus = layout.gpus
    tokens = None
    if best is None:
        per_gpu = None
    elif hasattr(best, "capacity_per_gpu"):
        per_gpu = best.capacity_per_gpu
        tokens = (best.output_tok_s or 0.0) / gpus
    else:
        per_gpu = tokens = best.goodput_tok_s / gpus
    return {"hardware": p.hardware, "layout": layout.label, "flags": layout.flags(), "gpus": gpus,
            "_choice": best, "_model_error": getattr(p, "model_error", 0.0),
            "drafter": None if best is None else best.drafter,
            "max_num_seqs": None if best is None else best.max_num_seqs, "per_gpu": per_gpu,
            "output_tok_s_per_gpu": tokens, "usd_per_million_tokens": getattr(best, "usd_per_million_tokens", None),
            "usd_per_query": getattr(best, "usd_per_query", None),
            "unit": "queries/s per GPU" if hasattr(p, "search") else "output tok/s per GPU"}


def _ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Most load per GPU (then more tokens per GPU, then fewer GPUs); rows with nothing to plan with last.
    return sorted(rows, key=lambda r: (r["per_gpu"] is None, -(r["per_gpu"] or 0.0),
                                       -(r["output_tok_s_per_gpu"] or 0.0), r["gpus"]))


def _ranked_by_money(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Where every GPU has a price: least $ per query first (a cheaper GPU may carry less per GPU); else by load.
    if rows and all(r["usd_per_query"] is not None for r in rows):
        return sorted(rows, key=lambda r: (r["usd_per_query"], r["gpus"]))
    return _ranked(rows)


def layout_summary(plans: list) -> list[dict[str, Any]]:
    """Per (trace, hardware, model) planned at more than one parallel layout: each layout's best choice, most load
    (capacity plans) or goodput (batch plans) per GPU first — the layout `plan` recommends for that pair."""
    by_pair: dict[tuple[str, str, str], list] = {}
    for p in plans:
        by_pair.setdefault((p.trace, p.hardware, p.model), []).append(p)
    return [{"trace": trace, "hardware": hardware, "model": model,
             "layouts": _told_apart(_ranked([_per_gpu_row(p) for p in group]))}
            for (trace, hardware, model), group in by_pair.items() if len(group) >= 2]


def _told_apart(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with `told_apart_from_best`: False where a capacity plan's choice is not told apart from the best
    layout's (their intervals and the step cost's error overlap: `capacity_plan.told_apart`), None where that
    cannot be said (a batch plan, nothing planned); the choices themselves dropped (not JSON)."""
    best = rows[0]["_choice"] if rows else None
    out = []
    for i, row in enumerate(rows):
        choice, error = row.pop("_choice"), row.pop("_model_error")
        apart = None
        if i > 0 and hasattr(best, "told_apart_from") and hasattr(choice, "told_apart_from"):  # capacity choices
            apart = choice.told_apart_from(best, error or 0.0)
        out.append({**row, "told_apart_from_best": apart})
    return out


def hardware_summary(plans: list) -> list[dict[str, Any]]:
    """Per (trace, model) planned on more than one GPU: each GPU's best layout and choice, least $ per query first
    where every GPU has a price (else most load per GPU first) — which GPU `plan` recommends for that model."""
    by_model: dict[tuple[str, str], dict[str, list]] = {}
    for p in plans:
        by_model.setdefault((p.trace, p.model), {}).setdefault(p.hardware, []).append(_per_gpu_row(p))
    return [{"trace": trace, "model": model,
             "hardware": _ranked_by_money([_told_apart(_ranked(rows))[0] for rows in per_hw.values()])}
            for (trace, model), per_hw in by_model.items() if len(per_hw) >= 2]


def vllm_engine_args(engine: dict[str, Any]) -> list[str]:
    """The `vllm serve` flags (vLLM 0.33, vllm/engine/arg_utils.py) that set the engine as the sweep simulated
    it: every setting it was given that differs from what vLLM picks by itself. An unset limit (None) is
    resolved by the simulator as vLLM resolves it (agentspec_sim/engine/config.py), so it needs no flag. The
    workload knobs (rate, replicate, think_time, arrival) and the calibration shape the simulation, not the
    server, and have no flag."""
    from agentspec_sim.cost.profiles import VLLM_GPU_MEMORY_UTILIZATION

    args: list[str] = []
    for key, flag in (("max_num_batched_tokens", "--max-num-batched-tokens"), ("max_model_len", "--max-model-len"),
                      ("num_kv_blocks", "--num-gpu-blocks-override")):  # vLLM's override counts the null block too
        if engine.get(key) is not None:
            args += [flag, str(engine[key])]
    utilisation = engine.get("gpu_memory_utilization")
    if utilisation is not None and utilisation != VLLM_GPU_MEMORY_UTILIZATION:
        args += ["--gpu-memory-utilization", f"{utilisation:g}"]
    if engine.get("kv_cache_dtype") not in (None, "auto"):
        args += ["--kv-cache-dtype", str(engine["kv_cache_dtype"])]
    if engine.get("tensor_parallel_size", 1) != 1:
        args += ["--tensor-parallel-size", str(engine["tensor_parallel_size"])]
    if (engine.get("data_parallel_size") or 1) != 1:
        args += ["--data-parallel-size", str(engine["data_parallel_size"])]
    if engine.get("enable_expert_parallel"):
        args.append("--enable-expert-parallel")
    if engine.get("block_size", 16) != 16:  # vLLM's block size on CUDA
        args += ["--block-size", str(engine["block_size"])]
    if engine.get("enable_prefix_caching") is False:  # on by default in vLLM 0.33 as here
        args.append("--no-enable-prefix-caching")
    return args


def _choice(row: dict[str, Any]) -> Choice:
    from agentspec_sim.run.band import row_values

    return Choice(drafter=row["drafter"], speculative_config=json.loads(row["speculative_config"]),
                  max_num_seqs=int(row["max_num_seqs"]), goodput_tok_s=float(row["goodput_tok_s"]),
                  speedup=row["speedup"], query_latency_p99_s=row["query_latency_p99"], ttft_p99_s=row["ttft_p99"],
                  tpot_p99_s=row["tpot_p99"], preemptions=int(row["preemptions"]),
                  goodput_tok_s_band=row_values(row, "goodput_tok_s"), speedup_band=row_values(row, "speedup"))


def band_overlaps(winner: DrafterPlan, others: list[DrafterPlan]) -> tuple[list[str], str | None]:
    """The drafters (of `others`, each at its own best batch size) that the chosen configuration is not told
    apart from by the acceptance model's uncertainty band: the chosen goodput lies inside one's goodput band,
    or one's goodput inside the chosen one's band (agentspec_sim.run.band). (names, the sentence saying so)."""
    from agentspec_sim.run.band import span

    best = winner.best
    assert best is not None
    own = span(best.goodput_tok_s_band)
    names, parts = [], []
    for other in others:
        b = other.best
        if b is None:
            continue
        theirs = span(b.goodput_tok_s_band)
        found = []
        if theirs is not None and theirs[0] <= best.goodput_tok_s <= theirs[1]:
            found.append(f"the chosen goodput ({best.goodput_tok_s:,.0f} tok/s) lies inside {other.drafter}'s band "
                         f"at max_num_seqs {b.max_num_seqs} ({theirs[0]:,.0f}–{theirs[1]:,.0f} tok/s)")
        if own is not None and own[0] <= b.goodput_tok_s <= own[1]:
            found.append(f"{other.drafter}'s goodput at max_num_seqs {b.max_num_seqs} ({b.goodput_tok_s:,.0f} tok/s) "
                         f"lies inside the chosen one's band ({own[0]:,.0f}–{own[1]:,.0f} tok/s)")
        if found:
            names.append(other.drafter)
            parts += found
    if not names:
        return [], None
    return names, (f"within the acceptance model's uncertainty band, {winner.drafter} is not told apart from "
                   f"{', '.join(names)}: {'; '.join(parts)}")


def _plan_drafter(label: str, rows: list[dict[str, Any]], slo: SLO) -> DrafterPlan:
    feasible = [r for r in rows if not slo.violations(r)]
    if not feasible:
        smallest = rows[0]
        return DrafterPlan(label, None, f"no swept batch size meets the objectives (max_num_seqs "
                                        f"{smallest['max_num_seqs']}: {'; '.join(slo.violations(smallest))})")
    best = max(feasible, key=lambda r: (r["goodput_tok_s"], -r["max_num_seqs"]))
    larger = [r for r in rows if r["max_num_seqs"] > best["max_num_seqs"]]
    if not larger:
        why = "the largest batch size swept"
    else:
        nxt = larger[0]
        broken = slo.violations(nxt)
        why = (f"max_num_seqs {nxt['max_num_seqs']}: {'; '.join(broken)}" if broken else
               f"max_num_seqs {nxt['max_num_seqs']} gives no more goodput ({nxt['goodput_tok_s']:,.0f} tok/s)")
    return DrafterPlan(label, _choice(best), why)


def _plan_group(trace: str, hardware: str, model: str, cells: pl.DataFrame, slo: SLO,
                engine: dict[str, Any] | None = None) -> Plan:
    rows = cells.to_dicts()
    # Queries cut short by a refused call (a prompt ≥ max_model_len, refused as vLLM refuses it) fail
    # at every batch size and say nothing about it: only incompleteness beyond the group's least counts.
    unavoidable = min(r["incomplete_queries"] for r in rows)
    for r in rows:
        r["incomplete_queries"] -= unavoidable
    labels = list(dict.fromkeys(r["drafter"] for r in rows))
    drafters = [_plan_drafter(label, [r for r in rows if r["drafter"] == label], slo) for label in labels]
    ranked = sorted((d for d in drafters if d.best is not None),
                    key=lambda d: (-d.best.goodput_tok_s, d.best.speculative_config["method"] != "normal",
                                   d.best.max_num_seqs))
    if not ranked:
        return Plan(trace, hardware, model, slo, drafters, None,
                    "no drafter meets the objectives at any swept max_num_seqs; relax an SLO or sweep smaller "
                    "batch sizes", None, [])
    winner = ranked[0]
    best = winner.best
    speed = f", {best.speedup:.2f}× normal at that batch size" if best.speedup is not None else ""
    runner_up = (f"; next: {ranked[1].drafter} at max_num_seqs {ranked[1].best.max_num_seqs} "
                 f"({ranked[1].best.goodput_tok_s:,.0f} tok/s)") if len(ranked) > 1 else ""
    refused = (f"; {unavoidable} queries never complete at any batch size (a call's prompt exceeds max_model_len)"
               if unavoidable else "")
    reason = (f"{winner.drafter} at max_num_seqs {best.max_num_seqs} has the highest goodput meeting the objectives "
              f"({best.goodput_tok_s:,.0f} tok/s{speed}); larger: {winner.why}{runner_up}{refused}")
    config, args, env, note, served = serve_flags(best, model, engine, rows)
    overlaps, band_note = band_overlaps(winner, ranked[1:])
    return Plan(trace, hardware, model, slo, drafters, best, reason, config, args, env, note, served, engine, overlaps,
                band_note)


def serve_flags(best: Any, model: str, engine: dict[str, Any] | None, rows: list[dict[str, Any]]
                ) -> tuple[dict[str, Any] | None, list[str], dict[str, str], str | None, str]:
    """What deploys the chosen configuration `best` (a Choice or CapacityChoice: its speculative_config,
    max_num_seqs, k): (its vLLM --speculative-config, the `vllm serve` flags after the model, the environment,
    a note on what the flags cannot say, the served model). `rows`: the group's cells with the metric the
    k-by-batch-size schedule maximises as `goodput_tok_s`."""
    from agentspec_sim.cost.profiles import served_model_name

    config = _vllm_config(best, rows)
    args = ["--max-num-seqs", str(best.max_num_seqs)]
    notes = []
    if engine is not None:
        args += vllm_engine_args(engine)
    else:
        notes.append("these results do not record the sweep's engine settings (a file from an older version): add "
                     "the --max-model-len, --max-num-batched-tokens, … flags the sweep ran with")
    env: dict[str, str] = {}
    profile = _profile(model)
    moe = profile is not None and profile.is_moe
    if "--enable-expert-parallel" in args and not moe:
        args.remove("--enable-expert-parallel")  # vLLM places experts only: a dense model has none to place
        notes.append(f"--enable-expert-parallel left out: {model} is a dense model (no experts to place)")
    if engine is not None and int(engine.get("data_parallel_size") or 1) > 1 and moe:
        notes.append(f"data-parallel attention ({int(engine['data_parallel_size'])} ranks): the ranks step in lockstep "
                     "and vLLM's router sends a query's calls to any rank (its prefix is prefilled again there); "
                     "vLLM's --prefill-schedule-interval and pinning a session to a rank (X-data-parallel-rank) "
                     "are not simulated (docs/cost-model.md, 'Verdict: data-parallel attention')")
    limit = _model_context(profile)
    if engine is not None and engine.get("max_model_len") and limit and engine["max_model_len"] > limit:
        # vLLM refuses a max_model_len past the model's derived limit unless told to allow it.
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        notes.append(f"--max-model-len {engine['max_model_len']:,} is past {model}'s context ({limit:,}): vLLM 0.33 "
                     "serves it only with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, and the model's output past its trained "
                     "length is not what the trace recorded")
    if config is not None:
        method = config["method"]
        env.update(_VLLM_ENV.get(method, {}))
        if method == "suffix":
            notes.append("vLLM's suffix method needs ArcticInference installed beside it (pip install "
                         "arctic-inference)")
        if method == "draft_model":  # vLLM loads the draft model by its Hugging Face repo
            from agentspec_sim.cost.profiles import default_draft_model, load_model, model_by_repo

            ident = model_by_repo(str(config["model"])) if config.get("model") else default_draft_model(
                load_model(model))
            config["model"] = (served_model_name(ident) or ident) if ident else REQUIRED_DRAFT_MODEL
        if method in _NEEDS_DRAFT_MODEL and not config.get("model"):
            config["model"] = _draft_model(config, model) or REQUIRED_DRAFT_MODEL
            if config["model"] == REQUIRED_DRAFT_MODEL:
                notes.append(f'{method} needs its draft head in --speculative-config "model" (vLLM 0.33 refuses '
                             f"{method} without one): replace {REQUIRED_DRAFT_MODEL} with the head you deploy (the "
                             f"simulated acceptance is not from one particular head for {model})")
        config = {k: v for k, v in config.items() if k in VLLM_SPECULATIVE_KEYS}
        config["method"] = _VLLM_METHOD.get(method, method)
        args += ["--speculative-config", json.dumps(config, sort_keys=True)]
        if method in _NOT_IN_VLLM or method.startswith("test-"):
            notes.insert(0, f"{method} is simulated here; vLLM 0.33 has no such method")
    return config, args, env, "; ".join(notes) or None, served_model_name(model) or model


def _profile(model: str):
    """`model`'s profile, None when it does not load (results from elsewhere)."""
    try:
        from agentspec_sim.cost import load_model

        return load_model(model)
    except ValueError:
        return None


def _model_context(profile) -> int | None:
    """The context vLLM derives for a model profile (None: no profile)."""
    if profile is None:
        return None
    return int(getattr(profile, "max_model_len", 0) or profile.default_max_model_len or 0) or None


def _draft_model(config: dict[str, Any], model: str) -> str | None:
    """The draft weights the acceptance parameters of (method, target model) were measured with, if known."""
    from agentspec_sim.drafters.model.rule import load_params, load_params_file

    try:
        path = config.get("acceptance_params")
        params = load_params_file(path) if path else load_params(config["method"], model)
    except ValueError:
        return None
    return params.draft_model


def _vllm_config(best: Choice, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The winner's `--speculative-config` (None for normal), with a batch-size schedule where the
    best k of its method changes across the swept batch sizes up to the chosen one."""
    from agentspec_sim.drafters.registry import drafter_class

    config = dict(best.speculative_config)
    method = config["method"]
    if method == "normal":
        return None
    if not drafter_class(method).supports_batch_size_schedule or "num_speculative_tokens_per_batch_size" in config:
        return config

    def same_family(spec: dict[str, Any]) -> bool:
        if spec["method"] == "normal":
            return True
        def rest(c: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in c.items() if k != "num_speculative_tokens"}

        return rest(spec) == rest(config)

    sizes = sorted({r["max_num_seqs"] for r in rows if r["max_num_seqs"] <= best.max_num_seqs})
    ranges: list[list[int]] = []
    start = 1
    for size in sizes:
        if size == best.max_num_seqs:
            k = best.k  # the chosen configuration itself at the chosen batch size
        else:
            at = [r for r in rows if r["max_num_seqs"] == size and same_family(json.loads(r["speculative_config"]))]
            k = _k(max(at, key=lambda r: (r["goodput_tok_s"], -_k(r))))
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = size
        else:
            ranges.append([start, size, k])
        start = size + 1
    if len(ranges) <= 1:
        return config
    config["num_speculative_tokens"] = max(k for _, _, k in ranges)
    config["num_speculative_tokens_per_batch_size"] = ranges
    return config


def _k(row: dict[str, Any]) -> int:
    return int(json.loads(row["speculative_config"]).get("num_speculative_tokens", 0))
