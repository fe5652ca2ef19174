"""Step-cost models: how long one engine step takes on given hardware for a given model.

`build_cost_model(hardware, model, tensor_parallel_size, calibration)` is the one way in (`cost_model_for(config)`
from an EngineConfig); the
engine codes against `StepCostModel` (base.py). Profiles are JSON data under `profiles/`.
docs/cost-model.md documents the model, its defaults and their sources, and the cross-check.
"""

from agentspec_sim.cost.base import BatchShape, StepCost, StepCostModel
from agentspec_sim.cost.build import build_cost_model, check_calibration, cost_model_for
from agentspec_sim.cost.profiles import (
    VLLM_GPU_MEMORY_UTILIZATION,
    DraftSpec,
    HardwareProfile,
    ModelProfile,
    ProfileError,
    activation_reserve_bytes,
    hardware_ids,
    kv_bytes_per_token,
    kv_capacity_tokens,
    load_hardware,
    load_model,
    model_from_hf_config,
    model_ids,
    profile_mismatch,
    profile_name,
    served_model_name,
    weight_bytes,
)
from agentspec_sim.cost.roofline import Calibration, RooflineCostModel

__all__ = [
    "VLLM_GPU_MEMORY_UTILIZATION",
    "BatchShape",
    "Calibration",
    "DraftSpec",
    "HardwareProfile",
    "ModelProfile",
    "ProfileError",
    "RooflineCostModel",
    "StepCost",
    "StepCostModel",
    "activation_reserve_bytes",
    "build_cost_model",
    "check_calibration",
    "cost_model_for",
    "hardware_ids",
    "kv_bytes_per_token",
    "kv_capacity_tokens",
    "load_hardware",
    "load_model",
    "model_from_hf_config",
    "model_ids",
    "profile_mismatch",
    "profile_name",
    "served_model_name",
    "weight_bytes",
]
