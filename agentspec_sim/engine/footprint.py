"""What a run will allocate, estimated before it starts, and the guard that refuses a run that does not fit.

`run_footprint` adds up what `Simulator._build` and the run allocate, per knob that scales it:

- per call instance (a tenant's copy of a call, `replicate` × the trace's calls): its call-table
  record, the Python objects of the layout, its `CallState`, the heap and the result frames;
- per step-log row (one per decode call-step, at most one per output token, plus prefill chunks:
  `StepLogBuilder`'s room), and per engine step;
- per prefix-hash slot (each call's blocks, in the regions of its tenant): the hash and node ids,
  the pool's node record and its hash-table entries;
- per KV block (`num_kv_blocks`): the block record, the pool's scratch, and the list the free
  queue is built from;
- per running-call slot (`max_num_seqs`): a block-table row of max_model_len / block_size entries,
  a row of drafts as long as the longest draft (`num_speculative_tokens`), and the per-slot work arrays;
- the drafter's state per token of the trace (`DRAFTER_BYTES_PER_TOKEN`): its workload table for
  one tenant, its own live state per tenant with `replicate` > 1.

Record sizes come from the dtypes themselves; the per-call, per-slot and drafter figures were measured
as the peak RSS a run adds to the RSS just before it (VmHWM reset through /proc/self/clear_refs; the
drafter's kernels loaded by an earlier tiny run; its workload tables built in the run), on this
project's 2-core VM. Measured vs estimated, MiB (tests/test_resource_guards.py keeps one within 2×):

    trace, drafter, setting                                  measured  estimated
    2 calls × (8 + 3 tokens), normal, replicate 10⁵             306.6      343.0
    2 calls × (8 + 3000), normal, replicate 1000                220.1      220.3
    2 calls × (3000 + 3), normal, replicate 1000                 26.9       30.5
    2 calls × (8 + 3), normal, num_kv_blocks 10⁷                690.0      651.1
    2 calls × (8 + 3), normal, max_model_len 10⁷                620.7      616.8
    2 calls × (8 + 3), normal, max_num_seqs 10⁶ (context 64)    171.5      171.7
    8 random calls × (500 + 2000), suffix, replicate 50         369.6      245.3
    8 random calls × (500 + 2000), agentspec, replicate 50      244.9      197.6
    default trace, normal                                       122.7      111.7
    default trace, normal, replicate 2                          244.0      219.1
    default trace, normal, max_num_seqs 1                       796.2      781.3
    default trace, ngram / eagle3 (workload tables)     313.8 / 268.6  292.9 / 242.5
    default trace, agentspec / suffix (workload tables) 299.3 / 731.8  272.8 / 675.4
    default trace, agentspec, replicate 2 (live)               1564.3     1930.2
    default trace, suffix, replicate 2 (live)                  1647.6     2433.5
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from agentspec_sim.engine.config import EngineConfig, ResolvedLimits
from agentspec_sim.engine.drafting import BaseDrafter, SpeculativeConfig
from agentspec_sim.engine.kv import BLOCK, ENTRY, NODE, cdiv
from agentspec_sim.engine.request import CALL
from agentspec_sim.engine.result import LOG_ROW, STEP_LOG_BYTES
from agentspec_sim.host.resources import require_memory
from agentspec_sim.trace.schema import Workload

# Python objects per call instance beyond its CALL record: the layout's lists and id string, its
# CallState, its heap events and its rows of the result frames (measured: 2 calls × replicate 1e4 and
# 1e5, 1,521 bytes per call instance in all).
CALL_OBJECT_BYTES = 1330
# Per prefix-hash slot: hash and node ids (int64 each), the node record, and its hash-table entries
# (a power of two ≥ 4/3 of the nodes: about 2 per node).
HASH_SLOT_BYTES = 16 + NODE.itemsize + 2 * ENTRY.itemsize
# Per engine step: its log record, and its row of the engine-steps frame `summarize` reads (measured at
# max_num_seqs 1, one call-step per step: 308 bytes per step beyond the call-step's row).
STEP_BYTES = STEP_LOG_BYTES + 180
# Per KV block: the block record, the pool's int64 scratch, and the Python list of block ids the free
# queue is first built from (8-byte pointer + 28-byte int, transient).
KV_BLOCK_BYTES = BLOCK.itemsize + 8 + 36
# Per running-call slot besides its block-table row: the slot record, its first row of drafts, the
# scheduler's and drafting work arrays and the per-batch-size tables (measured: 180 bytes per slot with
# a 5-entry block row, 10⁶ slots).
SLOT_FIXED_BYTES = 160
# vLLM's largest default max_num_seqs and a long model context: the slot table's memory is blamed on
# whichever of max_num_seqs and max_model_len is further above these.
_TYPICAL_SEQS, _TYPICAL_CONTEXT = 1024, 131072

# Drafter state in bytes per token of the trace's token arena: each drafter class declares its own
# (`BaseDrafter.bytes_per_token`: its workload table, built once for one tenant; its live state per tenant, the
# event loop's drafters with replicate > 1). Measured on the default trace (5.3M arena tokens, tables built in
# the run) at max_num_seqs 256 above a `normal` run: ngram 33, eagle3 25, agentspec 27, suffix 106 bytes per
# token with the table; live, per tenant: agentspec 131 on the default trace (replicate 2) and 226 on a trace of
# random tokens (replicate 10 → 50), suffix 139 and 338. Drafters that declare none (agspec, agentspec+,
# agentspec-r) are taken as agentspec's live state, the default.
# Per running-call slot and draft token of the longest draft (k): the slot's row of scheduled drafts, int32
# (measured: 3.8 bytes per slot per token, k = 10⁵ at max_num_seqs 256, every drafter).
DRAFT_TOKEN_BYTES = 4


def _trace_stats(workload: Workload, max_len: int, max_num_batched_tokens: int, bs: int) -> dict[str, int]:
    """Per tenant: calls, queries, step-log rows (as `Simulator._build` sizes the log) and prefix-hash slots;
    for the run: the token arena's tokens and those of it copied (engine/layout.py `_token_arena`: calls
    outside the loader's one buffer get their prompt + output copied; calls in it share it in place)."""
    calls = [c for q in workload.queries for c in q.calls]
    prompt = np.fromiter((c.prompt_len for c in calls), dtype=np.int64, count=len(calls))
    output = np.fromiter((c.output_len for c in calls), dtype=np.int64, count=len(calls))
    target = np.clip(np.minimum(output, max_len - prompt), 0, None)
    rows = int((target + prompt // max_num_batched_tokens + 2).sum())
    base = calls[0].prompt_tokens.base if calls else None
    base = base if isinstance(base, np.ndarray) else None
    in_place = np.fromiter((base is not None and c.prompt_tokens.base is base for c in calls), dtype=bool,
                           count=len(calls))
    shared = int(base.shape[0]) if base is not None and in_place.any() else 0
    copied = int((prompt + target)[~in_place].sum())
    # Calls extending each other share one region of hashes (one block per bs tokens, one spare each).
    slots = shared // bs + copied // bs + len(calls)
    return {"calls": len(calls), "queries": len(workload.queries), "rows": rows, "hash_slots": slots,
            "arena": shared + copied, "copied": copied}


def run_footprint(workload: Workload, spec: SpeculativeConfig, config: EngineConfig,
                  limits: ResolvedLimits) -> dict[str | None, float]:
    """Bytes a `simulate` run of `workload` with drafter `spec` allocates, by the knob that scales each
    part (None: the trace itself, with replicate 1). See the module docstring."""
    return _footprint(_stats_for(workload, config, limits), spec, config, limits)


def _stats_for(workload: Workload, config: EngineConfig, limits: ResolvedLimits) -> dict[str, int]:
    return _trace_stats(workload, limits.max_model_len, limits.max_num_batched_tokens, config.block_size)


def _footprint(stats: Mapping[str, int], spec: SpeculativeConfig, config: EngineConfig,
               limits: ResolvedLimits) -> dict[str | None, float]:
    bs, seqs, max_len = config.block_size, limits.max_num_seqs, limits.max_model_len
    tenants = config.tenants
    # Steps: the log's rows over the calls that run at once (at most max_num_seqs, at most every query).
    batch = max(1, min(seqs, stats["queries"] * tenants))
    # Data-parallel ranks: each a whole engine with its own copy of the call table, KV cache and drafter (sized by
    # the workload: engine/data_parallel.py); the steps are split between them.
    ranks = config.data_parallel_size
    per_tenant = (ranks * stats["calls"] * (CALL.itemsize + CALL_OBJECT_BYTES)
                  + stats["rows"] * (LOG_ROW.itemsize + STEP_BYTES / batch)
                  + ranks * stats["hash_slots"] * HASH_SLOT_BYTES)
    table, live = (spec.drafter_class or BaseDrafter).bytes_per_token
    drafter = stats["arena"] * (table if tenants == 1 else live * tenants) * ranks
    blocks_per_call = cdiv(max_len, bs) + 1
    slot_table = seqs * 4.0 * blocks_per_call + 8.0 * blocks_per_call
    context_blamed = config.max_model_len is not None and (
        config.max_num_seqs is None or max_len / _TYPICAL_CONTEXT > seqs / _TYPICAL_SEQS)
    terms: dict[str | None, float] = {}

    def add(knob: str | None, n: float) -> None:
        terms[knob] = terms.get(knob, 0.0) + n

    add(None, 4.0 * stats["copied"] * ranks)
    add(_tenant_knob(config) if tenants > 1 else None, per_tenant * tenants + drafter)
    add("num_kv_blocks", limits.num_kv_blocks * KV_BLOCK_BYTES * ranks)
    add("max_model_len" if context_blamed else "max_num_seqs", slot_table * ranks)
    add("max_num_seqs", seqs * SLOT_FIXED_BYTES * ranks)
    add("num_speculative_tokens", seqs * _longest_draft(spec) * DRAFT_TOKEN_BYTES * ranks)
    if ranks > 1:  # every rank a whole engine: the run grows with their number first
        return {"data_parallel_size": sum(terms.values())}
    return terms


def _tenant_knob(config: EngineConfig) -> str:
    """The setting that multiplies the query instances: --copies or --replicate."""
    return "copies" if config.copies_protocol else "replicate"


def _longest_draft(spec: SpeculativeConfig) -> int:
    schedule = spec.num_speculative_tokens_per_batch_size or ()
    return max([spec.num_speculative_tokens, *(k for _, _, k in schedule)])


# A local sweep worker besides its run: the interpreter with numpy, polars and numba loaded (measured: 128
# MiB) and its own copy of the workload (the default trace: 76 MiB, 4 bytes per arena token + ~5.7 KB per call).
WORKER_PROCESS_BYTES = 128 * 2**20
LOADED_CALL_BYTES = 5700


def check_run_memory(workload: Workload, spec: SpeculativeConfig, config: EngineConfig, limits: ResolvedLimits,
                     workers: int = 1, terms: Mapping[str | None, float] | None = None) -> None:
    """Refuse (`ResourceError`, naming the knob, the estimate and what is available) a run whose
    `run_footprint` (or `terms`, that footprint already made) exceeds the memory available; with `workers`
    > 1 (a sweep's parallel cells) that many such runs at once must fit too."""
    stats = _stats_for(workload, config, limits)
    terms = dict(terms) if terms is not None else _footprint(stats, spec, config, limits)
    values = {_tenant_knob(config): config.tenants, "data_parallel_size": config.data_parallel_size,
              "num_kv_blocks": limits.num_kv_blocks,
              "max_num_seqs": limits.max_num_seqs, "max_model_len": limits.max_model_len,
              "num_speculative_tokens": _longest_draft(spec)}
    require_memory(terms, "the run", values=values)
    if workers > 1:
        worker = WORKER_PROCESS_BYTES + 4 * stats["arena"] + LOADED_CALL_BYTES * stats["calls"]
        require_memory({"jobs": (sum(terms.values()) + worker) * workers}, f"running {workers:,} cells at once",
                       values={"jobs": workers})


__all__ = ["check_run_memory", "run_footprint"]
