"""Run a converter end to end: raw logs → records → validated workload → trace file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agentspec_sim.trace.convert import CONVERTERS, ConvertError, ConvertOptions
from agentspec_sim.trace.io import parse_records, write_records, write_trace
from agentspec_sim.trace.tokenizer import UnknownTokenizerError, load_tokenizer


def convert_records(fmt: str, inputs: Sequence[Path], tokenizer: str = "qwen3",
                    max_queries: int | None = None, skipped: list[ConvertError] | None = None,
                    notes: list[str] | None = None) -> list[dict]:
    """The trace records a converter makes of `inputs` (meta first), optionally the first N queries. `skipped`:
    a line-oriented converter skips the lines it cannot read and appends why to this list (else it refuses)."""
    try:
        tok = load_tokenizer(tokenizer)
    except UnknownTokenizerError as exc:
        raise ConvertError(tokenizer, str(exc)) from None
    opts = ConvertOptions(tokenizer=tokenizer, eot_text=tok.eot_text or "", skip_bad_lines=skipped is not None,
                          skipped=skipped if skipped is not None else [], notes=notes if notes is not None else [])
    records = list(CONVERTERS[fmt].convert([Path(p) for p in inputs], opts))
    if not records or records[0].get("type") != "meta":
        raise ConvertError(inputs[0] if inputs else fmt, "the converter produced no trace")
    if len(records) == 1:
        raise ConvertError(inputs[0], f"no LLM calls found for format {fmt!r}")
    if max_queries is not None:
        keep: set[tuple] = set()
        out = [records[0]]
        for r in records[1:]:
            key = (r["agent_id"], r["query_id"])
            if key not in keep and len(keep) >= max_queries:
                continue
            keep.add(key)
            out.append(r)
        records = out
    return records


def convert_to_trace(fmt: str, inputs: Sequence[Path], output: Path, tokens: bool = False,
                     tokenizer: str = "qwen3", max_queries: int | None = None, skip_bad_lines: bool = False) -> dict:
    """Convert and write; the records are loaded first, so a written trace always loads. The summary's
    `skipped` lists the input lines skipped as unreadable (with `skip_bad_lines`)."""
    skipped: list[ConvertError] | None = [] if skip_bad_lines else None
    notes: list[str] = []
    records = convert_records(fmt, inputs, tokenizer, max_queries, skipped, notes)
    workload = parse_records(enumerate(records, start=1), source=f"<{fmt} converter>")
    if tokens:
        write_trace(workload, output)
    else:
        write_records(records, output)
    return {
        "queries": len(workload.queries), "calls": workload.num_calls,
        "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens,
        "bytes": _size_written(output), "skipped": list(skipped or []), "notes": notes,
    }


def _size_written(output: Path) -> int | None:
    """Bytes now at `output`; None where that is no file's size (standard output, a pipe, a device)."""
    import stat

    from agentspec_sim.io.outputs import stdout_alias

    st = Path(stdout_alias(output)).stat()
    return st.st_size if stat.S_ISREG(st.st_mode) else None
