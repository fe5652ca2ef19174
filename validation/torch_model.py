"""A decoder-only transformer in plain torch, shaped like the target model, for timing real forward passes.

One forward pass over one engine step's batch, laid out the way vLLM 0.33 lays it out:
  * the step's tokens are packed: [T, hidden] with T = Σ query_len (no padding to the longest call);
  * every call's KV cache is a contiguous run of context_len + query_len slots in one packed buffer
    per layer; the step writes its new K/V into the last query_len slots (vLLM's reshape_and_cache);
  * attention is varlen: FlashAttention's `varlen_attn` on CUDA (cu_seqlens over queries and keys,
    causal aligned bottom-right, GQA, sliding window), a per-call SDPA loop over the same buffers
    elsewhere (CPU tests);
  * layers: RMSNorm → QKV → (Qwen3 per-head q/k RMSNorm) → RoPE → attention → O → residual →
    RMSNorm → SwiGLU MLP, or a top-k MoE block (router softmax over the top k, experts as one
    grouped GEMM over tokens sorted by expert, as fused-MoE kernels do) → residual;
  * logits only for the rows the sampler needs (every decode/verify token, the last token of a
    prefill chunk), then greedy argmax.

Weights are random (seeded) in the run dtype (bf16 by default); which weights do not change
the time. Known differences from vLLM: GPT-OSS's MXFP4 experts run as bf16 (the cost model is
told so: `profile_for`), GPT-OSS attention sinks and projection biases are left out, and KV
buffers are contiguous per call rather than paged in 16-token blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily (the `validate` extra)
    import torch

    from agentspec_sim.cost.profiles import ModelProfile


@dataclass(frozen=True)
class ArchSpec:
    """The architecture numbers a forward pass needs (a subset of the cost model's ModelProfile)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    qk_norm: bool = False
    rope_theta: float = 1e6

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> ArchSpec:
        """The executed architecture of a cost-model profile (MLA models are not supported)."""
        if profile.is_mla:
            raise ValueError(f"{profile.id}: MLA attention is not implemented in the timing model")
        return cls(
            name=profile.id, hidden_size=profile.hidden_size, num_layers=profile.num_layers,
            num_heads=profile.num_attention_heads, num_kv_heads=profile.num_kv_heads, head_dim=profile.head_dim,
            intermediate_size=profile.intermediate_size, vocab_size=profile.vocab_size,
            num_experts=profile.num_experts, experts_per_token=profile.experts_per_token,
            moe_intermediate_size=profile.moe_intermediate_size,
            shared_intermediate_size=profile.shared_intermediate_size,
            layer_types=tuple(profile.layer_types), sliding_window=profile.sliding_window,
            qk_norm=profile.model_type.startswith("qwen3"),
        )

    def tiny(self) -> ArchSpec:
        """The same family (GQA ratio, MoE or dense, sliding layers) at CPU-test size."""
        group = max(1, self.num_heads // max(1, self.num_kv_heads))
        kv = 2
        layers = 2
        types = tuple(self.layer_types[:layers]) if self.layer_types else ()
        return replace(
            self, name=f"{self.name}-tiny", hidden_size=64, num_layers=layers, num_heads=kv * min(group, 4),
            num_kv_heads=kv, head_dim=16, intermediate_size=128, vocab_size=512,
            num_experts=min(self.num_experts, 8), experts_per_token=min(self.experts_per_token, 2),
            moe_intermediate_size=32 if self.is_moe else 0,
            shared_intermediate_size=32 if self.shared_intermediate_size else 0,
            layer_types=types, sliding_window=min(self.sliding_window, 16) if self.sliding_window else None,
        )

    def hf_config(self) -> dict:
        """Hugging Face config.json fields describing exactly what runs (for the cost model)."""
        cfg = {
            "architectures": ["TimingModel"], "model_type": "qwen3" if self.qk_norm else "llama",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "tie_word_embeddings": False, "max_position_embeddings": 1 << 20,
        }
        if self.is_moe:
            cfg |= {"num_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token,
                    "moe_intermediate_size": self.moe_intermediate_size,
                    "shared_expert_intermediate_size": self.shared_intermediate_size}
        if self.layer_types:
            cfg |= {"layer_types": list(self.layer_types), "sliding_window": self.sliding_window}
        return cfg


def profile_for(spec: ArchSpec, dtype_bytes: int = 2) -> ModelProfile:
    """The cost model's profile of what the timing model executes: every weight in the run dtype."""
    from agentspec_sim.cost.profiles import model_from_hf_config

    profile = model_from_hf_config(spec.hf_config(), id=spec.name, where=f"timing model {spec.name}")
    return replace(profile, dense_bytes_per_param=float(dtype_bytes), expert_bytes_per_param=float(dtype_bytes),
                   embedding_bytes_per_param=float(dtype_bytes))


@dataclass
class StepInputs:
    """One step's device tensors (built once per step, reused by warm-up, timed runs and graph replays)."""

    token_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64: where each token's K/V goes in the packed buffer
    cu_q: torch.Tensor             # [n + 1] int32
    cu_k: torch.Tensor             # [n + 1] int32
    logit_rows: torch.Tensor       # [R] int64
    query_lens: list[int]
    context_lens: list[int]
    max_q: int
    max_k: int
    total_k: int


class TimingModel:
    """Random-weight transformer of `spec` on `device` in `dtype`; `forward(inputs, kv)` runs one step."""

    def __init__(self, spec: ArchSpec, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0) -> None:
        import torch

        self.spec, self.device = spec, torch.device(device)
        self.dtype = dtype or torch.bfloat16
        # Drawn on the device itself: a CPU draw of 8-20 B parameters would take minutes.
        gen = torch.Generator(device=self.device).manual_seed(seed)
        h, d = spec.hidden_size, spec.head_dim
        qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * d

        def weight(*shape: int) -> torch.Tensor:
            # Seeded, scaled so activations stay finite; drawn in the run dtype (no float32 copy of 40 GB).
            w = torch.randn(*shape, generator=gen, device=self.device, dtype=self.dtype)
            return w.mul_(1.0 / math.sqrt(shape[-2]))

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=self.dtype)

        self.embed = weight(spec.vocab_size, h)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(spec.num_layers):
            layer = {"in_norm": ones(h), "post_norm": ones(h), "qkv": weight(h, qkv_out),
                     "o": weight(spec.num_heads * d, h)}
            if spec.qk_norm:
                layer |= {"q_norm": ones(d), "k_norm": ones(d)}
            if spec.is_moe:
                e, w = spec.num_experts, spec.moe_intermediate_size
                layer |= {"router": weight(h, e), "experts_gate_up": weight(e, h, 2 * w),
                          "experts_down": weight(e, w, h)}
                if spec.shared_intermediate_size:
                    layer |= {"gate_up": weight(h, 2 * spec.shared_intermediate_size),
                              "down": weight(spec.shared_intermediate_size, h)}
            else:
                layer |= {"gate_up": weight(h, 2 * spec.intermediate_size), "down": weight(spec.intermediate_size, h)}
            self.layers.append(layer)
        self.final_norm = ones(h)
        self.lm_head = weight(h, spec.vocab_size)
        self.inv_freq = (1.0 / spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(self.device)
        self._varlen = _varlen_attention() if self.device.type == "cuda" else None
        # Why a CUDA run uses the reference loop (reported in summaries and by gpu_check), None when it does not.
        self.attention_fallback: str | None = None
        if self._varlen is None and self.device.type == "cuda":
            self.attention_fallback = "this torch has no torch.nn.attention.varlen"
        elif self._varlen is not None:
            self._check_varlen()
        self._grouped_mm = hasattr(torch, "_grouped_mm")

    # ---- inputs ----

    def prepare(self, query_lens: np.ndarray, context_lens: np.ndarray, is_prefill: np.ndarray,
                seed: int = 0) -> StepInputs:
        """Device tensors for one step: random token ids, positions, KV slots and logit rows."""
        import torch

        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(context_lens, dtype=np.int64)
        pf = np.asarray(is_prefill, dtype=bool)
        if q.ndim != 1 or q.shape != c.shape or q.shape != pf.shape or q.shape[0] == 0 or int(q.min()) < 1:
            raise ValueError("a step needs ≥ 1 call, each with query_len ≥ 1 and a context_len")
        kv_lens = c + q
        cu_q = np.concatenate([[0], np.cumsum(q)])
        cu_k = np.concatenate([[0], np.cumsum(kv_lens)])
        call_of_token = np.repeat(np.arange(q.shape[0]), q)
        offset_in_call = np.arange(int(cu_q[-1])) - cu_q[:-1][call_of_token]
        positions = c[call_of_token] + offset_in_call
        slots = cu_k[:-1][call_of_token] + c[call_of_token] + offset_in_call
        last = cu_q[1:] - 1
        rows = np.concatenate([np.arange(cu_q[i], cu_q[i + 1]) if not pf[i] else last[i:i + 1]
                               for i in range(q.shape[0])])
        rng = np.random.default_rng(seed)
        dev = self.device

        def tensor(a: np.ndarray, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

        return StepInputs(
            token_ids=tensor(rng.integers(0, self.spec.vocab_size, int(cu_q[-1])), torch.int64),
            positions=tensor(positions, torch.int64), slot_mapping=tensor(slots, torch.int64),
            cu_q=tensor(cu_q, torch.int32), cu_k=tensor(cu_k, torch.int32), logit_rows=tensor(rows, torch.int64),
            query_lens=q.tolist(), context_lens=c.tolist(), max_q=int(q.max()), max_k=int(kv_lens.max()),
            total_k=int(cu_k[-1]),
        )

    def kv_buffer_bytes(self, total_k: int) -> int:
        """Bytes of one layer's K and V buffers for `total_k` packed slots."""
        return 2 * total_k * self.spec.num_kv_heads * self.spec.head_dim * self.dtype.itemsize

    def allocate_kv(self, total_k: int, max_bytes: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V buffers for the layers: one per layer, or a pool that layers share in turn when `max_bytes`
        cannot hold one per layer (contents do not matter for timing; distinct buffers keep consecutive
        layers from hitting in cache)."""
        import torch

        per = self.kv_buffer_bytes(total_k)
        count = self.spec.num_layers if max_bytes is None else max(1, min(self.spec.num_layers, max_bytes // per))
        shape = (total_k, self.spec.num_kv_heads, self.spec.head_dim)
        return [(torch.randn(shape, device=self.device, dtype=self.dtype),
                 torch.randn(shape, device=self.device, dtype=self.dtype)) for _ in range(count)]

    # ---- forward ----

    def forward(self, inputs: StepInputs, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One engine step: the sampled (greedy) token of every logit row."""
        import torch

        spec = self.spec
        x = self.embed[inputs.token_ids]
        angles = inputs.positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv[i % len(kv)]
            residual = x
            hidden = _rms_norm(x, layer["in_norm"])
            qkv = hidden @ layer["qkv"]
            hq, hk, d = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.head_dim
            q = qkv[:, :hq].reshape(-1, spec.num_heads, d)
            k = qkv[:, hq:hq + hk].reshape(-1, spec.num_kv_heads, d)
            v = qkv[:, hq + hk:].reshape(-1, spec.num_kv_heads, d)
            if spec.qk_norm:
                q, k = _rms_norm(q, layer["q_norm"]), _rms_norm(k, layer["k_norm"])
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k_cache.index_copy_(0, inputs.slot_mapping, k)
            v_cache.index_copy_(0, inputs.slot_mapping, v)
            window = spec.sliding_window if spec.is_sliding(i) else None
            attn = self._attention(q, k_cache, v_cache, inputs, window)
            x = residual + attn.reshape(-1, hq) @ layer["o"]
            residual = x
            hidden = _rms_norm(x, layer["post_norm"])
            mlp = self._moe(hidden, layer) if spec.is_moe else _swiglu(hidden, layer["gate_up"], layer["down"])
            x = residual + mlp
        rows = _rms_norm(x[inputs.logit_rows], self.final_norm)
        logits = rows @ self.lm_head
        return logits.argmax(dim=-1)

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inputs: StepInputs,
                   window: int | None) -> torch.Tensor:
        if self._varlen is not None:
            try:
                return self._varlen(q, k_cache, v_cache, inputs.cu_q, inputs.cu_k, inputs.max_q, inputs.max_k,
                                    window_size=(window - 1 if window else -1, 0))
            except (RuntimeError, TypeError) as exc:  # this torch's kernel refuses the shape: the loop from now on
                self._varlen = None
                self.attention_fallback = f"varlen_attn raised {type(exc).__name__}: {exc}"[:300]
        return _attention_loop(q, k_cache, v_cache, inputs, window)

    def _check_varlen(self) -> None:
        """Run the kernel once against the reference loop on a small mixed batch (prefill over a context,
        decode, verify; full and sliding window): a torch whose kernel is missing, refuses these
        arguments or disagrees falls back to the loop, with the reason in `attention_fallback`."""
        import torch

        spec = self.spec
        gen = torch.Generator(device=self.device).manual_seed(1)
        inputs = self.prepare(np.array([5, 1, 3]), np.array([7, 20, 0]), np.array([True, False, False]))
        q = torch.randn(9, spec.num_heads, spec.head_dim, generator=gen, device=self.device, dtype=self.dtype)
        k, v = (torch.randn(inputs.total_k, spec.num_kv_heads, spec.head_dim, generator=gen, device=self.device,
                            dtype=self.dtype) for _ in range(2))
        for window in (None, 4):
            got = self._attention(q, k, v, inputs, window)
            if self._varlen is None:
                return
            want = _attention_loop(q, k, v, inputs, window)
            err = (got.float() - want.float()).abs().max().item()
            if not err <= 0.05:  # bf16 rounding of values of order 1; a wrong mask or head mapping is O(1)
                self._varlen = None
                self.attention_fallback = (f"varlen_attn disagrees with the reference loop (window {window}): "
                                           f"max abs error {err:.3g}")
                return

    def _moe(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """Top-k MoE: softmax over the top-k router logits, token copies sorted by expert, one grouped
        GEMM per projection (fixed shapes, so it captures into a CUDA graph)."""
        import torch

        spec = self.spec
        k, e = spec.experts_per_token, spec.num_experts
        weights, experts = torch.topk(x @ layer["router"], k, dim=-1)
        weights = torch.softmax(weights.float(), dim=-1).to(x.dtype)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_copy = order // k
        # scatter_add, not bincount: bincount reads its max on the host, which a CUDA graph cannot capture.
        counts = torch.zeros(e, device=x.device, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[token_of_copy]
        out = None
        if self._grouped_mm:
            try:
                gate_up = torch._grouped_mm(xs, layer["experts_gate_up"], offs=offsets)
                w = spec.moe_intermediate_size
                act = torch.nn.functional.silu(gate_up[:, :w]) * gate_up[:, w:]
                out = torch._grouped_mm(act, layer["experts_down"], offs=offsets)
            except RuntimeError:  # no grouped-GEMM kernel for this device/dtype: loop over experts from now on
                self._grouped_mm = False
        if out is None:  # loop fallback (reads the offsets on the host, so it cannot be graph-captured)
            out = torch.empty_like(xs)
            bounds = [0, *offsets.tolist()]
            for j in range(e):
                a, b = bounds[j], bounds[j + 1]
                if b > a:
                    out[a:b] = _swiglu(xs[a:b], layer["experts_gate_up"][j], layer["experts_down"][j])
        out = out * weights.reshape(-1)[order][:, None]
        combined = torch.zeros_like(x).index_add_(0, token_of_copy, out)
        if "gate_up" in layer:
            combined = combined + _swiglu(x, layer["gate_up"], layer["down"])
        return combined


def _varlen_attention():
    """torch's FlashAttention varlen kernel when this torch has it (2.10+ on CUDA), else None. Before 2.13 it
    takes no `enable_gqa`: FlashAttention maps query heads onto fewer KV heads by itself."""
    import functools
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return functools.partial(varlen_attn, enable_gqa=True)
    return varlen_attn


_QUERY_BLOCK = 256


def _attention_loop(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inputs: StepInputs,
                    window: int | None) -> torch.Tensor:
    """Varlen attention call by call over its own keys (explicit GQA softmax: the reference semantics):
    causal, aligned bottom-right (query j of a call with context c sees keys ≤ c + j), keys before
    c + j − window + 1 masked on sliding layers."""
    import torch

    out = torch.empty_like(q)
    cu_q, cu_k = inputs.cu_q.tolist(), inputs.cu_k.tolist()
    for i, (qn, cn) in enumerate(zip(inputs.query_lens, inputs.context_lens, strict=True)):
        lo = cu_k[i]
        first_key = max(0, cn - window + 1) if window else 0  # keys no query of this call can see
        kv_heads = k_cache.shape[1]
        group = q.shape[1] // kv_heads
        ki = k_cache[lo + first_key:lo + cn + qn].transpose(0, 1)
        vi = v_cache[lo + first_key:lo + cn + qn].transpose(0, 1)
        keys = torch.arange(first_key, cn + qn, device=q.device)
        # Query rows in blocks, so a long prefill chunk over a long context stays within memory.
        for a in range(0, qn, _QUERY_BLOCK):
            b = min(qn, a + _QUERY_BLOCK)
            pos = torch.arange(cn + a, cn + b, device=q.device)[:, None]
            allowed = keys[None, :] <= pos
            if window:
                allowed &= keys[None, :] > pos - window
            # GQA without copying K/V: the `group` query heads of a KV head become extra query rows.
            qi = q[cu_q[i] + a:cu_q[i] + b].transpose(0, 1).reshape(kv_heads, group * (b - a), -1)
            scores = (qi @ ki.transpose(1, 2)).float() * (q.shape[-1] ** -0.5)
            scores = scores.masked_fill(~allowed.repeat(group, 1), float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[cu_q[i] + a:cu_q[i] + b] = (probs @ vi).reshape(q.shape[1], b - a, -1).transpose(0, 1)
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding over [T, heads, d] with [T, d/2] angles."""
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    import torch

    h = x @ gate_up
    w = h.shape[-1] // 2
    return (torch.nn.functional.silu(h[:, :w]) * h[:, w:]) @ down


def free_gpu_memory() -> None:
    """Collect garbage and hand torch's cached GPU memory back (no-op without torch or CUDA). The caller
    must have dropped its own references first (`del engine`): nothing here can drop them."""
    import gc

    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
