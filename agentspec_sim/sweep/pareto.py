"""The Pareto view of a sweep: output tokens/s per GPU against tokens/s per user, AIConfigurator's first view.

Every configuration a sweep ran — drafter (and k), max_num_seqs, parallel layout, GPU — is a point: how much output
one GPU of it carries (throughput per GPU) and how fast each user's tokens arrive (1 / mean TPOT, `vllm bench serve`'s
TPOT). A point no other point beats on both is on the frontier: the configurations worth deploying, from the
cheapest-per-token to the most interactive. Capacity results place each configuration at its capacity (the load it
sustains under the SLO: `capacity_output_tok_s`, and the TPOT of the run at that rate); batch results at the batch
job's goodput. Seeds are averaged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import polars as pl

from agentspec_sim.sweep.cells import SweepError


@dataclass(frozen=True)
class ParetoPoint:
    trace: str
    model: str
    hardware: str
    layout: str  # "tp 8 + EP", …
    gpus: int
    drafter: str
    max_num_seqs: int
    tok_s_per_gpu: float
    tok_s_per_user: float
    on_frontier: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pareto_points(results: pl.DataFrame) -> list[ParetoPoint]:
    """Every configuration of `results` as a point, per (trace, model) across GPUs, layouts, drafters and batch
    sizes, each marked on or off its group's frontier; frontier points first, most throughput per GPU first."""
    from agentspec_sim.cost.layout import Layout
    from agentspec_sim.sweep.capacity_plan import is_capacity_results
    from agentspec_sim.sweep.results import ENGINE_CONFIG

    capacity = is_capacity_results(results)
    throughput = "capacity_output_tok_s" if capacity else "goodput_tok_s"
    need = ["trace", "model", "hardware", "drafter", "max_num_seqs", throughput, "tpot_mean"]
    missing = [c for c in need if c not in results.columns]
    if missing:
        raise SweepError(f"results lack column(s) {', '.join(missing)} for the Pareto view")
    texts = results[ENGINE_CONFIG].to_list() if ENGINE_CONFIG in results.columns else [None] * results.height
    layouts = [Layout.of(json.loads(t) if t else None) for t in texts]
    frame = results.select(need).with_columns(
        pl.Series("layout", [lay.label for lay in layouts]), pl.Series("gpus", [lay.gpus for lay in layouts]))
    means = (frame.group_by(["trace", "model", "hardware", "layout", "gpus", "drafter", "max_num_seqs"],
                            maintain_order=True)
             .agg(pl.col(throughput).mean().alias("throughput"), pl.col("tpot_mean").mean().alias("tpot")))
    points: list[ParetoPoint] = []
    for (trace, model), group in means.group_by(["trace", "model"], maintain_order=True):
        rows = [r for r in group.iter_rows(named=True)
                if r["throughput"] is not None and r["tpot"] is not None and r["throughput"] > 0 and r["tpot"] > 0]
        pairs = [(r["throughput"] / r["gpus"], 1.0 / r["tpot"]) for r in rows]
        for r, (per_gpu, per_user) in zip(rows, pairs, strict=True):
            dominated = any(g >= per_gpu and u >= per_user and (g > per_gpu or u > per_user) for g, u in pairs)
            points.append(ParetoPoint(trace=str(trace), model=str(model), hardware=r["hardware"], layout=r["layout"],
                                      gpus=int(r["gpus"]), drafter=r["drafter"], max_num_seqs=int(r["max_num_seqs"]),
                                      tok_s_per_gpu=per_gpu, tok_s_per_user=per_user, on_frontier=not dominated))
    return sorted(points, key=lambda p: (p.trace, p.model, not p.on_frontier, -p.tok_s_per_gpu))
