"""AgentSpec's lookups for a whole workload, made once: the table the engine drafts from instead of a
live `History`.

Why a table is exact: the lookup an AgentSpec call makes before its output token t reads only the
history of its (agent, query) — the query's earlier calls and the call's own first t tokens — and a
query's calls run one after another (the engine admits a query's next call only when the previous one
has finished). So its answer — n, c, |CT*| and the plurality path P — at (call, t) is the same whatever
the batch size, the schedule or the preemptions; only the draft length (the step's budget over its
batch, the per-call caps) depends on the run. `build_tables` replays every query once
(`History.replay`: a lookup before every output token, then the token) and keeps the four numbers
and P of every position; the engine allocates the budget and verifies as before
(engine/scheduler.py `propose_table_rows`). The cells of a sweep and repeated runs share one table
through the disk cache (drafters/common/table_cache.py) keyed by the workload's tokens, the drafter's
options and this code.

Nothing crosses queries: AgentSpec keeps every running query's history until the query ends (the
paper's space O(H), appendix A.4). The live history's memory bound (`MAX_LIVE_TOKENS`) is the
simulator's own and no part of these semantics; where a live run passes it, it says so
(drafters/agentspec/rule.py `History.evict`). A table holds no histories, so it needs no bound.

P is stored once per position as a window of one token pool (`table_cache.pack_paths`): the default
trace's 28.7M path tokens take 9.0M.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from agentspec_sim.drafters.agentspec import block_index
from agentspec_sim.drafters.agentspec import rule as agentspec
from agentspec_sim.drafters.agentspec.block_index import META_P
from agentspec_sim.drafters.agentspec.history import MAX_SCAN, MIN_SUPPORT, History
from agentspec_sim.drafters.common import structure, table_cache
from agentspec_sim.drafters.common.table_cache import Arrays, PathPool, cached_arrays
from agentspec_sim.trace.schema import Call

FORMAT = 3  # bump when the table's layout changes (the code's own bytes are in the key too)
TABLE_FIELDS = 5  # meta columns kept: n, c, |CT*|, |P|, match length (block_index META_N … META_MATCH)


@dataclass(frozen=True)
class HistoryTables:
    """Every engine call's lookups: call i's positions are at[i] … at[i + 1] − 1, one per output token
    (the lookup before it). meta int32 [positions, 5]: n, c, |CT*|, |P|, match length;
    P = pool[path[j]:path[j] + |P|]."""

    at: np.ndarray  # int64 [calls + 1]
    meta: np.ndarray  # int32 [positions, TABLE_FIELDS]
    path: np.ndarray  # int64 [positions]
    pool: np.ndarray  # int32

    def arrays(self) -> Arrays:
        return {"at": self.at, "meta": self.meta, "path": self.path, "pool": self.pool}

    @classmethod
    def from_arrays(cls, arrays: Arrays) -> HistoryTables:
        return cls(arrays["at"], arrays["meta"], arrays["path"], arrays["pool"])

    @staticmethod
    def valid(arrays: Arrays) -> bool:
        at, meta, path, pool = arrays["at"], arrays["meta"], arrays["path"], arrays["pool"]
        positions = int(at[-1]) if at.shape[0] else -1
        return (at.dtype == np.int64 and meta.dtype == np.int32 and path.dtype == np.int64 and pool.dtype == np.int32
                and meta.shape == (positions, TABLE_FIELDS) and path.shape == (positions,))


def build_tables(history: History, calls: Sequence[Call], prompts: Sequence[np.ndarray],
                 outputs: Sequence[np.ndarray | None], last_in_query: Sequence[bool]) -> HistoryTables:
    """Replay `calls` (engine order: each query's calls in order) through `history` (empty, the drafter's
    options): call i has prompt `prompts[i]` and emits `outputs[i]` (None: it never runs — refused — and
    has no positions); `last_in_query[i]`: its query's histories are dropped after it, as the drafter
    drops them when that call finishes."""
    n = len(calls)
    at = np.zeros(n + 1, dtype=np.int64)
    metas: list[np.ndarray] = []
    paths: list[np.ndarray] = []
    pool = PathPool()
    for i, call in enumerate(calls):
        output = outputs[i]
        at[i + 1] = at[i]
        if output is not None and output.shape[0]:
            prompt = prompts[i]
            cursor = history.start(call, prompt)
            out, meta = history.replay(cursor, prompt, output)
            history.finish(cursor, np.concatenate([prompt, output]))
            paths.append(pool.add(out, meta[:, META_P]))
            metas.append(meta[:, :TABLE_FIELDS].astype(np.int32))
            at[i + 1] += output.shape[0]
        if last_in_query[i]:
            history.end_query(call.query_id)
    meta = np.concatenate(metas) if metas else np.zeros((0, TABLE_FIELDS), dtype=np.int32)
    path = np.concatenate(paths) if paths else np.zeros(0, dtype=np.int64)
    return HistoryTables(at, meta, path, pool.tokens())


_CODE = (agentspec.__file__, block_index.__file__, structure.__file__, table_cache.__file__, __file__)


def table_key(history: History, tokens: np.ndarray | bytes, starts: np.ndarray, prompt_lens: np.ndarray,
              output_lens: np.ndarray, calls: Sequence[Call]) -> str:
    """What the table of these calls depends on: the code, the history's options (its token→bytes map
    included), each call's tokens (tokens[starts[i]:starts[i] + prompt_lens[i] + output_lens[i]], output
    length −1: never runs), agent, query and structure."""
    h = table_cache.key_hash("history tables", FORMAT, _CODE,
                             history.options() | {"max_scan": MAX_SCAN, "min_support": MIN_SUPPORT},
                             tokens, starts, prompt_lens, output_lens)
    h.update(history.table_digest())
    for call in calls:
        h.update(repr((call.agent_id, call.query_id, call.structure)).encode())
    return h.hexdigest()


def cached_tables(key: str, build: Callable[[], HistoryTables]) -> HistoryTables:
    """The tables under `key` in the disk cache, else `build()`'s, stored (drafters/common/table_cache.py)."""
    arrays = cached_arrays("history-tables", key, lambda: build().arrays(), HistoryTables.valid)
    return HistoryTables.from_arrays(arrays)


__all__ = ["HistoryTables", "build_tables", "cached_tables", "table_key"]
