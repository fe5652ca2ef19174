"""NVIDIA AIConfigurator's measured vLLM kernel tables as a price list for step shapes.

AIConfigurator (AIC, `aiconfigurator-core`, Apache-2.0; the optional extra `aic`, imported only here and
only when asked) ships per-kernel latencies measured on the silicon under vLLM: GEMMs by (m, n, k,
dtype), decode attention by (batch, KV length, heads, head dim, window), prefill attention, MoE. It
walks a model into its ops and prices each op from those tables in its compiled engine. This module asks
that engine for the ops of one of our step shapes and adds them up by part:

  decode   the generation ops at b tokens; decode attention over b calls of c + 1 keys
  verify   the generation ops at b·q tokens (every verified position needs its logits, as in vLLM);
           decode attention over b calls of c + q keys, each call's KV read once: vLLM's FlashAttention
           kernel packs a call's 1 + k query rows with its GQA heads into one tile (q·heads/kv ≤ 68 here),
           so a verify reads the KV as a decode does. AIC's own MTP rule prices b·q separate decode rows,
           (1 + k)× the KV read; real vLLM verify steps (SpecDecode-Bench, 3.93e-8 s per KV token at
           k = 20: one read at H100 bandwidth) side with one read.
  prefill  the context ops of one chunk of q tokens after p cached (logits for its last row only)
  mixed    the context ops' GEMMs at q + b tokens (logits for 1 + b rows), the chunk's prefill
           attention, and decode attention over the b decodes: AIC's own three-pass mixed-step rule

Parts: `weights` (dense GEMMs: QKV/O projections, MLP, router, LM head), `attention`, `moe` (routed
experts and their dispatch), `other` (norms, activations, embedding gather) and `communication`
(all-reduces; 0 at TP 1). AIC has no host time (scheduler, sampler, input preparation): its prices are
GPU time, and compare with the cost model's prices without its host overheads.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from functools import cache

from agentspec_sim.cost.layout import SINGLE_GPU, Layout
from agentspec_sim.cost.profiles import (
    ModelProfile,
    aic_model_configs,
    aic_repo,
    kv_capacity_tokens,
    load_hardware,
    load_model,
)
from agentspec_sim.cost.shapes import StepShape

AIC_PACKAGE = "aiconfigurator-core"
AIC_VERSION = "0.12.0"
BACKEND = "vllm"

# Our hardware profiles → AIC's systems with vLLM tables (SXM boards: the profiles' bandwidths and peaks are
# the SXM ones; GB200/GB300 one GPU of an NVL72 rack).
SYSTEMS = {"a100-80g": "a100_sxm", "h100-80g": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm",
           "b300": "b300_sxm", "gb200": "gb200", "gb300": "gb300", "l40s": "l40s",
           "rtx-pro-6000": "rtx_pro_6000_server"}
# Our bundled model profiles → the AIC model configs that price them. DeepSeek-R1-Distill-Llama-8B is
# Llama-3.1-8B's architecture to the last dimension (checked against the profile when the pricer is built).
MODELS = {
    "qwen3-8b": "Qwen/Qwen3-8B",
    "llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B",
    "deepseek-r1-distill-llama-8b": "meta-llama/Meta-Llama-3.1-8B",
    "mimo-7b": "XiaomiMiMo/MiMo-7B-Base",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "qwen3-coder-480b-a35b": "Qwen/Qwen3-Coder-480B-A35B-Instruct",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek-r1": "deepseek-ai/DeepSeek-R1",
}
# Pairs AIC's support matrix (systems/support_matrix/<system>.csv) marks as failing, and why.
_NO_MLA = "AIC's {} vLLM tables hold no MLA kernels for DeepSeek-V3's attention (its support matrix: FAIL)"
UNSUPPORTED = {
    ("a100-80g", "gpt-oss-20b"): "AIC's A100 vLLM tables (0.14.0) hold no MXFP4 MoE kernels (bfloat16 MoE only) "
                                 "and no sliding-window attention",
    ("a100-80g", "gpt-oss-120b"): "AIC's A100 vLLM tables (0.14.0) hold no MXFP4 MoE kernels (bfloat16 MoE only) "
                                  "and no sliding-window attention",
    ("a100-80g", "deepseek-v3"): "AIC marks DeepSeek-V3 on A100 hardware-incompatible (FP8 weights, no MLA tables)",
    ("a100-80g", "deepseek-r1"): "AIC marks DeepSeek-R1 on A100 hardware-incompatible (FP8 weights, no MLA tables)",
    ("l40s", "deepseek-v3"): _NO_MLA.format("L40S"),
    ("l40s", "deepseek-r1"): _NO_MLA.format("L40S"),
    ("rtx-pro-6000", "deepseek-v3"): _NO_MLA.format("RTX PRO 6000"),
    ("rtx-pro-6000", "deepseek-r1"): _NO_MLA.format("RTX PRO 6000"),
    ("l40s", "qwen3-coder-480b-a35b"): "AIC's support matrix marks Qwen3-Coder-480B on L40S as failing",
}
PARTS = ("weights", "attention", "moe", "other", "communication")


class AicUnavailable(RuntimeError):
    """AIConfigurator is not installed, or cannot price this hardware/model pair."""


def aic_installed() -> bool:
    return importlib.util.find_spec("aiconfigurator_core") is not None


# The layouts bundled beside TP 1 (the acceptance pairs): the large models as they are served.
BUNDLED_LAYOUTS = {
    "llama-3.1-70b": Layout(4),
    "qwen3-235b-a22b": Layout(8, True),
    "deepseek-v3": Layout(8, True),
}
# Attention data parallelism, as vLLM recommends serving an MLA model (its latent KV is replicated by tensor
# parallelism, split by data parallelism): one GPU per rank, experts over all eight.
DATA_PARALLEL_LAYOUTS = {"deepseek-v3": Layout(1, True, 8)}


def covered_pairs() -> list[tuple[str, str]]:
    """Every (hardware, model) pair of our profiles that AIC's vLLM tables price."""
    return [(hw, m) for hw in SYSTEMS for m in MODELS if (hw, m) not in UNSUPPORTED]


def bundled_fits() -> list[tuple[str, str, Layout]]:
    """The (hardware, model, layout) fits bundled with the package (`calibrate aic --all`): the 8B-class models
    on the GPUs they were first calibrated on, and the larger models on H100, H200 and B200 at the layout they
    are served with (a model that does not fit one GPU at TP 1 is fitted at its serving layout only)."""
    small = ("qwen3-8b", "llama-3.1-8b", "deepseek-r1-distill-llama-8b", "mimo-7b", "gpt-oss-20b")
    fits = [(hw, m, SINGLE_GPU) for hw in ("a100-80g", "h100-80g", "h200") for m in small
            if (hw, m) not in UNSUPPORTED]
    fits.append(("l40s", "qwen3-8b", SINGLE_GPU))
    # Tensor parallelism of the 8B class, where the one-GPU fit's collectives at their defaults were weakest.
    fits += [(hw, m, Layout(2)) for hw in ("h100-80g", "h200") for m in ("qwen3-8b", "llama-3.1-8b")]
    for hw in ("h100-80g", "h200", "b200"):
        for m in ("qwen3-32b", "gpt-oss-120b", "llama-3.1-70b", "qwen3-235b-a22b", "deepseek-v3"):
            layout = BUNDLED_LAYOUTS.get(m, SINGLE_GPU)
            if _fits(hw, m, layout):  # DeepSeek-V3's 671 GB do not fit 8× H100-80G: vLLM serves it on 2 nodes
                fits.append((hw, m, layout))
            if m in DATA_PARALLEL_LAYOUTS and _fits(hw, m, DATA_PARALLEL_LAYOUTS[m]):
                fits.append((hw, m, DATA_PARALLEL_LAYOUTS[m]))
    return fits


def _fits(hardware: str, model: str, layout: Layout) -> bool:
    """Whether the model's weights leave KV cache on the layout's GPUs (vLLM's sizing at the defaults)."""
    return kv_capacity_tokens(load_hardware(hardware), load_model(model), tp=layout.tensor_parallel_size,
                              data_parallel_size=layout.data_parallel_size) > 0


def aic_model_of(model: str) -> str | None:
    """The AIC model config that prices one of our model ids: a bundled profile's (`MODELS`), or the AIC
    config a short id names (`profiles.aic_model_configs`, with the extra installed); None otherwise."""
    if model in MODELS:
        return MODELS[model]
    path = aic_model_configs().get(model)
    return aic_repo(path) if path is not None else None


def coverage(hardware: str, model: str) -> str | None:
    """None when AIC covers the pair, else why not (a sentence)."""
    if hardware not in SYSTEMS:
        return f"AIConfigurator has no system for hardware {hardware!r} (covered: {', '.join(SYSTEMS)})"
    if aic_model_of(model) is None:
        return (f"AIConfigurator has no model config for {model!r} (covered: {', '.join(MODELS)}, and with the "
                "aic extra installed every config it ships, by short id)")
    return UNSUPPORTED.get((hardware, model))


def _part(op_name: str) -> str:
    name = op_name.split("_", 1)[1] if "_" in op_name else op_name  # drop "context_" / "generation_"
    if "dispatch" in name or name.endswith("_ar") or name.startswith("ar_") or name == "p2p" or "allreduce" in name:
        return "communication"  # MoE dispatch on vLLM is the tensor-parallel all-reduce (AIC's MoEDispatch)
    if "attention" in name or name.startswith("mla"):
        return "attention"  # DeepSeek's MLA block: AIC measures the whole block, projections included
    if name.startswith("moe"):
        return "moe"  # routed experts (DeepSeek's moe_overlap: with the shared expert run beside them)
    if name.endswith("_gemm"):
        return "weights"
    return "other"


@dataclass(frozen=True, slots=True)
class AicPrice:
    """What AIC's measured kernels say one step shape costs, in seconds, by part."""

    shape: StepShape
    weights: float
    attention: float
    moe: float
    other: float
    communication: float

    @property
    def total(self) -> float:
        return self.weights + self.attention + self.moe + self.other + self.communication

    def to_dict(self) -> dict:
        return {**self.shape.to_dict(), "seconds": self.total,
                **{f"{part}_s": getattr(self, part) for part in PARTS}}


class AicPricer:
    """Prices `StepShape`s for one (hardware, model) pair at one parallel layout from AIC's vLLM kernel tables:
    the time of one GPU of the replica (every GPU runs the same step)."""

    def __init__(self, hardware: str, model: str, layout: Layout = SINGLE_GPU) -> None:
        if not aic_installed():
            raise AicUnavailable(f"AIConfigurator is not installed (pip install '{AIC_PACKAGE}=={AIC_VERSION}', "
                                 "or the extra: pip install -e '.[aic]')")
        why = coverage(load_hardware(hardware).id, load_model(model).id)
        if why:
            raise AicUnavailable(why)
        self.hardware, self.model = load_hardware(hardware).id, load_model(model).id
        self.system, self.aic_model = SYSTEMS[self.hardware], aic_model_of(self.model)
        self.layout = layout
        self._db, self._aic, self.backend_version = _load(self.system, self.aic_model, layout)
        _check_same_architecture(self._aic, load_model(self.model))
        from aiconfigurator_core.sdk import rust_engine_step

        self._engine = rust_engine_step
        self._gen = [(i, op._name, _part(op._name)) for i, op in enumerate(self._aic.generation_ops)]
        self._ctx = [(i, op._name, _part(op._name)) for i, op in enumerate(self._aic.context_ops)]

    @property
    def provenance(self) -> dict[str, str]:
        import importlib.metadata

        return {"aiconfigurator_core": importlib.metadata.version(AIC_PACKAGE), "system": self.system,
                "backend": BACKEND, "backend_version": self.backend_version, "aic_model": self.aic_model,
                "tensor_parallel_size": self.layout.tensor_parallel_size,
                "expert_parallel": self.layout.expert_parallel,
                # Only where there are ranks: the files written before data parallelism stay as they are.
                **({"data_parallel_size": self.layout.data_parallel_size} if self.layout.data_parallel_size > 1
                   else {})}

    def price(self, shape: StepShape) -> AicPrice:
        parts = dict.fromkeys(PARTS, 0.0)
        kind, b, c, q, p = shape.kind, shape.batch, shape.context, shape.query_tokens, shape.prefix
        if kind in ("decode", "verify"):
            tokens = b * q
            self._add(parts, self._gen, "generation", lambda part: part != "attention", batch_size=tokens,
                      s=c + q, x=tokens)
            self._add(parts, self._gen, "generation", lambda part: part == "attention", batch_size=b, s=c + q)
        elif kind == "prefill":
            self._add(parts, self._ctx, "context", lambda part: True, batch_size=1, s=q, prefix=p)
        else:  # mixed: the chunk's context ops with the decodes' tokens added, then both attentions
            tokens = q + b
            self._add(parts, self._ctx, "context", lambda part: part != "attention", batch_size=1, s=q,
                      prefix=p, x=tokens, logits_x=1 + b)
            self._add(parts, self._ctx, "context", lambda part: part == "attention", batch_size=1, s=q, prefix=p)
            self._add(parts, self._gen, "generation", lambda part: part == "attention", batch_size=b, s=c + 1)
        return AicPrice(shape, **{k: v / 1000.0 for k, v in parts.items()})

    def _add(self, parts: dict[str, float], ops, phase: str, keep, *, batch_size: int, s: int, prefix: int = 0,
             x: int | None = None, logits_x: int | None = None) -> None:
        evaluate = (self._engine.evaluate_generation_ops_with_rust if phase == "generation"
                    else self._engine.evaluate_context_ops_with_rust)
        chosen = [(i, name, part) for i, name, part in ops if keep(part)]
        plain = [i for i, name, _ in chosen if not (logits_x is not None and name.endswith("logits_gemm"))]
        logits = [i for i, name, _ in chosen if logits_x is not None and name.endswith("logits_gemm")]
        part_of = {name: part for _, name, part in chosen}
        for indices, tokens in ((plain, x), (logits, logits_x)):
            if not indices:
                continue
            for name, latency_ms, _energy, _source in evaluate(self._aic, self._db, indices=indices,
                                                               batch_size=batch_size, s=s, prefix=prefix, x=tokens):
                parts[part_of[name]] += float(latency_ms)


@cache
def _load(system: str, aic_model: str, layout: Layout):
    """AIC's database view and model for one pair and layout (cached: loading the tables takes ~1 s).
    vLLM's layouts in AIC's terms: attention over `tp` GPUs, `dp` attention data-parallel ranks of them; the
    MoE's experts sliced over all dp × tp GPUs (moe_tp) or, with expert parallelism, placed whole (moe_ep)."""
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)  # its fallback-table notices are not ours
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    version = perf_database.get_latest_database_version(system, BACKEND)
    if version is None:
        raise AicUnavailable(f"AIConfigurator has no {BACKEND} tables for {system}")
    database = perf_database.get_database_view(system, BACKEND, version)
    tp, ep, dp = layout.tensor_parallel_size, layout.expert_parallel, layout.data_parallel_size
    config = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=dp, moe_tp_size=1 if ep else tp * dp,
                                moe_ep_size=tp * dp if ep else 1)
    return database, get_model(aic_model, config, BACKEND), str(version)


def _check_same_architecture(aic_model, profile: ModelProfile) -> None:
    """Refuse to price a profile with another model's tables: every dimension that sets a kernel's shape."""
    pairs = {
        "layers": (aic_model._num_layers, profile.num_layers),
        "hidden size": (aic_model._hidden_size, profile.hidden_size),
        "attention heads": (aic_model._num_heads, profile.num_attention_heads),
        "KV heads": (aic_model._num_kv_heads, profile.num_kv_heads),
        "head dim": (aic_model._head_size, profile.head_dim),
        "vocabulary": (aic_model._vocab_size, profile.vocab_size),
    }
    if profile.is_moe:
        pairs["experts"] = (aic_model._num_experts, profile.num_experts)
        pairs["experts per token"] = (aic_model._topk, profile.experts_per_token)
    else:
        pairs["MLP width"] = (aic_model._inter_size, profile.intermediate_size)
    differ = [f"{what} {theirs} vs {ours}" for what, (theirs, ours) in pairs.items() if int(theirs) != int(ours)]
    if differ:
        raise AicUnavailable(f"AIC's {aic_model.model_path} is not {profile.id}'s architecture: {', '.join(differ)}")


@dataclass(frozen=True)
class GemmFloor:
    """A GPU's small-GEMM kernel floor, fitted on AIC's measured vLLM BF16 GEMM table: latency = floor_s +
    weight bytes / (HBM bandwidth × efficiency), over the memory-bound decode rows (m ≤ 16 tokens, n and k in
    [256, 32768]); `median_error` its fit's, `median_error_without` a pure bandwidth fit's (no floor)."""

    hardware: str
    table_version: str
    rows: int
    floor_s: float
    efficiency: float
    median_error: float
    median_error_without: float


def gemm_floor(hardware: str) -> GemmFloor:
    """Fit `HardwareProfile.gemm_kernel_floor_s` from AIC's GEMM table for one GPU (deterministic)."""
    import numpy as np
    import polars as pl
    from scipy.optimize import least_squares

    if not aic_installed():
        raise AicUnavailable(f"AIConfigurator is not installed (pip install '{AIC_PACKAGE}=={AIC_VERSION}')")
    hw = load_hardware(hardware)
    if hw.id not in SYSTEMS:
        raise AicUnavailable(f"AIConfigurator has no system for {hw.id}")
    from aiconfigurator_core.sdk import perf_database

    system = SYSTEMS[hw.id]
    version = perf_database.get_latest_database_version(system, BACKEND)
    spec = importlib.util.find_spec("aiconfigurator_core")
    root = next(iter(spec.submodule_search_locations))
    path = f"{root}/systems/data/{system}/gemm/{BACKEND}/{version}/gemm_perf.parquet"
    rows = (pl.read_parquet(path)
            .filter((pl.col("gemm_dtype") == "bfloat16") & (pl.col("m") <= 16)
                    & pl.col("n").is_between(256, 32768) & pl.col("k").is_between(256, 32768))
            .group_by("m", "n", "k").agg(pl.col("latency").median()).sort("m", "n", "k"))
    stream = (rows["n"] * rows["k"] * 2).to_numpy().astype(np.float64) / hw.hbm_bandwidth
    measured = rows["latency"].to_numpy() * 1e-3  # AIC's tables are in milliseconds

    def errors(floor_s: float, efficiency: float) -> np.ndarray:
        return (floor_s + stream / efficiency) / measured - 1

    fit = least_squares(lambda x: errors(x[0] * 1e-6, x[1]), [3.0, 0.8], loss="soft_l1", f_scale=0.05,
                        bounds=([0.0, 0.05], [50.0, 1.2]))
    without = least_squares(lambda x: errors(0.0, x[0]), [0.8], loss="soft_l1", f_scale=0.05, bounds=(0.05, 1.2))
    return GemmFloor(hardware=hw.id, table_version=str(version), rows=rows.height,
                     floor_s=float(fit.x[0]) * 1e-6, efficiency=float(fit.x[1]),
                     median_error=float(np.median(np.abs(errors(fit.x[0] * 1e-6, fit.x[1])))),
                     median_error_without=float(np.median(np.abs(errors(0.0, without.x[0])))))
