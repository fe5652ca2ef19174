"""On-disk cache of loaded traces, keyed by the trace's content (and the tokenizer's).

One entry is two files: `<key>.npy` (all token ids of the workload, int32) and `<key>.json`
(everything else, with each call's offsets into the token array). No pickle: a cache file is
data, like a trace. Entries are written atomically; a corrupt or stale entry is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

from agentspec_sim.io.atomic import write_bytes_atomic
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload, WorkspaceFile

FORMAT = 3  # bump when the loader's output for the same input can change (3: strict JSON refuses more)


def cache_root() -> Path:
    """Where agentspec-sim keeps its caches (loaded traces, AgentSpec lookup tables): AGENTSPEC_SIM_CACHE,
    else ~/.cache/agentspec-sim."""
    return Path(os.environ.get("AGENTSPEC_SIM_CACHE", Path.home() / ".cache" / "agentspec-sim"))


def cache_key(data: bytes, skip_bad_lines: bool, base_dir: Path) -> str:
    """Content hash of the trace plus everything else the loaded result depends on."""
    h = hashlib.sha256()
    h.update(f"agentspec-sim trace cache {FORMAT} skip={skip_bad_lines}\n".encode())
    h.update(data)
    # A tokenizer given by path can change under the same trace: hash its identity too.
    first = data.split(b"\n", 1)[0]
    with contextlib.suppress(ValueError, AttributeError):
        tokenizer = json.loads(first).get("tokenizer")
        if isinstance(tokenizer, str):
            p = Path(tokenizer) if Path(tokenizer).is_absolute() else base_dir / tokenizer
            if p.is_dir():
                p = p / "tokenizer.json"
            if p.is_file():
                st = p.stat()
                h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def _base(buffer_holder: np.ndarray) -> np.ndarray:
    return buffer_holder if buffer_holder.base is None else buffer_holder.base  # type: ignore[return-value]


def store(directory: Path, key: str, workload: Workload) -> None:
    """Save `workload` under `key`; failures (read-only home, full disk) are silently skipped."""
    calls = [c for q in workload.queries for c in q.calls]
    if not calls:
        return
    buffer = _base(calls[0].prompt_tokens)
    if not all(_base(c.prompt_tokens) is buffer and _base(c.output_tokens) is buffer for c in calls):
        return  # not laid out by the loader: nothing compact to store
    origin = buffer.__array_interface__["data"][0]
    itemsize = buffer.itemsize

    def offset(view: np.ndarray) -> int:
        return (view.__array_interface__["data"][0] - origin) // itemsize

    meta = {
        "format": FORMAT,
        "meta": workload.meta.to_record(),
        "skipped": list(workload.skipped),
        "queries": [
            [
                {
                    "id": c.id, "agent_id": c.agent_id, "query_id": c.query_id, "seq": c.seq,
                    "p": [offset(c.prompt_tokens), c.prompt_len], "o": [offset(c.output_tokens), c.output_len],
                    "role": c.role, "structure": c.structure, "emission": c.emission,
                    "arrival_s": c.arrival_s, "think_s": c.think_s, "prompt_extends": c.prompt_extends,
                    "extra": c.extra, "workspace": [[f.path, f.content] for f in c.workspace],
                }
                for c in q.calls
            ]
            for q in workload.queries
        ],
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        raw = io.BytesIO()
        np.save(raw, np.ascontiguousarray(buffer, dtype=np.int32), allow_pickle=False)
        write_bytes_atomic(directory / f"{key}.npy", raw.getvalue(), sync=False)
        write_bytes_atomic(directory / f"{key}.json", json.dumps(meta, ensure_ascii=False).encode(), sync=False)
    except OSError:
        return


def load(directory: Path, key: str) -> Workload | None:
    """The cached workload for `key`, or None when absent or unreadable."""
    try:
        meta = json.loads((directory / f"{key}.json").read_bytes())
        buffer = np.load(directory / f"{key}.npy", allow_pickle=False)
        if meta.get("format") != FORMAT or buffer.dtype != np.int32:
            return None
        m = meta["meta"]
        workload_meta = TraceMeta(
            version=m["version"], tokenizer=m.get("tokenizer"), model=m.get("model"),
            workload=m.get("workload"), source=m.get("source"), vocab_size=m.get("vocab_size"),
            extra=m.get("extra"),
        )
        files: dict[tuple[str, str], WorkspaceFile] = {}  # share objects like the loader does
        queries = []
        for q in meta["queries"]:
            calls = []
            for c in q:
                (ps, pl), (os_, ol) = c["p"], c["o"]
                workspace = tuple(files.setdefault((p, t), WorkspaceFile(p, t)) for p, t in c["workspace"])
                calls.append(Call(
                    id=c["id"], agent_id=c["agent_id"], query_id=c["query_id"], seq=c["seq"],
                    prompt_tokens=buffer[ps:ps + pl], output_tokens=buffer[os_:os_ + ol], role=c["role"],
                    structure=tuple(tuple((a, b) for a, b in g) for g in c["structure"]),
                    workspace=workspace, emission=c["emission"], arrival_s=c["arrival_s"],
                    think_s=c["think_s"], prompt_extends=c["prompt_extends"], extra=c["extra"],
                ))
            queries.append(Query(agent_id=calls[0].agent_id, query_id=calls[0].query_id, calls=tuple(calls)))
        return Workload(meta=workload_meta, queries=tuple(queries), skipped=tuple(meta["skipped"]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
