"""Large synthetic traces made by resampling a real one, for scale runs and capacity planning.

`synthesize(workload, queries=N)` (or `output_tokens=N`) returns a workload of whole queries drawn
from `workload`: each synthetic query is a copy of a real one with new ids and the same per-call
shapes (prompt and output lengths, delta-form chaining, think times, roles, structure), so the
engine and the drafters face the same per-query work, only more of it.

Drawing. Queries are drawn in *generations*: generation g is a seeded shuffle of all the real
queries, each used once; generations follow each other until N queries (or N output tokens,
counted in whole queries) are reached. Same workload + seed ⇒ the same trace.

Copies must not share text that distinct tasks would not. Drafters with cross-query state
(suffix's global tree, agspec's corpora, agentspec-plus's global history) would otherwise find a
query's whole output in an earlier copy of it and draft it perfectly. Generation 0 keeps the real
token ids; generation g ≥ 1 relabels every token id through its own seeded permutation of the
vocabulary. Within a generation, queries are distinct real tasks and share exactly what the real
trace's queries share (system prompts, tool descriptions, idioms); across generations they share
only the ids the permutation keeps fixed. That is what `--replicate` does with tenants (each copy
its own drafter, its own KV hashes), expressed in the trace itself — a trace file has no tenant
field, and a relabelled trace replays the same under every engine mode and drafter.

A bijection keeps every equality between tokens of one query, so whatever a drafter matches
within a query (n-grams, suffixes, repeated spans) matches the same in the copy. Kept fixed:

- special and added tokens (end of turn, chat-template markers, tool-call tags), whose ids the
  engine and templates treat by identity;
- every token whose bytes could take part in one of the trace's structure delimiters (it contains a
  delimiter, lies inside one, or a prefix/suffix of it is a suffix/prefix of one). A relabelled
  token then can neither complete, continue nor start a delimiter, so AgentSpec's byte-level
  automaton (drafters/common/structure.py) finds the same delimiters at the same tokens and labels every
  token with the same block (tests/test_synth.py replays agentspec on both and compares).

Without a tokenizer (an ids-only trace) every id below the vocabulary size is relabelled.
Not carried into generations ≥ 1: workspace files (text, which cannot be relabelled; agspec's
workspace corpus is empty there) and recorded arrival times (dropped in every generation: a
synthetic trace is paced by think times and the engine's arrival mode).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from agentspec_sim.trace.schema import Call, Query, Structure, Workload

SEP = "~"  # new ids are "<real id>~<generation>"


@dataclass(frozen=True)
class Vocabulary:
    """What relabelling may touch: `size` ids, of which `fixed[i]` must map to themselves."""

    size: int
    fixed: np.ndarray  # bool, shape (size,)


def delimiters_of(workload: Workload) -> set[bytes]:
    """Every structure delimiter (opener and closer) used by any call, as UTF-8 bytes."""
    seen: set[Structure] = {c.structure for q in workload.queries for c in q.calls}
    return {d.encode("utf-8") for s in seen for group in s for pair in group for d in pair if d}


def _touches(token: bytes, delims: Sequence[bytes], prefixes: set[bytes], suffixes: set[bytes], longest: int) -> bool:
    """True if `token` could take part in a delimiter: contains one, lies inside one, or overlaps one's end or start."""
    if any(d in token or token in d for d in delims):
        return True
    span = min(len(token), longest)
    return any(token[-k:] in prefixes or token[:k] in suffixes for k in range(1, span + 1))


def vocabulary(token_bytes: Sequence[bytes] | None, special_ids: Iterable[int], delims: Iterable[bytes],
               size: int) -> Vocabulary:
    """The relabelling vocabulary: `size` ids; fixed are `special_ids`, ids without bytes, and (with
    `token_bytes`) every token that could take part in a delimiter of `delims`."""
    fixed = np.zeros(size, dtype=bool)
    for i in special_ids:
        if 0 <= i < size:
            fixed[i] = True
    if token_bytes is not None:
        delims = sorted(set(delims))
        prefixes = {d[:k] for d in delims for k in range(1, len(d) + 1)}
        suffixes = {d[-k:] for d in delims for k in range(1, len(d) + 1)}
        longest = max((len(d) for d in delims), default=0)
        for i, token in enumerate(token_bytes[:size]):
            if not token or (delims and _touches(token, delims, prefixes, suffixes, longest)):
                fixed[i] = True
    return Vocabulary(size, fixed)


def vocabulary_for(workload: Workload, base_dir=None) -> Vocabulary:
    """The relabelling vocabulary of `workload`: from its tokenizer, or, for an ids-only trace, every id
    below meta.vocab_size (or the largest id used + 1)."""
    largest = max((int(a.max()) for q in workload.queries for c in q.calls
                   for a in (c.prompt_tokens, c.output_tokens) if a.shape[0]), default=-1) + 1
    name = workload.meta.tokenizer
    if name is None:
        return vocabulary(None, (), (), max(largest, workload.meta.vocab_size or 0))
    from agentspec_sim.trace.tokenizer import load_tokenizer

    tok = load_tokenizer(name, base_dir)
    table = tok.token_bytes()
    special = tok.backend.get_added_tokens_decoder().keys()
    return vocabulary(table, special, delimiters_of(workload), max(len(table), largest))


def relabelling(vocab: Vocabulary, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ids (int32 lookup table) that moves only the free ids, among themselves."""
    perm = np.arange(vocab.size, dtype=np.int32)
    free = np.flatnonzero(~vocab.fixed).astype(np.int32)
    perm[free] = free[rng.permutation(free.shape[0])]
    return perm


def draw(workload: Workload, queries: int | None = None, output_tokens: int | None = None,
         seed: int = 0) -> list[tuple[int, int]]:
    """(generation, real query index) of each synthetic query, in order: whole generations of
    seeded shuffles until `queries` queries or at least `output_tokens` output tokens."""
    if (queries is None) == (output_tokens is None):
        raise ValueError("give exactly one of queries and output_tokens")
    if not workload.queries:
        raise ValueError("the trace has no queries to resample")
    target = queries if queries is not None else output_tokens
    if target is None or target < 1:
        raise ValueError(f"the target must be ≥ 1, got {target}")
    sizes = [q.output_tokens for q in workload.queries]
    order_rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    picks: list[tuple[int, int]] = []
    total = 0
    generation = 0
    while True:
        for index in order_rng.permutation(len(workload.queries)).tolist():
            picks.append((generation, index))
            total += sizes[index]
            if len(picks) >= (queries or len(picks) + 1) or total >= (output_tokens or total + 1):
                return picks
        generation += 1


class _Relabel:
    """Relabels a generation's arrays: views of the workload's buffer become views of its relabelled copy."""

    def __init__(self, perm: np.ndarray | None, base: np.ndarray | None) -> None:
        self.perm, self.base = perm, base
        self.new_base = perm[base] if perm is not None and base is not None else None

    def __call__(self, array: np.ndarray) -> np.ndarray:
        if self.perm is None or not array.shape[0]:
            return array
        if self.new_base is not None and array.base is self.base:
            start = (array.__array_interface__["data"][0] - self.base.__array_interface__["data"][0]) // 4
            return self.new_base[start:start + array.shape[0]]
        return self.perm[array]


def _copy_query(query: Query, generation: int, relabel: _Relabel) -> Query:
    suffix = f"{SEP}{generation}"
    calls = []
    for c in query.calls:
        extra = {**(c.extra or {}), "synth": {"of": c.id, "generation": generation}}
        calls.append(Call(
            id=f"{c.id}{suffix}", agent_id=c.agent_id, query_id=f"{query.query_id}{suffix}", seq=c.seq,
            prompt_tokens=relabel(c.prompt_tokens), output_tokens=relabel(c.output_tokens),
            role=c.role, structure=c.structure, workspace=c.workspace if generation == 0 else (),
            emission=c.emission, arrival_s=None, think_s=c.think_s,
            prompt_extends=f"{c.prompt_extends}{suffix}" if c.prompt_extends is not None else None, extra=extra,
        ))
    return Query(agent_id=query.agent_id, query_id=f"{query.query_id}{suffix}", calls=tuple(calls))


# What synthesizing holds per synthetic call (its Call with new ids and provenance, in its Query; measured:
# 1.49 KB per call for 2·10⁵ and 6·10⁵ calls) and per generation ≥ 1 (a relabelled copy of the token
# arena and the vocabulary's permutation, int32 each); what writing takes per call record besides its
# token ids (measured: 170 bytes for ids like "c1~12"), and per token id its digits and a comma.
SYNTH_CALL_BYTES = 1500
RECORD_BYTES = 170
# The best a compressed trace of token ids compresses (trace/io.py: up to ~25×): the least it takes on disk.
BEST_COMPRESSION = 25


@dataclass(frozen=True)
class SynthSize:
    """How large `synthesize(workload, queries | output_tokens)` comes out, estimated from whole generations
    (`draw` repeats the real queries in seeded shuffles): queries, calls and generations it makes, the memory
    it holds and the bytes of its trace text."""

    queries: int
    calls: int
    generations: int
    memory_bytes: int
    text_bytes: int


def synth_size(workload: Workload, queries: int | None = None, output_tokens: int | None = None,
               vocab_size: int | None = None) -> SynthSize:
    """`SynthSize` of the synthetic trace, without drawing it (a billion queries cost nothing to size)."""
    real = len(workload.queries)
    calls = [c for q in workload.queries for c in q.calls]
    total_out = max(1, sum(c.output_len for c in calls))
    # Whole generations and a share of the next: by queries, or by output tokens (whole queries up to ≥ N).
    share = queries / real if queries is not None else (output_tokens or 0) / total_out
    generations = max(1, math.ceil(share))
    by_id = {c.id: c for c in calls}
    written = 0  # token ids one generation writes: delta-form prompts write only their appended part
    for c in calls:
        parent = by_id.get(c.prompt_extends) if c.prompt_extends else None
        written += c.prompt_len - (parent.prompt_len + parent.output_len if parent else 0) + c.output_len
    base = calls[0].prompt_tokens.base if calls else None
    arena = int(base.shape[0]) if isinstance(base, np.ndarray) else sum(c.prompt_len + c.output_len for c in calls)
    sample = base[:1 << 20] if isinstance(base, np.ndarray) else (calls[0].prompt_tokens if calls else None)
    digits = float(np.mean(np.floor(np.log10(np.maximum(sample, 1))) + 1)) if sample is not None and sample.size else 1
    n_calls = round(share * len(calls))
    memory = n_calls * SYNTH_CALL_BYTES + (generations - 1) * 4 * (arena + (vocab_size or 0))
    text = n_calls * RECORD_BYTES + share * written * (digits + 1)
    return SynthSize(round(share * real), n_calls, generations, int(memory), int(text))


def check_synth(workload: Workload, queries: int | None = None, output_tokens: int | None = None,
                vocab_size: int | None = None, output: str | Path | None = None) -> SynthSize:
    """Refuse (`ResourceError`, naming `queries` or `output_tokens`) a synthetic trace whose making needs more
    memory than is available, or, given the `output` it is written to, more disk than that has free."""
    from agentspec_sim.host.resources import require_disk, require_memory
    from agentspec_sim.io.atomic import compression_of

    knob, value = ("queries", queries) if queries is not None else ("output_tokens", output_tokens)
    size = synth_size(workload, queries, output_tokens, vocab_size)
    require_memory({knob: size.memory_bytes}, "the synthetic trace", values={knob: value} if value else None)
    if output is not None:
        ratio = BEST_COMPRESSION if compression_of(output) else 1
        require_disk(output, size.text_bytes / ratio, knob, value,
                     f"the synthetic trace ({size.calls:,} calls{', compressed' if ratio > 1 else ''})")
    return size


def synthesize(workload: Workload, queries: int | None = None, output_tokens: int | None = None, seed: int = 0,
               vocab: Vocabulary | None = None) -> Workload:
    """A workload of `queries` resampled queries (or whole queries up to ≥ `output_tokens` output tokens);
    see the module docstring. `vocab` defaults to `vocabulary_for(workload)`. Refused before it is drawn
    (`ResourceError`) where it would not fit in memory (`check_synth`)."""
    if workload.queries and (queries or output_tokens):
        check_synth(workload, queries, output_tokens, vocab.size if vocab is not None else None)
    picks = draw(workload, queries, output_tokens, seed)
    if vocab is None and any(g for g, _ in picks):
        vocab = vocabulary_for(workload)
    # The loader lays every token in one int32 buffer: relabel it once per generation, and copies stay views.
    first = workload.queries[0].calls[0].prompt_tokens if workload.queries[0].calls else None
    base = first.base if first is not None and isinstance(first.base, np.ndarray) else None
    if base is not None and (base.dtype != np.int32 or base.ndim != 1 or not base.flags.c_contiguous):
        base = None
    relabels: dict[int, _Relabel] = {0: _Relabel(None, None)}
    out = []
    for generation, index in picks:
        if generation not in relabels:
            assert vocab is not None
            perm = relabelling(vocab, np.random.default_rng(np.random.SeedSequence([seed, 1, generation])))
            relabels[generation] = _Relabel(perm, base)
        out.append(_copy_query(workload.queries[index], generation, relabels[generation]))
    meta = workload.meta
    return Workload(meta=replace(meta, source=f"synthesized from {meta.source or 'a trace'} (seed {seed})"),
                    queries=tuple(out))


__all__ = ["SynthSize", "Vocabulary", "check_synth", "delimiters_of", "draw", "relabelling", "synth_size", "synthesize",
           "vocabulary", "vocabulary_for"]
