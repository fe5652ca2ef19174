"""vLLM's persistent-batch row order (engine/scheduler.py `PersistentBatch`), which the suffix proposer walks.

A hand-worked sequence of steps pins the rule; random schedules (and the engine's scheduler with
preemptions and a token budget that leaves calls out) are checked against a line-for-line port of
vLLM 0.32's `InputBatch` bookkeeping (tests/suffix_reference.py `InputBatchRows`); a suffix run shows a
draft that depends on the order.
"""

from __future__ import annotations

import numpy as np
from simhelpers import ConstantCost, call, config, workload
from suffix_reference import InputBatchRows

from agentspec_sim.drafters.registry import parse_drafter
from agentspec_sim.engine.config import resolve
from agentspec_sim.engine.kv import KVCacheManager
from agentspec_sim.engine.request import CallState
from agentspec_sim.engine.scheduler import PersistentBatch, Scheduler, persistent_batch_update_from_python
from agentspec_sim.engine.simulator import Simulator

NAMES = "abcdef"


def _rows(pb: PersistentBatch, scheduled: str) -> tuple[str, list[int]]:
    """One step that scheduled `scheduled` (call names, scheduling order): the batch's rows and pb.order."""
    calls = np.array([NAMES.index(x) for x in scheduled], dtype=np.int64)
    persistent_batch_update_from_python(pb, calls)
    order = pb.order[:len(scheduled)].tolist()
    return "".join(scheduled[i] for i in order), order


def test_a_hand_worked_sequence_of_steps():
    pb = PersistentBatch.make(4, len(NAMES))
    port = InputBatchRows()
    steps = [
        # (scheduled, in scheduling order: running ones, then admissions;  the rows vLLM gives them)
        ("abc", "abc"),    # three new requests: rows 0, 1, 2
        ("abcd", "abcd"),  # d is new: appended
        ("ac", "ac"),      # b finished (row 1 a hole), the token budget left d out (row 3): c moves into row 1
        ("acde", "aced"),  # e is new, d comes back (cached): new requests first, so e takes row 2, d row 3
        ("acd", "acd"),    # e preempted (the last running): its row 2 is a hole, d moves into it
        ("cdef", "fcde"),  # a finished (row 0); e resumed and f new, admitted in waiting order e, f: f first
        ("", ""),          # every running call preempted itself: an empty schedule empties the batch
        ("cd", "cd"),      # they come back, in scheduling order
    ]
    for scheduled, rows in steps:
        got, order = _rows(pb, scheduled)
        assert got == rows, (scheduled, got)
        assert order == [scheduled.index(x) for x in rows]
        assert "".join(port.step(list(scheduled))) == rows
    # Row order differs from scheduling order at steps 4 and 6: pb.order says where each row's call is.
    pb = PersistentBatch.make(4, len(NAMES))
    for scheduled, _ in steps[:3]:
        _rows(pb, scheduled)
    assert _rows(pb, "acde") == ("aced", [0, 1, 3, 2])


def test_random_schedules_agree_with_vllms_input_batch():
    rng = np.random.default_rng(0)
    for trial in range(200):
        seqs, ncalls = int(rng.integers(1, 9)), int(rng.integers(1, 30))
        pb = PersistentBatch.make(seqs, ncalls)
        port = InputBatchRows()
        finished: set[int] = set()
        for _ in range(40):
            alive = [r for r in range(ncalls) if r not in finished]
            n = int(rng.integers(0, min(seqs, len(alive)) + 1))
            scheduled = [int(x) for x in rng.permutation(alive)[:n]]
            if rng.random() < 0.2 and scheduled:
                finished.add(scheduled[0])  # finishes in this step: never scheduled again
            persistent_batch_update_from_python(pb, np.array(scheduled, dtype=np.int64))
            ours = [scheduled[i] for i in pb.order[:n].tolist()]
            assert ours == [int(x) for x in port.step([str(r) for r in scheduled])], trial


def test_the_schedulers_batch_order_through_preemptions_and_a_short_budget():
    kv = KVCacheManager(24, 4, 4096)
    s = Scheduler(kv, 4, 64, 4096)
    s.track_batch_rows()
    rng = np.random.default_rng(3)
    port = InputBatchRows()
    reqs = []
    for i in range(12):
        prompt, output = range(100 * i, 100 * i + int(rng.integers(4, 20))), range(int(rng.integers(5, 40)))
        c = call(f"c{i}", list(prompt), list(output), query=f"q{i}")
        reqs.append(CallState(i, c, c.id, 0, i, c.output_len))
    arrivals = dict(zip(sorted(rng.choice(60, 8, replace=False).tolist()), reqs[4:], strict=True))
    for r in reqs[:4]:
        s.add_request(r)
    reordered = 0
    for step in range(400):
        if step in arrivals:
            s.add_request(arrivals.pop(step))
        if not s.has_work() and not arrivals:
            break
        s.max_num_batched_tokens = int(rng.choice([3, 64, 64]))  # a short budget leaves calls out
        batch = s.schedule()
        ids = [r.call_id for r in batch.rows]
        ours = [ids[i] for i in s.batch_order(len(ids)).tolist()]
        assert ours == port.step(ids), step
        reordered += ours != ids
        s.update_from_output(batch, step)
    assert s.num_preemptions > 0 and reordered > 0
    assert all(r.num_emitted == r.target_len for r in reqs)


def _suffix_run(event_loop: bool, track: bool, monkeypatch) -> dict[tuple[str, int], list[int]]:
    """The draft each call verifies at each of its output positions, in a suffix run where a call admitted
    into a finished call's row is walked before a running call that the schedule lists first."""
    b_out = list(range(100, 120))
    wl = workload([call("a", [1, 2, 3, 4], [11, 12, 13], query="A")],
                  [call("b", [5, 6, 7, 8], b_out, query="B")],
                  [call("d", [21, 22, 23, 24], [102, 103, 300, 301], query="D")])
    cfg = config(max_num_seqs=2, arrival="zero", check_invariants=False)
    if not track:
        monkeypatch.setattr(Scheduler, "track_batch_rows", lambda self: None)
    sim = Simulator(wl, parse_drafter({"method": "suffix", "num_speculative_tokens": 4}), cfg, resolve(cfg),
                    ConstantCost(), fast_path=not event_loop)
    if event_loop:
        sim.max_run_steps = 1
    steps = sim.run().steps
    return {(cid, p): list(d) for cid, p, d in zip(steps["call_id"], steps["position"], steps["draft"], strict=True)}


def test_a_suffix_draft_follows_the_persistent_batch_order(monkeypatch):
    # Steps 1-3: a and b (rows 0, 1) emit a token each; a's third ends it. Step 4: b emits 103 and d, admitted
    # into a's row 0, its first token 102 — d's row comes first. vLLM adds d's 102 and speculates before b adds
    # 103: the global tree's "102" (b's and d's) has no continuation yet, so d drafts nothing. Walked in
    # scheduling order (b, then d), d would have seen b's "102 103" and drafted [103].
    for event_loop in (False, True):
        drafts = _suffix_run(event_loop, track=True, monkeypatch=monkeypatch)
        assert drafts[("d", 1)] == [], event_loop
    with monkeypatch.context() as m:
        assert _suffix_run(False, track=False, monkeypatch=m)[("d", 1)] == [103]
