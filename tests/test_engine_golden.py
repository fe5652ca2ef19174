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
read) and the front end's time in TTFT/E2EL, and again when it took up the GEMM kernels' floor and a synchronous
step's host time (`host_s`)); max_num_seqs 1, 8, 32, 256; a KV
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
        "steps": "27bd3ca9b78d7fde9be412df746109e8",
        "engine_steps": "21150614f96508537d8fd9c596f02dda",
        "calls": "30430dc6a623d67275f02f08b702a7d8",
        "queries": "b7202299ac671f7e61b609b2568f7278",
        "summary": "5a6f2068402a49e471cb496c9d895837"
    },
    "q12-ngram-256": {
        "steps": "29cf3dc4131aeb4d85df0bdd7bb21779",
        "engine_steps": "18ed193bcc2449d18f5805801aad0262",
        "calls": "8b9d7868fe415324b7ef85c2ed069b0d",
        "queries": "bbd188f40af1d47b11aebd7d84a0d69f",
        "summary": "7a9b83705f889282747fb09d6ac3569e"
    },
    "q12-normal-8": {
        "steps": "e56c9ae338b45a93656a006001756df0",
        "engine_steps": "3c9c4965c0c6d59ac5d950c33a56b25b",
        "calls": "a5889361dceb9b8ff1e2942ad0d09687",
        "queries": "846014cfbd7c5890e2b01a0608b0e66e",
        "summary": "9753ab434d408879c64571d754b8fc81"
    },
    "q12-ngram-8": {
        "steps": "67a6c5b68ca4243c5a5c0c10ae858ff2",
        "engine_steps": "8217094daaf2b2ea877d6eed4fac4677",
        "calls": "08798142cf5e20a5efd4dfad1a067af0",
        "queries": "add994fc82ad3d361a13e60f00c771d5",
        "summary": "23088c16574c247a4d217408ae0051e7"
    },
    "q3-normal-1": {
        "steps": "bbeda8f4ad069453408489d815c828ab",
        "engine_steps": "88c920f764a8e6d215e1263bdd384e80",
        "calls": "cc0e7acd383f1ea1f8870e868b51b71c",
        "queries": "7d25592f63b218d97ef8a6a8488ad226",
        "summary": "88453a09646436a666d562b697299dc4"
    },
    "q3-ngram-1": {
        "steps": "2215802b9d37a78a1eccc94d77735305",
        "engine_steps": "cae5b7900e2a8fab063448c8161a21d5",
        "calls": "abd4e1534c45a9a1254bbb518c354cc5",
        "queries": "16e8e12aaaf691a25e6f2ea7d84740f8",
        "summary": "3141b92548bb6e38fc57d1c5bb2a0527"
    },
    "tinykv-normal": {
        "steps": "224b7febfce51226ff1b86f83e9ed20e",
        "engine_steps": "01a002da9924aa92e1fbdcd2595ffe2c",
        "calls": "12b62401d21ced60f108c3046539744f",
        "queries": "a626b5db7ea53ba6b1aec883b4887450",
        "summary": "8dc4ab82eb3bba109d9fda5209d0fc21"
    },
    "tinykv-ngram": {
        "steps": "761980300cce96d0f4e08a6284c3ca5c",
        "engine_steps": "0cb48ec8f9a9f57ff3050be8bf839c5e",
        "calls": "9cf6946f9c8dd12d254289fa6ddbe8c5",
        "queries": "6f8c17fbc147bd4cc9ab9d820aabca83",
        "summary": "37df00effbb64fb303e75997adcad745"
    },
    "poisson-rep2-normal": {
        "steps": "f5dfb8ff861893fc254293d157ea7814",
        "engine_steps": "828075af2562dd63a3cb28e448aab9a3",
        "calls": "5a0a4ee50e834c9e3f6bfc42bf4b59fa",
        "queries": "2b059f80e3b9163e6c0daae71682f9df",
        "summary": "137562c874d4b831c32ce28f39ecc8eb"
    },
    "poisson-rep2-ngram": {
        "steps": "5bc6dbbbf7b0cda3cdfe89bd1c9267b5",
        "engine_steps": "e04a05474705563de30c7d4bb6e5df48",
        "calls": "dc888dda512884197c8af4d7c59c2696",
        "queries": "fa238fdb7b41b8f431e7c8d2b788c57a",
        "summary": "d9feaae06c572a3bca92520950207396"
    },
    "nocache-normal": {
        "steps": "4165ac994df49a2fbaea3b62e03f357a",
        "engine_steps": "9bde1843b6ba46206b194555e8f7880b",
        "calls": "c401c9a2b011e42e9f1c65ade2aa5707",
        "queries": "f5e7bc0032dfdad08720e86192406702",
        "summary": "97813337bbd779e018874c11e02ee9fe"
    },
    "nocache-ngram": {
        "steps": "1772f137c11397f18468c02e6eb29a5f",
        "engine_steps": "de35d7ff5dd10c6b60dab3ef7019e135",
        "calls": "4ed28d641ac1b27681d4d2c6f910204d",
        "queries": "f4d3c5eb1d714de59bc2f7a6af5ab440",
        "summary": "d620ef95550fe2103633ead952c31481"
    },
    "budget48-normal": {
        "steps": "962ad753b0802dbaf5fbbaa9325e89f0",
        "engine_steps": "0804dae68a9890b0d764c5d8246143b4",
        "calls": "e0206424cdf2d72b50902841c5128e6b",
        "queries": "8f69db0ee0f404191439949c8fe3f832",
        "summary": "049a74813092fed3ef88e0e0ef3603ed"
    },
    "budget48-ngram": {
        "steps": "973c087da23eccab827819ffb4aa523d",
        "engine_steps": "5116f98b1ef579a6f6c4e1d3e11825ff",
        "calls": "4d7844887806963ed56a79690e443312",
        "queries": "b27adffbcd27a26124770a6829cc6d43",
        "summary": "c67a7466af7bd4972a52285ee61b2ec1"
    },
    "maxlen-ngram": {
        "steps": "0c177cea21976431f2edbb49a77317cf",
        "engine_steps": "1281fc3afd31b111e4e77a195eef246d",
        "calls": "c496ce61138e8d8b11fd84884f692156",
        "queries": "f5cce480311ce532e0a802851254ec3e",
        "summary": "783e3e55499b5c3f4eb92e16195a37d3"
    },
    "schedule-ngram": {
        "steps": "29c87387f0e42298db05f641dc54a2c2",
        "engine_steps": "32c8a73f32e802f0870e7f373356eb3b",
        "calls": "7d672f6a44302f2e71269becd2e581a3",
        "queries": "643d63dd879270fb30a824b4db0b291e",
        "summary": "47a5599ab840a976a6a51a52953a8524"
    },
    "maxlen-suffix": {
        "steps": "edc3432714d51cda63882e8a66f3dcdd",
        "engine_steps": "fe3b80481c63378b9aa9f4ca5678e4db",
        "calls": "34b8b0402518658efff6b0e2c38df0fa",
        "queries": "3034996edfc6a8f837c4a7d0d08d0c09",
        "summary": "4f14281eaf1f1fb045e10e29c4829b5e"
    },
    "tinykv-suffix": {
        "steps": "969834c5b9634ffc554c93205cdedf73",
        "engine_steps": "0a9a8ea3bc34b8e51fe349aa0cfdb4c4",
        "calls": "39540f59dede54315a75ec6944622261",
        "queries": "f2f4f8c6b0bf52d0c339b162c76ba835",
        "summary": "291688ece7195102bacdddc20cf12fe6"
    },
    "moe-tp2-normal": {
        "steps": "fda41ed0e5f1e7031906f666bece05f9",
        "engine_steps": "23118eb9b4793211f703b469cfb87819",
        "calls": "c10fd4943014a892eaf003553b454d5f",
        "queries": "4014fcb232d278b32b344b435928464f",
        "summary": "8e8a093056cea2f20b741a8b5e99c909"
    },
    "moe-tp2-ngram": {
        "steps": "4e8c6da509d69473ffd0f731bf00df99",
        "engine_steps": "acfcc88ade81f8789c041c50f65d41d9",
        "calls": "9824e9909c58f04a3cfec63979d89837",
        "queries": "f1894cd34b2d771ce86f7eefddc5e1de",
        "summary": "77816d4f83b14a23a27f5a4adbcc843d"
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
