"""Batch-aware AgentSpec drafting (docs/agentspec.md §3): the break-even τ(b, c) from the cost model, the
depth it allows, short matches inside the budget only, the paper-rule switches, the Figure-5 verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from agentspec_sim.analysis.repetition import isolation_premise
from agentspec_sim.cost import build_cost_model
from agentspec_sim.cost.base import BatchShape
from agentspec_sim.cost.break_even import batch_grid, break_even, break_even_at, break_even_grid
from agentspec_sim.drafters.agentspec.allocation import break_even_depth, capped_lengths
from agentspec_sim.drafters.agentspec.block_index import META_FIELDS
from agentspec_sim.drafters.registry import make_drafter, parse_drafter
from agentspec_sim.engine.drafting import SpecConfigError

COST = build_cost_model("a100-80g", "qwen3-8b")


def _tau(cost, b, ctx):
    one = cost.step_time(BatchShape.decode(b, ctx)).total_s
    return cost.step_time(BatchShape.decode(b, ctx, 2)).total_s / one - 1.0


def test_break_even_is_t_v_over_t_a_on_the_grid_and_between():
    grid = break_even_grid(COST, 256)
    for b, ctx in ((1, 128), (16, 1024), (40, 2048), (245, 8192), (163, 512)):  # grid points: exact
        assert b in batch_grid(256)
        assert break_even(COST, b, ctx, 256) == pytest.approx(_tau(COST, b, ctx), rel=1e-9)
        # the cost model's own t_V / t_A, as the paper's §3.1 defines them
        ratio = COST.per_token_verify_time(b, ctx) / COST.per_token_decode_time(b, ctx)
        assert break_even(COST, b, ctx, 256) == pytest.approx(ratio, rel=1e-9)
    # between grid points: interpolated, within the neighbours and close to the exact value
    for b, ctx in ((150, 3000), (256, 8192), (50, 700)):
        assert break_even_at(grid, float(b), float(ctx)) == pytest.approx(_tau(COST, b, ctx), rel=0.03)
    # verification is nearly free at b = 1 and not at b = 256 (the A100's ridge is ~190 tokens)
    assert break_even(COST, 1, 1024) < 0.002 < 0.25 < break_even(COST, 256, 1024)
    # long contexts make attention's per-call reads dominate: τ falls
    assert break_even(COST, 256, 16384) < break_even(COST, 256, 1024)


def test_the_batch_ladder_is_prefix_stable():
    small, large = batch_grid(256), batch_grid(1024)
    assert np.array_equal(large[:small.shape[0]], small) and small[-1] >= 256 and large[-1] >= 1024
    assert list(small[:32]) == list(range(1, 33))
    a, b = break_even_grid(COST, 256), break_even_grid(COST, 1024)
    for batch, ctx in ((7, 700), (100, 5000), (250, 100_000)):
        assert break_even_at(a, batch, ctx) == break_even_at(b, batch, ctx)


def test_break_even_depth_hand_cases():
    assert break_even_depth(0.5, 0.1, 32) == 3  # 0.5³ = 0.125 ≥ 0.1 > 0.5⁴
    assert break_even_depth(0.5, 0.125, 32) == 3  # exactly at break-even: still drafted
    assert break_even_depth(0.9, 0.3, 32) == math.floor(math.log(0.3) / math.log(0.9))  # 11
    assert break_even_depth(1.0, 0.3, 32) == 32 and break_even_depth(0.7, -1.0, 32) == 32
    assert break_even_depth(0.0, 0.1, 32) == 0 and break_even_depth(0.6, 1.0, 32) == 0
    assert break_even_depth(0.99, 1e-6, 16) == 16  # capped by k


def _lengths(rows, budget, tau, ct_min=3, single_ct_only=False, k=32, max_len=32):
    meta = np.zeros((len(rows), META_FIELDS), dtype=np.int64)
    meta[:] = rows  # n, c, |CT*|, |P|, match length
    out = np.zeros(len(rows), dtype=np.int64)
    capped_lengths(meta, np.full(len(rows), max_len, dtype=np.int64), budget, 0.5, k, True, ct_min,
                   single_ct_only, tau, out, np.zeros((2, len(rows))), np.zeros((4, len(rows)), dtype=np.int64))
    return out.tolist()


def test_short_matches_draft_only_inside_the_budget():
    strong, short = (4, 4, 10, 20, 5), (4, 4, 10, 20, 2)  # the same candidates after a 5- and a 2-token match
    # no budget (a batch past the ridge): CT* only after a match of ≥ ct_min tokens
    assert _lengths([strong, short], budget=0, tau=-1.0) == [10, 0]
    # a budget: the short match drafts its share, its g at the saturation floor g_min = 0.5 against the
    # strong row's 0.975: 24 · 0.5 / 1.475 ≈ 8
    assert _lengths([strong, short], budget=24, tau=-1.0) == [16, 8]
    # batch-aware: a loose step (τ ≤ g_min³ = 0.125) lets the weak row draft to its break-even depth
    # ⌊ln 0.1 / ln 0.5⌋ = 3; a strict one gives it no candidates, and its share goes to the strong row
    assert _lengths([strong, short], budget=24, tau=0.1) == [16, 3]
    assert _lengths([strong, short], budget=24, tau=0.2) == [20, 0]  # 24, capped by |P| = 20
    assert _lengths([strong, short], budget=24, tau=-1.0, ct_min=1) == [12, 12]
    assert _lengths([strong, short], budget=0, tau=-1.0, ct_min=1) == [10, 10]


def test_the_break_even_depth_bounds_every_row():
    # g = (c/n)·p(n): n = c = 4 → p(4) = 0.5 + 0.5(1 − e⁻³) ≈ 0.975; at τ = 0.3 depth ⌊ln 0.3 / ln g⌋ = 47 → k
    # n = 3, c = 2: g = 2/3·p(3) ≈ 0.621 → depth ⌊ln 0.3 / ln 0.621⌋ = 2
    rows = [(4, 4, 10, 20, 5), (3, 2, 6, 20, 5), (1, 1, 0, 20, 5)]
    assert _lengths(rows, budget=0, tau=0.3) == [10, 2, 0]
    # with a budget the one-candidate row (g = g_min = 0.5) gets its share, cut at ⌊ln τ / ln 0.5⌋
    free = _lengths(rows, budget=60, tau=0.001)
    assert free[2] == 9 and free[0] >= 10  # 0.5⁹ ≈ 0.002 ≥ 0.001 > 0.5¹⁰
    assert _lengths(rows, budget=60, tau=0.3)[2] == 1
    # single_candidate "ct_only": a one-candidate row drafts only its CT* (empty: one candidate is no consensus)
    assert _lengths(rows, budget=60, tau=0.001, single_ct_only=True)[2] == 0


def test_agentspec_needs_the_engine_cost_model_and_says_so():
    drafter = make_drafter(parse_drafter("agentspec"))
    with pytest.raises(SpecConfigError, match="cost model"):
        drafter.break_even_grid()
    drafter.bind_cost_model(COST)
    assert drafter.step_break_even(16, 1024) == pytest.approx(_tau(COST, 16, 1024), rel=1e-9)
    paper = make_drafter(parse_drafter("agentspec-paper"))
    assert paper.step_break_even(16, 1024) == -1.0 and paper.break_even_grid().shape == (1, 1)


def test_isolation_premise_verdicts():
    def profile(same, other_block, other_query):
        return {"by_k": {4: {"same_block": same, "same_query_other_block": other_block, "other_query": other_query,
                             "total": same + other_block + other_query}, 8: {}}}

    assert isolation_premise(profile(0.54, 0.03, 0.20))["verdict"] == "holds"
    assert isolation_premise(profile(0.35, 0.04, 0.14))["verdict"] == "partly"
    got = isolation_premise(profile(0.225, 0.012, 0.49))
    assert got["verdict"] == "fails" and got["k"] == 4 and got["elsewhere"] == pytest.approx(0.502)


def test_inspect_json_gives_the_premise(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agentspec_sim.cli", "inspect", "traces/deep-research.jsonl.zst",
                          "--json"], capture_output=True, text=True, check=True)
    premise = json.loads(out.stdout)["isolation_premise"]
    assert premise["verdict"] == "holds" and premise["k"] == 4 and premise["same_block"] > 0.3
