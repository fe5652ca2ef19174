"""`agentspec-sim cost`: what step shapes cost on given hardware for a given model, by part."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from agentspec_sim.cli.common import caption_below
from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app
from agentspec_sim.cli.sweep_options import data_parallel_ranks_option, expert_parallel_option


@app.command("cost")
def cost(
    hardware: str = typer.Option("a100-80g", "--hardware", help="Hardware profile (id or JSON)."),
    model: str = typer.Option("qwen3-8b", "--model", help="Model profile (id, profile JSON or config.json)."),
    calibration: str | None = typer.Option(None, "--calibration", help="Calibration file, or 'defaults' for "
                                           "the documented defaults; default: the pair's bundled calibration "
                                           "where there is one."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="GPUs per model replica."),
    expert_parallel: bool = expert_parallel_option(),
    data_parallel_size: int = data_parallel_ranks_option(),
    shapes: Path | None = typer.Option(None, "--shapes", help="JSONL of step shapes, one per line: {\"kind\": "
                                       "decode|verify|prefill|mixed, \"batch\", \"context\", \"query_tokens\", "
                                       "\"prefix\"} (docs/cost-model.md, \"Pricing shapes\").", show_default=False),
    kind: str | None = typer.Option(None, "--kind", help="One shape instead of --shapes: decode, verify, prefill "
                                    "or mixed.", show_default=False),
    batch: int = typer.Option(1, "--batch", help="Decode calls in the step (decode, verify, mixed)."),
    context: int = typer.Option(0, "--context", help="Tokens cached per decode call."),
    query_tokens: int = typer.Option(1, "--query-tokens", help="Tokens per verify call (1 + k), or the prefill "
                                     "chunk's tokens."),
    prefix: int = typer.Option(0, "--prefix", help="Tokens cached before the prefill chunk."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"steps\": [...]} as JSON, in input order."),
) -> None:
    """Price step shapes with the cost model: seconds per step, split into weights, MoE, attention, overhead
    (GPU small kernels and host) and communication."""
    from agentspec_sim.cost.build import build_cost_model, calibration_note
    from agentspec_sim.cost.profiles import ProfileError
    from agentspec_sim.cost.shapes import ShapeError, StepShape, read_shapes

    if (shapes is None) == (kind is None):
        raise UsageError("give either --shapes FILE or --kind (with --batch/--context/--query-tokens/--prefix)")
    try:
        if shapes is not None:
            steps = read_shapes(shapes)
        else:
            fields = {"batch": batch, "context": context, "query_tokens": query_tokens, "prefix": prefix}
            if kind == "prefill":
                fields.pop("batch")
                fields.pop("context")
            elif kind == "decode":
                fields.pop("query_tokens")
            steps = [StepShape.from_dict({"kind": kind, **fields})]
        cost_model = build_cost_model(hardware, model, tensor_parallel_size, calibration,
                                      expert_parallel=expert_parallel, data_parallel_size=data_parallel_size)
    except (ShapeError, ProfileError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"{shapes}: {exc.strerror or exc}") from None
    rows = []
    for shape in steps:
        c = cost_model.step_time(shape.batch_shape())
        rows.append({**shape.to_dict(), "seconds": c.total_s, "weights_s": c.linear_s, "moe_s": c.moe_s,
                     "attention_s": c.attention_s, "overhead_s": c.overhead_s, "communication_s": c.communication_s,
                     "tokens": shape.num_tokens})
    note = calibration_note(cost_model)
    if as_json:
        typer.echo(json.dumps({"hardware": cost_model.hardware.id, "model": cost_model.model.id,
                               "tensor_parallel_size": tensor_parallel_size,
                               "expert_parallel": cost_model.expert_parallel,
                               "data_parallel_size": cost_model.data_parallel_size,
                               "calibration": cost_model.calibration.source, "steps": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"step cost: {cost_model.hardware.id} + {cost_model.model.id}")
    for col in ("shape", "ms", "weights", "MoE", "attention", "overhead", "comm."):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for row in rows:
        shape = ", ".join(f"{k} {v}" for k, v in row.items() if k in ("batch", "context", "query_tokens", "prefix"))
        table.add_row(f"{row['kind']}: {shape}", f"{row['seconds'] * 1e3:.3f}",
                      *(f"{row[k] * 1e3:.3f}" for k in ("weights_s", "moe_s", "attention_s", "overhead_s",
                                                        "communication_s")))
    console = Console()
    console.print(caption_below(table))
    console.print(note, markup=False, highlight=False)
