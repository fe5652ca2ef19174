"""Suffix decoding's prompt-tree drafts for a whole workload, made once: the table the engine reads them
from instead of building every call's prompt tree in every run.

Why a table is exact: a call's prompt tree holds its prompt and then its own output as it is emitted,
so after t output tokens it is the tree of prompt + output[:t] — in every run, whatever the batch and
whatever else is cached — and its draft for the next step is a function of that tree, the context
(the same tokens' last ≤ depth) and the step's limit min(k, max_model_len − (prompt + t) − 1), fixed
by the call and t. Only the global response tree depends on the run: the engine still builds that one
and compares its draft with the table's (drafters/suffix/rule.py, `suffix_tree.OP_TABLE_STEP`). A call
whose tree is not that — restarted (vLLM rebuilds it from the prompt alone), or whose tokens a step
that skipped the proposer never added — builds its own tree, as without the table.

The prompt trees are three quarters of suffix decoding's work on agent traces (their prompts are long
and each call's is indexed: 3.4M prompt tokens against 2.2M output tokens on the default trace), so a
sweep that builds them once instead of once per cell does about a third of the work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from agentspec_sim.drafters.common import table_cache
from agentspec_sim.drafters.common.table_cache import Arrays, PathPool, cached_arrays
from agentspec_sim.drafters.suffix import rule as suffix
from agentspec_sim.drafters.suffix import tree as suffix_tree
from agentspec_sim.drafters.suffix.tree import OP_APPEND, OP_FIELDS, OP_STEP, LocalTable, SuffixForest

FORMAT = 1


def build_local_table(depth: int, k: int, factor: float, min_prob: float, max_model_len: int,
                      prompts: Sequence[np.ndarray],
                      outputs: Sequence[np.ndarray | None]) -> tuple[LocalTable, np.ndarray]:
    """(table, at): call i's prompt-tree draft after t output tokens is the table's at position at[i] + t,
    t < len(outputs[i]) (position 0 and positions with no room to draft hold empty drafts). outputs[i]
    None: the call never runs. A call's tree extends the previous call's when that one's tokens are a
    prefix of its prompt (an agent's next call), else it is built from its prompt."""
    forest = SuffixForest(depth)
    global_root = forest.new_tree()  # empty: the drafts are the prompt tree's alone
    at = np.zeros(len(prompts) + 1, dtype=np.int64)
    scores: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    paths: list[np.ndarray] = []
    pool = PathPool()
    root = seq = -1
    held = np.zeros(0, dtype=np.int32)  # the tokens in the current tree
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        at[i + 1] = at[i]
        if output is None or not output.shape[0]:
            continue
        P, T = prompt.shape[0], output.shape[0]
        have = held.shape[0]
        if root < 0 or have > P or not np.array_equal(prompt[:have], held):
            if root >= 0:
                forest.free_trees([(root, seq)])
            root, seq, have = forest.new_tree(), forest.new_seq(), 0
        # tb = prompt[lo:] + output, enough of the prompt for what is appended and the first contexts
        lo = max(0, min(have, P - depth))
        tb = np.concatenate([prompt[lo:], output]).astype(np.int32, copy=False)
        t = np.arange(1, T, dtype=np.int64)  # draft after t tokens: output[t − 1] is appended first
        ctx = np.minimum(depth, P + t)
        spec = np.minimum(k, max_model_len - (P + t) - 1)
        ops = np.zeros((T + 1, OP_FIELDS), dtype=np.int64)
        ops[0] = (OP_APPEND, root, seq, -1, have - lo, P - have, 0, 0, 0, -1)
        steps = ops[1:T]
        steps[:, 0] = OP_STEP
        steps[:, 1] = root
        steps[:, 2] = seq
        steps[:, 3] = -1
        steps[:, 4] = P - lo + t - 1
        steps[:, 5] = 1
        steps[:, 6] = P - lo + t - ctx
        steps[:, 7] = ctx
        steps[:, 8] = np.maximum(spec, 0)
        steps[:, 9] = np.where(spec > 0, t, -1)
        ops[T] = (OP_APPEND, root, seq, -1, P - lo + T - 1, 1, 0, 0, 0, -1)
        forest.reserve(seq, P - have + T)
        out = np.zeros((T, max(k, 1)), dtype=np.int32)
        out_n = np.zeros(T, dtype=np.int32)
        score = np.zeros(T, dtype=np.float32)
        forest.run(global_root, ops, tb, factor, 0.0, min_prob, out, out_n, score)
        held = np.concatenate([prompt, output])  # (prompt[:have] was the tree's tokens)
        scores.append(score)
        lengths.append(out_n)
        paths.append(pool.add(out, out_n))
        at[i + 1] += T

    def joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

    table = LocalTable(joined(scores, np.float32), joined(lengths, np.int32), joined(paths, np.int64), pool.tokens())
    return table, at


_CODE = (suffix_tree.__file__, suffix.__file__, table_cache.__file__, __file__)


def table_key(options: dict, tokens: np.ndarray | bytes, starts: np.ndarray, prompt_lens: np.ndarray,
              output_lens: np.ndarray) -> str:
    """What the table depends on: the code, the drafter's options and the engine's max_model_len
    (`options`), each call's tokens (tokens[starts[i]:starts[i] + prompt_lens[i] + output_lens[i]];
    output length −1: never runs; `tokens` may be their digest, as bytes)."""
    return table_cache.key_hash("suffix tables", FORMAT, _CODE, options, tokens, starts, prompt_lens,
                                output_lens).hexdigest()


def _valid(arrays: Arrays) -> bool:
    at, score, length, path, pool = (arrays[n] for n in ("at", "score", "length", "path", "pool"))
    positions = int(at[-1]) if at.shape[0] else -1
    return (at.dtype == np.int64 and score.dtype == np.float32 and length.dtype == np.int32
            and path.dtype == np.int64 and pool.dtype == np.int32
            and score.shape == length.shape == path.shape == (positions,))


def cached_local_table(key: str, build: Callable[[], tuple[LocalTable, np.ndarray]]) -> tuple[LocalTable, np.ndarray]:
    """The table under `key` in the disk cache, else `build()`'s, stored (drafters/common/table_cache.py)."""
    def arrays() -> Arrays:
        table, at = build()
        return {"at": at, **table._asdict()}

    got = cached_arrays("suffix-tables", key, arrays, _valid)
    return LocalTable(got["score"], got["length"], got["path"], got["pool"]), got["at"]


__all__ = ["build_local_table", "cached_local_table", "table_key"]
