"""The cost model against AIConfigurator's measured vLLM kernels: the tables in docs/cost-model.md.

    python reports/aic_cost_tables.py > /tmp/tables.md      (needs the extra `aic`)

1. ratio agentspec-sim / AIC (GPU time: the host terms AIC does not price are left out) over decode steps
   b ∈ {1, 8, 32, 64, 128, 256} × context {1k, 4k, 16k, 32k} and prefills of 512 / 2,048 / 8,192 tokens,
   with the documented defaults and with the bundled calibration;
2. ΔT(b)/T(b) = (T(b calls × (1 + k)) − T(b calls × 1)) / T(b calls × 1), k ∈ {1, 3, 5, 8}, ours vs AIC's;
3. the token budget's AI: spec sheet vs the calibrated model's, with M(b) = AI − b.
"""

from __future__ import annotations

import numpy as np

from agentspec_sim.cost import BatchShape, Calibration, build_cost_model
from agentspec_sim.cost.aic import AicPricer, covered_pairs
from agentspec_sim.cost.aic_calibration import gpu_only
from agentspec_sim.cost.roofline import RooflineCostModel
from agentspec_sim.cost.shapes import StepShape

SHOWN = ("qwen3-8b", "llama-3.1-8b", "gpt-oss-20b")
HW = ("h100-80g", "h200", "a100-80g")


def _gpu_model(hw: str, model: str, calibration: Calibration) -> RooflineCostModel:
    return RooflineCostModel(hw, model, 1, gpu_only(calibration))


def ratio_table() -> str:
    shapes = [StepShape.decode(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (1024, 4096, 16384, 32768)]
    shapes += [StepShape.prefill(q) for q in (512, 2048, 8192)]
    lines = ["| model | " + " | ".join(HW) + " |", "|---|" + "---|" * len(HW)]
    for model in SHOWN:
        cells = []
        for hw in HW:
            if (hw, model) not in covered_pairs():
                cells.append("—")
                continue
            pricer = AicPricer(hw, model)
            aic = np.array([pricer.price(s).total for s in shapes])
            out = []
            for cal in (Calibration(), build_cost_model(hw, model).calibration):
                cm = _gpu_model(hw, model, cal)
                r = np.array([cm.step_time(s.batch_shape()).total_s for s in shapes]) / aic
                out.append(f"{np.median(r):.2f} ({r.min():.2f}–{r.max():.2f})")
            cells.append(" → ".join(out))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def delta_t_table(hw: str, model: str, context: int = 2048) -> str:
    pricer = AicPricer(hw, model)
    cm = _gpu_model(hw, model, build_cost_model(hw, model).calibration)
    ks = (1, 3, 5, 8)
    lines = [f"{hw} + {model}, context {context}: ΔT(b)/T(b), ours / AIC",
             "", "| b | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---:|" + "---|" * len(ks)]
    for b in (1, 8, 32, 64, 128, 256):
        base_ours = cm.step_time(BatchShape.decode(b, context)).total_s
        base_aic = pricer.price(StepShape.decode(b, context)).total
        cells = []
        for k in ks:
            ours = cm.step_time(BatchShape.decode(b, context, 1 + k)).total_s / base_ours - 1
            theirs = pricer.price(StepShape.verify(b, context, k)).total / base_aic - 1
            cells.append(f"{ours:.1%} / {theirs:.1%}")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def budget_table() -> str:
    lines = ["| hardware | model | AI, spec sheet | AI, calibrated | M(64) | M(128) | M(256) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for hw, model in covered_pairs():
        if model not in SHOWN:
            continue
        spec = RooflineCostModel(hw, model, 1, Calibration()).ridge_tokens
        cm = build_cost_model(hw, model)
        lines.append(f"| {hw} | {model} | {spec:.0f} | {cm.ridge_tokens:.0f} | {cm.token_budget(64)} | "
                     f"{cm.token_budget(128)} | {cm.token_budget(256)} |")
    return "\n".join(lines)


def main() -> None:
    print("## ratio agentspec-sim / AIC: defaults → calibrated\n")
    print(ratio_table())
    for hw, model in (("a100-80g", "qwen3-8b"), ("h100-80g", "qwen3-8b"), ("h100-80g", "gpt-oss-20b")):
        print()
        print(delta_t_table(hw, model))
    print("\n## token budget\n")
    print(budget_table())


if __name__ == "__main__":
    main()
