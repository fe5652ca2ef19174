"""`agentspec-sim record TRACE`: re-generate a trace's outputs with a real model through vLLM (same machinery
as `validate vllm`), so the trace matches the served model."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app


@app.command()
def record(
    trace: Path = typer.Argument(..., help="The trace whose prompts are served.", show_default=False),
    model: str = typer.Option(..., "--model", help="Model weights for vLLM (a local folder or hub id).",
                              show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="The new trace (.jsonl[.gz|.xz|.zst]).",
                                show_default=False),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="vLLM's max_num_seqs while recording."),
    queries: int | None = typer.Option(None, "--queries", help="Record only the first N queries."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="vLLM's context limit (default: the "
                                             "model's)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="No CUDA graphs / torch.compile (faster to "
                                       "build, e.g. on a CPU)."),
) -> None:
    """Serve every call (recorded prompt, greedy, output length pinned to the recording) without speculation
    and write the trace with vLLM's outputs; prompts, arrivals and think times are kept."""
    import importlib.util
    from dataclasses import replace

    from agentspec_sim.cli.validate import vllm_engine_args
    from agentspec_sim.trace.io import load_trace, write_trace
    from agentspec_sim.validation.vllm_runner import methods, workload_with_outputs
    from agentspec_sim.validation.vllm_worker import VllmRunError, WorkerRequest, run_in_subprocess

    if max_num_seqs < 1 or (queries is not None and queries < 1):
        raise UsageError("--max-num-seqs and --queries must be ≥ 1")
    from agentspec_sim.io.outputs import TRACE_SUFFIXES, Output, check_outputs

    check_outputs(Output("--output", output, TRACE_SUFFIXES), inputs={"TRACE": trace, "--model": model})
    workload = load_trace(trace)  # a bad trace is reported before a missing vLLM
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("record needs vLLM and model weights: pip install 'agentspec-sim[vllm]' (vllm==0.33.0)")
    if queries is not None:
        workload = replace(workload, queries=workload.queries[:queries])
    llm_kwargs = vllm_engine_args(None, None, max_model_len, None, enforce_eager, enable_prefix_caching=True)
    # The step clock: a query's next call follows its think time in engine steps, so recording never sleeps.
    request = WorkerRequest(model, methods()["normal"], workload, max_num_seqs, "steps", llm_kwargs)
    try:
        run = run_in_subprocess(request)
    except VllmRunError as exc:
        raise UsageError(str(exc)) from None
    written = write_trace(workload_with_outputs(workload, run, model=model), output)
    Console().print(f"recorded {len(run.calls)} calls ({run.output_tokens:,} output tokens in {run.wall_s:.1f} s, "
                    f"{run.goodput_tok_s:,.0f} tok/s) → {output} ({written} lines)")
