"""Measured all-reduce latencies: what a tensor-parallel step's collectives cost on each GPU, by GPU count.

vLLM all-reduces each layer's output twice under tensor parallelism (after attention and after the MLP or MoE),
with its own custom all-reduce kernel inside CUDA graphs for the message sizes a decode or a prefill chunk has.
NVIDIA AIConfigurator measured that kernel under vLLM on every system it covers (`custom_allreduce_perf`,
backend `vllm_graph`, bfloat16, 2/4/8 GPUs, 128 to 512M elements). Those curves are bundled here, one file per
hardware profile (profiles/collectives/<hardware>.json, each with its source), so the cost model prices a
layout's collectives from measurement, not from the link bandwidth, without the `aic` extra.

Between two measured sizes the latency is interpolated linearly in the message size; past the largest, it grows
in proportion (the bandwidth regime); below the smallest, it is the smallest's (the latency floor).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from agentspec_sim.cost.profiles import PROFILE_DIR

COLLECTIVES_DIR = PROFILE_DIR / "collectives"
FORMAT = "agentspec-sim/collectives"


@functools.cache
def allreduce_curve(hardware_id: str, gpus: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(message sizes in bf16 elements, seconds) of one all-reduce over `gpus` GPUs of this hardware, or None
    where nothing was measured (no file, or not at that GPU count)."""
    path = COLLECTIVES_DIR / f"{hardware_id}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    points = data.get("all_reduce_bf16", {}).get(str(gpus))
    if not points:
        return None
    sizes = np.array([p[0] for p in points], dtype=np.float64)
    seconds = np.array([p[1] for p in points], dtype=np.float64)
    return sizes, seconds


def allreduce_seconds(curve: tuple[np.ndarray, np.ndarray], elements: np.ndarray | float) -> np.ndarray | float:
    """One all-reduce of `elements` bf16 values on the measured curve (scalar or elementwise; the same arithmetic
    either way, so a step priced alone and in a batch of steps agree to the bit)."""
    sizes, seconds = curve
    inside = np.interp(elements, sizes, seconds)
    past = seconds[-1] * (np.asarray(elements, dtype=np.float64) / sizes[-1])
    return np.where(np.asarray(elements) > sizes[-1], past, inside) if np.ndim(elements) else (
        float(past) if elements > sizes[-1] else float(inside))


def extract_from_aic(out_dir: str | Path = COLLECTIVES_DIR) -> list[Path]:
    """Rewrite the bundled curves from AIConfigurator's tables (the `aic` extra, with pandas and pyarrow): for each
    hardware profile AIC covers, its custom all-reduce at the vLLM table version AIC prices with (the newest at or
    below it), CUDA-graph backend."""
    import importlib.metadata
    import importlib.util

    import pandas as pd  # comes with the aic extra

    from agentspec_sim.cost.aic import AIC_PACKAGE, BACKEND, SYSTEMS
    from agentspec_sim.io.atomic import write_json_atomic

    root = Path(next(iter(importlib.util.find_spec("aiconfigurator_core").submodule_search_locations)))
    from aiconfigurator_core.sdk import perf_database

    version = importlib.metadata.version(AIC_PACKAGE)
    written = []
    for hardware, system in SYSTEMS.items():
        folder = root / "systems" / "data" / system / "comm" / BACKEND
        tables = {p.parent.name: p for p in folder.glob("*/custom_allreduce_perf.parquet")}
        if not tables:
            continue
        priced = str(perf_database.get_latest_database_version(system, BACKEND))
        key = _version_key
        below = [v for v in tables if key(v) <= key(priced)]
        chosen = max(below or tables, key=key)
        frame = pd.read_parquet(tables[chosen])
        frame = frame[(frame["backend"] == "vllm_graph") & (frame["allreduce_dtype"] == "bfloat16")]
        curves = {}
        for gpus, group in frame.groupby("num_gpus"):
            group = group.sort_values("message_size")
            curves[str(int(gpus))] = [[int(n), round(float(ms) / 1e3, 12)] for n, ms in
                                      zip(group["message_size"], group["latency"], strict=True)]
        path = Path(out_dir) / f"{hardware}.json"
        write_json_atomic(path, {
            "format": FORMAT, "hardware": hardware,
            "source": (f"AIConfigurator {version} systems/data/{system}/comm/{BACKEND}/{chosen}/"
                       "custom_allreduce_perf.parquet: vLLM's custom all-reduce measured under vLLM, CUDA graph "
                       "(backend vllm_graph), bfloat16; message sizes in elements, latency in seconds"),
            "all_reduce_bf16": curves})
        written.append(path)
    return written


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())
