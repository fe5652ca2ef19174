"""τ(b, c): the acceptance probability at which one more draft token pays for its verification.

From the paper's §3.1 terms (`agentspec_sim.cost.base`): accepting a draft token saves t_A(b) =
T(b, 1)/b of batch time and verifying it costs t_V(b) = (T(b, 2) − T(b, 1))/b, where T(b, q) is
one decode step of b calls at context c, each computing q tokens. A token accepted with
probability a is worth drafting when a·t_A ≥ t_V, i.e. a ≥ τ = t_V/t_A = T(b, 2)/T(b, 1) − 1.
Memory-bound steps verify almost for free (τ ≈ 0.001 at b = 1 on an A100 for Qwen3-8B); once the
step's tokens pass the ridge the linear layers are compute-bound and τ rises (0.29 at b = 256,
c = 1k); long contexts lower it again (the attention's KV reads are paid per call, not per token:
0.06 at b = 256, c = 8k).

A batch-aware drafter reads τ once per step, for the step's drafting calls and their mean context,
so the cost model is priced here, once per run, on a grid: every batch size up to 32, then steps of
about 1/16 of the size; contexts at every half octave from 128 to 512k tokens. `break_even_at`
interpolates (linear in b, in log₂ c) and clamps at the grid's edges; it is compiled, so an engine
step pays a few multiplications for it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from agentspec_sim.cost.base import StepCostModel, step_times

MIN_LOG2_CONTEXT, MAX_LOG2_CONTEXT, CONTEXT_STEPS_PER_OCTAVE = 7.0, 19.0, 2
DENSE_BATCHES = 32  # every batch size up to this one is on the grid; above, steps of ~1/16 of the size
_GRIDS: dict[tuple[int, int], tuple[StepCostModel, np.ndarray]] = {}  # (id(cost), max batch) → grid


def batch_grid(max_batch: int) -> np.ndarray:
    """The batch sizes τ is priced at: 1 … 32, then steps of b // 16, up to the first ≥ max_batch. The
    ladder does not depend on max_batch (a larger one only extends it), so two grids of one cost model
    give the same τ wherever both reach."""
    sizes = list(range(1, DENSE_BATCHES + 1))
    b = sizes[-1]
    while b < max_batch:
        b += b // 16
        sizes.append(b)
    return np.asarray(sizes, dtype=np.int64)


def break_even_grid(cost: StepCostModel, max_batch: int) -> np.ndarray:
    """float64 [1 + B, 1 + C]: row 0 from column 1 holds log₂ of the grid's contexts, column 0 from
    row 1 its batch sizes, and cell [1 + i, 1 + j] τ at (batch i, context j). Memoised per cost model
    (a model is immutable) and max_batch: a sweep's cells price it once."""
    key = (id(cost), int(max_batch))
    known = _GRIDS.get(key)
    if known is not None and known[0] is cost:
        return known[1]
    batches = batch_grid(max(1, int(max_batch)))
    count = int((MAX_LOG2_CONTEXT - MIN_LOG2_CONTEXT) * CONTEXT_STEPS_PER_OCTAVE) + 1
    log2_ctx = np.linspace(MIN_LOG2_CONTEXT, MAX_LOG2_CONTEXT, count)
    contexts = np.round(np.exp2(log2_ctx)).astype(np.int64)
    # One batched pricing: for each (b, c) a plain decode step and the same step verifying one more token.
    sizes = np.repeat(np.tile(batches, contexts.shape[0]), 2)
    ctx = np.repeat(np.repeat(contexts, batches.shape[0]), 2)
    query = np.tile(np.array([1, 2], dtype=np.int64), batches.shape[0] * contexts.shape[0])
    rows_q, rows_c = np.repeat(query, sizes), np.repeat(ctx, sizes)
    offsets = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    t = step_times(cost, rows_q, rows_c, np.zeros(rows_q.shape[0], dtype=bool), offsets).reshape(-1, 2)
    tau = np.maximum(t[:, 1] / t[:, 0] - 1.0, 0.0).reshape(contexts.shape[0], batches.shape[0]).T
    grid = np.zeros((1 + batches.shape[0], 1 + contexts.shape[0]))
    grid[0, 1:] = log2_ctx
    grid[1:, 0] = batches
    grid[1:, 1:] = tau
    grid.setflags(write=False)
    if len(_GRIDS) >= 16:
        _GRIDS.clear()
    _GRIDS[key] = (cost, grid)
    return grid


@njit(cache=True, nogil=True)
def break_even_at(grid, batch, context):
    """τ at `batch` drafting calls of mean context `context` (tokens), from `break_even_grid`."""
    nb = grid.shape[0] - 1
    nc = grid.shape[1] - 1
    # batch: the last grid size ≤ batch, then linear to the next
    lo, hi = 1, nb
    if batch <= grid[1, 0]:
        i, wb = 1, 0.0
    elif batch >= grid[nb, 0]:
        i, wb = nb, 0.0
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if grid[mid, 0] <= batch:
                lo = mid
            else:
                hi = mid
        i = lo
        wb = (batch - grid[i, 0]) / (grid[i + 1, 0] - grid[i, 0])
    x = math.log2(max(context, 1.0))
    x0, step = grid[0, 1], grid[0, 2] - grid[0, 1] if nc > 1 else 1.0
    f = (x - x0) / step
    if f <= 0.0:
        j, wc = 1, 0.0
    elif f >= nc - 1:
        j, wc = nc, 0.0
    else:
        j = 1 + int(f)
        wc = f - (j - 1)
    i1 = i + 1 if wb > 0.0 else i
    j1 = j + 1 if wc > 0.0 else j
    top = grid[i, j] * (1.0 - wc) + grid[i, j1] * wc
    bottom = grid[i1, j] * (1.0 - wc) + grid[i1, j1] * wc
    return top * (1.0 - wb) + bottom * wb


def break_even(cost: StepCostModel, batch: int, context: float, max_batch: int | None = None) -> float:
    """τ(batch, context) from the memoised grid of `cost` (Python callers: tools and tests)."""
    grid = break_even_grid(cost, max_batch or max(batch, 1))
    return float(break_even_at(grid, float(batch), float(context)))


__all__ = ["batch_grid", "break_even", "break_even_at", "break_even_grid"]
