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

from agentspec_sim.cost.profiles import ModelProfile, load_hardware, load_model
from agentspec_sim.cost.shapes import StepShape

AIC_PACKAGE = "aiconfigurator-core"
AIC_VERSION = "0.12.0"
BACKEND = "vllm"

# Our hardware profiles → AIC's systems (SXM boards: the profiles' bandwidths and peaks are the SXM ones).
SYSTEMS = {"a100-80g": "a100_sxm", "h100-80g": "h100_sxm", "h200": "h200_sxm"}
# Our model profiles → the AIC model configs that price them. DeepSeek-R1-Distill-Llama-8B is Llama-3.1-8B's
# architecture to the last dimension (checked against the profile when the pricer is built).
MODELS = {
    "qwen3-8b": "Qwen/Qwen3-8B",
    "llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B",
    "deepseek-r1-distill-llama-8b": "meta-llama/Meta-Llama-3.1-8B",
    "mimo-7b": "XiaomiMiMo/MiMo-7B-Base",
    "gpt-oss-20b": "openai/gpt-oss-20b",
}
# Pairs AIC's support matrix marks as failing, and why.
UNSUPPORTED = {
    ("a100-80g", "gpt-oss-20b"): "AIC's A100 vLLM tables (0.14.0) hold no MXFP4 MoE kernels (bfloat16 MoE only) "
                                 "and no sliding-window attention",
}
PARTS = ("weights", "attention", "moe", "other", "communication")


class AicUnavailable(RuntimeError):
    """AIConfigurator is not installed, or cannot price this hardware/model pair."""


def aic_installed() -> bool:
    return importlib.util.find_spec("aiconfigurator_core") is not None


def covered_pairs() -> list[tuple[str, str]]:
    """Every (hardware, model) pair of our profiles that AIC's vLLM tables price."""
    return [(hw, m) for hw in SYSTEMS for m in MODELS if (hw, m) not in UNSUPPORTED]


def coverage(hardware: str, model: str) -> str | None:
    """None when AIC covers the pair, else why not (a sentence)."""
    if hardware not in SYSTEMS:
        return f"AIConfigurator has no system for hardware {hardware!r} (covered: {', '.join(SYSTEMS)})"
    if model not in MODELS:
        return f"AIConfigurator has no model config for {model!r} (covered: {', '.join(MODELS)})"
    return UNSUPPORTED.get((hardware, model))


def _part(op_name: str) -> str:
    name = op_name.split("_", 1)[1] if "_" in op_name else op_name  # drop "context_" / "generation_"
    if "attention" in name:
        return "attention"
    if name.startswith("moe"):
        return "moe"
    if name.endswith("_gemm"):
        return "weights"
    if name.endswith("_ar") or name.startswith("ar_") or name == "p2p" or "allreduce" in name:
        return "communication"
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
    """Prices `StepShape`s for one (hardware, model) pair from AIC's vLLM kernel tables (TP 1)."""

    def __init__(self, hardware: str, model: str) -> None:
        if not aic_installed():
            raise AicUnavailable(f"AIConfigurator is not installed (pip install '{AIC_PACKAGE}=={AIC_VERSION}', "
                                 "or the extra: pip install -e '.[aic]')")
        why = coverage(load_hardware(hardware).id, load_model(model).id)
        if why:
            raise AicUnavailable(why)
        self.hardware, self.model = load_hardware(hardware).id, load_model(model).id
        self.system, self.aic_model = SYSTEMS[self.hardware], MODELS[self.model]
        self._db, self._aic, self.backend_version = _load(self.system, self.aic_model)
        _check_same_architecture(self._aic, load_model(self.model))
        from aiconfigurator_core.sdk import rust_engine_step

        self._engine = rust_engine_step
        self._gen = [(i, op._name, _part(op._name)) for i, op in enumerate(self._aic.generation_ops)]
        self._ctx = [(i, op._name, _part(op._name)) for i, op in enumerate(self._aic.context_ops)]

    @property
    def provenance(self) -> dict[str, str]:
        import importlib.metadata

        return {"aiconfigurator_core": importlib.metadata.version(AIC_PACKAGE), "system": self.system,
                "backend": BACKEND, "backend_version": self.backend_version, "aic_model": self.aic_model}

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
def _load(system: str, aic_model: str):
    """AIC's database view and model for one pair (cached: loading the tables takes ~1 s)."""
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)  # its fallback-table notices are not ours
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    version = perf_database.get_latest_database_version(system, BACKEND)
    if version is None:
        raise AicUnavailable(f"AIConfigurator has no {BACKEND} tables for {system}")
    database = perf_database.get_database_view(system, BACKEND, version)
    config = build_model_config(tp_size=1, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1)
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
