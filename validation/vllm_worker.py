"""One method's vLLM run in a process of its own: `run_in_subprocess` starts it, `main` is the child.

Why a process per engine:
- GPU (or CPU KV) memory goes back to the system when the process ends, before the next engine is built;
- vLLM's process-global state (the Prometheus registry, environment variables such as the model-runner
  choice, its kernel registry) does not leak from one method into the next;
- vLLM 0.32's CPU platform scans every loaded module when its worker starts
  (`triton_utils.dispatcher._rebind_kernels`) and fails on llvmlite's `ffi.lib` object ("'_lib_fn_wrapper'
  object has no attribute 'get'") once numba is loaded, which the simulator always is. The child builds the
  engine before it imports anything that loads numba.

Protocol: the parent pickles a `WorkerRequest` (with the workload) to a file and runs
`python -m agentspec_sim.validation.vllm_worker REQUEST RESULT`; the child prints `progress DONE TOTAL`
lines on stdout and pickles either the `VllmRun` or a `WorkerFailure` to RESULT. vLLM's own log goes to
a file whose tail is shown when the child fails.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec_sim.trace.schema import Workload
from agentspec_sim.validation.vllm_runner import ClockName, Method, MethodUnavailable, VllmRun


class VllmRunError(RuntimeError):
    """The vLLM child process failed; the message carries the end of its log."""


@dataclass(frozen=True)
class WorkerRequest:
    model: str
    method: Method
    workload: Workload
    max_num_seqs: int
    clock: ClockName
    llm_kwargs: Mapping[str, Any] = field(default_factory=dict)
    think_time: float | None = None
    seed: int = 0
    probe_hardware: bool = False  # measure the machine's profile after the run (`VllmRun.hardware_profile`)


@dataclass(frozen=True)
class WorkerFailure:
    kind: str  # "unavailable" (the method cannot run on the built engine) or "error"
    message: str


# `-P` (Python ≥ 3.11): the child does not put its working directory first on sys.path. Run from a checkout's
# root with a non-editable install, the checkout's `agentspec_sim/` (which holds no `validation/`) would shadow
# the installed package and `-m agentspec_sim.validation.vllm_worker` would not be found.
_ISOLATED = ("-P",)


def run_in_subprocess(request: WorkerRequest, *, progress: Callable[[int, int], None] | None = None,
                      env: Mapping[str, str] | None = None, log_tail_lines: int = 25) -> VllmRun:
    """Run `request` in a child process; raise MethodUnavailable or VllmRunError when it fails."""
    with tempfile.TemporaryDirectory(prefix="agentspec-vllm-") as tmp:
        req_path, res_path, log_path = Path(tmp, "request.pkl"), Path(tmp, "result.pkl"), Path(tmp, "vllm.log")
        req_path.write_bytes(pickle.dumps(request))
        child_env = {**os.environ, **(env or {})}
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, *_ISOLATED, "-m", "agentspec_sim.validation.vllm_worker",
                                     str(req_path), str(res_path)], stdout=subprocess.PIPE, stderr=log, text=True,
                                    env=child_env)
            assert proc.stdout is not None
            for line in proc.stdout:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "progress" and progress is not None:
                    progress(int(parts[1]), int(parts[2]))
            code = proc.wait()
        result = pickle.loads(res_path.read_bytes()) if res_path.exists() else None
        if isinstance(result, VllmRun) and code == 0:
            return result
        if isinstance(result, WorkerFailure) and result.kind == "unavailable":
            raise MethodUnavailable(result.message)
        tail = log_path.read_text(errors="replace").splitlines()[-log_tail_lines:]
        why = result.message if isinstance(result, WorkerFailure) else f"exit status {code}"
        raise VllmRunError(f"vLLM ({request.method.name}) failed: {why}\n" + "\n".join(tail))


def main(argv: list[str]) -> int:
    req_path, res_path = Path(argv[0]), Path(argv[1])
    request: WorkerRequest = pickle.loads(req_path.read_bytes())

    def answer(value: object) -> None:
        res_path.write_bytes(pickle.dumps(value))

    # Run as `-m`, this module is __main__: results must pickle under the importable name.
    from agentspec_sim.validation.vllm_runner import build_llm, check_runner, run_vllm
    from agentspec_sim.validation.vllm_worker import WorkerFailure

    try:
        llm = build_llm(request.model, request.method, max_num_seqs=request.max_num_seqs, seed=request.seed,
                        **dict(request.llm_kwargs))
        check_runner(request.method, llm)
    except MethodUnavailable as exc:
        answer(WorkerFailure("unavailable", str(exc)))
        return 3
    except Exception as exc:
        answer(WorkerFailure("error", f"{type(exc).__name__}: {exc}"))
        return 1

    def report(done: int, total: int) -> None:
        print(f"progress {done} {total}", flush=True)

    try:
        run = run_vllm(request.workload, llm, request.method.name, clock=request.clock,
                       think_time=request.think_time, progress=report)
    except Exception as exc:
        answer(WorkerFailure("error", f"{type(exc).__name__}: {exc}"))
        return 1
    if request.probe_hardware:
        run.hardware_profile = _probe()
    answer(run)
    return 0


def _probe() -> dict[str, Any]:
    """The bundled profile of this GPU, else one measured here (validation/hardware_probe.py), as JSON."""
    import torch

    from agentspec_sim.validation.hardware_probe import hardware_for, profile_to_json

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return profile_to_json(hardware_for(device, torch.bfloat16))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
