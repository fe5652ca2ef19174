"""Test helper: the real ArcticInference `SuffixDecodingCache` driven exactly as vLLM 0.33 drives it,
and a replay harness that runs it side by side with our `suffix` drafter.

`VllmSuffixProposer.propose` is `vllm/v1/spec_decode/suffix_decoding.py::SuffixDecodingProposer.propose`
step for step: for each batch row in order — skip rows that sampled nothing (partial prefill) and
rows at max_model_len; start a request that is not active (evicting its cached response first);
`add_active_response(sampled)`; `speculate` on the last ≤ depth tokens with max_spec_tokens =
min(k, max_model_len − len − 1); finally stop every active request absent from the batch.

`engine_replay` runs the engine itself (`Simulator` with `suffix`), records every `propose` it makes
(step, rows, budgets, drafts), and replays the engine's own step log — each step's calls in the rows
of vLLM's persistent batch (`InputBatchRows`, from the log's scheduling order), their sampled tokens
(the recording from `position`, `emitted` long) — into the real cache
through `VllmSuffixProposer`, skipping the steps where vLLM's runner skips the proposer
(`_input_fits_in_drafter`: max over the batch of num_computed + num_scheduled + k > max_model_len).
It checks the engine's driving (one `propose` per step that vLLM runs the proposer in and none
otherwise; budgets min(k, max_model_len − num_tokens − 1); k token-0 drafts after a skipped step;
the draft each call verifies next is the proposal, maybe cut) and compares every proposal.

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

from agentspec_sim.drafters.registry import make_drafter
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.engine.drafting import SpeculativeConfig
from agentspec_sim.engine.request import CallState
from agentspec_sim.trace.schema import Call, Workload


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


class InputBatchRows:
    """The row bookkeeping of vLLM 0.32's persistent batch, ported line for line from
    `GPUModelRunner._update_states` (v1/worker/gpu_model_runner.py) and `InputBatch.add_request /
    remove_request / condense` with `BatchUpdateBuilder`'s removed list (v1/worker/gpu_input_batch.py,
    v1/sample/logits_processor/state.py) — what the engine's compiled `PersistentBatch` must agree with.

    `step(scheduled)`: the step's request ids in scheduling order (running ones, then admissions);
    returns the batch's request ids by row, which is the order the suffix proposer walks."""

    def __init__(self) -> None:
        self.req_ids: list[str | None] = []  # InputBatch._req_ids
        self.req_id_to_index: dict[str, int] = {}
        self.removed: list[int] = []  # BatchUpdateBuilder._removed
        self.requests: set[str] = set()  # GPUModelRunner.requests: every request seen (finished ones popped)

    def step(self, scheduled: Sequence[str]) -> list[str]:
        scheduled_set = set(scheduled)
        # Finished and unscheduled requests leave the batch (the finished ones are not scheduled either).
        for req_id in [r for r in self.req_id_to_index if r not in scheduled_set]:
            self._remove_request(req_id)
        # reqs_to_add: scheduled_new_reqs, then the scheduled_cached_reqs the batch does not hold.
        new = [r for r in scheduled if r not in self.requests]
        cached = [r for r in scheduled if r in self.requests and r not in self.req_id_to_index]
        self.requests.update(new)
        for req_id in new + cached:
            self._add_request(req_id)
        self._condense()
        self.removed = []  # refresh_metadata → get_and_reset
        return list(self.req_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def _remove_request(self, req_id: str) -> None:
        index = self.req_id_to_index.pop(req_id)
        self.removed.append(index)
        self.req_ids[index] = None

    def _add_request(self, req_id: str) -> None:
        if self.removed:  # pop_removed: the lowest removed index
            self.removed.sort(reverse=True)
            index = self.removed.pop()
        else:
            index = self.num_reqs
        if index == len(self.req_ids):
            self.req_ids.append(req_id)
        else:
            self.req_ids[index] = req_id
        self.req_id_to_index[req_id] = index

    def _condense(self) -> None:
        num_reqs = self.num_reqs
        empty = self.removed
        if not empty:
            return
        if num_reqs == 0:
            self.req_ids.clear()
            return
        empty.sort(reverse=True)
        last = num_reqs + len(empty) - 1
        while empty:
            while last in empty:
                last -= 1
            index = empty[-1]  # peek_removed
            if index >= last:
                break
            empty.pop()
            req_id = self.req_ids[last]
            self.req_ids[index] = req_id
            self.req_ids[last] = None
            self.req_id_to_index[req_id] = index
            last -= 1
        del self.req_ids[num_reqs:]


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


# --------------------------------------------------------------------------------------------
# The engine's own run, replayed into the real library


@dataclass
class EngineReplayResult:
    steps: int = 0  # engine steps
    proposer_steps: int = 0  # steps after which vLLM runs the proposer (and our engine called propose)
    skipped_steps: int = 0  # steps where `_input_fits_in_drafter` fails
    zero_drafts: int = 0  # calls handed k token-0 drafts after a skipped step
    compared: int = 0  # proposals compared (rows the engine passed to propose)
    nonempty: int = 0  # of which non-empty
    absent_active: int = 0  # (step, call) pairs where a started, unfinished call was absent from the batch
    preemptions: int = 0
    problems: list[str] = field(default_factory=list)  # driving errors and mismatches (the first few)
    wall_engine_s: float = 0.0
    wall_reference_s: float = 0.0

    def problem(self, text: str, limit: int = 20) -> None:
        if len(self.problems) < limit:
            self.problems.append(text)


def engine_replay(workload: Workload, spec: SpeculativeConfig, config: EngineConfig, cost_model=None,
                  reference: bool = True, progress=None) -> EngineReplayResult:
    """Run the engine with `spec` (a suffix config) recording its proposals, then replay its step log
    into the real library as vLLM drives it and compare (module docstring). One tenant only."""
    from agentspec_sim.engine.config import resolve
    from agentspec_sim.engine.simulator import Simulator
    from agentspec_sim.run.simulation import bind_engine_context

    if config.replicate != 1:
        raise ValueError("engine_replay replays one tenant (replicate=1)")
    if cost_model is None:
        from agentspec_sim.cost import build_cost_model

        cost_model = build_cost_model(hardware=config.hardware, model=config.model,
                                      tensor_parallel_size=config.tensor_parallel_size)
    spec = bind_engine_context(spec, config, workload)
    limits = resolve(config)
    # What is recorded is the drafter's own propose, so the event loop drives it after every step; the
    # engine's compiled driving equals that step for step (tests/test_engine_fast_paths.py
    # ::test_suffix_driven_in_runs_equals_the_event_loops).
    sim = Simulator(workload, spec, config, limits, cost_model, fast_path=False)
    sim.max_run_steps = 1
    drafter = sim.drafters[0]
    inner = drafter.propose
    proposals: dict[int, list[tuple[list[str], list[int], list[list[int]]]]] = {}

    def recording(rows, max_lens):
        out = inner(rows, max_lens)
        proposals.setdefault(sim.step_count, []).append(
            ([r.call_id for r in rows], np.asarray(max_lens).tolist(), [d.tolist() for d in out]))
        return out

    drafter.propose = recording
    res = EngineReplayResult()
    t0 = time.perf_counter()
    run = sim.run()
    res.wall_engine_s = time.perf_counter() - t0
    res.preemptions = run.num_preemptions
    calls = {c.id: c for q in workload.queries for c in q.calls}
    max_len, k = limits.max_model_len, spec.num_speculative_tokens
    ref = reference_from_spec(spec, max_len) if reference else None
    frame = run.steps.select("step", "call_id", "position", "context_len", "scheduled_tokens", "draft", "emitted")
    step_col = frame["step"].to_numpy()
    bounds = np.flatnonzero(np.diff(step_col)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [step_col.shape[0]]])
    ids, pos, ctx, sched, emitted = (frame[c].to_list() if c == "call_id" else frame[c].to_numpy()
                                     for c in ("call_id", "position", "context_len", "scheduled_tokens", "emitted"))
    drafts = frame["draft"].to_list()
    prompts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # call → (prompt, prompt + output), int32
    target = {cid: min(c.output_len, max_len - c.prompt_len) for cid, c in calls.items()}
    started: set[str] = set()
    finished: set[str] = set()
    expect_next: dict[str, tuple[str, list[int]]] = {}  # call → ("zeros" | "prefix", the proposal)
    res.steps = len(starts)
    batch = InputBatchRows()
    t0 = time.perf_counter()
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        step = int(step_col[a])
        # The step log lists a step's calls in scheduling order; the proposer walks the persistent batch.
        at = {ids[i]: i for i in range(a, b)}
        rows = [at[cid] for cid in batch.step([ids[i] for i in range(a, b)])]
        present = {ids[i] for i in rows}
        res.absent_active += len(started - finished - present)
        # What the engine scheduled for each call: the draft it was handed after its previous step.
        for i in rows:
            want = expect_next.pop(ids[i], None)
            if want is None:
                if drafts[i]:
                    res.problem(f"step {step}: {ids[i]} verifies a draft nobody proposed: {drafts[i]}")
                continue
            kind, proposal = want
            got = list(drafts[i])
            if kind == "zeros" and (got != [0] * len(got) or len(got) > k):
                res.problem(f"step {step}: {ids[i]} after a skipped step verifies {got}, not token-0 drafts")
            if kind == "prefix" and got != proposal[:len(got)]:
                res.problem(f"step {step}: {ids[i]} verifies {got}, not a prefix of its proposal {proposal}")
        for i in rows:
            if emitted[i]:
                started.add(ids[i])
                if pos[i] + emitted[i] >= target[ids[i]]:
                    finished.add(ids[i])
        goes_on = {i for i in rows if emitted[i] and pos[i] + emitted[i] < target[ids[i]]}
        fits = int((ctx[a:b] + sched[a:b]).max()) + k <= max_len
        ours = proposals.pop(step, None)
        if not fits:
            res.skipped_steps += 1
            if ours is not None:
                res.problem(f"step {step}: the engine proposed in a step where vLLM skips the proposer")
            for i in sorted(goes_on):
                expect_next[ids[i]] = ("zeros", [])
                res.zero_drafts += 1
            continue
        res.proposer_steps += 1
        if ours is None or len(ours) != 1:
            res.problem(f"step {step}: the engine called propose {0 if ours is None else len(ours)} times, not once")
            continue
        our_ids, our_lens, our_drafts = ours[0]
        mine = dict(zip(our_ids, zip(our_lens, our_drafts, strict=True), strict=True))
        in_rows = [ids[i] for i in rows if ids[i] in mine]
        if our_ids != in_rows:
            res.problem(f"step {step}: the engine drafted {our_ids}, not in batch-row order {in_rows}")
        theirs: list[list[int]] = []
        if ref is not None:
            row_ids, row_prompts, row_tokens, row_sampled = [], [], [], []
            for i in rows:
                c = calls[ids[i]]
                if ids[i] not in prompts:
                    prompts[ids[i]] = (np.ascontiguousarray(c.prompt_tokens, dtype=np.int32),
                                       np.concatenate([c.prompt_tokens, c.output_tokens]).astype(np.int32))
                prompt, whole = prompts[ids[i]]
                e = int(emitted[i])
                done = int(pos[i]) + e
                row_ids.append(ids[i])
                row_prompts.append(prompt)
                row_tokens.append(whole[:c.prompt_len + done])
                row_sampled.append(c.output_tokens[done - e:done].tolist() if e else [])
            theirs = ref.propose(row_ids, row_prompts, row_tokens, row_sampled)
        for j, i in enumerate(rows):
            cid = ids[i]
            if i not in goes_on:
                if cid in mine:
                    res.problem(f"step {step}: the engine proposed for {cid}, which does not go on")
                continue
            num_tokens = calls[cid].prompt_len + int(pos[i]) + int(emitted[i])
            budget = min(k, max_len - num_tokens - 1)
            if cid not in mine:
                if budget > 0:
                    res.problem(f"step {step}: no proposal for {cid} (budget {budget})")
                if ref is not None and theirs[j]:
                    res.problem(f"step {step}: {cid} has budget {budget} here but vLLM drafts {theirs[j]}")
                continue
            length, draft = mine[cid]
            if length != budget:
                res.problem(f"step {step}: {cid} was given budget {length}, vLLM gives {budget}")
            res.compared += 1
            res.nonempty += bool(draft)
            expect_next[cid] = ("prefix", draft)
            if ref is not None and draft != list(theirs[j]):
                res.problem(f"step {step}: {cid} (position {int(pos[i])}): ours {draft} ≠ vLLM {list(theirs[j])}")
        for i in rows:
            if emitted[i] and pos[i] + emitted[i] >= target[ids[i]]:
                prompts.pop(ids[i], None)  # finished: its tokens are not needed again
        if progress is not None:
            progress(step, res.steps)
    res.wall_reference_s = time.perf_counter() - t0
    if proposals:
        res.problem(f"propose was called after steps absent from the log: {sorted(proposals)[:5]}")
    return res
