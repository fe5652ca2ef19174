"""`agentspec-sim synth --like TRACE --queries N | --output-tokens N -o OUT`: a large resampled trace."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from agentspec_sim.cli.common import load_workload
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app


@app.command()
def synth(
    like: Path | None = typer.Option(None, "--like", help="Trace to resample (default: the bundled coding-agent "
                                     "trace).", show_default=False),
    queries: int | None = typer.Option(None, "--queries", help="Number of queries to draw."),
    output_tokens: int | None = typer.Option(None, "--output-tokens", help="Draw whole queries until they hold at "
                                             "least this many output tokens."),
    seed: int = typer.Option(0, "--seed", help="Seed for the draw order and the per-copy token relabelling."),
    output: Path = typer.Option(..., "-o", "--output", help="Trace to write (.jsonl, .jsonl.gz/.xz/.zst)."),
) -> None:
    """Make a large trace by resampling a real one: new ids, the same per-query shapes, and copies of
    one query relabelled so that they share no text (see agentspec_sim/trace/synth.py)."""
    from agentspec_sim.io.outputs import TRACE_SUFFIXES, Output, check_outputs
    from agentspec_sim.trace.bundled import default_trace_path
    from agentspec_sim.trace.io import write_trace
    from agentspec_sim.trace.synth import check_synth, synthesize, vocabulary_for

    if (queries is None) == (output_tokens is None):
        raise UsageError("--queries / --output-tokens: give exactly one of them")
    for name, value in (("--queries", queries), ("--output-tokens", output_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{name}: must be ≥ 1, got {value}")
    if seed < 0:
        raise UsageError(f"--seed: must be ≥ 0, got {seed}")
    check_outputs(Output("--output", output, TRACE_SUFFIXES), inputs={"--like": like or default_trace_path()})
    path, workload = load_workload(like)
    if not workload.queries:
        raise UsageError(f"--like: {path} has no queries to resample")
    check_synth(workload, queries, output_tokens, output=output)  # memory and disk, before the vocabulary is built
    vocab = vocabulary_for(workload, path.parent)
    synthetic = synthesize(workload, queries=queries, output_tokens=output_tokens, seed=seed, vocab=vocab)
    write_trace(synthetic, output)
    prompt = sum(c.prompt_len for q in synthetic.queries for c in q.calls)
    copies = synthetic.queries[-1].calls[0].extra["synth"]["generation"] + 1
    Console(stderr=True).print(
        f"wrote {output}: {len(synthetic.queries):,} queries ({copies} generation(s) of {path.name}), "
        f"{synthetic.num_calls:,} calls, {prompt:,} prompt / {synthetic.output_tokens:,} output tokens")
