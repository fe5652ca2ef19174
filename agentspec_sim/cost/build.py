"""The one way to get a cost model: a run's hardware, model, tensor parallelism and calibration → its
`RooflineCostModel`, the bundled calibration of the pair where there is one (docs/cost-model.md)."""

from __future__ import annotations

from pathlib import Path

from agentspec_sim.cost.aic import coverage
from agentspec_sim.cost.layout import SINGLE_GPU, Layout
from agentspec_sim.cost.profiles import (
    HardwareProfile,
    ModelProfile,
    ProfileError,
    load_hardware,
    load_model,
    profile_mismatch,
    profile_name,
)
from agentspec_sim.cost.roofline import Calibration, RooflineCostModel

CALIBRATIONS_DIR = Path(__file__).parent / "profiles" / "calibrations"
DEFAULTS = "defaults"  # `calibration=` / `--calibration` value for the documented defaults, bundled file or not


def bundled_calibration(hardware_id: str, model_id: str, layout: Layout = SINGLE_GPU) -> Path | None:
    """The bundled calibration file of a (hardware, model) profile pair at a parallel layout, or None (`calibrate
    aic` writes them): the layout's own fit, else — for a layout nobody fitted — the pair's single-GPU fit,
    whose kernel efficiencies still hold while the collectives keep their documented defaults. A data-parallel
    layout nobody fitted takes the fit of the expert-parallel layout on as many GPUs first (the same expert
    kernels and collectives; attention on fewer heads per GPU)."""
    tags = [layout.tag] if layout.tag else []
    if layout.data_parallel_size > 1:
        if layout.expert_parallel:
            tags.append(Layout(layout.gpus, True).tag)
        rank = Layout(layout.tensor_parallel_size, layout.expert_parallel)
        if rank.tag:
            tags.append(rank.tag)
    for tag in tags:
        tagged = CALIBRATIONS_DIR / f"{hardware_id}--{model_id}--{tag}.json"
        if tagged.is_file():
            return tagged
    path = CALIBRATIONS_DIR / f"{hardware_id}--{model_id}.json"
    return path if path.is_file() else None


def calibration_note(cost_model) -> str:
    """One line saying what the cost model's factors rest on, for run output."""
    source = cost_model.calibration.source
    pair = f"{cost_model.hardware.id} + {cost_model.model.id}"
    layout = cost_model.layout
    fit = (f"`calibrate aic --hardware {cost_model.hardware.id} --model {cost_model.model.id}"
           + (f" {layout.flags()}" if layout.tag else "") + "` fits it")
    if source == "defaults":
        why = coverage(cost_model.hardware.id, cost_model.model.id)
        if why is not None:
            return f"cost model: {pair}, documented defaults (no measured-kernel calibration: {why})"
        if bundled_calibration(cost_model.hardware.id, cost_model.model.id, layout) is None:
            return (f"cost model: {pair}" + (f" at {layout.flags()}" if layout.tag else "")
                    + f", documented defaults (uncalibrated: no bundled fit of this pair; {fit})")
        return f"cost model: {pair}, documented defaults (asked for; a bundled AIConfigurator calibration exists)"
    if layout.tag and source.startswith("AIConfigurator") and layout.flags() not in source:
        collectives = "on the measured all-reduce curve" if cost_model.measured_collectives else "from the link formula"
        return (f"cost model: {pair} at {layout.flags()}, {source} — uncalibrated at this layout: the kernels of "
                f"that fit, the collectives {collectives} ({fit})")
    return f"cost model: {pair}, {source}"


def cost_model_for(engine) -> RooflineCostModel:
    """`build_cost_model` for an engine configuration (an `EngineConfig`: anything with `hardware`, `model`,
    `tensor_parallel_size` and `calibration`): the one place a run's settings become its cost model."""
    return build_cost_model(engine.hardware, engine.model, engine.tensor_parallel_size, engine.calibration,
                            expert_parallel=getattr(engine, "enable_expert_parallel", False),
                            data_parallel_size=getattr(engine, "data_parallel_size", 1),
                            kv_dtype_bytes=getattr(engine, "kv_dtype_bytes", 2))


def build_cost_model(
    hardware: str | Path | HardwareProfile,
    model: str | Path | ModelProfile,
    tensor_parallel_size: int = 1,
    calibration: str | Path | Calibration | None = None,
    *,
    draft: str | None = None,
    expert_parallel: bool = False,
    data_parallel_size: int = 1,
    kv_dtype_bytes: int = 2,
) -> RooflineCostModel:
    """The roofline step-cost model for `model` on `hardware` with `tensor_parallel_size` GPUs.

    calibration: a calibration JSON file (see `Calibration.from_file`; refused when it was fitted on
                 other hardware or another model, `check_calibration`), a Calibration, None for the
                 bundled calibration of this pair where there is one (fitted to AIConfigurator's measured
                 vLLM kernels, `bundled_calibration`) and the documented defaults otherwise, or
                 "defaults" for the documented defaults always (docs/cost-model.md).
    draft:       which draft network `draft_model_time` prices by default: "eagle3", "mtp", or
                 None (the model's MTP layer when it has one, else EAGLE-3).
    expert_parallel: vLLM's --enable-expert-parallel (a MoE model's experts placed whole over the
                 tensor-parallel GPUs); picks that layout's bundled calibration.
    data_parallel_size: vLLM's --data-parallel-size; the model prices one rank (a MoE model's experts
                 sharded over all ranks' GPUs).
    kv_dtype_bytes: bytes a KV cache element takes (1: vLLM's fp8 KV cache, whose attention reads half the
                 bytes; the calibrations were fitted on BF16 caches and keep their efficiencies).
    """
    hw, m = load_hardware(hardware), load_model(model)
    if calibration is None:
        # A dense model's data-parallel ranks are replicas: each is priced as its tensor-parallel layout.
        layout = Layout(int(tensor_parallel_size), expert_parallel and m.is_moe,
                        int(data_parallel_size) if m.is_moe else 1)
        bundled = bundled_calibration(hw.id, m.id, layout)
        cal = Calibration.from_file(bundled) if bundled else Calibration()
    elif isinstance(calibration, str) and calibration == DEFAULTS:
        cal = Calibration()
    elif isinstance(calibration, Calibration):
        cal = calibration
    else:
        cal = Calibration.from_file(calibration)
        check_calibration(calibration, hw, m)
    return RooflineCostModel(hw, m, tensor_parallel_size, cal, draft=draft, expert_parallel=expert_parallel,
                             data_parallel_size=data_parallel_size, kv_dtype_bytes=kv_dtype_bytes)


def check_calibration(calibration: str | Path, hw: HardwareProfile, m: ModelProfile) -> None:
    """ProfileError when the calibration file was fitted on other hardware or another model than `hw` / `m`.

    Refused, not warned about: fitted efficiencies describe the kernels of the device and model they were
    measured on (CPU timings fitted against an A100 profile gave efficiencies of 2.0 and 1.43), so on any
    other pair every step time, goodput and speedup would be wrong with nothing in the results to show it.
    A calibration that records neither (written by hand, or before files recorded them) is used as it is.
    """
    hardware, model = Calibration.fitted_on(calibration)
    mismatch = profile_mismatch(hardware, model, hw, m)
    if mismatch:
        raise ProfileError(f"{calibration}: fitted on {mismatch}: its factors would misprice every step of this "
                           f"run; fit one on {hw.id} / {profile_name(m)} (`agentspec-sim calibrate cost`), or "
                           "run with the hardware and model it was fitted on")
