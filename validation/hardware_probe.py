"""The hardware profile a timing run is predicted with: the bundled GPU profile, or one measured here.

On a GPU whose name matches a bundled profile (A100 80GB, H100, H200) that profile is used, so the
check tests the same numbers the simulator uses. Anywhere else (a CPU in tests, an unknown GPU) a
profile is measured: peak matmul throughput (best of a few large square GEMMs in the run dtype) and
memory bandwidth (best of a few large copies: read + write bytes), so the roofline's efficiencies
stay meaningful and `calibrate cost` fits only them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from agentspec_sim.cost.profiles import HardwareProfile, load_hardware

if TYPE_CHECKING:
    import torch

_BUNDLED_BY_NAME = (("H200", "h200"), ("H100", "h100-80g"), ("A100", "a100-80g"))


def bundled_profile_for(device_name: str) -> str | None:
    """The bundled hardware id for a CUDA device name ("NVIDIA H100 80GB HBM3" → "h100-80g"), if any."""
    upper = device_name.upper()
    for key, ident in _BUNDLED_BY_NAME:
        if key in upper and (key != "A100" or "80GB" in upper):
            return ident
    return None


def measure_profile(device: str, dtype: torch.dtype, *, matmul_size: int = 512, copy_mib: int = 64,
                    repeats: int = 5) -> HardwareProfile:
    """A profile of `device` from measured matmul FLOP/s and copy bandwidth (best of `repeats`)."""
    import torch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # CPU: this thread's CPU time, like the CPU timing run (validation/timing.py); GPU: the wall clock.
    clock = time.perf_counter if dev.type == "cuda" else time.thread_time
    n = matmul_size
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    src = torch.empty(copy_mib * (1 << 20) // 4, device=dev, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            sync()
            times.append(clock() - start)
        return min(times)

    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the CPU timing runs on one thread (validation/timing.py)
    try:
        flops = 2.0 * n**3 / best(lambda: a @ b)
        bandwidth = 2.0 * src.numel() * 4 / best(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(threads)
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        name = torch.cuda.get_device_name(dev)
    else:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        name = "CPU"
    how = f"measured on this machine ({name}): best of {repeats}"
    return HardwareProfile(
        id=f"measured-{dev.type}", name=f"{name} (measured)", hbm_bytes=int(total), hbm_bandwidth=bandwidth,
        peak_flops_bf16=flops, interconnect_bandwidth=bandwidth,
        sources={"hbm_bytes": f"total memory of {name} as reported by the driver / OS",
                 "hbm_bandwidth": f"{how} {copy_mib} MiB copies (read + write bytes)",
                 "peak_flops_bf16": f"{how} {n}×{n} {str(dtype).removeprefix('torch.')} matmuls",
                 "interconnect_bandwidth": "not used (one device): set to the memory bandwidth"})


def hardware_for(device: str, dtype: torch.dtype, override: str | None = None) -> HardwareProfile:
    """`override` (a bundled id or a profile JSON) if given; else the bundled profile of this GPU;
    else a measured profile."""
    if override:
        return load_hardware(override)
    if device.startswith("cuda"):
        import torch

        ident = bundled_profile_for(torch.cuda.get_device_name(torch.device(device)))
        if ident:
            return load_hardware(ident)
    return measure_profile(device, dtype)


def profile_to_json(profile: HardwareProfile) -> dict:
    """The hardware-profile JSON layout `load_hardware` reads back."""
    out: dict = {"id": profile.id, "name": profile.name}
    for key in ("hbm_bytes", "hbm_bandwidth", "peak_flops_bf16", "interconnect_bandwidth"):
        out[key] = {"value": getattr(profile, key), "source": profile.sources.get(key, "")}
    return out
