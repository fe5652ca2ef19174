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
through a disk cache (`cached_tables`) keyed by the workload's tokens, the drafter's options and
this code.

The one thing that crosses queries is the history's memory bound: past `MAX_LIVE_TOKENS` arena tokens
the drafter drops idle queries' histories, least recently used first, and drafts then depend on which
queries were in flight. The table records the arena tokens each query's history reaches; a run may
use it only while their sum stays within the bound (no run can evict then), else it keeps the live
history (`HistoryTables.exact`).

P is stored once per position as a window of one token pool; where the next position's path continues
the previous one's (a match that goes on), the windows overlap: the default trace's 28.7M path tokens
take 9.0M.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit

from agentspec_sim.drafters import agentspec, block_index, structure
from agentspec_sim.drafters.agentspec import MAX_LIVE_TOKENS, MAX_SCAN, MIN_SUPPORT, History
from agentspec_sim.drafters.block_index import META_P
from agentspec_sim.trace.schema import Call

FORMAT = 1  # bump when the table's layout changes (the code's own bytes are in the key too)
TABLE_FIELDS = 4  # meta columns kept: n, c, |CT*|, |P| (block_index META_N … META_P)


@dataclass(frozen=True)
class HistoryTables:
    """Every engine call's lookups: call i's positions are at[i] … at[i + 1] − 1, one per output token
    (the lookup before it). meta int32 [positions, 4]: n, c, |CT*|, |P|; P = pool[path[j]:path[j] + |P|]."""

    at: np.ndarray  # int64 [calls + 1]
    meta: np.ndarray  # int32 [positions, TABLE_FIELDS]
    path: np.ndarray  # int64 [positions]
    pool: np.ndarray  # int32
    live_tokens: int  # Σ over queries of the arena tokens (SEPs and lead-ins included) its history reaches

    @property
    def exact(self) -> bool:
        """Whether every run drafts exactly what the table says: the histories can never be evicted."""
        return self.live_tokens <= MAX_LIVE_TOKENS

    def arrays(self) -> dict[str, np.ndarray]:
        return {"at": self.at, "meta": self.meta, "path": self.path, "pool": self.pool,
                "live_tokens": np.array([self.live_tokens], dtype=np.int64)}


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
    pool = np.zeros(1 << 16, dtype=np.int32)
    top = 0
    live = 0
    query_live = 0
    for i, call in enumerate(calls):
        output = outputs[i]
        if output is not None and output.shape[0]:
            prompt = prompts[i]
            cursor = history.start(call, prompt)
            out, meta = history.replay(cursor, prompt, output)
            history.finish(cursor, np.concatenate([prompt, output]))
            lengths = meta[:, META_P]
            need = top + int(lengths.sum())
            if need > pool.shape[0]:
                pool = np.concatenate([pool, np.zeros(max(need, 2 * pool.shape[0]) - pool.shape[0], dtype=np.int32)])
            path = np.zeros(output.shape[0], dtype=np.int64)
            top = _pack_paths(out, lengths, pool, top, path)
            metas.append(meta[:, :TABLE_FIELDS].astype(np.int32))
            paths.append(path)
            at[i + 1] = at[i] + output.shape[0]
            query_live = max(query_live, history.arena.live_tokens)
        else:
            at[i + 1] = at[i]
        if last_in_query[i]:
            history.end_query(call.query_id)
            live += query_live
            query_live = 0
    live += query_live
    meta = np.concatenate(metas) if metas else np.zeros((0, TABLE_FIELDS), dtype=np.int32)
    path = np.concatenate(paths) if paths else np.zeros(0, dtype=np.int64)
    return HistoryTables(at, meta, path, pool[:top].copy(), live)


@njit(cache=True, nogil=True)
def _pack_paths(out, lengths, pool, top, path):
    """Lay each position's path out[t, :lengths[t]] into pool from `top`, path[t] = its start: where the
    tokens after the previous position's start agree with it, the window starts one further on and only
    the tokens past the pool's end are added. Returns the new top."""
    prev = -1
    for t in range(out.shape[0]):
        n = lengths[t]
        placed = False
        if n > 0 and prev >= 0:
            start = prev + 1
            m = min(top - start, n)
            placed = True
            for i in range(m):
                if pool[start + i] != out[t, i]:
                    placed = False
                    break
            if placed:
                for i in range(m, n):
                    pool[top] = out[t, i]
                    top += 1
                path[t] = start
                prev = start
        if not placed:
            path[t] = top
            for i in range(n):
                pool[top + i] = out[t, i]
            prev = top if n > 0 else -1
            top += n
    return top


# --------------------------------------------------------------------------------------------
# The disk cache.

_SOURCES = (agentspec.__file__, block_index.__file__, structure.__file__, __file__)


def _code_digest() -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for name in _SOURCES:
        h.update(Path(name).read_bytes())
    return h.digest()


def table_key(history: History, tokens: np.ndarray, starts: np.ndarray, prompt_lens: np.ndarray,
              output_lens: np.ndarray, calls: Sequence[Call]) -> str:
    """What the table of these calls depends on: the code, the history's options (its token→bytes map
    included), each call's tokens (tokens[starts[i]:starts[i] + prompt_lens[i] + output_lens[i]], output
    length −1: never runs), agent, query and structure."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"agentspec-sim history tables {FORMAT}\n".encode())
    h.update(_code_digest())
    h.update(json.dumps(history.options() | {"max_scan": MAX_SCAN, "min_support": MIN_SUPPORT}).encode())
    h.update(history.table_digest())
    for array in (tokens, starts, prompt_lens, output_lens):
        h.update(np.ascontiguousarray(array).tobytes())
        h.update(b"|")
    for call in calls:
        h.update(repr((call.agent_id, call.query_id, call.structure)).encode())
    return h.hexdigest()


def cached_tables(directory: Path | None, key: str, build: callable) -> HistoryTables:  # type: ignore[valid-type]
    """The tables under `key` in `directory`, else `build()`'s, stored there (atomically). Processes that
    ask for the same key at once build it once: the others wait on the key's lock and read it. Without a
    usable directory (None, read-only, full) the tables are built and not kept."""
    if directory is None:
        return build()
    path = directory / "history-tables" / f"{key}.npz"
    hit = _load(path)
    if hit is not None:
        return hit
    with _locked(path.with_suffix(".lock")):
        hit = _load(path)
        if hit is not None:
            return hit
        tables = build()
        with contextlib.suppress(OSError):
            from agentspec_sim.atomic import write_bytes_atomic

            buffer = io.BytesIO()
            np.savez(buffer, **tables.arrays())
            write_bytes_atomic(path, buffer.getvalue())
        return tables


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (a no-op where it cannot be taken)."""
    handle = None
    with contextlib.suppress(OSError, ImportError):
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 (held until the block ends)
        fcntl.flock(handle, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def _load(path: Path) -> HistoryTables | None:
    """The tables stored at `path`, or None (absent, unreadable or malformed: it is rebuilt)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            at, meta, path_at, pool = data["at"], data["meta"], data["path"], data["pool"]
            live = int(data["live_tokens"][0])
    except (OSError, ValueError, KeyError, IndexError, EOFError):
        return None
    positions = int(at[-1]) if at.shape[0] else -1
    ok = (at.dtype == np.int64 and meta.dtype == np.int32 and path_at.dtype == np.int64 and pool.dtype == np.int32
          and meta.shape == (positions, TABLE_FIELDS) and path_at.shape == (positions,))
    return HistoryTables(at, meta, path_at, pool, live) if ok else None


__all__ = ["HistoryTables", "build_tables", "cached_tables", "table_key"]
