"""Test helper: the real ArcticInference `SuffixDecodingCache` driven exactly as vLLM 0.33 drives it,
and a replay harness that runs it side by side with our `suffix` drafter.

`VllmSuffixProposer.propose` is `vllm/v1/spec_decode/suffix_decoding.py::SuffixDecodingProposer.propose`
step for step: for each batch row in order — skip rows that sampled nothing (partial prefill) and
rows at max_model_len; start a request that is not active (evicting its cached response first);
`add_active_response(sampled)`; `speculate` on the last ≤ depth tokens with max_spec_tokens =
min(k, max_model_len − len − 1); finally stop every active request absent from the batch.

`replay` is a small batch scheduler over trace queries (calls of a query in sequence, `concurrency`
queries in flight, optional prefill steps and randomly unscheduled steps). Each step, emitted tokens
are the recorded output verified greedily against the previous draft (accepted prefix + 1). Our
drafter is driven through the engine's hook order (start_call/observe/finish_call for every row
that emitted, in row order, then one `propose` for the rows that go on with budget > 0, also when
there are none); the reference is driven as vLLM does. Proposals are compared at every step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from agentspec_sim.drafters.base import SpeculativeConfig, make_drafter
from agentspec_sim.engine.request import CallState
from agentspec_sim.trace.schema import Call


class VllmSuffixProposer:
    """vLLM 0.33's `SuffixDecodingProposer` over the real ArcticInference cache (needs arctic_inference)."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, max_model_len: int = 1 << 30) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.max_model_len = max_model_len
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.start_s = 0.0  # time spent in start_request (prompt-tree builds)
        self.starts = 0

    def propose(self, req_ids: Sequence[str], prompts: Sequence[np.ndarray], tokens: Sequence[np.ndarray],
                sampled: Sequence[list[int]]) -> list[list[int]]:
        """One step. Row i: request id, prompt (int32), prompt + output so far (int32), tokens sampled this step."""
        cache = self.cache
        drafts: list[list[int]] = []
        for req_id, prompt, toks, sampled_ids in zip(req_ids, prompts, tokens, sampled, strict=True):
            if not sampled_ids:
                drafts.append([])
                continue
            num_tokens = toks.shape[0]
            if num_tokens >= self.max_model_len:
                drafts.append([])
                continue
            if req_id not in cache.active_requests:
                if req_id in cache.cached_requests:
                    cache.evict_cached_response(req_id)
                t0 = time.perf_counter()
                cache.start_request(req_id, prompt)
                self.start_s += time.perf_counter() - t0
                self.starts += 1
            cache.add_active_response(req_id, sampled_ids)
            start = max(0, num_tokens - self.depth)
            draft = cache.speculate(req_id, toks[start:num_tokens],
                                    max_spec_tokens=min(self.k, self.max_model_len - num_tokens - 1),
                                    max_spec_factor=self.factor, min_token_prob=self.min_prob)
            drafts.append(list(draft.token_ids))
        present = set(req_ids)
        for req_id in [r for r in cache.active_requests if r not in present]:
            cache.stop_request(req_id)
        return drafts


def reference_from_spec(spec: SpeculativeConfig, max_model_len: int = 1 << 30) -> VllmSuffixProposer:
    o = dict(spec.options)
    return VllmSuffixProposer(spec.num_speculative_tokens, o["suffix_decoding_max_tree_depth"],
                              o["suffix_decoding_max_cached_requests"], o["suffix_decoding_max_spec_factor"],
                              o["suffix_decoding_min_token_prob"], max_model_len)


@dataclass
class _Run:
    state: CallState
    req_id: str
    prompt: np.ndarray
    output: np.ndarray
    prefill_left: int
    query: int
    position: int
    draft: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    hooked: bool = False  # our drafter's start_call ran


@dataclass
class ReplayResult:
    steps: int = 0  # engine steps
    call_steps: int = 0  # (call, step) pairs where the call emitted tokens
    compared: int = 0  # proposals compared (rows that go on with budget > 0)
    mismatches: list[tuple] = field(default_factory=list)
    calls: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    ours_s: float = 0.0
    ref_s: float = 0.0
    ours_start_step_s: float = 0.0  # our time in steps where some call started (its prompt tree built)
    start_steps: int = 0  # steps where some call started
    ref_start_s: float = 0.0
    starts: int = 0
    restarts: int = 0

    @property
    def mismatch_count(self) -> int:
        return len(self.mismatches)


def replay(queries: Sequence[Sequence[Call]], spec: SpeculativeConfig, *, concurrency: int = 4, seed: int = 0,
           max_model_len: int = 1 << 30, p_skip: float = 0.0, max_prefill_steps: int = 1, max_think_steps: int = 0,
           ours: bool = True, reference: bool = True, max_mismatches: int = 20,
           max_steps: int | None = None) -> ReplayResult:
    """Replay `queries` through our drafter and/or the real library; compare every proposal."""
    rng = np.random.default_rng(seed)
    drafter = make_drafter(spec) if ours else None
    ref = reference_from_spec(spec, max_model_len) if reference else None
    k = spec.num_speculative_tokens
    res = ReplayResult()
    pending = [(qi, 0, 0) for qi in range(len(queries))]  # (query, call position, ready at step)
    pending.reverse()
    waiting: list[tuple[int, int, int]] = []
    running: list[_Run] = []
    next_query = 0
    index = 0
    step = 0
    while True:
        # Admit: keep `concurrency` queries in flight; the next call of a query waits its think steps.
        while next_query < len(queries) and len({r.query for r in running} | {w[0] for w in waiting}) < concurrency:
            waiting.append((next_query, 0, step))
            next_query += 1
        for w in [w for w in waiting if w[2] <= step]:
            waiting.remove(w)
            qi, pos, _ = w
            c = queries[qi][pos]
            target = min(c.output_len, max_model_len - c.prompt_len)
            if target <= 0:  # refused (prompt ≥ max_model_len) or nothing to emit: the rest of the query is skipped
                continue
            state = CallState(index, c, c.id, 0, qi, target)
            index += 1
            run = _Run(state, f"{c.id}#{index}", np.ascontiguousarray(c.prompt_tokens, dtype=np.int32),
                       c.output_tokens[:target], int(rng.integers(1, max_prefill_steps + 1)), qi, pos)
            running.insert(int(rng.integers(0, len(running) + 1)), run)
        if not running and not waiting and next_query >= len(queries):
            break
        if max_steps is not None and step >= max_steps:
            break
        step += 1
        res.steps += 1
        # The batch: running calls in row order, minus those left unscheduled this step.
        batch = [r for r in running if not (r.state.num_emitted and p_skip and rng.random() < p_skip)]
        emitted: list[int] = []
        for r in batch:
            s = r.state
            if r.prefill_left > 1:
                r.prefill_left -= 1
                emitted.append(0)
                continue
            if r.prefill_left == 1:
                r.prefill_left = 0
                e = 1
            else:
                want = r.output[s.num_emitted:s.num_emitted + r.draft.shape[0]]
                acc = 0
                while acc < want.shape[0] and r.draft[acc] == want[acc]:
                    acc += 1
                res.drafted += r.draft.shape[0]
                res.accepted += acc
                e = min(acc + 1, s.target_len - s.num_emitted)
            end = s.prompt_len + s.num_emitted
            s.history[end:end + e] = r.output[s.num_emitted:s.num_emitted + e]
            s.num_emitted += e
            emitted.append(e)
            res.tokens += e
            res.call_steps += 1
        # Our drafter: the engine's hook order, then one propose.
        started_now = False
        go_on: list[int] = []
        lens: list[int] = []
        for i, r in enumerate(batch):
            e = emitted[i]
            if not e:
                continue
            s = r.state
            n = s.num_tokens
            if n < max_model_len and s.num_emitted < s.target_len:
                budget = min(k, max_model_len - n - 1)
                if budget > 0:
                    go_on.append(i)
                    lens.append(budget)
        ours_drafts: list[np.ndarray] = []
        if drafter is not None:
            t0 = time.perf_counter()
            for i, r in enumerate(batch):
                e = emitted[i]
                if not e:
                    continue
                s = r.state
                if s.num_tokens < max_model_len:  # vLLM adds nothing for a row at max_model_len
                    if not r.hooked:
                        r.hooked = started_now = True
                        drafter.start_call(s)
                    end = s.num_tokens
                    drafter.observe(s, s.history[end - e:end])
                if r.hooked and s.num_emitted >= s.target_len:
                    drafter.finish_call(s)
            ours_drafts = drafter.propose([batch[i].state for i in go_on], np.asarray(lens, dtype=np.int64))
            dt = time.perf_counter() - t0
            res.ours_s += dt
            if started_now:
                res.ours_start_step_s += dt
                res.start_steps += 1
        ref_drafts: list[list[int]] = []
        if ref is not None:
            # vLLM's inputs: request ids, prompts, token rows (prompt + output) and sampled-token lists.
            args = ([r.req_id for r in batch], [r.prompt for r in batch], [r.state.tokens for r in batch],
                    [r.output[r.state.num_emitted - e:r.state.num_emitted].tolist() if e else []
                     for r, e in zip(batch, emitted, strict=True)])
            t0 = time.perf_counter()
            ref_drafts = ref.propose(*args)
            res.ref_s += time.perf_counter() - t0
        # Compare and set the drafts verified next step.
        for j, i in enumerate(go_on):
            r = batch[i]
            mine = ours_drafts[j] if drafter is not None else None
            theirs = np.asarray(ref_drafts[i], dtype=np.int32) if ref is not None else None
            if mine is not None and theirs is not None:
                res.compared += 1
                if not np.array_equal(mine, theirs) and len(res.mismatches) < max_mismatches:
                    res.mismatches.append((step, r.req_id, r.state.num_emitted, mine.tolist(), theirs.tolist()))
            r.draft = theirs if theirs is not None else mine
        for i, r in enumerate(batch):
            if i not in go_on:
                r.draft = np.zeros(0, dtype=np.int32)
        # Finished calls leave; their query's next call waits its think steps.
        for r in [r for r in running if r.state.num_emitted and r.state.num_emitted >= r.state.target_len]:
            running.remove(r)
            res.calls += 1
            if r.position + 1 < len(queries[r.query]):
                waiting.append((r.query, r.position + 1, step + 1 + int(rng.integers(0, max_think_steps + 1))))
    if ref is not None:
        res.ref_start_s = ref.start_s
        res.starts = ref.starts
    return res
