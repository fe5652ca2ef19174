"""How vLLM spreads a model over GPUs, and which layouts fit a model on a GPU.

`--tensor-parallel-size N` splits every layer's weights and attention heads over N GPUs (two all-reduces a
layer); `--enable-expert-parallel` places a MoE model's routed experts whole over the GPUs instead of
slicing each one. `--data-parallel-size D` runs D engines ("ranks") of N GPUs each, every request routed to
one of them: for a dense model they are independent replicas; for a MoE model their attention is data
parallel (each rank its own requests and KV cache: the layout vLLM recommends for MLA models, whose latent KV
is replicated, not split, by tensor parallelism) while the routed experts are sharded over all D × N GPUs
and the ranks step in lockstep (engine/data_parallel.py). A layout fits when vLLM would start it: the heads
split evenly over a rank's GPUs (vLLM refuses otherwise) and the KV cache left beside the weights holds one
sequence of max_model_len tokens (vLLM's `check_enough_kv_cache_memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentspec_sim.cost.profiles import VLLM_GPU_MEMORY_UTILIZATION, kv_capacity_tokens, load_hardware, load_model

# Tensor-parallel sizes a layout search tries: one node's NVLink domain (8 GPUs on HGX boards; an NVL72
# rack reaches further, which these sizes leave to an explicit --tensor-parallel-size).
TP_SIZES = (1, 2, 4, 8)
NODE_GPUS = 8  # a searched data-parallel layout stays within one node (tp × dp ≤ 8)


@dataclass(frozen=True, slots=True)
class Layout:
    """A deployment's parallel layout: `--tensor-parallel-size`, `--enable-expert-parallel` and
    `--data-parallel-size`."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    data_parallel_size: int = 1

    @property
    def gpus(self) -> int:
        """GPUs the deployment takes: data-parallel ranks × tensor-parallel GPUs each."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def tag(self) -> str:
        """'' for one GPU, else e.g. 'tp8', 'tp8-ep', 'dp8-ep' or 'tp2-dp4-ep' (bundled calibration file names)."""
        parts = ([f"tp{self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []) + (
            [f"dp{self.data_parallel_size}"] if self.data_parallel_size > 1 else [])
        if self.expert_parallel:
            parts.append("ep")
        return "-".join(parts) if parts else ""

    @property
    def label(self) -> str:
        """For people: 'tp 1', 'tp 8 + EP', 'tp 1 × dp 8 + EP'."""
        dp = f" × dp {self.data_parallel_size}" if self.data_parallel_size > 1 else ""
        return f"tp {self.tensor_parallel_size}{dp}" + (" + EP" if self.expert_parallel else "")

    def flags(self) -> str:
        """The layout as `vllm serve` flags ('' for one GPU)."""
        parts = [f"--tensor-parallel-size {self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []
        if self.data_parallel_size > 1:
            parts.append(f"--data-parallel-size {self.data_parallel_size}")
        return " ".join(parts + (["--enable-expert-parallel"] if self.expert_parallel else []))

    @classmethod
    def of(cls, engine: dict | None) -> Layout:
        """The layout an engine configuration's settings (`EngineConfig` fields, as a dict) name."""
        engine = engine or {}
        return cls(int(engine.get("tensor_parallel_size") or 1), bool(engine.get("enable_expert_parallel")),
                   int(engine.get("data_parallel_size") or 1))


SINGLE_GPU = Layout()


@dataclass(frozen=True)
class LayoutSearch:
    """The layouts a sweep or plan crosses with its cells: tensor-parallel `sizes` (None: every size of
    `TP_SIZES` that fits), `expert_parallel` (None: a MoE model on several GPUs both with and without expert
    parallelism), `data_parallel_sizes` (data-parallel ranks, each crossed with each tensor-parallel size;
    None: for a MoE model every size of `TP_SIZES` that keeps tp × dp within one node's `NODE_GPUS` and fits,
    for a dense model 1 — its ranks are replicas, with one replica's load per GPU)."""

    sizes: tuple[int, ...] | None = None
    expert_parallel: bool | None = None
    data_parallel_sizes: tuple[int, ...] | None = (1,)

    @property
    def most(self) -> int:
        """The most layouts one (hardware, model) pair can get (for the sweep's size check)."""
        sizes = len(self.sizes) if self.sizes is not None else len(TP_SIZES)
        ranks = len(self.data_parallel_sizes) if self.data_parallel_sizes is not None else len(TP_SIZES)
        return sizes * ranks * (2 if self.expert_parallel is None else 1)

    def layouts(self, hardware: str, model: str, max_model_len: int | None = None,
                gpu_memory_utilization: float | None = None) -> list[Layout]:
        """The layouts of this search for one pair: an explicit size is kept when the heads split (the run says
        what else does not fit); a size found by the search also has to hold one max_model_len sequence, and so
        does each of several explicit sizes while another of them does (`left_out` names the others)."""
        kept, _ = self._split(hardware, model, max_model_len, gpu_memory_utilization)
        return kept

    def left_out(self, hardware: str, model: str, max_model_len: int | None = None,
                 gpu_memory_utilization: float | None = None) -> list[Layout]:
        """The explicit layouts of a list that `layouts` leaves out for this pair: they cannot hold one
        max_model_len sequence beside the weights while another layout of the list can."""
        return self._split(hardware, model, max_model_len, gpu_memory_utilization)[1]

    def _split(self, hardware: str, model: str, max_model_len: int | None,
               gpu_memory_utilization: float | None) -> tuple[list[Layout], list[Layout]]:
        out = self._candidates(hardware, model, max_model_len, gpu_memory_utilization)
        if len(out) < 2 or self.sizes is None:
            return out, []
        hw, m = load_hardware(hardware), load_model(model)
        context = max_model_len or m.default_max_model_len
        utilisation = gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
        fits = [lay for lay in out if kv_capacity_tokens(hw, m, utilisation, lay.tensor_parallel_size,
                                                         data_parallel_size=lay.data_parallel_size) >= context]
        if not fits:
            return out, []  # none fits: the run says why
        return fits, [lay for lay in out if lay not in fits]

    def _candidates(self, hardware: str, model: str, max_model_len: int | None,
                    gpu_memory_utilization: float | None) -> list[Layout]:
        hw, m = load_hardware(hardware), load_model(model)
        context = max_model_len or m.default_max_model_len
        utilisation = gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
        searched = self.data_parallel_sizes is None
        ranks = self.data_parallel_sizes if not searched else (TP_SIZES if m.is_moe else (1,))
        out = []
        for dp in ranks:
            for tp in self.sizes if self.sizes is not None else TP_SIZES:
                if m.num_attention_heads % tp or (searched and dp > 1 and tp * dp > NODE_GPUS):
                    continue
                if ((self.sizes is None or (searched and dp > 1))
                        and kv_capacity_tokens(hw, m, utilisation, tp, data_parallel_size=dp) < context):
                    continue
                ep_choices: Sequence[bool] = ((False, True) if self.expert_parallel is None
                                              else (self.expert_parallel,))
                for ep in ep_choices:
                    layout = Layout(tp, ep and m.is_moe and tp * dp > 1, dp)
                    if layout not in out:
                        out.append(layout)
        return out
