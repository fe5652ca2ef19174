"""The roofline step-cost model: one engine step priced from bytes moved and FLOPs done.

Per step with T tokens over n calls (docs/cost-model.md has the derivation and the cross-check):

  linear     bytes = streamed dense weights + MoE experts touched, E·(1 − (1 − k/E)^T) per layer
             flops = 2 · active params · T + 2 · vocab · hidden · logit rows
             t_lin = ‖(bytes / (BW·η_mem), flops / (F·η_cmp))‖_p        (a p-norm, p = combine_p)
  attention  per call i: KV bytes over its context_len + query_len tokens, read once per layer,
             and 2·heads·(d_qk + d_v) FLOPs per (query, key) pair (= 4·q·ctx·heads·head_dim for
             GQA), sliding-window layers capped at the window;
             t_att = Σ_i max(bytes_i / (BW·η_att), flops_i / (F·η_att_cmp) + q_i·t_query)
  tp > 1     weights and FLOPs split over ranks, plus 2 all-reduces per layer of T·hidden BF16
             values: 2·(tp − 1)/tp · T·hidden·2 bytes / (link BW·η_link) + latency each
  overhead   fixed per step + per layer (small-kernel latency floor) + per call, and per token per layer
             (the norms' and activations' traffic)
  floors     optional, from a kernel-table calibration (docs/cost-model.md, "Grounded in measured
             kernels"): an attention kernel floor per layer and per call per layer (a step of prefill chunks
             only may have its own), a prefill-step floor, a per-query compute time t_query; routed experts priced
             on their own with their own efficiencies and a per-layer floor (the MoE kernel's)

The p-norm is why the transition is smooth: max(a, b) (p = ∞) under-predicts a step whose memory
and compute times are close, where neither fully hides the other; p = 1 (a plain sum) is the
other extreme. p = 2 is the default; `combine_p` is calibratable like every other factor.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar

import numpy as np
from numba import njit

from agentspec_sim.cost.base import BatchShape, StepCost
from agentspec_sim.cost.collectives import allreduce_curve, allreduce_seconds
from agentspec_sim.cost.layout import Layout
from agentspec_sim.cost.profiles import (
    DraftSpec,
    HardwareProfile,
    ModelProfile,
    ProfileError,
    default_eagle3,
    draft_from_model,
    kv_bytes_per_token,
    load_hardware,
    load_model,
)
from agentspec_sim.io import strict_json
from agentspec_sim.io.atomic import atomic_text

CALIBRATION_FORMAT = "agentspec-sim/cost-calibration"
# `draft_model_time(kind=DRAFT_MODEL_KIND + model id)`: vLLM's draft_model method with that draft model.
DRAFT_MODEL_KIND = "draft_model:"
CALIBRATION_VERSION = 1


@dataclass(frozen=True, slots=True)
class Calibration:
    """The roofline's efficiency factors and overheads; every one can be set from a JSON file.

    Defaults and where they come from: `Calibration.SOURCES` (also in docs/cost-model.md).
    """

    memory_efficiency: float = 0.85
    compute_efficiency: float = 0.70
    combine_p: float = 2.0
    attention_bandwidth_efficiency: float = 0.80
    attention_compute_efficiency: float = 0.50
    step_overhead_s: float = 150e-6
    layer_overhead_s: float = 15e-6
    per_call_overhead_s: float = 3e-6
    model_free_draft_step_s: float = 20e-6
    model_free_draft_per_call_s: float = 2e-6
    draft_model_efficiency: float = 0.80
    draft_pass_overhead_s: float = 150e-6
    interconnect_efficiency: float = 0.70
    allreduce_latency_s: float = 10e-6
    collective_scale: float = 1.0
    attention_layer_floor_s: float = 0.0
    attention_call_layer_s: float = 0.0
    prefill_attention_layer_floor_s: float = 0.0
    prefill_only_attention_layer_floor_s: float | None = None
    prefill_attention_compute_efficiency: float | None = None
    attention_query_layer_s: float = 0.0
    layer_token_overhead_s: float = 0.0
    moe_memory_efficiency: float | None = None
    moe_compute_efficiency: float | None = None
    moe_layer_floor_s: float = 0.0
    moe_combine_p: float | None = None
    moe_routing_spread: float = 1.0
    frontend_request_s: float = 20.7e-3
    frontend_prompt_token_s: float = 2.0e-6
    sync_host_step_s: float = 0.56e-3
    sync_host_call_s: float = 32e-6
    ridge_tokens: float | None = None
    source: str = "defaults"

    SOURCES: ClassVar[dict[str, str]] = {
        "memory_efficiency": (
            "fraction of peak HBM bandwidth a weight-streaming GEMM reaches; large copies/GEMVs reach "
            "80-90% on A100/H100. Cross-check: it puts Llama-3.1-8B's H100 weight read at 5.3 ms vs "
            "SpecDecode-Bench's fitted 5.89 ms constant (docs/cost-model.md)"),
        "compute_efficiency": (
            "fraction of dense BF16 peak a large GEMM reaches (cuBLAS: ~70% on H100, more on A100); "
            "SpecDecode-Bench's 2.10e-5 s per batched token for Llama-3.1-8B on H100 implies 72%"),
        "combine_p": (
            "p of the p-norm joining memory and compute time of the linear layers; 2 puts the knee "
            "√2 above max() where they are equal (calibratable; 1 = sum, large p → max)"),
        "attention_bandwidth_efficiency": (
            "fraction of HBM peak paged decode attention (FlashAttention/FlashInfer split-KV) reaches "
            "on long contexts; SpecDecode-Bench's 3.93e-8 s per KV token on H100 implies ~1.0, "
            "80% is the conservative kernel-benchmark figure"),
        "attention_compute_efficiency": (
            "FlashAttention-2 reaches 50-73% of peak FLOP/s in the forward pass on A100 "
            "(Dao 2023, arXiv 2307.08691); the low end covers varlen chunked prefill"),
        "step_overhead_s": (
            "per-step time not overlapped by vLLM 0.33's async scheduling: input preparation, "
            "CUDA-graph launch, sampler kernels (estimate, ~0.1-0.2 ms)"),
        "layer_overhead_s": (
            "small-kernel latency floor per layer (norms, RoPE, KV write, activation, residual: "
            "~6-8 kernels of ~2 µs each even inside a CUDA graph); 32 layers × 15 µs + 0.15 ms = "
            "0.63 ms, the gap between SpecDecode-Bench's 5.89 ms constant and the weight read"),
        "per_call_overhead_s": (
            "per running request per step: sampling rows, output processing in "
            "`update_from_output` (a per-request Python loop); estimate"),
        "model_free_draft_step_s": (
            "fixed CPU cost of a model-free drafting pass per step; with the per-call term it "
            "makes n-gram drafting ~0.5-1% of a verify step at batch 8-64, as SpecDecode-Bench "
            "reports (n-gram draft ≈ 0.6% of verify)"),
        "model_free_draft_per_call_s": "CPU suffix/n-gram lookup per call per step (see model_free_draft_step_s)",
        "draft_model_efficiency": (
            "draft forward passes reach this fraction of the target's memory/compute efficiency "
            "(one small layer + LM head: shorter kernels); estimate"),
        "draft_pass_overhead_s": (
            "fixed cost of one draft forward pass (~12 small kernels + proposer bookkeeping); with "
            "it an EAGLE-3 head on Llama-3.1-8B/H100 costs ~0.6 ms per pass, matching "
            "SpecDecode-Bench's 2.14 ms draft constant at k = 3"),
        "interconnect_efficiency": (
            "fraction of NVLink per-direction bandwidth an NCCL/custom all-reduce reaches; estimate"),
        "allreduce_latency_s": (
            "latency of one small all-reduce on NVLink (vLLM custom all-reduce: a few µs; NCCL: "
            "10-20 µs); estimate"),
        "collective_scale": (
            "multiplies the measured all-reduce curve (cost/collectives.py: vLLM's custom all-reduce as "
            "AIConfigurator measured it) where the hardware has one at the run's tensor-parallel size, in place "
            "of the link formula above: 1 in the defaults (two all-reduces a layer, as measured), fitted at a "
            "layout by `calibrate aic` (what AIC prices for the layer's collectives)"),
        "attention_layer_floor_s": (
            "attention kernel time per layer per step that does not shrink with the KV read (launch and "
            "split-KV reduction of the decode kernel; ~13 µs a layer at batch 1 in AIConfigurator's measured "
            "vLLM tables); 0 in the defaults, where layer_overhead_s covers it"),
        "attention_call_layer_s": (
            "attention kernel time per call per layer beyond its KV read (per-sequence work of the "
            "paged kernel); 0 in the defaults, fitted from measured kernel tables"),
        "prefill_attention_layer_floor_s": (
            "attention time per layer of a step that holds prefill chunks, beyond the decode floor: the "
            "prefill path's own kernels (QK-norm, RoPE, KV-cache write, the varlen kernel's launch); "
            "~20 µs a layer in AIConfigurator's vLLM prices, ~45 µs with Qwen3's QK-norm; 0 in the defaults"),
        "prefill_only_attention_layer_floor_s": (
            "None: every step pays attention_layer_floor_s; a number: a step of prefill chunks only (no decode "
            "row) pays this per layer instead. AIConfigurator prices such a step with its context-attention "
            "kernel alone, whose fixed time prefill_attention_layer_floor_s holds: its fits find 0"),
        "prefill_attention_compute_efficiency": (
            "fraction of BF16 peak a prefill chunk's attention FLOPs reach (None: attention_compute_efficiency). An "
            "MLA model's prefill runs another kernel than its decodes (vLLM's forward_mha: FlashAttention over "
            "up-projected keys, against FlashMLA's absorbed MQA), so its fits set it apart"),
        "attention_query_layer_s": (
            "compute time per query token per layer of a call beyond its (query, key) pairs: the attention "
            "kernel's per-row work that does not grow with the keys (Q load, O store, softmax epilogue, masked "
            "diagonal tiles), which makes a short prefill chunk's kernel less efficient than a long one's; "
            "0 in the defaults, fitted from measured kernel tables"),
        "layer_token_overhead_s": (
            "per token per layer: the norms', activation's and residual adds' memory traffic, which "
            "grows with the step's tokens; 0 in the defaults, fitted from measured kernel tables"),
        "moe_memory_efficiency": (
            "None: routed experts share the dense layers' p-norm and efficiencies; a number prices them "
            "on their own, streaming the experts touched at this fraction of HBM bandwidth (grouped "
            "W4A16/BF16 MoE kernels reach far less than a dense GEMM at few tokens per expert)"),
        "moe_compute_efficiency": (
            "fraction of BF16 peak the routed experts' FLOPs reach when priced on their own (None: "
            "compute_efficiency)"),
        "moe_layer_floor_s": (
            "fixed MoE kernel time per MoE layer per step (routing, permutation, grouped-GEMM launch); "
            "used only when experts are priced on their own"),
        "moe_combine_p": (
            "p of the p-norm joining the routed experts' streaming and FLOP times when priced on their own "
            "(None: combine_p)"),
        "moe_routing_spread": (
            "how fast a step's tokens spread over the experts: E·(1 − (1 − k/E)^(spread·T)) experts touched; "
            "1 is uniform independent routing, below 1 a skewed router (fewer experts touched at small T); "
            "used only when experts are priced on their own"),
        "frontend_request_s": (
            "per request, outside the engine core, on the way to the client's first token: the API server's "
            "request handling and input processing, the hand-off to the core, and the first chunk's way back "
            "(output processor, detokenizer, SSE stream). Fitted on AIConfigurator's measured vLLM 0.18 serving "
            "rows of gpt-oss-120b (H100 TP 2/4/8, H200 TP 1-8; reports/serving_ttft.py), with the engine's async "
            "one-step lag and the tokenizer term below in place; Qwen3-32B's rows held out"),
        "frontend_prompt_token_s": (
            "per prompt token: the API server tokenizes the prompt text (`vllm bench serve` sends text). Measured: "
            "HF tokenizers on Qwen3's tokenizer, random-token text as vLLM's random dataset makes it, 1.7-2.4 us a "
            "token for 1k-8k tokens on one core (reports/serving_ttft.py --tokenizer)"),
        "sync_host_step_s": (
            "per synchronous engine step (async scheduling off: the V1 runner's CPU proposers, vLLM before 0.14): the "
            "engine core's host work the GPU waits for — Scheduler.schedule, the model runner's input preparation and "
            "bookkeeping, update_from_output — measured on vLLM 0.32's CPU build (tiny Qwen3, decode steps, forward, "
            "logits and sampler taken out; reports/host_time.py): 0.56 ms + 32 us a call. SpecDecode-Bench's measured "
            "vLLM 0.10.1 H100 steps carry 1.21 ms a step outside the forward"),
        "sync_host_call_s": "per call in a synchronous step (see sync_host_step_s)",
        "ridge_tokens": (
            "None: AI is computed from the hardware's spec sheet (peak FLOP/s ÷ bandwidth) and the "
            "model; a number overrides it (e.g. 256, the value the AgentSpec paper quotes for A100)"),
    }

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source":
                if not isinstance(value, str):
                    raise ValueError("Calibration.source: expected a string")
                continue
            if value is None and f.name in ("ridge_tokens", "moe_memory_efficiency", "moe_compute_efficiency",
                                             "moe_combine_p", "prefill_only_attention_layer_floor_s",
                                             "prefill_attention_compute_efficiency"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"Calibration.{f.name}: expected a finite number, got {value!r}")
            if f.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"Calibration.{f.name}: a time cannot be negative ({value})")
            elif f.name in ("combine_p", "moe_combine_p"):
                if value < 1:
                    raise ValueError(f"Calibration.{f.name}: must be ≥ 1 (1 = sum), got {value}")
            elif value <= 0:
                raise ValueError(f"Calibration.{f.name}: must be > 0, got {value}")

    @classmethod
    def factor_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "source")

    def replace(self, **changes) -> Calibration:
        values = asdict(self)
        values.update(changes)
        return Calibration(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> Calibration:
        """Read `{"format": "agentspec-sim/cost-calibration", "version": 1, "source": "...",
        "factors": {name: value, ...}}`; factors not named keep their defaults."""
        path = Path(path)
        try:
            data = strict_json.load_path(path)
        except FileNotFoundError as exc:
            raise ProfileError(f"{path}: no such calibration file") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: expected a JSON object")
        if data.get("format", CALIBRATION_FORMAT) != CALIBRATION_FORMAT:
            raise ProfileError(f"{path}: format: expected {CALIBRATION_FORMAT!r}, got {data.get('format')!r}")
        if data.get("version", CALIBRATION_VERSION) != CALIBRATION_VERSION:
            raise ProfileError(f"{path}: version: expected {CALIBRATION_VERSION}, got {data.get('version')!r}")
        factors = data.get("factors", {})
        if not isinstance(factors, dict):
            raise ProfileError(f"{path}: factors: expected an object")
        known = cls.factor_names()
        for name in factors:
            if name not in known:
                raise ProfileError(f"{path}: factors.{name}: unknown factor (known: {', '.join(known)})")
        try:
            return cls(**factors, source=str(data.get("source") or path))
        except ValueError as exc:
            raise ProfileError(f"{path}: {exc}") from exc

    @staticmethod
    def fitted_on(path: str | Path) -> tuple[str | None, str | None]:
        """The (hardware, model) a calibration file records it was fitted on (`to_file`'s meta; None where
        absent). Reads the file again: `from_file` has checked it."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None, None
        if not isinstance(data, dict):
            return None, None
        hardware, model = data.get("hardware"), data.get("model")
        return (hardware if isinstance(hardware, str) else None), (model if isinstance(model, str) else None)

    def to_file(self, path: str | Path, **meta) -> None:
        """Write every factor (atomically); `meta` (e.g. hardware=, model=) is stored alongside."""
        record = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "source": self.source,
                  **meta, "factors": {name: getattr(self, name) for name in self.factor_names()}}
        with atomic_text(path) as out:
            out.write(json.dumps(record, indent=2, ensure_ascii=False) + "\n")


_sum = np.add.reduce  # ufunc reductions skip the ndarray-method dispatch (~0.6 µs each)
_max = np.maximum.reduce
# Above this many compute-bound calls in one step, `_compute_excess` sums with numpy (pairwise).
_SCALAR_EXCESS_MAX = 16


@njit(cache=True, nogil=True, inline="always")
def _excess_d(qi, ci, window, mf, cf, ms, cs, cq):
    """A call's attention compute time minus its memory time (q query tokens over c cached): the same IEEE
    operations as `_compute_excess`'s scalar path."""
    keys = ci + (qi + 1) * 0.5
    d = qi * keys * cf - (ci + qi) * mf
    if ms:
        d += qi * min(keys, np.float64(window)) * cs - (min(ci, window) + qi) * ms
    if cq:
        d += qi * cq
    return d


@njit(cache=True, nogil=True, inline="always")
def _row_excess(qi, ci, prefill, window, mf, cf, ms, cs, cq, cfp, cu):
    """`_excess_d` of one row: a prefill chunk with its own compute per pair (`cfp`) and, for MLA, the up-projection
    of its cached context (`cu` a token); a decode or verify row with `cf`."""
    if prefill:
        d = _excess_d(qi, ci, window, mf, cfp, ms, cs, cq)
        if cu:
            d += ci * cu
        return d
    return _excess_d(qi, ci, window, mf, cf, ms, cs, cq)


@njit(cache=True, nogil=True)
def _step_sums(q, c, pf, window, q_mem_bound, mf, cf, ms, cs, cq, cfp, cu, excess_terms):
    """One pass over a step's calls: (tokens, prefill query tokens, prefill calls, Σ context,
    Σ min(context, window), compute-bound calls, their attention compute excess summed in order).
    cq: attention compute seconds per query token (`Calibration.attention_query_layer_s`, all layers);
    cfp, cu: a prefill row's compute per pair and per cached token (`_row_excess`; cfp = cf, cu = 0 but for MLA).

    The excess terms max(0, d) of the compute-bound calls go to `excess_terms` (the caller sums them
    with numpy when there are more than `_SCALAR_EXCESS_MAX`, as `_compute_excess` does); each d and
    the in-order sum are the same IEEE operations as `_compute_excess`'s scalar path.
    """
    tokens = 0
    q_prefill = 0
    n_prefill = 0
    sum_c = 0
    sum_cw = 0
    n_heavy = 0
    excess = 0.0
    for i in range(q.shape[0]):
        qi = np.int64(q[i])
        ci = np.int64(c[i])
        tokens += qi
        sum_c += ci
        if window:
            sum_cw += min(ci, window)
        if pf[i]:
            q_prefill += qi
            n_prefill += 1
        if qi > q_mem_bound or (cu and pf[i]):  # an MLA prefill's context up-projection: any q may be heavy
            d = _row_excess(qi, ci, pf[i], window, mf, cf, ms, cs, cq, cfp, cu)
            if (cq or cu) and not d > 0.0:  # every row a candidate: count the compute-bound ones
                continue
            excess_terms[n_heavy] = d if d > 0.0 else 0.0
            n_heavy += 1
            if d > 0.0:
                excess += d
    return tokens, q_prefill, n_prefill, sum_c, sum_cw, n_heavy, excess


@njit(cache=True, nogil=True)
def _step_parts(q, c, pf, offsets, window, q_mem_bound, mem_full, cmp_full, mem_slide, cmp_slide, cmp_query,
                cmp_prefill, up_context, excess_max):
    """Per step of a run (rows offsets[k]:offsets[k + 1]): tokens, logit rows, and the attention time with
    its compute excess, in `step_time`'s IEEE order (integer sums exact, the excess summed row by row).
    A step with more than `excess_max` compute-bound rows gets its excess from `_compute_excess` (its
    numpy sum): flagged in `many`, its attention left without it. cmp_query, cmp_prefill, up_context: as
    `_step_sums`'s cq, cfp and cu.
    One pass per step: the excess is summed in row order as the rows are counted."""
    num_steps = offsets.shape[0] - 1
    tokens = np.empty(num_steps, dtype=np.int64)
    logit_rows = np.empty(num_steps, dtype=np.int64)
    attention = np.empty(num_steps, dtype=np.float64)
    many = np.zeros(num_steps, dtype=np.bool_)
    for k in range(num_steps):
        t = np.int64(0)
        tq_prefill = np.int64(0)
        n_prefill = np.int64(0)
        sum_c = np.int64(0)
        sum_cw = np.int64(0)
        heavy = 0
        excess = 0.0
        for i in range(offsets[k], offsets[k + 1]):
            qi = np.int64(q[i])
            ci = np.int64(c[i])
            t += qi
            if pf[i]:
                tq_prefill += qi
                n_prefill += 1
            sum_c += ci
            sum_cw += min(ci, window)
            if qi > q_mem_bound or (up_context and pf[i]):
                d = _row_excess(qi, ci, pf[i], window, mem_full, cmp_full, mem_slide, cmp_slide, cmp_query,
                                cmp_prefill, up_context)
                if (cmp_query or up_context) and not d > 0.0:  # as `_step_sums`: only the compute-bound rows count
                    continue
                heavy += 1
                if d > 0.0:
                    excess += d
        tokens[k] = t
        logit_rows[k] = t - tq_prefill + n_prefill if n_prefill > 0 else t
        a = (sum_c + t) * mem_full
        if mem_slide:
            a += (sum_cw + t) * mem_slide
        if heavy > excess_max:
            many[k] = True
        elif heavy:
            a += excess
        attention[k] = a
    return tokens, logit_rows, attention, many


def _pnorm(a: float, b: float, p: float) -> float:
    if p == 2.0:
        return math.hypot(a, b)
    if p == 1.0:
        return a + b
    m = a if a > b else b
    if m == 0.0:
        return 0.0
    return m * ((a / m) ** p + (b / m) ** p) ** (1.0 / p)


def _draft_seconds(per_pass: float, kv_bytes: float, inv_attn_bw: float, efficiency: float, pass_overhead: float,
                   num_calls: int, draft_len: int, ctx: float) -> float:
    """`draft_model_time` from its terms: draft_len passes over num_calls rows whose contexts sum to ctx."""
    kv_tokens = draft_len * (ctx + num_calls) + num_calls * draft_len * (draft_len - 1) / 2
    attention = kv_tokens * kv_bytes * inv_attn_bw
    return (draft_len * per_pass + attention) / efficiency + draft_len * pass_overhead


# The same formula compiled, for drafting inside the engine's loop: the same IEEE operations in the same
# order, hence the same seconds as `draft_model_time` (tests/test_engine_fast_paths.py compares whole runs).
draft_seconds = njit(cache=True, nogil=True)(_draft_seconds)


@dataclass(frozen=True, slots=True)
class _DraftConsts:
    spec: DraftSpec
    bytes: float        # weight bytes one pass streams (per GPU)
    flops_row: float    # FLOPs per row per pass (per GPU), logits included
    kv_bytes: float     # draft KV bytes per context token (per GPU)


class RooflineCostModel:
    """StepCostModel from a hardware profile, a model profile, a TP degree and a Calibration.

    All per-step constants are folded at construction, so `step_time` is a handful of numpy
    reductions (< 20 µs at batch 256). Immutable after construction.
    """

    __slots__ = (
        "_attn_cmp_full",
        "_attn_cmp_prefill",
        "_attn_cmp_slide",
        "_attn_fixed",
        "_attn_fixed_prefill_only",
        "_attn_mem_full",
        "_attn_mem_slide",
        "_attn_per_call",
        "_attn_prefill",
        "_attn_prefill_only",
        "_attn_query",
        "_attn_up_context",
        "_calc_ridge",
        "_check",
        "_comm_curve",
        "_comm_fixed",
        "_comm_layers",
        "_comm_memo",
        "_comm_moe_curve",
        "_comm_moe_layers",
        "_comm_moe_token",
        "_comm_token",
        "_decode_linear",
        "_default_draft",
        "_dense_bytes",
        "_dp",
        "_drafts",
        "_expert_flops",
        "_flops_logit",
        "_flops_token",
        "_gemm_floor",
        "_inv_attn_bw",
        "_inv_bw",
        "_inv_flops",
        "_inv_moe_bw",
        "_inv_moe_flops",
        "_linear_memo",
        "_moe_bytes",
        "_moe_fixed",
        "_moe_flops_token",
        "_moe_miss",
        "_moe_miss_spread",
        "_moe_p",
        "_overhead_fixed",
        "_p",
        "_per_call",
        "_q_mem_bound",
        "_token_overhead",
        "_window",
        "calibration",
        "data_parallel_size",
        "expert_parallel",
        "hardware",
        "kv_dtype_bytes",
        "model",
        "tensor_parallel_size",
    )

    def __init__(self, hardware: HardwareProfile | str, model: ModelProfile | str,
                 tensor_parallel_size: int = 1, calibration: Calibration | None = None, *,
                 draft: str | None = None, kv_dtype_bytes: int = 2, check_inputs: bool = False,
                 expert_parallel: bool = False, data_parallel_size: int = 1) -> None:
        hw, m = load_hardware(hardware), load_model(model)
        cal = calibration or Calibration()
        tp = int(tensor_parallel_size)
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be ≥ 1, got {tensor_parallel_size}")
        if m.num_attention_heads % tp:
            raise ValueError(f"{m.id}: {m.num_attention_heads} attention heads do not split over tp={tp}")
        self.hardware, self.model, self.calibration = hw, m, cal
        self.tensor_parallel_size, self.kv_dtype_bytes, self._check = tp, kv_dtype_bytes, check_inputs
        # vLLM's --enable-expert-parallel places whole experts over the tp GPUs instead of slicing each one:
        # the same bytes and FLOPs per GPU on average, so the formulas are the tensor-parallel ones; the
        # layout's own kernels (and their imbalance) are in its calibration (`calibrate aic`).
        self.expert_parallel = bool(expert_parallel) and m.is_moe
        # --data-parallel-size: this model prices one rank (tp GPUs, its own requests). A dense model's ranks
        # are independent replicas; a MoE model's routed experts are sharded over all dp × tp GPUs, each
        # serving the tokens of every rank (`BatchShape.moe_tokens`).
        dp = int(data_parallel_size)
        if dp < 1:
            raise ValueError(f"data_parallel_size must be ≥ 1, got {data_parallel_size}")
        self.data_parallel_size = dp
        self._dp = dp if m.is_moe else 1

        # Linear layers, per GPU. The embedding is gathered (not streamed); the LM head is streamed
        # (the embedding matrix itself when tied) and multiplies only the rows whose logits are needed.
        head_bytes = m.lm_head_params() * m.embedding_bytes_per_param
        self._dense_bytes = (m.layer_dense_params() * m.dense_bytes_per_param + head_bytes) / tp
        self._moe_bytes = (m.num_moe_layers * m.num_experts * m.expert_params() * m.expert_bytes_per_param
                           / (tp * self._dp))
        self._moe_miss = 1.0 - m.experts_per_token / m.num_experts if m.is_moe else 1.0
        self._flops_token = 2.0 * m.layer_active_params() / tp  # the experts' share: this rank's tokens
        self._flops_logit = 2.0 * m.lm_head_params() / tp
        # The routed experts' FLOPs per token seen at the experts, per GPU (they are sharded over dp × tp GPUs).
        self._expert_flops = (2.0 * m.num_moe_layers * m.experts_per_token * m.expert_params() / (tp * self._dp)
                              if m.is_moe else 0.0)
        # Each GEMM kernel takes a floor beyond its weight stream (launch, prologue, tail wave: ~3 µs on Hopper in
        # AIConfigurator's measured vLLM GEMM tables, `gemm_kernel_floor_s`), one per kernel whatever the tensor-
        # parallel size: why a layer's linear time does not shrink as 1/tp.
        self._gemm_floor = m.dense_gemm_kernels() * (hw.gemm_kernel_floor_s or 0.0)
        self._inv_bw = 1.0 / (hw.hbm_bandwidth * cal.memory_efficiency)
        self._inv_flops = 1.0 / (hw.peak_flops_bf16 * cal.compute_efficiency)
        self._p = float(cal.combine_p)
        # Routed experts on their own (a kernel-table calibration sets their efficiencies): the dense
        # p-norm then covers dense bytes and FLOPs only, and the experts add theirs with their own floor.
        separate_moe = m.is_moe and (cal.moe_memory_efficiency is not None or cal.moe_compute_efficiency
                                     is not None or cal.moe_layer_floor_s > 0)
        if separate_moe:
            self._moe_flops_token = self._expert_flops
            self._inv_moe_bw = 1.0 / (hw.hbm_bandwidth * (cal.moe_memory_efficiency or cal.memory_efficiency))
            self._inv_moe_flops = 1.0 / (hw.peak_flops_bf16 * (cal.moe_compute_efficiency or cal.compute_efficiency))
            self._moe_fixed = m.num_moe_layers * cal.moe_layer_floor_s
            self._moe_miss_spread = self._moe_miss ** cal.moe_routing_spread
            self._moe_p = float(cal.moe_combine_p or cal.combine_p)
        else:
            self._moe_flops_token = self._inv_moe_bw = self._inv_moe_flops = self._moe_fixed = 0.0
            self._moe_miss_spread, self._moe_p = self._moe_miss, self._p

        # Attention, per GPU: seconds per KV token read and per (query, key) pair, summed over layers.
        per_layer_kv = m.kv_bytes_per_token_per_layer(kv_dtype_bytes, tp)
        attn_bw = hw.hbm_bandwidth * cal.attention_bandwidth_efficiency
        attn_f = hw.peak_flops_bf16 * cal.attention_compute_efficiency
        pair_flops = 2.0 * (m.num_attention_heads / tp) * (m.qk_head_dim + m.value_head_dim)
        self._inv_attn_bw = 1.0 / attn_bw
        self._attn_mem_full = m.num_full_layers * per_layer_kv / attn_bw
        self._attn_mem_slide = m.num_sliding_layers * per_layer_kv / attn_bw
        self._attn_cmp_full = m.num_full_layers * pair_flops / attn_f
        self._attn_cmp_slide = m.num_sliding_layers * pair_flops / attn_f
        # MLA (vLLM's mla_attention.py): decodes and verifies attend in the absorbed form above (MQA over the
        # 576-wide latent); a prefill chunk in the compute-friendly one (`forward_mha`: MHA with qk = nope + rope,
        # v = v_head_dim) after up-projecting its cached context's latents (kv_b_proj) into keys and values.
        prefill_f = (attn_f if cal.prefill_attention_compute_efficiency is None
                     else hw.peak_flops_bf16 * cal.prefill_attention_compute_efficiency)
        if m.is_mla:
            heads = m.num_attention_heads / tp
            mha_pair = 2.0 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
            self._attn_cmp_prefill = m.num_full_layers * mha_pair / prefill_f
            # The up-projection is a GEMM (`_compute_prefill_context`: kv_b_proj over every cached token, each
            # prefill step): priced at the linear layers' rate.
            self._attn_up_context = (m.num_full_layers * 2.0 * m.kv_lora_rank * heads
                                     * (m.qk_nope_head_dim + m.v_head_dim) * self._inv_flops)
        else:
            self._attn_cmp_prefill = m.num_full_layers * pair_flops / prefill_f
            self._attn_up_context = 0.0
        self._window = int(m.sliding_window or 0)
        self._attn_query = m.num_layers * cal.attention_query_layer_s  # compute per query token, all layers
        # A call with q ≤ this many query tokens is memory-bound in attention for any context
        # (q·(c + (q+1)/2)·cmp + q·cq ≤ (c + q)·mem whenever q ≤ (mem − cq)/cmp), so decode-only
        # batches skip the per-call maximum exactly.
        ratios = [(mem - self._attn_query) / cmp for mem, cmp in ((self._attn_mem_full, self._attn_cmp_full),
                                                                  (self._attn_mem_slide, self._attn_cmp_slide))
                  if cmp > 0]
        self._q_mem_bound = max(0, int(min(ratios))) if ratios else 0

        # Tensor parallel: 2 all-reduces per layer (after attention and after the MLP) of T·hidden values, priced
        # from the measured curve of this GPU at this size where there is one, else from the link.
        # Data-parallel MoE: each MoE layer gathers every rank's tokens to the expert GPUs and scatters the
        # sums back (vLLM's default all2all backend, allgather_reducescatter): the bytes of one all-reduce of
        # the global tokens over dp × tp GPUs, priced on that size's measured all-reduce curve, in place of the
        # MoE layers' own tensor-parallel all-reduce. Where that size was not measured, the link formula (the
        # ring's 2·(n − 1)/n of the bytes).
        allreduces = 2 * m.num_layers - (m.num_moe_layers if self._dp > 1 else 0)
        self._comm_curve = allreduce_curve(hw.id, tp) if tp > 1 else None
        self._comm_layers = allreduces * cal.collective_scale
        if tp > 1 and self._comm_curve is None:
            link = hw.interconnect_bandwidth * cal.interconnect_efficiency
            self._comm_token = allreduces * (2.0 * (tp - 1) / tp) * m.hidden_size * 2 / link
            self._comm_fixed = allreduces * cal.allreduce_latency_s
        else:
            self._comm_token = self._comm_fixed = 0.0
        self._comm_moe_curve = allreduce_curve(hw.id, tp * self._dp) if self._dp > 1 else None
        self._comm_moe_layers = m.num_moe_layers * cal.collective_scale if self._dp > 1 else 0.0
        self._comm_moe_token = 0.0
        if self._dp > 1 and self._comm_moe_curve is None:
            n = tp * self._dp
            self._comm_moe_token = (m.num_moe_layers * (2.0 * (n - 1) / n) * m.hidden_size * 2
                                    / (hw.interconnect_bandwidth * cal.interconnect_efficiency))

        self._overhead_fixed = cal.step_overhead_s + m.num_layers * cal.layer_overhead_s
        self._per_call = cal.per_call_overhead_s
        self._token_overhead = m.num_layers * cal.layer_token_overhead_s
        self._attn_fixed = m.num_layers * cal.attention_layer_floor_s
        self._attn_per_call = m.num_layers * cal.attention_call_layer_s
        self._attn_prefill = m.num_layers * cal.prefill_attention_layer_floor_s
        # A step of prefill chunks only: its own attention floor (off: attention_layer_floor_s, as every step).
        self._attn_prefill_only = cal.prefill_only_attention_layer_floor_s is not None
        self._attn_fixed_prefill_only = (m.num_layers * cal.prefill_only_attention_layer_floor_s
                                         if self._attn_prefill_only else self._attn_fixed)

        drafts: dict[str, _DraftConsts] = {}
        for kind, spec in (("eagle3", m.eagle3 or default_eagle3(m)), ("mtp", m.mtp)):
            if spec is None:
                continue
            drafts[kind] = _DraftConsts(
                spec=spec,
                bytes=spec.streamed_params() * spec.bytes_per_param / tp,
                flops_row=2.0 * spec.streamed_params() / tp,
                kv_bytes=spec.kv_bytes_per_token(kv_dtype_bytes) / min(tp, max(1, spec.num_kv_heads)),
            )
        self._drafts = drafts
        if draft is None:
            draft = "mtp" if "mtp" in drafts else "eagle3"
        if draft not in drafts:
            raise ValueError(f"{m.id}: no {draft!r} draft network (available: {', '.join(sorted(drafts))})")
        self._default_draft = draft
        self._calc_ridge = self._crossover(hw.hbm_bandwidth, hw.peak_flops_bf16)
        # `_linear_s` of each (tokens, logit rows) pair seen: a pure function of two integers, and
        # a step has few distinct pairs (a cache, not state: results are the same without it).
        self._linear_memo: dict[tuple[int, int], float] = {}
        self._comm_memo: dict[tuple[int, int], float] = {}
        self._decode_linear = np.full(256, np.nan)  # the same for decode-only steps, by token count

    # ---- StepCostModel ----

    def step_time(self, batch: BatchShape) -> StepCost:
        """Seconds for one forward pass over `batch` (contract: `StepCostModel.step_time`)."""
        if self._check:
            batch.validate()
        q, c, pf = batch.query_lens, batch.context_lens, batch.is_prefill
        n = q.shape[0]
        terms = np.empty(n, dtype=np.float64)
        tokens, q_prefill, n_prefill, sum_c, sum_cw, n_heavy, excess = _step_sums(
            q, c, pf, self._window, self._q_mem_bound, self._attn_mem_full, self._attn_cmp_full,
            self._attn_mem_slide, self._attn_cmp_slide, self._attn_query, self._attn_cmp_prefill,
            self._attn_up_context, terms)
        logit_rows = tokens - q_prefill + n_prefill if n_prefill else tokens
        moe_tokens = batch.moe_tokens or tokens * self._dp
        key = (tokens, logit_rows) if moe_tokens == tokens * self._dp else (tokens, logit_rows, moe_tokens)
        linear = self._linear_memo.get(key)
        if linear is None:
            linear = self._linear_memo[key] = self._linear_s(tokens, logit_rows, moe_tokens)

        # Attention: every call reads its KV once per layer (memory time, summed in closed form);
        # calls with enough query tokens to be compute-bound add their compute excess.
        attention = (sum_c + tokens) * self._attn_mem_full
        if self._attn_mem_slide:
            attention += (sum_cw + tokens) * self._attn_mem_slide
        if n_heavy:
            attention += float(_sum(terms[:n_heavy])) if n_heavy > _SCALAR_EXCESS_MAX else excess
        if self._attn_fixed or self._attn_per_call or self._attn_prefill_only:
            fixed = self._attn_fixed_prefill_only if n_prefill == n else self._attn_fixed
            attention += fixed + self._attn_per_call * n
        if n_prefill and self._attn_prefill:
            attention += self._attn_prefill

        communication = self._comm_memo.get((tokens, moe_tokens))
        if communication is None:  # a pure function of two integers, as `_linear_memo`
            communication = self._comm_memo[(tokens, moe_tokens)] = self._communication(tokens, moe_tokens)
        overhead = self._overhead_fixed + self._per_call * n
        if self._token_overhead:
            overhead += self._token_overhead * tokens
        total = linear + attention + overhead + communication
        if self._moe_fixed or self._inv_moe_bw:
            moe = self._moe_s(moe_tokens)
            return StepCost(total, linear - moe, attention, overhead, communication, moe)
        return StepCost(total, linear, attention, overhead, communication)

    def _linear_s(self, tokens: int, logit_rows: int, moe_tokens: int | None = None) -> float:
        """The linear layers' time for `tokens` tokens of which `logit_rows` need logits (Python ints), routed
        experts included, which see `moe_tokens` (None: tokens × the data-parallel size, ranks in balance)."""
        weight_bytes = self._dense_bytes
        flops = self._flops_token * tokens + self._flops_logit * logit_rows
        local = tokens * self._dp  # the experts' FLOPs in `flops`, in units of their per-GPU share
        if moe_tokens is None:
            moe_tokens = local
        if self._inv_moe_bw:  # experts on their own
            flops -= self._moe_flops_token * local
            return (self._gemm_floor + _pnorm(weight_bytes * self._inv_bw, flops * self._inv_flops, self._p)
                    + self._moe_s(moe_tokens))
        if self._moe_bytes:
            weight_bytes += self._moe_bytes * (1.0 - self._moe_miss**moe_tokens)
            if moe_tokens != local:
                flops += self._expert_flops * (moe_tokens - local)
        return self._gemm_floor + _pnorm(weight_bytes * self._inv_bw, flops * self._inv_flops, self._p)

    def _moe_s(self, tokens: int) -> float:
        """The routed experts' time when priced on their own: the experts `tokens` tokens touch under uniform
        routing, streamed, p-normed with their FLOPs, plus the MoE kernels' floor."""
        touched = self._moe_bytes * (1.0 - self._moe_miss_spread**tokens)
        return self._moe_fixed + _pnorm(touched * self._inv_moe_bw, self._moe_flops_token * tokens
                                        * self._inv_moe_flops, self._moe_p)

    def step_times(self, query_lens: np.ndarray, context_lens: np.ndarray, is_prefill: np.ndarray,
                   offsets: np.ndarray) -> np.ndarray:
        """`step_time(...).total_s` of many steps at once (the simulator prices a run of steps in one call).

        Step k is rows `offsets[k]:offsets[k + 1]` of the flat integer `query_lens` / `context_lens` and
        bool `is_prefill` arrays; every step has ≥ 1 row. Bit-for-bit equal to calling `step_time` on
        each step: the same IEEE operations in the same order, elementwise over steps. Integer sums are
        exact; the linear layers' p-norm is computed by `_linear_s` once per distinct (tokens, logit
        rows) pair, in Python (`_linear_of`); the per-step sums and the attention (`_step_parts`, compiled: a run's
        pricing is a handful of calls, not dozens of small numpy ones) add the compute excess row by row
        in row order, as `_compute_excess` does for up to 16 compute-bound calls, and a step with more
        than 16 calls `_compute_excess` itself (its numpy path sums pairwise).
        """
        q, c = np.asarray(query_lens), np.asarray(context_lens)  # any integer dtype: sums are taken in int64
        pf = np.asarray(is_prefill, dtype=bool)
        offsets = np.asarray(offsets, dtype=np.int64)
        num_steps = offsets.shape[0] - 1
        if num_steps <= 0:
            return np.zeros(0, dtype=np.float64)
        n = np.diff(offsets)
        if self._check and (q.shape[0] != offsets[-1] or int(n.min()) < 1 or int(q.min()) < 1 or int(c.min()) < 0):
            raise ValueError("step_times: every step needs ≥ 1 call with query_len ≥ 1 and context_len ≥ 0")
        tokens, logit_rows, attention, many = _step_parts(
            q, c, pf, offsets, self._window, self._q_mem_bound, self._attn_mem_full, self._attn_cmp_full,
            self._attn_mem_slide, self._attn_cmp_slide, self._attn_query, self._attn_cmp_prefill,
            self._attn_up_context, _SCALAR_EXCESS_MAX)
        if many.any():
            for k in many.nonzero()[0].tolist():
                lo, hi = int(offsets[k]), int(offsets[k + 1])
                attention[k] += self._compute_excess(q[lo:hi].astype(np.int64), c[lo:hi].astype(np.int64),
                                                     pf[lo:hi])
        if self._attn_fixed or self._attn_per_call or self._attn_prefill_only:
            fixed = self._attn_fixed
            if self._attn_prefill_only:  # steps of prefill chunks only
                fixed = np.where(np.logical_and.reduceat(pf, offsets[:-1]), self._attn_fixed_prefill_only, fixed)
            attention += fixed + self._attn_per_call * n
        if self._attn_prefill:
            attention += np.where(np.logical_or.reduceat(pf, offsets[:-1]), self._attn_prefill, 0.0)
        linear = self._linear_of(tokens, logit_rows)
        communication = self._communication(tokens, tokens * self._dp)
        overhead = self._overhead_fixed + self._per_call * n
        if self._token_overhead:
            overhead += self._token_overhead * tokens
        return linear + attention + overhead + communication

    @property
    def layout(self) -> Layout:
        """The layout this model prices (a dense model's data-parallel ranks are replicas: its tensor-parallel one)."""
        return Layout(self.tensor_parallel_size, self.expert_parallel, self._dp)

    @property
    def measured_collectives(self) -> bool:
        """Whether the collectives (tensor-parallel all-reduces; a data-parallel MoE model's gathers to its experts)
        are priced from measured all-reduce curves (cost/collectives.py)."""
        tp_measured = self.tensor_parallel_size == 1 or self._comm_curve is not None
        dp_measured = self._dp == 1 or self._comm_moe_curve is not None
        return tp_measured and dp_measured and (self.tensor_parallel_size > 1 or self._dp > 1)

    def _communication(self, tokens, moe_tokens=None):
        """The step's collectives for `tokens` tokens of this rank, `moe_tokens` at the experts (ints, or arrays
        of steps: the same arithmetic elementwise)."""
        if self._comm_curve is not None:
            seconds = self._comm_layers * allreduce_seconds(self._comm_curve, tokens * self.model.hidden_size)
        else:
            seconds = self._comm_token * tokens + self._comm_fixed if self._comm_token else 0.0
        if self._comm_moe_layers:
            moe_tokens = tokens * self._dp if moe_tokens is None else moe_tokens
            if self._comm_moe_curve is not None:
                seconds = seconds + self._comm_moe_layers * allreduce_seconds(self._comm_moe_curve,
                                                                              moe_tokens * self.model.hidden_size)
            else:
                seconds = seconds + self._comm_moe_token * moe_tokens
        return seconds

    def _linear_of(self, tokens: np.ndarray, logit_rows: np.ndarray) -> np.ndarray:
        """`_linear_s` of each step: decode-only steps (logit rows = tokens) read a table by token count,
        the others the memo; either is filled by `_linear_s` on first use."""
        table = self._decode_linear
        top = int(tokens.max()) + 1
        if top > table.shape[0]:
            table = self._decode_linear = np.concatenate([table, np.full(max(top, 2 * table.shape[0]) - table.shape[0],
                                                                       np.nan)])
        linear = table[tokens]
        decode = logit_rows == tokens
        missing = decode & np.isnan(linear)
        if missing.any():  # token counts met for the first time: fill the table once per count
            seen = np.zeros(top, dtype=bool)
            seen[tokens[missing]] = True
            for n in (seen & np.isnan(table[:top])).nonzero()[0].tolist():
                table[n] = self._linear_s(n, n)
            linear = table[tokens]
        other = (~decode).nonzero()[0]
        if other.shape[0]:
            # Steps with prefill chunks repeat (tokens, logit rows) pairs: look each distinct one up once.
            pairs, which = np.unique((tokens[other].astype(np.int64) << 32) | logit_rows[other], return_inverse=True)
            memo = self._linear_memo
            values = []
            for key in zip((pairs >> 32).tolist(), (pairs & 0xFFFFFFFF).tolist(), strict=True):
                value = memo.get(key)
                if value is None:
                    value = memo[key] = self._linear_s(*key)
                values.append(value)
            linear[other] = np.array(values, dtype=np.float64)[which.reshape(-1)]
        return linear

    def _compute_excess(self, q: np.ndarray, c: np.ndarray, pf: np.ndarray) -> float:
        """Σ max(0, compute time − memory time) over calls with more than `_q_mem_bound` query tokens (and, for an
        MLA model, every prefill chunk: its context's up-projection), a prefill row at its own compute per pair
        (`_row_excess`)."""
        cu = self._attn_up_context
        heavy = q > self._q_mem_bound
        if cu:
            heavy |= pf
        idx = heavy.nonzero()[0]
        mf, cf, ms, cs, w, cq = (self._attn_mem_full, self._attn_cmp_full, self._attn_mem_slide,
                                 self._attn_cmp_slide, self._window, self._attn_query)
        cfp = self._attn_cmp_prefill
        if cq or cu:
            # A per-query term (or a context term) makes rows candidates that may not be compute-bound: keep the
            # compute-bound ones, as the compiled sums count them, so decode batches stay on the scalar path.
            qq, cc, pp = q[idx], c[idx], pf[idx]
            keys = cc + (qq + 1) * 0.5
            d = (qq * keys) * np.where(pp, cfp, cf) - (cc + qq) * mf
            if ms:
                d += (qq * np.minimum(keys, w)) * cs - (np.minimum(cc, w) + qq) * ms
            if cq:
                d += qq * cq
            if cu:
                d += np.where(pp, cc * cu, 0.0)
            idx = idx[d > 0.0]
        if idx.shape[0] <= _SCALAR_EXCESS_MAX:  # the usual case (a few prefill chunks): scalars beat tiny arrays
            excess = 0.0
            for qi, ci, prefill in zip(q[idx].tolist(), c[idx].tolist(), pf[idx].tolist(), strict=True):
                keys = ci + (qi + 1) * 0.5  # mean keys a causal query attends to
                d = qi * keys * (cfp if prefill else cf) - (ci + qi) * mf
                if ms:
                    d += qi * min(keys, w) * cs - (min(ci, w) + qi) * ms
                if cq:
                    d += qi * cq
                if prefill and cu:
                    d += ci * cu
                if d > 0.0:
                    excess += d
            return excess
        q, c, pf = q[idx], c[idx], pf[idx]
        keys = c + (q + 1) * 0.5
        d = (q * keys) * np.where(pf, cfp, cf) - (c + q) * mf
        if ms:
            d += (q * np.minimum(keys, w)) * cs - (np.minimum(c, w) + q) * ms
        if cq:
            d += q * cq
        if cu:
            d += np.where(pf, c * cu, 0.0)
        return float(_sum(np.maximum(d, 0.0)))

    def draft_model_time(self, num_calls: int, draft_len: int, context_lens: np.ndarray | None = None,
                         kind: str | None = None) -> float:
        """Seconds for `draft_len` sequential draft passes over `num_calls` rows (one token each).

        Each pass streams the draft network's weights (p-norm with its FLOPs, like the target),
        reads the draft layer's own KV cache over each row's context (+ the tokens drafted so
        far), and pays `draft_pass_overhead_s`. kind: "eagle3" / "mtp" (default: the model's).
        Simplification: EAGLE-3's first pass also re-reads the tokens accepted last step; it is
        priced as one token per row. Contract: `StepCostModel.draft_model_time`.
        """
        if num_calls <= 0 or draft_len <= 0:
            return 0.0
        d = self._draft(kind)
        cal = self.calibration
        per_pass = _pnorm(d.bytes * self._inv_bw, d.flops_row * num_calls * self._inv_flops, self._p)
        ctx = float(np.sum(context_lens)) if context_lens is not None else 0.0
        return _draft_seconds(per_pass, d.kv_bytes, self._inv_attn_bw, cal.draft_model_efficiency,
                              cal.draft_pass_overhead_s, num_calls, draft_len, ctx)

    def draft_model_terms(self, max_calls: int, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """What `draft_model_time` needs, for compiled callers (`draft_seconds`): the weight pass of
        0…max_calls rows, and [KV bytes per token, 1 / attention bandwidth, efficiency, pass overhead]."""
        d = self._draft(kind)
        cal = self.calibration
        per_pass = np.array([_pnorm(d.bytes * self._inv_bw, d.flops_row * n * self._inv_flops, self._p)
                             for n in range(max_calls + 1)], dtype=np.float64)
        return per_pass, np.array([d.kv_bytes, self._inv_attn_bw, cal.draft_model_efficiency,
                                   cal.draft_pass_overhead_s], dtype=np.float64)

    def frontend_time(self, prompt_lens: np.ndarray) -> np.ndarray:
        """Seconds each request spends outside the engine core before the client has its first token (and again
        none after: the same offset moves its finish): `frontend_request_s` + `frontend_prompt_token_s` × prompt."""
        cal = self.calibration
        return cal.frontend_request_s + cal.frontend_prompt_token_s * np.asarray(prompt_lens, dtype=np.float64)

    def sync_host_time(self, batch_sizes: np.ndarray) -> np.ndarray:
        """Host work a synchronous step waits for (contract: `StepCostModel.sync_host_time`): `sync_host_step_s` +
        `sync_host_call_s` a call."""
        cal = self.calibration
        return cal.sync_host_step_s + cal.sync_host_call_s * np.asarray(batch_sizes, dtype=np.float64)

    def model_free_draft_time(self, num_calls: int) -> float:
        """CPU drafting per step: a fixed part plus a per-call part (0 for no calls)."""
        if num_calls <= 0:
            return 0.0
        cal = self.calibration
        return cal.model_free_draft_step_s + cal.model_free_draft_per_call_s * num_calls

    @property
    def ridge_tokens(self) -> float:
        """AI in tokens (the paper's AI in M(b) = AI − b).

        The hardware's ridge point in FLOP/byte (peak BF16 FLOP/s ÷ peak HBM bytes/s) divided by
        the FLOPs a decode token does per weight byte streamed, i.e. the tokens per step at which
        the linear layers' FLOP time equals their weight-read time. Dense BF16 models do 2 FLOPs
        per 2-byte weight per token, so AI_tokens = AI_FLOP/byte (153 on A100); MoE models solve
        the crossing with the expected experts touched. `Calibration.ridge_tokens` overrides.
        """
        override = self.calibration.ridge_tokens
        return float(override) if override is not None else self._calc_ridge

    @property
    def effective_ridge_tokens(self) -> float:
        """Where this model's *modelled* linear memory and compute times cross (efficiencies applied)."""
        hw, cal = self.hardware, self.calibration
        return self._crossover(hw.hbm_bandwidth * cal.memory_efficiency, hw.peak_flops_bf16 * cal.compute_efficiency)

    def token_budget(self, batch_size: int) -> int:
        """M(b) = max(0, ⌊AI − b⌋)."""
        return max(0, math.floor(self.ridge_tokens - batch_size))

    def per_token_decode_time(self, batch_size: int, context_len: int) -> float:
        """t_A(b) = T_step(b plain decode calls at context_len) / b (see `agentspec_sim.cost.base`)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        return self.step_time(BatchShape.decode(batch_size, context_len)).total_s / batch_size

    def per_token_verify_time(self, batch_size: int, context_len: int, draft_tokens: int = 1) -> float:
        """t_V(b): the marginal step time per draft token when each of b calls verifies
        `draft_tokens` more tokens: (T(b, 1 + k) − T(b, 1)) / (b·k)."""
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be ≥ 1")
        base = self.step_time(BatchShape.decode(batch_size, context_len)).total_s
        spec = self.step_time(BatchShape.decode(batch_size, context_len, 1 + draft_tokens)).total_s
        return (spec - base) / (batch_size * draft_tokens)

    # ---- helpers ----

    @property
    def draft_kinds(self) -> tuple[str, ...]:
        return tuple(sorted(self._drafts))

    @property
    def default_draft(self) -> str:
        return self._default_draft

    def draft_spec(self, kind: str | None = None) -> DraftSpec:
        return self._draft(kind).spec

    def _draft(self, kind: str | None) -> _DraftConsts:
        key = kind or self._default_draft
        if key not in self._drafts and key.startswith(DRAFT_MODEL_KIND):
            self._drafts[key] = self._draft_model_consts(key[len(DRAFT_MODEL_KIND):])
        try:
            return self._drafts[key]
        except KeyError:
            raise ValueError(f"{self.model.id}: no {key!r} draft network "
                             f"(available: {', '.join(sorted(self._drafts))})") from None

    def _draft_model_consts(self, draft: str) -> _DraftConsts:
        """vLLM's `draft_model` method: the draft model's own forward passes, at the target's tensor-parallel size
        (vLLM's default draft_tensor_parallel_size), each pass priced like the target's (a p-norm of its weight
        stream and FLOPs) and its KV read as a decode's."""
        try:
            m = load_model(draft)
            spec = draft_from_model(m)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        if m.vocab_size != self.model.vocab_size:
            raise ValueError(f"draft model {m.id} has a vocabulary of {m.vocab_size:,} tokens, {self.model.id} "
                             f"{self.model.vocab_size:,}: vLLM's draft_model method needs the target's tokenizer")
        tp = self.tensor_parallel_size
        return _DraftConsts(spec=spec, bytes=spec.streamed_params() * spec.bytes_per_param / tp,
                            flops_row=2.0 * spec.streamed_params() / tp,
                            kv_bytes=spec.kv_bytes_per_token(self.kv_dtype_bytes) / min(tp, max(1, spec.num_kv_heads)))

    def _crossover(self, bandwidth: float, flops_rate: float) -> float:
        """Tokens T at which decode FLOPs(T)/flops_rate = streamed bytes(T)/bandwidth (each token a logits row)."""
        per_token = self._flops_token + self._flops_logit

        def excess(t: float) -> float:
            moe = self._moe_bytes * (1.0 - self._moe_miss**t) if self._moe_bytes else 0.0
            return per_token * t / flops_rate - (self._dense_bytes + moe) / bandwidth

        if not self._moe_bytes:
            return self._dense_bytes * flops_rate / (bandwidth * per_token)
        lo, hi = 0.0, 1.0
        while excess(hi) < 0:
            lo, hi = hi, hi * 2
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
        return 0.5 * (lo + hi)

    def describe(self) -> dict[str, float | int | str]:
        """The folded constants, for reports and docs."""
        m, hw = self.model, self.hardware
        return {
            "hardware": hw.id,
            "model": m.id,
            "tensor_parallel_size": self.tensor_parallel_size,
            "expert_parallel": self.expert_parallel,
            "data_parallel_size": self.data_parallel_size,
            "streamed_weight_bytes_per_gpu": self._dense_bytes + self._moe_bytes,
            "flops_per_decode_token_per_gpu": self._flops_token + self._flops_logit,
            "kv_bytes_per_token_per_gpu": kv_bytes_per_token(m, self.kv_dtype_bytes,
                                                             tensor_parallel_size=self.tensor_parallel_size),
            "ridge_tokens": self.ridge_tokens,
            "effective_ridge_tokens": self.effective_ridge_tokens,
            "fixed_overhead_s": self._overhead_fixed,
            "default_draft": self._default_draft,
        }

    def __repr__(self) -> str:
        return (f"RooflineCostModel(hardware={self.hardware.id!r}, model={self.model.id!r}, "
                f"tp={self.tensor_parallel_size}{', ep' if self.expert_parallel else ''}"
                f"{f', dp={self.data_parallel_size}' if self.data_parallel_size > 1 else ''}, "
                f"calibration={self.calibration.source!r})")
