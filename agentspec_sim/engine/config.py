"""Engine configuration: the `vllm serve` knobs the simulator models, plus workload-shaping options.

Unset values (None) take vLLM 0.33's defaults when a run resolves them (`resolve`): the batch
limits by GPU tier (docs/ENGINE-FACTS.md §1, `EngineArgs.get_batch_defaults` for `vllm serve`),
`max_model_len` from the model profile, the KV block count from the GPU memory left after weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from agentspec_sim.engine.kv import cdiv

if TYPE_CHECKING:
    from agentspec_sim.cost.profiles import ModelProfile

ArrivalMode = Literal["recorded", "zero", "poisson", "request-rate"]
ARRIVAL_MODES = ("recorded", "zero", "poisson", "request-rate", "copies")
# vLLM 0.33's --kv-cache-dtype choices (config/cache.py CacheDType): "auto" is the model's dtype (BF16 here); the fp8
# caches store one byte an element, halving the KV cache's bytes a token (capacity) and the attention's KV read.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


class EngineConfigError(ValueError):
    """An engine setting vLLM would reject (or that cannot be resolved), with the reason."""


# The compiled engine counts tokens, blocks and calls in int64: a larger setting would overflow.
MAX_SETTING = 2**62
# The latest simulated time a call may arrive: at 1e11 s float64 still resolves ~2e-5 s, below any step's time
# (Unix timestamps as arrival_s, ~1.8e9 s, fit); past ~1e13 s a millisecond step no longer moves the clock.
MAX_CLOCK_S = 1e11


@dataclass(frozen=True)
class EngineConfig:
    """One engine deployment and workload shaping. Frozen: derive variants with `dataclasses.replace`.

    Batch and memory (vLLM names): max_num_seqs, max_num_batched_tokens (the per-step token budget),
    block_size, gpu_memory_utilization, enable_prefix_caching, max_model_len (None: the model's
    context), num_kv_blocks (vLLM's num_gpu_blocks_override, null block included).
    Cost: hardware, model, tensor_parallel_size, enable_expert_parallel (vLLM's flag: a MoE model's experts
    placed whole over the tensor-parallel GPUs), data_parallel_size (vLLM's --data-parallel-size: that many
    engines of tensor_parallel_size GPUs each, every call routed to one of them as vLLM's load balancer does;
    engine/data_parallel.py), calibration (a fitted cost-profile file). max_num_seqs, max_num_batched_tokens
    and the KV cache are each data-parallel rank's, as in vLLM.
    Workload: arrival ("recorded": the trace's arrival_s, else 0; "zero": every query at t=0;
    "poisson": queries arrive at `rate` per second, the first at 0 — the simulator's older rule;
    "request-rate": `vllm bench serve --request-rate rate --burstiness burstiness`, engine/load.py),
    think_time (overrides every call's think_s), replicate (copies of each query as independent
    tenants), replicate_stagger_s (copy k ≥ 1 of a query starts a seeded uniform [0, stagger) later,
    so copies do not run in lockstep).
    Load protocol (engine/load.py): max_concurrency (`vllm bench serve --max-concurrency`: at most this
    many queries in flight, the next starting when one ends), copies (each query run alone as this
    many identical copies submitted together, the next query's when all have finished: the offline
    `LLM.generate([prompt] * B)` protocol of published per-request speedups), disable_shuffle (`vllm bench
    serve --disable-shuffle`: under a request rate or max concurrency the queries go out in trace order;
    by default in the order `random.seed(seed); random.shuffle(dataset)` gives, as vLLM's datasets do).
    seed: all randomness; check_invariants: run the engine's runtime checks after every run of steps and over
    the whole log at the end.
    Host: async_scheduling (vLLM's `--async-scheduling`; None: vLLM 0.33's default for the speculative method —
    on for no speculation and the Model Runner V2 methods (ngram-v2, eagle3, mtp, draft models), off for the V1
    runner's CPU proposers (ngram, suffix and the proposers built like them); the scheduler then makes each step
    one step ahead, engine/scheduler.py); in_process_client (calls are added between steps by the process that
    steps the engine, as the validation harness's `LLMEngine.step` loop does, so a finished call's successor can
    join the very next step; by default a client sends it over HTTP once it has read the finish, after the core
    has scheduled the next step).
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    hardware: str = "a100-80g"
    model: str = "qwen3-8b"
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    calibration: str | None = None
    seed: int = 0
    think_time: float | None = None
    arrival: ArrivalMode = "recorded"
    rate: float | None = None
    replicate: int = 1
    replicate_stagger_s: float = 1.0
    burstiness: float = 1.0
    max_concurrency: int | None = None
    copies: int = 1
    disable_shuffle: bool = False
    check_invariants: bool = False
    async_scheduling: bool | None = None
    in_process_client: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "block_size",
                    "tensor_parallel_size", "data_parallel_size", "replicate", "max_concurrency", "copies")
        for name in positive:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
            if value is not None and value > MAX_SETTING:
                raise EngineConfigError(f"{name} must be at most 2**62 (the engine counts in 64-bit integers), "
                                        f"got {value:,}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.arrival not in ARRIVAL_MODES:
            raise EngineConfigError(f"arrival must be one of {', '.join(ARRIVAL_MODES)}, got {self.arrival!r}")
        if self.arrival == "poisson" and (self.rate is None or not 0 < self.rate < math.inf):
            raise EngineConfigError("arrival 'poisson' needs a finite rate > 0 (queries per second)")
        if self.arrival == "request-rate" and (self.rate is None or not self.rate > 0):
            raise EngineConfigError("arrival 'request-rate' needs rate > 0 (queries per second, inf: all at once)")
        if not self.burstiness > 0:
            raise EngineConfigError(f"burstiness must be > 0 (vLLM's gamma shape; 1 is Poisson), got {self.burstiness}")
        if self.copies > 1 and self.arrival not in ("recorded", "zero", "copies"):
            raise EngineConfigError("copies runs each query alone as identical copies: arrival 'copies'")
        if self.copies_protocol and (self.replicate > 1 or self.max_concurrency is not None):
            raise EngineConfigError("copies runs each query alone as identical copies: it takes no request rate, "
                                    "max_concurrency or replicate")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (vLLM's "
                                    f"--kv-cache-dtype), got {self.kv_cache_dtype!r}")
        if self.think_time is not None and self.think_time < 0:
            raise EngineConfigError(f"think_time must be ≥ 0, got {self.think_time}")
        if self.think_time is not None and self.think_time > MAX_CLOCK_S:
            raise EngineConfigError(f"think_time must be ≤ {MAX_CLOCK_S:.0e} s (past it the simulated clock cannot "
                                    f"resolve one step), got {self.think_time:g}")
        if self.replicate_stagger_s < 0:
            raise EngineConfigError(f"replicate_stagger_s must be ≥ 0, got {self.replicate_stagger_s}")

    @property
    def copies_protocol(self) -> bool:
        """Each query alone as `copies` identical copies, the next query's when all have ended (`--copies B`, B ≥ 1;
        arrival 'copies', or copies > 1 with the default arrival, as configurations written before it say it)."""
        return self.copies > 1 or self.arrival == "copies"

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes a KV cache element takes: 1 for vLLM's fp8 caches, else the model's 16-bit dtype."""
        return 1 if self.kv_cache_dtype.startswith("fp8") else 2

    @property
    def tenants(self) -> int:
        """Instances of each query the engine runs, each with its own drafter state: replicate or copies."""
        return self.replicate * self.copies


# vLLM 0.33 `vllm serve` (UsageContext.OPENAI_API_SERVER) batch defaults by GPU tier:
# (max_num_batched_tokens, max_num_seqs). H200 (~140 GiB) is below the 160 GiB tier.
_TIER_B200 = (16384, 1024)
_TIER_H100 = (8192, 1024)
_TIER_SMALL = (2048, 256)
_KNOWN_GPUS = {"a100-80g": _TIER_SMALL, "a100-40g": _TIER_SMALL, "a100": _TIER_SMALL, "h100": _TIER_H100,
               "h100-80g": _TIER_H100, "h200": _TIER_H100, "h200-141g": _TIER_H100, "b200": _TIER_B200}


def vllm_defaults(hardware: str, memory_gib: float | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` picks on this GPU.

    Tiers (arg_utils.get_batch_defaults): ≥ 160 GiB → 16384/1024; ≥ 70 GiB and not an A100 → 8192/1024;
    otherwise (A100-80GB included, or memory unknown) → 2048/256.
    """
    key = hardware.lower()
    if key in _KNOWN_GPUS:
        return _KNOWN_GPUS[key]
    if memory_gib is None:
        return _TIER_SMALL
    if memory_gib >= 160:
        return _TIER_B200
    if memory_gib >= 70 and "a100" not in key:
        return _TIER_H100
    return _TIER_SMALL


@dataclass(frozen=True)
class ResolvedLimits:
    """What a run actually uses after defaults: every field set."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_kv_blocks: int  # including vLLM's null block
    seqs_from_default: bool
    tokens_from_default: bool


def resolve(config: EngineConfig) -> ResolvedLimits:
    """Fill unset limits as vLLM 0.33 does (`_set_default_max_num_seqs_and_batched_tokens_args`).

    Needs `agentspec_sim.cost` for the model's context and the KV capacity unless both
    `max_model_len` and `num_kv_blocks` are given, and for its heads with tensor parallelism
    (`check_tensor_parallel`).
    """
    max_model_len = config.max_model_len
    model = hw = None
    if max_model_len is None or config.num_kv_blocks is None:
        from agentspec_sim.cost import load_hardware, load_model

        model = load_model(config.model)
        hw = load_hardware(config.hardware)
    if config.tensor_parallel_size > 1:
        from agentspec_sim.cost import load_model

        check_tensor_parallel(model or load_model(config.model), config.tensor_parallel_size)
    if max_model_len is None:
        max_model_len = int(getattr(model, "max_model_len", 0) or model.default_max_model_len)
    memory = hw.hbm_bytes / 2**30 if hw is not None else None
    default_tokens, default_seqs = vllm_defaults(config.hardware, memory)
    seqs = config.max_num_seqs if config.max_num_seqs is not None else default_seqs
    tokens = config.max_num_batched_tokens
    if tokens is None:
        # Chunked prefill is on, so only the seqs × context cap applies.
        tokens = min(seqs * max_model_len, default_tokens)
    if config.max_num_seqs is None:
        seqs = min(seqs, tokens)
    if tokens < seqs:
        raise EngineConfigError(f"max_num_batched_tokens ({tokens}) must be ≥ max_num_seqs ({seqs}), as vLLM requires")
    blocks = config.num_kv_blocks
    if blocks is None:
        from agentspec_sim.cost import kv_capacity_tokens

        capacity = int(kv_capacity_tokens(hw, model, config.gpu_memory_utilization, config.tensor_parallel_size,
                                          kv_dtype_bytes=config.kv_dtype_bytes, max_num_batched_tokens=tokens,
                                          max_num_seqs=seqs, data_parallel_size=config.data_parallel_size))
        blocks = capacity // config.block_size
        if blocks < 2:
            raise EngineConfigError(f"no KV cache memory left: {config.model} on {config.tensor_parallel_size}× "
                                    f"{config.hardware} at gpu_memory_utilization {config.gpu_memory_utilization} "
                                    f"leaves {capacity} tokens after the weights and the activations vLLM reserves "
                                    f"for max_num_batched_tokens {tokens:,} and max_num_seqs {seqs:,}; lower "
                                    "those, or raise gpu_memory_utilization or tensor_parallel_size")
    return ResolvedLimits(seqs, tokens, max_model_len, blocks, config.max_num_seqs is None,
                          config.max_num_batched_tokens is None)


def check_tensor_parallel(model: ModelProfile, tensor_parallel_size: int) -> None:
    """vLLM splits the attention heads over the tensor-parallel GPUs and refuses a size that does not divide
    them (`ModelConfig.verify_with_parallel_config`: "Total number of attention heads (28) must be divisible
    by tensor parallel size (3)"); so does this, before the cost model is built, naming the sizes that work."""
    from agentspec_sim.host.resources import ResourceError, literal

    heads = int(model.num_attention_heads)
    if heads % tensor_parallel_size == 0:
        return
    sizes = [n for n in range(1, heads + 1) if heads % n == 0]
    raise ResourceError("tensor_parallel_size", f"{literal(model.id)} has {heads} attention heads and vLLM requires "
                        f"the tensor parallel size to divide them, got {tensor_parallel_size:,} GPUs; use one of "
                        f"{', '.join(map(str, sizes))}")


def blocks_for(tokens: int, block_size: int) -> int:
    return cdiv(tokens, block_size)


def with_overrides(config: EngineConfig, **changes: object) -> EngineConfig:
    """`replace` that ignores None values (CLI options left unset)."""
    return replace(config, **{k: v for k, v in changes.items() if v is not None})
