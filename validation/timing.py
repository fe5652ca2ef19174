"""`validate timing`: execute each step's batch as a real forward pass and compare with the cost model.

For every step of a schedule (a run's step log, or a committed sample) the timing model
(validation/torch_model.py) runs the step's exact batch: per call, its query tokens (1 + the draft,
or the prefill chunk) over its context. Timing, as vLLM runs it:
  * CUDA: `warmup` eager runs, then, for steps of at most `graph_max_tokens` tokens (vLLM 0.33
    captures CUDA graphs up to 512 tokens by default), the forward is captured once into a CUDA graph
    and replayed; larger steps run eagerly (vLLM runs those without a graph too). Each of `repeats`
    runs is bracketed by CUDA events; the step's time is the median.
  * CPU: the same code on a tiny configuration, on one thread, timed by that thread's CPU time
    (`time.thread_time`, the minimum of `repeats`): on a shared machine the wall clock also counts
    the time other processes hold the core.
The prediction is the cost model's forward time (drafting is not part of a forward pass) for the
architecture that actually ran (`torch_model.profile_for`: every weight in the run dtype) on the
hardware profile of this device (`hardware_probe.hardware_for`).

Nothing here imports polars (the GPU path has none); torch is imported when a run starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentspec_sim.cost.calibrate import CalibrationFit, StepTimings, fit_calibration, mape
from agentspec_sim.cost.profiles import HardwareProfile, ModelProfile, load_model
from agentspec_sim.cost.roofline import Calibration, RooflineCostModel
from agentspec_sim.validation.schedule import StepShapes, bucket_label, bucket_of, write_table
from agentspec_sim.validation.torch_model import ArchSpec, TimingModel, profile_for


@dataclass(frozen=True)
class TimingConfig:
    """How to run a timing validation.

    model: a model profile id or config.json; tiny: run the tiny variant (default: on CPU only);
    device: "cuda" / "cpu" (default: cuda when available); hardware: a profile to predict with
    (default: this GPU's bundled profile, else a measured one); calibration: the calibration the
    predictions start from (default: the documented defaults).
    """

    model: str = "qwen3-8b"
    tiny: bool | None = None
    device: str | None = None
    dtype: str = "bfloat16"
    hardware: str | None = None
    calibration: str | None = None
    warmup: int = 2
    repeats: int = 5
    cuda_graphs: bool = True
    graph_max_tokens: int = 512
    kv_memory_fraction: float = 0.5
    seed: int = 0


@dataclass
class TimingResult:
    """Measured and predicted forward time of every step, and what ran."""

    shapes: StepShapes
    measured_s: np.ndarray
    predicted_s: np.ndarray
    graphed: np.ndarray
    spec: ArchSpec
    profile: ModelProfile
    hardware: HardwareProfile
    calibration: Calibration
    device: str
    dtype: str
    wall_s: float = 0.0
    fit: CalibrationFit | None = None
    calibrated_s: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def mape(self) -> float:
        return mape(self.predicted_s, self.measured_s)

    def per_bucket(self) -> list[dict]:
        """MAPE per batch-size bucket (powers of two), before and (when fitted) after calibration."""
        buckets = bucket_of(self.shapes.batch_sizes)
        rows = []
        for b in np.unique(buckets).tolist():
            sel = buckets == b
            row = {"batch_size": bucket_label(b), "steps": int(sel.sum()),
                   "mape": mape(self.predicted_s[sel], self.measured_s[sel]),
                   "measured_ms": float(np.median(self.measured_s[sel]) * 1e3)}
            if self.calibrated_s is not None:
                row["mape_calibrated"] = mape(self.calibrated_s[sel], self.measured_s[sel])
            rows.append(row)
        return rows

    def step_columns(self) -> dict[str, np.ndarray]:
        """One row per step: its shape summary, predicted and measured seconds."""
        s = self.shapes
        cols = {
            "step": s.step_ids, "batch_size": s.batch_sizes, "num_tokens": s.num_tokens,
            "prefill_calls": np.add.reduceat(s.is_prefill.astype(np.int64), s.offsets[:-1]),
            "context_tokens": np.add.reduceat(s.context_lens, s.offsets[:-1]),
            "predicted_s": self.predicted_s, "measured_s": self.measured_s, "cuda_graph": self.graphed,
            "error": self.predicted_s / self.measured_s - 1.0,
        }
        if self.calibrated_s is not None:
            cols["calibrated_s"] = self.calibrated_s
        return cols

    def call_columns(self) -> dict[str, np.ndarray]:
        """One row per call-step, in the step log's columns plus `measured_s` (input for `calibrate cost`) and
        the hardware and model it was measured on (the ids hardware.json and model.json carry), so the times
        are never fitted against another device's profile by mistake."""
        s = self.shapes
        sizes = s.batch_sizes
        rows = int(sizes.sum())
        return {"step": np.repeat(s.step_ids, sizes), "phase": np.where(s.is_prefill, "prefill", "decode"),
                "context_len": s.context_lens, "scheduled_tokens": s.query_lens,
                "batch_size": np.repeat(sizes, sizes), "measured_s": np.repeat(self.measured_s, sizes),
                "hardware": np.full(rows, self.hardware.id), "model": np.full(rows, self.spec.name)}


def resolve_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device")
    return device


def time_step(model: TimingModel, q: np.ndarray, c: np.ndarray, pf: np.ndarray, config: TimingConfig,
              seed: int = 0) -> tuple[float, bool]:
    """(median seconds, ran as a CUDA graph) of one step's forward pass on `model`."""
    import torch

    inputs = model.prepare(q, c, pf, seed=seed)
    on_cuda = model.device.type == "cuda"
    budget = None
    if on_cuda:
        free, _ = torch.cuda.mem_get_info(model.device)
        # Blocks the caching allocator holds but no tensor uses (the last step's KV) are free for us too.
        cached = torch.cuda.memory_reserved(model.device) - torch.cuda.memory_allocated(model.device)
        budget = int((free + cached) * config.kv_memory_fraction)
    kv = model.allocate_kv(inputs.total_k, budget)
    if not on_cuda:
        # One thread, timed by the CPU time of this thread, minimum of the repeats: on a shared CPU the wall
        # clock counts the time other processes hold the core, a multi-threaded op stalls whenever one
        # of its threads is descheduled, and interference only ever adds time.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(config.warmup):
                model.forward(inputs, kv)
            times = []
            for _ in range(config.repeats):
                start = time.thread_time()
                model.forward(inputs, kv)
                times.append(time.thread_time() - start)
        finally:
            torch.set_num_threads(threads)
        return float(min(times)), False

    def eager() -> object:
        return model.forward(inputs, kv)

    run: Callable[[], object] = eager
    graph = None
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
        for _ in range(max(1, config.warmup)):
            model.forward(inputs, kv)
    torch.cuda.current_stream(model.device).wait_stream(side)
    torch.cuda.synchronize(model.device)
    if config.cuda_graphs and sum(inputs.query_lens) <= config.graph_max_tokens:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.forward(inputs, kv)
            run = graph.replay
            run()  # first replay uploads the graph
        except RuntimeError:  # an op that cannot be captured: time it eagerly, and say so
            graph = None
            torch.cuda.synchronize(model.device)
            run = eager
    start_ev = [torch.cuda.Event(enable_timing=True) for _ in range(config.repeats)]
    end_ev = [torch.cuda.Event(enable_timing=True) for _ in range(config.repeats)]
    for s, e in zip(start_ev, end_ev, strict=True):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize(model.device)
    times = [s.elapsed_time(e) / 1e3 for s, e in zip(start_ev, end_ev, strict=True)]
    graphed = graph is not None
    return float(np.median(times)), graphed


@dataclass
class TimingSession:
    """What a timing run builds once and can reuse across schedules: the model on its device, the
    architecture that runs, its cost-model profile, and the hardware profile predictions use."""

    config: TimingConfig
    device: str
    spec: ArchSpec
    model: TimingModel
    hardware: HardwareProfile
    profile: ModelProfile
    calibration: Calibration
    dtype_bytes: int


def open_session(config: TimingConfig = TimingConfig()) -> TimingSession:
    """Build the timing model (random weights) and resolve device and hardware profile."""
    import torch

    from agentspec_sim.validation.hardware_probe import hardware_for

    device = resolve_device(config.device)
    dtype = getattr(torch, config.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {config.dtype!r}: not a torch dtype")
    tiny = (not device.startswith("cuda")) if config.tiny is None else config.tiny
    spec = ArchSpec.from_profile(load_model(config.model))
    if tiny:
        spec = spec.tiny()
    model = TimingModel(spec, device=device, dtype=dtype, seed=config.seed)
    hardware = hardware_for(device, dtype, config.hardware)
    calibration = Calibration.from_file(config.calibration) if config.calibration else Calibration()
    return TimingSession(config, device, spec, model, hardware, profile_for(spec, dtype.itemsize), calibration,
                         dtype.itemsize)


# The most forward passes (steps × (warmup + repeats)) a timing run makes unless its caller raises the
# limit (`max_passes`; `validate timing --max-passes`): a full-size step takes ~10–100 ms on a GPU, so a
# million passes are hours; a whole step log (a replay at max_num_seqs 1 has ~2M steps) is sampled instead.
MAX_FORWARD_PASSES = 1_000_000


def check_timing_work(steps: int, config: TimingConfig, max_passes: int | None = MAX_FORWARD_PASSES) -> int:
    """The forward passes timing `steps` steps makes; `ResourceError` over `max_passes` (None: no limit),
    blaming the largest factor: the steps (`sample`), `repeats` or `warmup`."""
    from agentspec_sim.host.resources import require_count

    factors = {"sample": steps, "repeats": config.repeats, "warmup": config.warmup}
    passes = steps * (config.warmup + config.repeats)
    blamed = max(factors, key=lambda k: factors[k])
    per_step = f"{config.warmup:,} warmup + {config.repeats:,} timed runs"
    require_count(blamed, passes, "forward passes", "the timing run", max_passes, "max_passes",
                  detail=f"{steps:,} steps × ({per_step})",
                  lower="time a {sample} of fewer steps" if blamed == "sample" else None,
                  value=factors[blamed] if blamed != "warmup" else None)
    return passes


def run_timing(shapes: StepShapes, config: TimingConfig = TimingConfig(),
               progress: Callable[[int, int], None] | None = None, *, session: TimingSession | None = None,
               fit: bool = True, holdout: float = 0.25, max_passes: int | None = MAX_FORWARD_PASSES) -> TimingResult:
    """Time every step of `shapes` and predict it (module docstring); optionally fit a calibration
    to the measurements (`fit`, with `holdout` of the steps held out). `session`: reuse a built model
    (its config wins over `config`). More than `max_passes` forward passes are refused before the model
    is built (`check_timing_work`)."""
    check_timing_work(len(shapes), session.config if session is not None else config, max_passes)
    session = session or open_session(config)
    config = session.config
    began = time.perf_counter()
    measured = np.zeros(len(shapes))
    graphed = np.zeros(len(shapes), dtype=bool)
    for k in range(len(shapes)):
        q, c, pf = shapes.step(k)
        measured[k], graphed[k] = time_step(session.model, q, c, pf, config, seed=config.seed + k)
        if progress is not None:
            progress(k + 1, len(shapes))
    wall = time.perf_counter() - began
    result = TimingResult(shapes, measured, predict(session, shapes, session.calibration), graphed, session.spec,
                          session.profile, session.hardware, session.calibration, session.device, config.dtype,
                          wall, meta={"config": dict(config.__dict__), "attention": attention_kind(session.model)})
    if fit:
        attach_fit(result, session, holdout)
    return result


def attention_kind(model: TimingModel) -> str:
    """Which attention ran: FlashAttention varlen, or the per-call reference loop (CPU, or a CUDA fallback)."""
    if model._varlen is not None:
        return "flash varlen_attn"
    if model.attention_fallback:
        return f"per-call reference loop (CUDA fallback, slower than vLLM's kernel: {model.attention_fallback})"
    return "per-call reference loop"


def predict(session: TimingSession, shapes: StepShapes, calibration: Calibration) -> np.ndarray:
    """The cost model's forward time of every step, for what the session runs."""
    cost = RooflineCostModel(session.hardware, session.profile, 1, calibration, kv_dtype_bytes=session.dtype_bytes)
    return cost.step_times(shapes.query_lens, shapes.context_lens, shapes.is_prefill, shapes.offsets)


def attach_fit(result: TimingResult, session: TimingSession, holdout: float = 0.25) -> None:
    """Fit a calibration to `result`'s measurements (when there are enough steps) and record it."""
    shapes = result.shapes
    timings = StepTimings(shapes.offsets, shapes.query_lens, shapes.context_lens, shapes.is_prefill,
                          result.measured_s)
    if timings.num_steps * (1 - holdout) < 8:
        return
    result.fit = fit_calibration(timings, session.hardware, session.profile, start=session.calibration,
                                 holdout=holdout, seed=session.config.seed, kv_dtype_bytes=session.dtype_bytes,
                                 source=f"validate timing on {session.hardware.name}, {session.spec.name}")
    result.calibrated_s = predict(session, shapes, result.fit.calibration)


def write_outputs(result: TimingResult, out_dir: str | Path, *, plot: bool = True,
                  table_suffix: str = ".parquet") -> dict[str, Path]:
    """Write the run's files under `out_dir` (each atomically); returns them by role.

    timing.parquet (per step), timing_calls.parquet (per call-step, `calibrate cost` input; `.csv`
    with table_suffix=".csv"),
    hardware.json and model.json (what the predictions used; `--hardware` / `--model` accept them),
    calibration.json (when fitted), scatter.png, summary.json.
    """
    from agentspec_sim.io.atomic import write_json_atomic
    from agentspec_sim.validation.hardware_probe import profile_to_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"steps": out / f"timing{table_suffix}", "calls": out / f"timing_calls{table_suffix}",
             "hardware": out / "hardware.json", "model": out / "model.json", "summary": out / "summary.json"}
    write_table(paths["steps"], result.step_columns())
    write_table(paths["calls"], result.call_columns())
    write_json_atomic(paths["hardware"], profile_to_json(result.hardware))
    write_json_atomic(paths["model"], result.spec.hf_config() | {"_name_or_path": result.spec.name})
    if result.fit is not None:
        paths["calibration"] = out / "calibration.json"
        result.fit.calibration.to_file(paths["calibration"], hardware=result.hardware.id, model=result.spec.name,
                                       fit=result.fit.to_dict())
    summary = summary_dict(result)
    write_json_atomic(paths["summary"], summary)
    if plot:
        paths["scatter"] = out / "scatter.png"
        scatter_png(result, paths["scatter"])
    return paths


def summary_dict(result: TimingResult) -> dict:
    fit = result.fit
    return {
        "model": result.spec.name, "device": result.device, "dtype": result.dtype, "hardware": result.hardware.id,
        "steps": len(result.shapes), "cuda_graph_steps": int(result.graphed.sum()), "wall_s": result.wall_s,
        "attention": result.meta.get("attention", "per-call reference loop"),
        "mape": result.mape, "per_batch_size": result.per_bucket(),
        "fit": fit.to_dict() if fit is not None else None, "schedule": result.shapes.meta,
    }


def scatter_png(result: TimingResult, path: str | Path) -> None:
    """Predicted vs measured step time, log-log, coloured by batch-size bucket (atomically written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from agentspec_sim.io.atomic import atomic_binary

    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=120)
    buckets = bucket_of(result.shapes.batch_sizes)
    meas_ms = result.measured_s * 1e3
    for b in np.unique(buckets).tolist():
        sel = buckets == b
        ax.scatter(meas_ms[sel], result.predicted_s[sel] * 1e3, s=14, label=f"batch {bucket_label(b)}")
    if result.calibrated_s is not None:
        ax.scatter(meas_ms, result.calibrated_s * 1e3, s=10, marker="x", color="black", label="calibrated")
    values = np.concatenate([meas_ms, result.predicted_s * 1e3])
    lo, hi = float(values.min()) * 0.8, float(values.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (ms)",
           ylabel="predicted step time (ms)",
           title=f"{result.spec.name} on {result.hardware.name}\nMAPE {result.mape:.1f}%"
           + (f", calibrated {mape(result.calibrated_s, result.measured_s):.1f}%"
              if result.calibrated_s is not None else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_binary(path, compress=False) as out:
        fig.savefig(out, format="png")
    plt.close(fig)
