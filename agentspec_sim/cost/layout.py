"""How vLLM spreads one model replica over GPUs, and which layouts fit a model on a GPU.

`--tensor-parallel-size N` splits every layer's weights and attention heads over N GPUs (two all-reduces a
layer); `--enable-expert-parallel` places a MoE model's routed experts whole over the same N GPUs instead of
slicing each one (vLLM's expert-parallel size is then N, with data parallelism 1). A layout fits when vLLM
would start it: the heads split evenly over the GPUs (vLLM refuses otherwise) and the KV cache left beside
the weights holds one sequence of max_model_len tokens (vLLM's `check_enough_kv_cache_memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentspec_sim.cost.profiles import VLLM_GPU_MEMORY_UTILIZATION, kv_capacity_tokens, load_hardware, load_model

# Tensor-parallel sizes a layout search tries: one node's NVLink domain (8 GPUs on HGX boards; an NVL72
# rack reaches further, which these sizes leave to an explicit --tensor-parallel-size).
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class Layout:
    """A replica's parallel layout: `--tensor-parallel-size` and `--enable-expert-parallel`."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    @property
    def tag(self) -> str:
        """'' for one GPU, else e.g. 'tp8' or 'tp8-ep' (bundled calibration file names)."""
        if self.tensor_parallel_size == 1 and not self.expert_parallel:
            return ""
        return f"tp{self.tensor_parallel_size}" + ("-ep" if self.expert_parallel else "")

    @property
    def label(self) -> str:
        """For people: 'tp 1', 'tp 8 + EP'."""
        return f"tp {self.tensor_parallel_size}" + (" + EP" if self.expert_parallel else "")

    def flags(self) -> str:
        """The layout as `vllm serve` flags ('' for one GPU)."""
        parts = [f"--tensor-parallel-size {self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []
        return " ".join(parts + (["--enable-expert-parallel"] if self.expert_parallel else []))

    @classmethod
    def of(cls, engine: dict | None) -> Layout:
        """The layout an engine configuration's settings (`EngineConfig` fields, as a dict) name."""
        engine = engine or {}
        return cls(int(engine.get("tensor_parallel_size") or 1), bool(engine.get("enable_expert_parallel")))


SINGLE_GPU = Layout()


@dataclass(frozen=True)
class LayoutSearch:
    """The layouts a sweep or plan crosses with its cells: `sizes` (None: every size of `TP_SIZES` that fits),
    `expert_parallel` (None: a MoE model at tp > 1 both with and without expert parallelism)."""

    sizes: tuple[int, ...] | None = None
    expert_parallel: bool | None = None

    @property
    def most(self) -> int:
        """The most layouts one (hardware, model) pair can get (for the sweep's size check)."""
        sizes = len(self.sizes) if self.sizes is not None else len(TP_SIZES)
        return sizes * (2 if self.expert_parallel is None else 1)

    def layouts(self, hardware: str, model: str, max_model_len: int | None = None,
                gpu_memory_utilization: float | None = None) -> list[Layout]:
        """The layouts of this search for one pair: an explicit size is kept when the heads split (the run says
        what else does not fit); a size found by the search also has to hold one max_model_len sequence."""
        hw, m = load_hardware(hardware), load_model(model)
        context = max_model_len or m.default_max_model_len
        utilisation = gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
        out = []
        for tp in self.sizes if self.sizes is not None else TP_SIZES:
            if m.num_attention_heads % tp:
                continue
            if self.sizes is None and kv_capacity_tokens(hw, m, utilisation, tp) < context:
                continue
            ep_choices: Sequence[bool] = ((False, True) if self.expert_parallel is None else (self.expert_parallel,))
            for ep in ep_choices:
                layout = Layout(tp, ep and m.is_moe and tp > 1)
                if layout not in out:
                    out.append(layout)
        return out

