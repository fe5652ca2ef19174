"""Hardware and model profiles: the numbers the cost model prices a step with.

Profiles are data (JSON files under `profiles/hardware/` and `profiles/models/`); each number in
them carries the source it was taken from. A model profile embeds the Hugging Face `config.json`
fields of the model verbatim, so the bundled profiles and any user-supplied `config.json` go
through one parser (`model_from_hf_config`), which understands llama / qwen2 / qwen3 / mistral /
mixtral / gpt-oss / qwen2-moe / qwen3-moe / deepseek-v2/v3 (MLA) / mimo style keys.

Memory arithmetic (`weight_bytes`, `kv_bytes_per_token`, `kv_capacity_tokens`) follows vLLM 0.33
(docs/ENGINE-FACTS.md §3): KV pages hold K and V for every KV head of every attention layer;
available KV memory = utilisation × HBM − weights − non-KV reserve.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agentspec_sim.io import strict_json

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
HARDWARE_DIR = PROFILE_DIR / "hardware"
MODEL_DIR = PROFILE_DIR / "models"

GIB = 1024**3
MXFP4_BYTES_PER_PARAM = 4.25 / 8  # 4-bit E2M1 element + one 8-bit E8M0 scale per 32 elements (OCP MX v1.0)
VLLM_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.33 default (config/cache.py:215; docs/ENGINE-FACTS.md §1)
EAGLE3_DRAFT_VOCAB = 32000  # speculators Eagle3SpeculatorConfig.draft_vocab_size default


class ProfileError(ValueError):
    """A profile or config.json that cannot be used: names the file and the field."""


def _frozen(mapping: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(mapping or {}))


# --------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator (per GPU). Rates are peak spec-sheet values; efficiencies live in Calibration.

    hbm_bytes:              device memory in bytes (what the driver reports as total).
    hbm_bandwidth:          peak HBM bandwidth, bytes/s.
    peak_flops_bf16:        dense (no sparsity) BF16 tensor-core FLOP/s.
    peak_flops_fp8 / fp4:   dense FP8 / FP4 tensor FLOP/s where the chip has them, else None.
    interconnect_bandwidth: GPU-to-GPU bandwidth per direction (NVLink), bytes/s, for TP all-reduce.
    gemm_kernel_floor_s:    the time one small GEMM kernel takes beyond streaming its weights (launch, prologue,
                            tail wave), seconds; it does not shrink with tensor parallelism. None: 0.
    sources:                field name → where the number comes from.
    """

    id: str
    name: str
    hbm_bytes: int
    hbm_bandwidth: float
    peak_flops_bf16: float
    interconnect_bandwidth: float
    peak_flops_fp8: float | None = None
    peak_flops_fp4: float | None = None
    gemm_kernel_floor_s: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def arithmetic_intensity(self) -> float:
        """Ridge point in FLOP per byte: peak BF16 FLOP/s over peak HBM bytes/s."""
        return self.peak_flops_bf16 / self.hbm_bandwidth

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "<dict>") -> HardwareProfile:
        """Build from the JSON layout: numeric fields are {"value": x, "source": "..."}."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for key in ("id", "name"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise ProfileError(f"{where}: {key}: expected a non-empty string")
            values[key] = data[key]
        numeric = ("hbm_bytes", "hbm_bandwidth", "peak_flops_bf16", "interconnect_bandwidth",
                   "peak_flops_fp8", "peak_flops_fp4", "gemm_kernel_floor_s")
        required = numeric[:4]
        unknown = set(data) - {"id", "name", "notes", *numeric}
        if unknown:
            raise ProfileError(f"{where}: unknown field(s) {sorted(unknown)}")
        for key in numeric:
            entry = data.get(key)
            if entry is None:
                if key in required:
                    raise ProfileError(f"{where}: {key}: missing")
                continue
            if not isinstance(entry, Mapping) or "value" not in entry or not entry.get("source"):
                raise ProfileError(f"{where}: {key}: expected {{\"value\": number, \"source\": \"...\"}}")
            value = entry["value"]
            if value is None and key not in required:
                sources[key] = str(entry["source"])
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ProfileError(f"{where}: {key}: expected a positive number, got {value!r}")
            values[key] = int(value) if key == "hbm_bytes" else float(value)
            sources[key] = str(entry["source"])
        return cls(**values, sources=_frozen(sources))


def _resolve(kind_dir: Path, ident: str | Path, what: str) -> Path:
    """A bundled id (a bare name) wins over a same-named folder; anything path-like is a path."""
    text = str(ident)
    bundled = kind_dir / f"{text.lower()}.json"
    path_like = isinstance(ident, Path) or "/" in text or "\\" in text or text.endswith(".json")
    if not path_like and bundled.exists():
        return bundled
    path = Path(ident)
    if path_like or path.exists():
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ProfileError(f"{path}: no such {what} file")
        return path
    known = ", ".join(sorted(p.stem for p in kind_dir.glob("*.json")))
    raise ProfileError(f"unknown {what} {ident!r} (bundled: {known}; or pass a path to a JSON file)")


def _read_json(path: Path) -> dict:
    try:
        data = strict_json.load_path(path)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a JSON object")
    return data


def hardware_ids() -> list[str]:
    """Ids of the bundled hardware profiles."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def model_ids() -> list[str]:
    """Ids of the bundled model profiles."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.json"))


def load_hardware(hardware: str | Path | HardwareProfile) -> HardwareProfile:
    """A bundled hardware profile by id (`a100-80g`, `h100-80g`, `h200`) or a profile JSON path."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    path = _resolve(HARDWARE_DIR, hardware, "hardware profile")
    return HardwareProfile.from_dict(_read_json(path), where=str(path))


# --------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True, slots=True)
class DraftSpec:
    """The draft network a model-based drafter runs once per draft token.

    eagle3: one Llama decoder layer whose attention reads [embedding ⊕ fused hidden] (2·hidden
            wide), an `fc` fusing three target hidden states (3·hidden → hidden), and an LM head
            over a reduced draft vocabulary (EAGLE-3, Li et al. 2025; vLLM `llama_eagle3.py`).
    mtp:    the model's own next-token-prediction layer(s): an input projection
            (2·hidden → hidden), one decoder layer at the target's dimensions, and the target's
            full LM head (MiMo / DeepSeek-V3 MTP).
    """

    kind: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention_input_size: int
    extra_params: int
    lm_head_rows: int
    bytes_per_param: float = 2.0
    source: str = ""

    def layer_params(self) -> int:
        h, a = self.hidden_size, self.attention_input_size
        qkv = a * (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.num_attention_heads * self.head_dim * h + 3 * h * self.intermediate_size

    def streamed_params(self) -> int:
        """Parameters one draft forward pass reads (embedding rows are gathered, not streamed)."""
        return self.num_layers * self.layer_params() + self.extra_params + self.lm_head_rows * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A decoder-only model's architecture numbers, as a Hugging Face config.json gives them.

    intermediate_size is the dense MLP width (used by dense layers); MoE layers use
    `num_experts` experts of width `moe_intermediate_size`, `experts_per_token` active per token,
    plus always-active shared experts of total width `shared_intermediate_size`.
    `num_dense_layers` leading layers of an MoE model have a dense MLP (DeepSeek's
    first_k_dense_replace). All MLPs are gated (gate, up, down: 3·hidden·width parameters).
    `layer_types[i]` is "full_attention" or "sliding_attention" (window `sliding_window`).
    MLA models (DeepSeek-V2/V3) set kv_lora_rank > 0: their KV cache stores one latent of
    kv_lora_rank + qk_rope_head_dim values per token per layer.
    Bytes per parameter: `dense_bytes_per_param` for attention/dense-MLP/shared/router weights,
    `expert_bytes_per_param` for routed experts (MXFP4 ≈ 4.25 bits), `embedding_bytes_per_param`
    for the embedding and LM head.
    """

    id: str
    name: str
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    num_dense_layers: int = 0
    dense_bytes_per_param: float = 2.0
    expert_bytes_per_param: float = 2.0
    embedding_bytes_per_param: float = 2.0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    max_position_embeddings: int = 0
    default_max_model_len: int = 0
    num_mtp_layers: int = 0
    eagle3: DraftSpec | None = None
    mtp: DraftSpec | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived sizes (parameters, not bytes) ----

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == "sliding_attention")

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of a query·key product (MLA absorbed: latent + rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.kv_lora_rank if self.is_mla else self.head_dim

    def attention_params_per_layer(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * heads * qk) if self.q_lora_rank else h * heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + heads * self.v_head_dim * h
        d = self.head_dim
        return h * (heads + 2 * self.num_kv_heads) * d + heads * d * h

    def expert_params(self) -> int:
        """Parameters of one routed expert (gated MLP)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def layer_dense_params(self) -> int:
        """All non-routed-expert parameters in the transformer layers (norms included)."""
        h, L = self.hidden_size, self.num_layers
        total = L * (self.attention_params_per_layer() + 2 * h)
        if self.is_moe:
            total += self.num_dense_layers * 3 * h * self.intermediate_size
            total += self.num_moe_layers * (h * self.num_experts + 3 * h * self.shared_intermediate_size)
        else:
            total += L * 3 * h * self.intermediate_size
        return total

    def layer_active_params(self) -> int:
        """Layer parameters one token passes through (dense part + its top-k experts)."""
        return self.layer_dense_params() + self.num_moe_layers * self.experts_per_token * self.expert_params()

    def total_expert_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params()

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def dense_gemm_kernels(self) -> int:
        """GEMM kernels one forward pass launches outside the routed experts, as vLLM fuses them: per layer the
        attention's projections (QKV fused and O; MLA: fused q_a/kv_a, q_b and O, its absorbed k/v up-projections
        running inside the attention backend), then a dense MLP's gate_up and down, or a MoE layer's router and its
        shared expert's two; the LM head."""
        attention = 3 if self.is_mla else 2
        moe_layer = 1 + (2 if self.shared_intermediate_size else 0)
        dense_layers = self.num_dense_layers if self.is_moe else self.num_layers
        return self.num_layers * attention + dense_layers * 2 + self.num_moe_layers * moe_layer + 1

    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.lm_head_params()
        return self.layer_dense_params() + self.total_expert_params() + self.vocab_size * self.hidden_size + head

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int = 2, tensor_parallel_size: int = 1) -> int:
        """KV bytes one token occupies in one attention layer on one GPU.

        GQA heads are split across TP ranks (replicated when fewer than ranks, as vLLM does);
        an MLA latent is replicated on every rank.
        """
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        heads = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * heads * self.head_dim * dtype_bytes


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    return default


def _positive_int(cfg: Mapping[str, Any], where: str, *keys: str, default: int | None = None) -> int:
    value = _first(cfg, *keys, default=default)
    if value is None:
        raise ProfileError(f"{where}: {keys[0]}: missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{where}: {keys[0]}: expected a positive integer, got {value!r}")
    return value


def _quantization(cfg: Mapping[str, Any]) -> tuple[float, float, str]:
    """(dense bytes/param, expert bytes/param, source) from `quantization_config`."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if not method:
        return 2.0, 2.0, "no quantization_config: served in BF16/FP16 (2 bytes per parameter)"
    if method == "mxfp4":
        return 2.0, MXFP4_BYTES_PER_PARAM, (
            "quantization_config.quant_method=mxfp4: routed experts in MXFP4 = 4-bit E2M1 + one 8-bit "
            "E8M0 scale per 32 values (OCP Microscaling Formats v1.0) = 4.25 bits; modules_to_not_convert "
            "(attention, router, embeddings, lm_head) stay BF16")
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        return 1.0, 1.0, f"quantization_config.quant_method={method}: 1 byte per linear weight (scales neglected)"
    bits = _first(qc, "bits", "w_bit", "weight_bits")
    if bits is None and isinstance(qc.get("config_groups"), Mapping):
        for group in qc["config_groups"].values():
            bits = (group.get("weights") or {}).get("num_bits")
            if bits:
                break
    if bits:
        group = _first(qc, "group_size", "q_group_size", default=128) or 128
        per = bits / 8 + (2 / group if group > 0 else 0)
        return per, per, f"quantization_config {method}: {bits}-bit weights + one 2-byte scale per {group}"
    return 2.0, 2.0, f"quantization_config.quant_method={method} not understood: assumed 2 bytes per parameter"


def _layer_types(cfg: Mapping[str, Any], num_layers: int, where: str) -> tuple[tuple[str, ...], int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != num_layers:
            raise ProfileError(f"{where}: layer_types: {len(types)} entries for {num_layers} layers")
        mapped = tuple("sliding_attention" if t == "sliding_attention" else "full_attention" for t in types)
    elif "use_sliding_window" in cfg:  # qwen2/qwen3 family: SWA only when switched on, from max_window_layers up
        if cfg.get("use_sliding_window") and window:
            first = int(cfg.get("max_window_layers") or 0)
            mapped = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
        else:
            mapped = ("full_attention",) * num_layers
    elif window:  # mistral v0.1 style: every layer uses the window
        mapped = ("sliding_attention",) * num_layers
    else:
        mapped = ("full_attention",) * num_layers
    if "sliding_attention" not in mapped:
        return mapped, None
    if not isinstance(window, int) or window <= 0:
        raise ProfileError(f"{where}: sliding_window: sliding layers need a positive window, got {window!r}")
    return mapped, window


def _dense_layer_count(cfg: Mapping[str, Any], num_layers: int) -> int:
    if cfg.get("first_k_dense_replace") is not None:  # deepseek
        return min(num_layers, int(cfg["first_k_dense_replace"]))
    dense = set(cfg.get("mlp_only_layers") or [])  # qwen2/3-moe
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step > 1:
        dense |= {i for i in range(num_layers) if (i + 1) % step != 0}
    return len(dense)


def draft_from_config(kind: str, cfg: Mapping[str, Any], target: ModelProfile | None = None) -> DraftSpec:
    """A DraftSpec from a profile's `drafts.<kind>` entry.

    eagle3 entries give the draft layer's HF fields (hidden_size, intermediate_size,
    num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers, draft_vocab_size);
    mtp entries give `num_layers` and take every dimension from the target model.
    """
    source = str(cfg.get("source", ""))
    where = f"drafts.{kind}"
    if kind == "eagle3":
        h = _positive_int(cfg, where, "hidden_size")
        heads = _positive_int(cfg, where, "num_attention_heads")
        return DraftSpec(
            kind="eagle3",
            num_layers=_positive_int(cfg, where, "num_hidden_layers", default=1),
            hidden_size=h,
            intermediate_size=_positive_int(cfg, where, "intermediate_size"),
            num_attention_heads=heads,
            num_kv_heads=_positive_int(cfg, where, "num_key_value_heads", default=heads),
            head_dim=_positive_int(cfg, where, "head_dim", default=h // heads),
            attention_input_size=2 * h,
            extra_params=3 * h * h,
            lm_head_rows=_positive_int(cfg, where, "draft_vocab_size", "vocab_size", default=EAGLE3_DRAFT_VOCAB),
            source=source,
        )
    if kind == "mtp":
        if target is None:
            raise ProfileError(f"{where}: an MTP draft needs its target model")
        h = target.hidden_size
        width = target.intermediate_size
        if target.is_moe and target.num_dense_layers == 0:
            width = target.experts_per_token * target.moe_intermediate_size + target.shared_intermediate_size
        return DraftSpec(
            kind="mtp",
            num_layers=_positive_int(cfg, where, "num_layers", default=max(1, target.num_mtp_layers)),
            hidden_size=h,
            intermediate_size=width,
            num_attention_heads=target.num_attention_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            attention_input_size=h,
            extra_params=2 * h * h,
            lm_head_rows=target.vocab_size,
            bytes_per_param=target.dense_bytes_per_param,
            source=source,
        )
    raise ProfileError(f"{where}: unknown draft kind {kind!r} (eagle3 or mtp)")


def draft_from_model(model: ModelProfile) -> DraftSpec:
    """A whole small model as the draft network of vLLM's `draft_model` method: every layer, its full vocabulary
    LM head, at its own weights' bytes. Dense models only (a MoE draft's touched experts are not priced here)."""
    if model.is_moe:
        raise ProfileError(f"{model.id}: a MoE model as a draft model is not priced (give a dense draft model)")
    return DraftSpec(
        kind="draft_model",
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        attention_input_size=model.hidden_size,
        extra_params=0,
        lm_head_rows=model.vocab_size,
        bytes_per_param=model.dense_bytes_per_param,
        source=f"the draft model {model.id}: its own forward pass per draft token ({model.sources.get('config', '')})",
    )


def model_by_repo(name: str) -> str | None:
    """The bundled profile id a Hugging Face repo name (`Qwen/Qwen3-0.6B`) or an id names, else None."""
    wanted = name.lower()
    for ident in model_ids():
        if ident == wanted:
            return ident
        data = _read_json(MODEL_DIR / f"{ident}.json")
        if str(data.get("hf_repo", "")).lower() == wanted:
            return ident
    return None


def default_draft_model(target: ModelProfile) -> str | None:
    """The bundled model vLLM's `draft_model` method would most likely be given for `target`: the smallest dense
    bundled model of its family (same id prefix) sharing its vocabulary (vLLM verifies the draft's tokens against
    the target's), else None."""
    family = target.id.split("-")[0]
    fits = []
    for ident in model_ids():
        if ident == target.id or ident.split("-")[0] != family:
            continue
        m = load_model(ident)
        if not m.is_moe and m.vocab_size == target.vocab_size and m.total_params() < target.total_params():
            fits.append((m.total_params(), ident))
    return min(fits)[1] if fits else None


def default_eagle3(model: ModelProfile) -> DraftSpec:
    """An EAGLE-3 head at the target's dimensions when the profile names none (assumption, documented)."""
    return draft_from_config("eagle3", {
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size if not model.is_moe or model.num_dense_layers
        else model.experts_per_token * model.moe_intermediate_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "num_hidden_layers": 1,
        "draft_vocab_size": min(EAGLE3_DRAFT_VOCAB, model.vocab_size),
        "source": "assumed: one Llama decoder layer at the target's dimensions, draft vocabulary 32000 "
                  "(the EAGLE-3 / speculators default); no public draft config consulted",
    })


def model_from_hf_config(
    config: Mapping[str, Any],
    *,
    id: str,
    name: str | None = None,
    sources: Mapping[str, str] | None = None,
    drafts: Mapping[str, Mapping[str, Any]] | None = None,
    where: str = "<config>",
) -> ModelProfile:
    """Build a ModelProfile from Hugging Face config.json fields (see the module docstring)."""
    cfg: dict[str, Any] = dict(config)
    if isinstance(cfg.get("text_config"), Mapping) and "hidden_size" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}  # multimodal wrappers keep the LM under text_config
    h = _positive_int(cfg, where, "hidden_size", "n_embd", "d_model")
    layers = _positive_int(cfg, where, "num_hidden_layers", "n_layer", "num_layers")
    heads = _positive_int(cfg, where, "num_attention_heads", "n_head")
    kv_default = 1 if cfg.get("multi_query") else heads
    kv_heads = _positive_int(cfg, where, "num_key_value_heads", "num_kv_heads", default=kv_default)
    head_dim = _positive_int(cfg, where, "head_dim", default=h // heads)
    vocab = _positive_int(cfg, where, "vocab_size")
    inter = _positive_int(cfg, where, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * h)
    experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    top_k = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", default=0) or 0)
    if experts and not top_k:
        raise ProfileError(f"{where}: num_experts_per_tok: an MoE config needs its top-k")
    if experts and top_k > experts:
        raise ProfileError(f"{where}: num_experts_per_tok: {top_k} > {experts} experts")
    moe_inter = int(_first(cfg, "moe_intermediate_size", default=inter if experts else 0) or 0)
    shared = 0
    if experts:
        shared = int(cfg.get("n_shared_experts") or 0) * moe_inter
        shared += int(cfg.get("shared_expert_intermediate_size") or 0)
    dense_layers = _dense_layer_count(cfg, layers) if experts else 0
    layer_types, window = _layer_types(cfg, layers, where)
    dense_bpp, expert_bpp, quant_source = _quantization(cfg)
    max_pos = int(_first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                         default=0) or 0)
    archs = cfg.get("architectures") or [""]
    all_sources = {
        "config": f"{where} (Hugging Face config.json fields)",
        "bytes_per_param": quant_source,
        "default_max_model_len": "vLLM derives max_model_len from max_position_embeddings",
        **(sources or {}),
    }
    profile = ModelProfile(
        id=id,
        name=name or id,
        architecture=str(archs[0]),
        model_type=str(cfg.get("model_type", "")),
        hidden_size=h,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        experts_per_token=top_k,
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=shared,
        num_dense_layers=dense_layers,
        dense_bytes_per_param=dense_bpp,
        expert_bytes_per_param=expert_bpp,
        layer_types=layer_types,
        sliding_window=window,
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        max_position_embeddings=max_pos,
        default_max_model_len=max_pos,
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        sources=_frozen(all_sources),
    )
    drafts = dict(drafts or {})
    eagle3 = draft_from_config("eagle3", drafts["eagle3"]) if "eagle3" in drafts else None
    mtp = None
    if "mtp" in drafts:
        mtp = draft_from_config("mtp", drafts["mtp"], profile)
    elif profile.num_mtp_layers:
        mtp = draft_from_config("mtp", {"num_layers": profile.num_mtp_layers,
                                        "source": f"{where}: num_nextn_predict_layers"}, profile)
    unknown = set(drafts) - {"eagle3", "mtp"}
    if unknown:
        raise ProfileError(f"{where}: drafts: unknown kind(s) {sorted(unknown)}")
    return replace(profile, eagle3=eagle3, mtp=mtp)


@functools.cache
def aic_model_configs() -> Mapping[str, Path]:
    """Short id → `config.json` of every model config AIConfigurator ships (`model_configs/<org>--<name>_config.json`;
    the `aic` extra), {} without it: `Qwen--Qwen3-Coder-480B-A35B-Instruct` is `qwen3-coder-480b-a35b-instruct`,
    `meta-llama--Meta-Llama-3.1-405B` also `llama-3.1-405b`. Found without importing the package."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        return MappingProxyType({})
    folder = Path(next(iter(spec.submodule_search_locations))) / "model_configs"
    out: dict[str, Path] = {}
    for path in sorted(folder.glob("*--*_config.json")):
        if path.name.endswith("_hf_quant_config.json"):
            continue
        short = path.name[:-len("_config.json")].partition("--")[2].lower()
        out.setdefault(short, path)
        if short.startswith("meta-llama-"):
            out.setdefault(short[len("meta-"):], path)
    return MappingProxyType(out)


def aic_repo(path: Path) -> str:
    """The Hugging Face repo an AIConfigurator model config file is named after (`org--name_config.json`)."""
    org, _, name = path.name[:-len("_config.json")].partition("--")
    return f"{org}/{name}"


def _aic_config(ident: str | Path) -> Path | None:
    text = str(ident)
    if isinstance(ident, Path) or "/" in text or "\\" in text or text.endswith(".json") or Path(text).exists():
        return None
    if (MODEL_DIR / f"{text.lower()}.json").exists():
        return None
    return aic_model_configs().get(text.lower())


def load_model(model: str | Path | ModelProfile) -> ModelProfile:
    """A bundled model profile by id, a profile JSON, a Hugging Face config.json, or its folder; with the `aic`
    extra installed, also any model config AIConfigurator ships, by short id (`aic_model_configs`).

    A bundled profile is `{"id", "name", "hf_repo", "config_source", "config": {...HF fields...},
    "sources": {...}, "drafts": {...}}`; any other JSON object is read as a config.json and the
    model id is taken from its folder name (or the file stem).
    """
    if isinstance(model, ModelProfile):
        return model
    aic = _aic_config(model)
    if aic is not None:
        return model_from_hf_config(_read_json(aic), id=str(model).lower(), name=aic_repo(aic),
                                    sources={"config": f"AIConfigurator model_configs/{aic.name} (the model's "
                                             "Hugging Face config.json)"}, where=str(aic))
    resolved = _bundled_by_repo(model)
    try:
        path = _resolve(MODEL_DIR, resolved, "model profile or config.json")
    except ProfileError as exc:
        if resolved is model and isinstance(model, str) and model.count("/") == 1:
            repos = sorted(str(_read_json(MODEL_DIR / f"{i}.json").get("hf_repo") or i) for i in model_ids())
            raise ProfileError(f"{exc}; nor a bundled profile's Hugging Face id ({', '.join(repos)})") from None
        raise
    data = _read_json(path)
    if isinstance(data.get("config"), Mapping):
        sources = dict(data.get("sources") or {})
        if data.get("config_source"):
            sources["config"] = str(data["config_source"])
        return model_from_hf_config(
            data["config"], id=str(data.get("id") or path.stem), name=data.get("name"),
            sources=sources, drafts=data.get("drafts"), where=str(path))
    ident = path.parent.name if path.name == "config.json" else path.stem
    ident = re.sub(r"[^a-z0-9._-]+", "-", ident.lower()) or "model"
    return model_from_hf_config(data, id=ident, name=data.get("_name_or_path") or ident, where=str(path))


def _bundled_by_repo(model: str | Path) -> str | Path:
    """A Hugging Face repo id (`Qwen/Qwen3-8B`, what `vllm serve` takes) that is no file here but names a bundled
    profile's `hf_repo`: that profile's id; anything else as given."""
    if isinstance(model, str) and model.count("/") == 1 and not model.endswith(".json") and not Path(model).exists():
        return model_by_repo(model) or model
    return model


def served_model_name(model: str | Path) -> str | None:
    """The model argument `vllm serve` takes for this profile: a bundled profile's `hf_repo`, a
    config.json's `_name_or_path`; None when the file names neither (or cannot be read)."""
    aic = _aic_config(model)
    if aic is not None:
        return aic_repo(aic)
    try:
        data = _read_json(_resolve(MODEL_DIR, _bundled_by_repo(model), "model profile or config.json"))
    except (ProfileError, OSError):
        return None
    name = data.get("hf_repo") or data.get("_name_or_path")
    return str(name) if name else None


# --------------------------------------------------------------------------------------------
# Which hardware and model a measurement or a fitted calibration belongs to


def profile_name(profile: HardwareProfile | ModelProfile) -> str:
    """The name a measurement or calibration records for the profile it was made on: a bundled profile or
    any hardware by its id, a model read from a config.json by its `_name_or_path` (the id of such a
    model is only its file's or folder's name; `validate timing` writes model.json with the id it ran)."""
    if isinstance(profile, ModelProfile) and profile.id not in model_ids() and profile.name:
        return str(profile.name)
    return profile.id


def _recorded_names(value: str, load) -> set[str]:
    names = {value.lower(), value.rsplit("/", 1)[-1].lower()}  # a Hugging Face repo id by its model part too
    if value.endswith(".json") or Path(value).is_dir():  # an older file recorded the path it was given
        try:
            profile = load(value)
        except (ProfileError, OSError):
            return names
        names |= {profile_name(profile).lower()}
    return names


def _matches(recorded: str, profile: HardwareProfile | ModelProfile, load) -> bool:
    return bool(_recorded_names(recorded, load) & {profile.id.lower(), str(profile.name).lower(),
                                                   profile_name(profile).lower()})


def profile_mismatch(hardware: str | None, model: str | None, hw: HardwareProfile, m: ModelProfile) -> str | None:
    """How the hardware / model something was measured or fitted on (as recorded: a profile's id or name)
    differ from `hw` / `m`, in words; None when they agree or nothing was recorded."""
    parts = []
    if hardware and not _matches(hardware, hw, load_hardware):
        parts.append(f"hardware {hardware!r} (not {hw.id})")
    if model and not _matches(model, m, load_model):
        parts.append(f"model {model!r} (not {profile_name(m)})")
    return " and ".join(parts) or None


# --------------------------------------------------------------------------------------------
# Memory arithmetic


def weight_bytes(model: ModelProfile) -> int:
    """Bytes of all weights held on the GPUs (embedding counted once when tied)."""
    embed = model.vocab_size * model.hidden_size * model.embedding_bytes_per_param
    head = 0 if model.tie_word_embeddings else model.lm_head_params() * model.embedding_bytes_per_param
    dense = model.layer_dense_params() * model.dense_bytes_per_param
    experts = model.total_expert_params() * model.expert_bytes_per_param
    return round(embed + head + dense + experts)


def kv_bytes_per_token(model: ModelProfile, dtype_bytes: int = 2, *, include_sliding: bool = True,
                       tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes one token occupies on one GPU, summed over attention layers.

    include_sliding=False counts only full-attention layers: the long-context cost per token
    under vLLM's hybrid KV manager, which frees a sliding-window layer's blocks outside its window.
    """
    per_layer = model.kv_bytes_per_token_per_layer(dtype_bytes, tensor_parallel_size)
    layers = model.num_layers if include_sliding else model.num_full_layers
    return per_layer * layers


def activation_reserve_bytes(model: ModelProfile, tensor_parallel_size: int = 1, *,
                             max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024) -> int:
    """Estimated transient peak of vLLM's profile run (its `transient_peak_headroom`), per GPU.

    The dummy forward of max_num_batched_tokens tokens peaks in the MLP: the gate/up output
    (2 × active MLP width) plus a few hidden-size buffers and the q/k/v projection output, in
    BF16; the dummy sampler run holds FP32 logits and probabilities for max_num_seqs rows.
    """
    tp = tensor_parallel_size
    width = model.intermediate_size
    if model.is_moe:
        width = max(width if model.num_dense_layers else 0,
                    model.experts_per_token * model.moe_intermediate_size + model.shared_intermediate_size)
    qkv = (model.num_attention_heads + 2 * model.num_kv_heads) * model.head_dim
    forward = max_num_batched_tokens * ((2 * width + qkv) / tp + 3 * model.hidden_size) * 2
    sampler = max_num_seqs * (model.vocab_size / tp) * 4 * 2
    return int(forward + sampler)


FIXED_RESERVE_BYTES = int(1.0 * GIB)
FIXED_RESERVE_SOURCE = (
    "estimate: CUDA-graph pool (vLLM logs 'Graph capturing finished ... took 0.3-1 GiB' for 7-8B models) "
    "plus cuBLAS/NCCL workspaces; vLLM 0.33 subtracts both (docs/ENGINE-FACTS.md §3)")


def kv_capacity_tokens(hw: HardwareProfile, model: ModelProfile,
                       gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION,
                       tp: int = 1, *, kv_dtype_bytes: int = 2, max_num_batched_tokens: int = 8192,
                       max_num_seqs: int = 1024, reserve_bytes: int | None = None,
                       data_parallel_size: int = 1) -> int:
    """Tokens of KV cache that fit on one GPU, as vLLM sizes it (docs/ENGINE-FACTS.md §3):

        (gpu_memory_utilization × HBM − weights per GPU − reserve) / KV bytes per token per GPU

    weights per GPU = weights / tp, except that with data parallelism a MoE model's routed experts are
    sharded over all dp × tp GPUs (vLLM's FusedMoE flattens tp across dp, sliced or, with expert
    parallelism, whole experts) while every rank holds its own copy of the rest.

    reserve = FIXED_RESERVE_BYTES (CUDA graphs, NCCL/cuBLAS workspaces; 1 GiB) +
    `activation_reserve_bytes` (profile-run activation peak), unless `reserve_bytes` is given.
    Models with sliding-window layers are priced per token by their full-attention layers only
    (vLLM's hybrid allocator frees sliding blocks outside the window; the window's own
    footprint, ≤ window + block_size tokens per running call, is neglected).
    Returns 0 when the weights do not fit.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if tp < 1:
        raise ValueError(f"tensor parallel size must be ≥ 1, got {tp}")
    if reserve_bytes is None:
        reserve_bytes = FIXED_RESERVE_BYTES + activation_reserve_bytes(
            model, tp, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    if data_parallel_size < 1:
        raise ValueError(f"data parallel size must be ≥ 1, got {data_parallel_size}")
    weights = weight_bytes(model) / tp
    if model.is_moe and data_parallel_size > 1:
        experts = model.total_expert_params() * model.expert_bytes_per_param
        weights -= experts / tp * (1.0 - 1.0 / data_parallel_size)
    available = gpu_memory_utilization * hw.hbm_bytes - weights - reserve_bytes
    per_token = kv_bytes_per_token(model, kv_dtype_bytes, include_sliding=model.num_full_layers == 0,
                                   tensor_parallel_size=tp)
    return max(0, math.floor(available / per_token))
