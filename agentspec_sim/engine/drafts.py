"""How drafts reach the engine: set in a call's draft slot and verified against the recording at once.

The compiled helpers every drafter's fast path uses (engine/drafting.py) to hand its drafts over, and
the per-run draft limits they share (`DraftSlots`): the engine decides how many tokens each call may
draft (the budget policy's length by batch size, vLLM's max_model_len clip, the V1 runner's proposer
skip); a drafter decides which tokens. Verification is decided when the drafts are set (`verify`), so
the scheduler's update only applies it (engine/scheduler.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from agentspec_sim.engine.counters import DS_K_MAX, DS_SKIP_UNFIT, SC_ROWS, SC_SAMPLED, SC_TOP
from agentspec_sim.engine.kv import internal_kernel, kernel


@kernel
def verify(drafts, output, position, target_len):
    """(accepted, emitted) for a greedy verification of `drafts` at `position` of the recorded output.

    accepted = the longest prefix of the drafts equal to the recording from `position`; drafts
    past the end of the call's output (`target_len`) can never be accepted. emitted = accepted + 1
    (the target's own next token: the bonus when every draft matched), except when the accepted
    drafts already end the output.
    """
    remaining = target_len - position
    m = min(drafts.shape[0], remaining)
    accepted = 0
    while accepted < m and drafts[accepted] == output[position + accepted]:
        accepted += 1
    return accepted, min(accepted + 1, remaining)


@internal_kernel
def set_verified(c, r, slot, n):
    """Call r's next drafts are slot_drafts[slot, :n]: record them and how many the recording accepts."""
    accepted = 0
    if n:
        out = c.calls.hist_off[r] + c.calls.prompt_len[r]
        accepted, _ = verify(c.slot_drafts[slot, :n], c.tokens[out:out + c.calls.target_len[r]],
                             c.calls.num_emitted[r], c.calls.target_len[r])
    c.calls.draft_len[r] = n
    c.calls.draft_acc[r] = accepted


@kernel
def drafts_from(c, rows, source, starts, lengths):
    """Set the drafts of calls rows[i] to source[starts[i]:starts[i] + lengths[i]] (the token arena, where
    the n-gram proposer's drafts lie, or the proposals laid end to end) and verify them against the
    recording (`Scheduler.set_drafts`)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        n = lengths[i]
        slot = c.calls.slot[r]
        for k in range(n):
            c.slot_drafts[slot, k] = source[starts[i] + k]
        set_verified(c, r, slot, n)


@kernel
def drafts_from_rows(c, buf, source, m):
    """`drafts_from` for the first m columns of `buf` (rows: table rows, draft starts, draft lengths)."""
    drafts_from(c, buf[0, :m], source, buf[1, :m], buf[2, :m])


@internal_kernel
def drafts_from_out(c, rows, out, lengths, m):
    """The drafts of calls rows[j], j < m: out[j, :lengths[j]], verified as `drafts_from`."""
    for j in range(m):
        r = rows[j]
        slot = c.calls.slot[r]
        length = lengths[j]
        for t in range(length):
            c.slot_drafts[slot, t] = out[j, t]
        set_verified(c, r, slot, length)


class DraftSlots(NamedTuple):
    """The draft limits of a run's fast path (fixed for the run) and its work space for one step."""

    par: np.ndarray  # int64: [num_speculative_tokens, V1 proposer skip applies]
    k_of_batch: np.ndarray  # int64 [max_num_seqs + 1]: draft length allowed at that many scheduled calls
    draft_s: np.ndarray  # float64 [max_num_seqs + 1]: model-free drafting seconds for that many drafting calls
    rows: np.ndarray  # int64 [max_num_seqs] work space: drafting calls' table rows,
    starts: np.ndarray  # their history offsets,
    lengths: np.ndarray  # history lengths,
    max_lens: np.ndarray  # draft limits,
    drafts: np.ndarray  # int64 [2, max_num_seqs]: and drafts (start in the arena, length)

    @classmethod
    def make(cls, k_max: int, skips_unfit: bool, k_of_batch: np.ndarray, draft_s: np.ndarray,
             max_num_seqs: int) -> DraftSlots:
        seqs = max(max_num_seqs, 1)
        work = [np.zeros(seqs, dtype=np.int64) for _ in range(4)]
        return cls(np.array([k_max, int(skips_unfit)], dtype=np.int64), k_of_batch.astype(np.int64),
                   draft_s.astype(np.float64), *work, np.zeros((2, seqs), dtype=np.int64))

    @classmethod
    def model_free(cls, run: Any) -> DraftSlots:
        """The limits of a model-free drafter in `run` (a `RunView` with a draft length by batch size): the
        policy's k per batch size, the CPU drafting seconds per number of drafting calls."""
        return cls.make(run.spec.num_speculative_tokens, run.skips_unfit_batches, run.k_of_batch,
                        run.model_free_draft_s(), run.max_num_seqs)


@internal_kernel
def proposer_skipped(sb, ds, max_model_len):
    """vLLM's V1 runner does not run the proposer for the batch in `sb` (`_input_fits_in_drafter` fails:
    some call's num_computed + num_scheduled + k exceeds max_model_len), for drafters that follow it."""
    return ds.par[DS_SKIP_UNFIT] != 0 and sb.sc[SC_ROWS] > 0 and sb.sc[SC_TOP] + ds.par[DS_K_MAX] > max_model_len


@internal_kernel
def batch_k(sb, ds):
    """The draft length the policy allows at the batch size of the step in `sb` (`DraftSlots.k_of_batch`)."""
    return ds.k_of_batch[min(sb.sc[SC_ROWS], ds.k_of_batch.shape[0] - 1)]


@internal_kernel
def zero_drafts(c, sb, ds):
    """k token-0 drafts for every call that sampled in the step in `sb` (the V1 runner's proposer skip:
    its zero-filled draft tensor, which the scheduler clips and verifies as any draft)."""
    k_max = ds.par[DS_K_MAX]
    for j in range(sb.sc[SC_SAMPLED]):
        r = sb.lists.sampled[j]
        slot = c.calls.slot[r]
        for k in range(k_max):
            c.slot_drafts[slot, k] = 0
        set_verified(c, r, slot, k_max)


@internal_kernel
def drafting_calls(c, sb, ds, max_model_len):
    """Lists in `ds`'s work space the calls that sampled in the step in `sb` and may draft (limit ≥ 1: the
    policy's length at this batch size, at most max_model_len − num_tokens as the V1 proposer drafts):
    rows, history offsets, history lengths, limits; returns how many."""
    k = batch_k(sb, ds)
    m = 0
    for j in range(sb.sc[SC_SAMPLED]):
        r = sb.lists.sampled[j]
        length = c.calls.prompt_len[r] + c.calls.num_emitted[r]
        limit = min(k, max_model_len - length)
        if limit > 0:
            ds.rows[m] = r
            ds.starts[m] = c.calls.hist_off[r]
            ds.lengths[m] = length
            ds.max_lens[m] = limit
            m += 1
    return m


@internal_kernel
def sampled_calls(c, sb, ds, max_model_len):
    """`drafting_calls` for a step in which the proposer runs; −1 when the V1 runner skips it (then every
    sampled call has its k token-0 drafts, `zero_drafts`). The start of every model-free fast path's step."""
    if proposer_skipped(sb, ds, max_model_len):
        zero_drafts(c, sb, ds)
        return -1
    return drafting_calls(c, sb, ds, max_model_len)
