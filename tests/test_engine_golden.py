"""Golden digests: everything `simulate` produces, pinned for fixed configurations.

Each case runs a small deterministic workload (a subset of the bundled default trace) through the
engine with the real roofline cost model and compares a SHA-256 digest of every output with the
value the reference engine (commit 9041cf3, before the performance work) produced:
the step log and the engine-step log (each column's numpy bytes; list columns as their flattened
values plus the list lengths; strings joined; nulls as a mask), the per-call and per-query frames,
and `summarize(...).to_dict()` (wall_s dropped, floats rounded to 12 significant digits).

The cases cover: normal and ngram (and suffix, whose digests come from the engine that drives it per
step as vLLM's V1 runner does, not from the reference engine; and maxlen-ngram, re-pinned when the
engine took up the V1 runner's proposer skip near max_model_len); max_num_seqs 1, 8, 32, 256; a KV
cache small enough to force
preemption (with the runtime invariant checks on); replicate=2 with Poisson arrivals and think
time; prefix caching off; a max_num_batched_tokens small enough to truncate drafts; a
max_model_len that refuses and truncates calls; a batch-size draft schedule with
prompt_lookup_min < max; an MoE model with sliding-window layers on two GPUs.

An optimisation of the engine must leave every digest unchanged. To see which column moved, run
`python tests/test_engine_golden.py --columns NAME` before and after a change and diff the output.
`python tests/test_engine_golden.py --print` prints the digest table (only when a change of
results is intended and reviewed).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from functools import cache

import numpy as np
import polars as pl
import pytest

from agentspec_sim import EngineConfig, load_trace, simulate
from agentspec_sim.cost import build_cost_model
from agentspec_sim.metrics import summarize
from agentspec_sim.trace.bundled import default_trace_path

NGRAM_SCHEDULE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                  "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 256, 1]]}

# Queries of the default trace with long outputs among their first calls (they grow past a small KV cache).
LONG_OUTPUTS = (18, 19, 25, 33, 39, 45, 48, 51, 53, 55)

# name: (queries (the first N, or these indices), calls per query (None: all), drafter, EngineConfig keywords,
#        (hardware, model, tensor_parallel_size))
A100 = ("a100-80g", "qwen3-8b", 1)
CASES: dict[str, tuple] = {
    "q12-normal-256": (12, None, "normal", {"max_num_seqs": 256, "arrival": "zero"}, A100),
    "q12-ngram-256": (12, None, "ngram", {"max_num_seqs": 256, "arrival": "zero"}, A100),
    "q12-normal-8": (12, None, "normal", {"max_num_seqs": 8, "arrival": "zero"}, A100),
    "q12-ngram-8": (12, None, "ngram", {"max_num_seqs": 8, "arrival": "zero"}, A100),
    "q3-normal-1": (3, 8, "normal", {"max_num_seqs": 1}, A100),
    "q3-ngram-1": (3, 8, "ngram", {"max_num_seqs": 1}, A100),
    "tinykv-normal": (LONG_OUTPUTS, 4, "normal", {"max_num_seqs": 16, "num_kv_blocks": 1100, "arrival": "zero",
                                                  "check_invariants": True}, A100),
    "tinykv-ngram": (LONG_OUTPUTS, 4, "ngram", {"max_num_seqs": 16, "num_kv_blocks": 1100, "arrival": "zero",
                                                "check_invariants": True}, A100),
    "poisson-rep2-normal": (4, 10, "normal", {"max_num_seqs": 32, "replicate": 2, "arrival": "poisson",
                                              "rate": 0.5, "think_time": 0.3, "seed": 3}, A100),
    "poisson-rep2-ngram": (4, 10, "ngram", {"max_num_seqs": 32, "replicate": 2, "arrival": "poisson",
                                            "rate": 0.5, "think_time": 0.3, "seed": 3}, A100),
    "nocache-normal": (4, 8, "normal", {"max_num_seqs": 32, "enable_prefix_caching": False}, A100),
    "nocache-ngram": (4, 8, "ngram", {"max_num_seqs": 32, "enable_prefix_caching": False}, A100),
    "budget48-normal": (8, 8, "normal", {"max_num_seqs": 32, "max_num_batched_tokens": 48}, A100),
    "budget48-ngram": (8, 8, "ngram", {"max_num_seqs": 32, "max_num_batched_tokens": 48}, A100),
    "maxlen-ngram": (6, 10, "ngram", {"max_num_seqs": 32, "max_model_len": 5000, "arrival": "zero"}, A100),
    "schedule-ngram": (6, 8, NGRAM_SCHEDULE, {"max_num_seqs": 32, "arrival": "zero"}, A100),
    # suffix (added with the per-step driving of docs/suffix-decoding.md; digests from that engine, re-pinned
    # when it took up vLLM's persistent-batch row order): truncated calls and steps where vLLM skips the
    # proposer; preemptions (stops and restarts).
    "maxlen-suffix": (6, 10, "suffix", {"max_num_seqs": 32, "max_model_len": 5000, "arrival": "zero"}, A100),
    "tinykv-suffix": (LONG_OUTPUTS, 4, "suffix", {"max_num_seqs": 16, "num_kv_blocks": 1100, "arrival": "zero",
                                                  "check_invariants": True}, A100),
    "moe-tp2-normal": (4, 8, "normal", {"max_num_seqs": 64, "hardware": "h100-80g", "model": "gpt-oss-20b",
                                        "tensor_parallel_size": 2}, ("h100-80g", "gpt-oss-20b", 2)),
    "moe-tp2-ngram": (4, 8, "ngram", {"max_num_seqs": 64, "hardware": "h100-80g", "model": "gpt-oss-20b",
                                      "tensor_parallel_size": 2}, ("h100-80g", "gpt-oss-20b", 2)),
}

# Computed with the reference engine (see the module docstring).
EXPECTED: dict[str, dict[str, str]] = {
    "q12-normal-256": {
        "steps": "460954c7be9a1918e7fb626dc5decbc9",
        "engine_steps": "a117f4fe99da725ec087c4831b5b287e",
        "calls": "ddef10fdc148f37ea3db25b712550e14",
        "queries": "cb24696ac3801127f62189929420e10b",
        "summary": "6a9ea4a307f3174d74131c833e8ef11a"
    },
    "q12-ngram-256": {
        "steps": "ab2e34fa3a2e20722895f3403e346daa",
        "engine_steps": "f437bc27c2abc074d9dd2ab98ff967f4",
        "calls": "263cb39435c56dc0d7c212954b41c615",
        "queries": "546a7b54e68964103b509347389afd1f",
        "summary": "755c57cbac246e5148f0dedcfd92d4d4"
    },
    "q12-normal-8": {
        "steps": "84018b9d6881352c07eccc08f0828a43",
        "engine_steps": "5403c1c3e5999b75e1441f22fdc54227",
        "calls": "6b92049f08e2b3160a459199790f7def",
        "queries": "37d7ab4edcb6f5089c11c902125f09de",
        "summary": "33e6a0a57f3123d9555dc0a4a9293c5b"
    },
    "q12-ngram-8": {
        "steps": "b4fe86fe336fe97df8d54fe1a9b9e6e5",
        "engine_steps": "f095bc8ffe434a19fb54ff330ef84bed",
        "calls": "1a1499b67d91a4b0344116ed98874c2c",
        "queries": "cd91aa3eaa46e64d6090e0c75265b748",
        "summary": "fa1687abb697e1bbbed3f27210e57a4c"
    },
    "q3-normal-1": {
        "steps": "344671249729ef51dd55a7ee31d9eb3e",
        "engine_steps": "a6753dcf2bc0a23c58c2d23b9286ed6c",
        "calls": "701e9ea351f62e562348360599109893",
        "queries": "3c47f4bfa1aca8b4d26b700803271546",
        "summary": "223edbcbe9acb2da8a05438d082b73d9"
    },
    "q3-ngram-1": {
        "steps": "7b53731e90196b65b2c2da446c719de4",
        "engine_steps": "1f0736f3479e2167facbca33a7cb61f3",
        "calls": "9f14a3b53ba9898f87c36913666a2b80",
        "queries": "94c558335696fe0ab72a9922ddb3eb43",
        "summary": "b2e40ca71d33cfe6e918e6588ca585dc"
    },
    "tinykv-normal": {
        "steps": "239adc7f446141bc0788bf19c213a788",
        "engine_steps": "bee0be4e0d51729ce46508a4c067981b",
        "calls": "4f8b29f386549bb67cb5060a1062a9b7",
        "queries": "f7da827ffb74a7e8109d2522d64ce94b",
        "summary": "7c1a514f04674afbe8861828b0d4164c"
    },
    "tinykv-ngram": {
        "steps": "849185c3fe67369503279aa8951987be",
        "engine_steps": "173a43da9ed5c74d502eb3cd03cbe271",
        "calls": "358b2ae80c86b3fe3839c471ce57583a",
        "queries": "8151bd7c571f5cbd4336aacc5e4ef70c",
        "summary": "d4e774761e0a7365311876a50d2538f1"
    },
    "poisson-rep2-normal": {
        "steps": "b23de5109b44fab1ed12384a78c21df2",
        "engine_steps": "09867a137f1a4dcd28824ad083f3ac23",
        "calls": "c09f54a795137af513afb1dc744606bc",
        "queries": "0cb005bcbc5d93b7cc499f5eba612ec9",
        "summary": "f64dabb606023e7cf145f2c4c0670dcc"
    },
    "poisson-rep2-ngram": {
        "steps": "2c446d8cf9b280094e3c5d71eafc4713",
        "engine_steps": "b9eab8f6e64528b3134f4ae44d0f2db3",
        "calls": "e41bcc01a5f14bca2e79d5f0f4574ac0",
        "queries": "04a2d6e2c9bb3eafaecfeb12bf7bfe03",
        "summary": "98b1d3299fc053c76a8b5f6c347c1777"
    },
    "nocache-normal": {
        "steps": "3736e486363346cc9e434e7a0778d810",
        "engine_steps": "5ac0cd2a948a5b646db5383c1f62d07e",
        "calls": "a14893d8448ac396b1597c83f611c2d1",
        "queries": "db678843a992d59f9e286a5d05a956b1",
        "summary": "7ae0629bf1da06407664c675c69c6355"
    },
    "nocache-ngram": {
        "steps": "748c9db8c0871496dc47e8d09b1127cb",
        "engine_steps": "548e62c4104880b032dfd851c1dda918",
        "calls": "e2d26ed9649a343d347e76e8e0ed993f",
        "queries": "af659bc7b0aada6a7c24ea954fd6b5a3",
        "summary": "e09c3ac0aea262e239fccd8129d67896"
    },
    "budget48-normal": {
        "steps": "dbce283046df2db2b605685b337d5682",
        "engine_steps": "ecfd592441d77b261971a3bca3437831",
        "calls": "2f2cddd02f0d3e8ce0d0205d1d2f3f9a",
        "queries": "6f975adf9fefce59dd5d72ea26218ab8",
        "summary": "6aa20f503d38a8279c8b150b0ed1bb9d"
    },
    "budget48-ngram": {
        "steps": "7a2eeaedf9faaf3307ec5a92d2ed8a4d",
        "engine_steps": "f01fdb763475dc868a28603ef58685ab",
        "calls": "325008c2e346f030a75c6238881ff7bf",
        "queries": "3493acd7661cb8687192a80c6d3ea2a1",
        "summary": "8b2ea0edd5b90feb4cd93d52d6167892"
    },
    "maxlen-ngram": {
        "steps": "1ecfebc2ddbe1b7cd9c3bc239e589ab0",
        "engine_steps": "7bd118b0c4264cdc8e4590c1c2ce92bf",
        "calls": "fa1106c009d42a239455ac3a33e49df1",
        "queries": "e7f4ba98e6a2f4a1cd88fa06e4fd2654",
        "summary": "9f487a9b5bf39d5c44d6c49341d42cc5"
    },
    "schedule-ngram": {
        "steps": "f7091d7aac009c15c52424dd5c08c462",
        "engine_steps": "7d7948c1bdd2365ee085eb97590494fc",
        "calls": "9eca9e4ebf54f16e04b2d856de6beb71",
        "queries": "ef4b94516b9fce7529942e61910003e6",
        "summary": "cf1549b9460166cddadcfec60c6fb8ed"
    },
    "maxlen-suffix": {
        "steps": "99f16f555755e03d8c619e9f3e285988",
        "engine_steps": "66ac9ae2024373b5100202dd5b029b89",
        "calls": "a8d8a75c01447e0b7ef3c74cd92d7302",
        "queries": "cd9d8c6fb4731714565f5afa1399183e",
        "summary": "a4c3d3c366db679b400d12f4561e535f"
    },
    "tinykv-suffix": {
        "steps": "1323946567bf7945c29f6fb9fd17433c",
        "engine_steps": "029d99095a9554a51c62335f2bf34899",
        "calls": "cf3a593b29185ef27b468752e6a55403",
        "queries": "f921a34977ec04130e707f6cfa8789be",
        "summary": "3d39cb8d05d414eddd9eaa79c0365e54"
    },
    "moe-tp2-normal": {
        "steps": "f32f3f75cfb70660e6cb404a58cee5c5",
        "engine_steps": "90114c38ab5ff77f448991d5bf2d5c85",
        "calls": "7ca26c6ca28d39173d778ebfb8ad03fa",
        "queries": "370d0ad16fa7fa47a6d72f1ca34e3b35",
        "summary": "007d87f4c60489836e4b42679aecc5d1"
    },
    "moe-tp2-ngram": {
        "steps": "c0ab0cc9ee87019526fd4190b5b0e3d9",
        "engine_steps": "cd357bd8c117b27dfc41317daf8572b0",
        "calls": "a237714510415f12425db99d03d50c47",
        "queries": "2c02c605ffbc26fcd1fa480346ee3855",
        "summary": "95532b04073a57f1af0d314e17421f9b"
    }
}


@cache
def _trace():
    return load_trace(default_trace_path())


def _workload(queries: int | tuple[int, ...], calls: int | None):
    w = _trace()
    qs = w.queries[:queries] if isinstance(queries, int) else tuple(w.queries[i] for i in queries)
    if calls is not None:
        qs = tuple(replace(q, calls=q.calls[:calls]) for q in qs)
    return replace(w, queries=tuple(qs))


@cache
def _cost(hardware: str, model: str, tp: int):
    # The documented defaults, not the bundled measured-kernel calibrations: the digests pin the engine, and the
    # reference engine priced its steps with these (tests/test_cost_aic.py pins the calibrated prices).
    return build_cost_model(hardware, model, tensor_parallel_size=tp, calibration="defaults")


def run_case(name: str):
    queries, calls, drafter, kw, cost = CASES[name]
    result = simulate(_workload(queries, calls), drafter, EngineConfig(**kw), _cost(*cost))
    return result, summarize(result)


def _series_digest(s: pl.Series) -> str:
    h = hashlib.sha256()
    h.update(f"{s.name}:{s.dtype}:{s.len()}:".encode())
    h.update(np.ascontiguousarray(s.is_null().to_numpy()).tobytes())
    if isinstance(s.dtype, pl.List):
        h.update(np.ascontiguousarray(s.list.len().fill_null(-1).to_numpy()).tobytes())
        h.update(np.ascontiguousarray(s.explode().drop_nulls().to_numpy()).tobytes())
    elif s.dtype == pl.Utf8:
        h.update("\x1f".join(s.fill_null("").to_list()).encode())
    elif s.dtype == pl.Boolean:
        h.update(np.ascontiguousarray(s.fill_null(False).to_numpy()).tobytes())
    else:
        h.update(np.ascontiguousarray(s.fill_null(0).to_numpy()).tobytes())
    return h.hexdigest()


def _round(value):
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.12g}")
    return value


def column_digests(result, summary) -> dict[str, dict[str, str]]:
    """table → column → digest (the summary as one entry)."""
    out = {}
    for table in ("steps", "engine_steps", "calls", "queries"):
        frame = getattr(result, table)
        out[table] = {"__columns__": hashlib.sha256("|".join(frame.columns).encode()).hexdigest(),
                      **{c: _series_digest(frame[c]) for c in frame.columns}}
    doc = summary.to_dict()
    doc.pop("wall_s")
    # The load fields (protocol, duration, throughputs, attainment; tests/test_capacity.py) came later: the
    # summary digest pins the fields these runs were first pinned with.
    for key in ("protocol", "duration_s", "request_throughput", "call_throughput", "output_throughput_tok_s",
                "attainment", "speedup_mean_per_query"):
        doc.pop(key)
    out["summary"] = {"to_dict": hashlib.sha256(json.dumps(_round(doc), sort_keys=True).encode()).hexdigest()}
    return out


def table_digests(result, summary) -> dict[str, str]:
    cols = column_digests(result, summary)
    return {t: hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:32] for t, c in cols.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    result, summary = run_case(name)
    assert (result.calls["status"] != "waiting").all()
    if name.startswith("tinykv"):
        assert summary.preemptions > 0  # the case exists to exercise preemption
    if name.startswith("budget48-ngram"):
        assert summary.drafted_call_steps > 0
    if name.startswith("maxlen"):
        assert summary.refused_calls > 0 and summary.truncated_calls > 0
    assert table_digests(result, summary) == EXPECTED[name]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print"]:
        table = {name: table_digests(*run_case(name)) for name in CASES}
        print("EXPECTED: dict[str, dict[str, str]] = " + json.dumps(table, indent=4) + "\n")
    elif sys.argv[1:2] == ["--columns"]:
        names = sys.argv[2:] or list(CASES)
        print(json.dumps({name: column_digests(*run_case(name)) for name in names}, indent=1, sort_keys=True))
    else:
        sys.exit(__doc__)
