"""Golden digests: everything `simulate` produces, pinned for fixed configurations.

Each case runs a small deterministic workload (a subset of the bundled default trace) through the
engine with the real roofline cost model and compares a SHA-256 digest of every output with the
value the reference engine (commit 9041cf3, before the performance work) produced:
the step log and the engine-step log (each column's numpy bytes; list columns as their flattened
values plus the list lengths; strings joined; nulls as a mask), the per-call and per-query frames,
and `summarize(...).to_dict()` (wall_s dropped, floats rounded to 12 significant digits).

The cases cover: normal and ngram (and suffix, whose digests come from the engine that drives it per
step as vLLM's V1 runner does, not from the reference engine; and maxlen-ngram, re-pinned when the
engine took up the V1 runner's proposer skip near max_model_len; every case re-pinned when the engine took
up the scheduler's lag behind a client (async scheduling, a successor sent once its predecessor's answer is
read) and the front end's time in TTFT/E2EL); max_num_seqs 1, 8, 32, 256; a KV
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

# Computed with the reference engine, then re-pinned where the module docstring says.
EXPECTED: dict[str, dict[str, str]] = {
    "q12-normal-256": {
        "steps": "a4309419b6d9730da4eeffdea02e4ad9",
        "engine_steps": "0908b75ba44bf368493785b44edb47fe",
        "calls": "2b56992773164697c29eef5ca9eaa30d",
        "queries": "50e7ae570f15fc161799aed1f094038e",
        "summary": "f65eb8857aa6822268945c4412fc3f4a"
    },
    "q12-ngram-256": {
        "steps": "4673dade23c4e2380cf9f7af9c1cf206",
        "engine_steps": "272b423a8b2f6d5c01a3fa682376f662",
        "calls": "761db5c80c850e341f1ac6a041568c51",
        "queries": "60811a65a7f824cf0e01cdad86360bc0",
        "summary": "69688d262e5b4bbae863aeb4025a0f62"
    },
    "q12-normal-8": {
        "steps": "32af920f9fcf33f87f3060e550414d9b",
        "engine_steps": "4c0cb7f38ee75019c04b8ad09b7b8dab",
        "calls": "503931b0a824bb5bb5ca2f1943cee428",
        "queries": "fef13cebad2b763c21a0ef6ac33fc3e0",
        "summary": "cf1a3a5541b4500bdac3c176c63579c2"
    },
    "q12-ngram-8": {
        "steps": "cf3de7e5c1a99f82ac4e271704243266",
        "engine_steps": "161d255527bb9e9f34d361a37e2e06ea",
        "calls": "829bebddf2ea1d831b04a555146ce171",
        "queries": "4af5790cce038c8c7625f4f2d0b7b774",
        "summary": "ef5be489e3d3d1a63277ff4cea5f1772"
    },
    "q3-normal-1": {
        "steps": "344671249729ef51dd55a7ee31d9eb3e",
        "engine_steps": "a6753dcf2bc0a23c58c2d23b9286ed6c",
        "calls": "3ee1fc8a6fa37787028b65dc7f32721b",
        "queries": "44f56640ddbdacf0b1a97a02aa199c95",
        "summary": "29eeb885fb33a989e1f3897cdef01d55"
    },
    "q3-ngram-1": {
        "steps": "7b53731e90196b65b2c2da446c719de4",
        "engine_steps": "1f0736f3479e2167facbca33a7cb61f3",
        "calls": "88c0a3e3a4fc1cf707202e473a4a35e8",
        "queries": "9deb9d1847531389a36022fb15910c7b",
        "summary": "75f458ebc213a9e8102489a70f979e10"
    },
    "tinykv-normal": {
        "steps": "8380bfacee6902af696077b0c30eebf5",
        "engine_steps": "cff1ba428266eee1912ec838a6ceb1e5",
        "calls": "30e874dc20b5341762784c4840dc9f4b",
        "queries": "173f50360892fda48fa142a38c525c32",
        "summary": "827a4f119d2124547d36300ce0ce2127"
    },
    "tinykv-ngram": {
        "steps": "1fb72c7f2af2b376a0a8ad8829ea5fb7",
        "engine_steps": "522a786d316dc32b18d128d02eb8707f",
        "calls": "9c8630290360aac87df1fa33e634afdc",
        "queries": "74a0023b9ae571f3670d9b9318ddfc47",
        "summary": "86e9f74a53a026ee0c91c62be3d41675"
    },
    "poisson-rep2-normal": {
        "steps": "d7d9e6c780980430dd808e3c82eb7347",
        "engine_steps": "89db53d7aa58f7dce6e986db762b799b",
        "calls": "11d04cd67c3ed10f589571e44052fbf6",
        "queries": "8316d75b6e57c92175bf3741e02c912e",
        "summary": "ac014c1a6e7f7aff0ab36ccf4e3b2e91"
    },
    "poisson-rep2-ngram": {
        "steps": "2c446d8cf9b280094e3c5d71eafc4713",
        "engine_steps": "b9eab8f6e64528b3134f4ae44d0f2db3",
        "calls": "cd63b3c7afb417117b9925eb934b4d59",
        "queries": "3fb1ed3bf763cf3cb8f2ef454f23dc78",
        "summary": "5eea4bef10b75c7a3ad670473f05df09"
    },
    "nocache-normal": {
        "steps": "ee69bdba8e444681f5349ecd1578b725",
        "engine_steps": "ff486c8cbde56f1f4ddf601f09d2116f",
        "calls": "8dec57bcd65028b18be33be22713b6cf",
        "queries": "5cf83a40eec4b44847633db943bc88ff",
        "summary": "8b9b362b5888d9457652e948f3d5ad07"
    },
    "nocache-ngram": {
        "steps": "cf1c7cbe6d3490632cb9b39d7f28e7af",
        "engine_steps": "d336846fa4c5fb416d85c43c2e855b92",
        "calls": "3ae50701c01bd0e0981c7ab97a88bfe4",
        "queries": "15d6df257c06a28df300ba82f0fe6c54",
        "summary": "30b3a5f74c637a3a860a02ba04155ecd"
    },
    "budget48-normal": {
        "steps": "748fcc185d1e1dafd004d65bc63e0264",
        "engine_steps": "d6d7c74d3a94da3c9a7015b8ee6ef1ab",
        "calls": "0d2dabe678119591f0bab96c7ac6297a",
        "queries": "99e60a352b4721d79dc98c3106dbf207",
        "summary": "6991aa33278e9b018328986a67fe250c"
    },
    "budget48-ngram": {
        "steps": "fc0b7fbd052714af68203afde1dcad10",
        "engine_steps": "ba745b84deeeb6f91280eac5b6eaa721",
        "calls": "323c12d789b262692497bb2d510ea072",
        "queries": "27a591dd74c76f7208069432e57c6289",
        "summary": "1a30ad1c0c1426062459f5a56f34e86b"
    },
    "maxlen-ngram": {
        "steps": "827f8cbd386746cabbe28e50bd3f0515",
        "engine_steps": "84a00fd02b2620b0a7ba720ac6f6228a",
        "calls": "0a988732d1ca90e104f1a44deb5c9151",
        "queries": "69e6522fb1e492ad33f9442c8389ddc7",
        "summary": "d1cfba4fabc354de000fd89c2abf973d"
    },
    "schedule-ngram": {
        "steps": "437ba156541023069caf5c805a49fa58",
        "engine_steps": "eafb86ee1b0fa0f309330061c81e9bf6",
        "calls": "1d83735750d136e1e38c05c4f4865658",
        "queries": "fcfb3a771ae3cb230cf8e8e42bcab3d5",
        "summary": "8f8b7ed5231fee4941974daa46c5c304"
    },
    "maxlen-suffix": {
        "steps": "e7dd7156f05da04f08145c91a261da90",
        "engine_steps": "65a3b1145a438fe20f010a9dd73cc59f",
        "calls": "7e425e91de86ee54ea730e6ecd94b061",
        "queries": "bdbec2ecb721c0979d4aa1db5c51da82",
        "summary": "95e35b3504f27b77ff2eb6e06a8262ec"
    },
    "tinykv-suffix": {
        "steps": "747253f10a466fb521c2578a09e8d1dc",
        "engine_steps": "7ced1437fdedf161989242da8bd7cd97",
        "calls": "1d8b84d6966453c30f280c2ecea69998",
        "queries": "f69c6e4d98e3eadaa07763e383a81a3a",
        "summary": "001e0d4d75bb97fae402049e51f26bdc"
    },
    "moe-tp2-normal": {
        "steps": "b9aed9e3caaf62c4f0dad443c6635663",
        "engine_steps": "8fdd337f69ae89544f91abcf40bd3a26",
        "calls": "a81b7bfec8555d5f25199569889929cf",
        "queries": "617645049840325ea58a483441732075",
        "summary": "0332589c006b1782fbab47a49f9b7d32"
    },
    "moe-tp2-ngram": {
        "steps": "5735027d986a0741db8321eab8484f0e",
        "engine_steps": "6f73207be08ec0541828e3ea76335a28",
        "calls": "397c0d22331e3ca9325e3ecc40ec1802",
        "queries": "4b442bb4ee6fdf94ea6c9c73e4148074",
        "summary": "756abe7d6c4cddbdbb9cc0d4a9c98c9f"
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
