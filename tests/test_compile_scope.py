"""What a run compiles (issue 24): a `normal` run no drafter's kernel, an `ngram` run no suffix tree; the
kernels only compiled code calls carry no Python wrapper to build. Measured in a fresh process with an empty
numba cache, where every kernel a run reaches is compiled (a warm cache loads the step loop whole)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from agentspec_sim.engine import kv, scheduler

SCRIPT = r"""
import json, sys
from dataclasses import replace
from numba.core.dispatcher import Dispatcher
from agentspec_sim.engine.config import EngineConfig
from agentspec_sim.run.simulation import simulate
from agentspec_sim.trace.bundled import bundled_trace
from agentspec_sim.trace.io import load_trace

def compiled():
    out = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("agentspec_sim."):
            continue
        for obj in vars(mod).values():
            if isinstance(obj, Dispatcher) and obj.signatures:  # named where defined, not where imported
                out.add(f"{obj.py_func.__module__}.{obj.py_func.__qualname__}")
    return out

workload = load_trace(bundled_trace("swe-agent.jsonl.zst"))
workload = replace(workload, queries=workload.queries[:2])
result = {}
for drafter in ("normal", "ngram"):
    simulate(workload, drafter, EngineConfig(max_num_seqs=4))
    result[drafter] = sorted(compiled())
result["loaded"] = sorted(m for m in sys.modules if m.startswith("agentspec_sim.drafters."))
print(json.dumps(result))
"""


def test_a_run_compiles_only_what_it_uses(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "AGENTSPEC_SIM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    normal, ngram = set(result["normal"]), set(result["ngram"])
    assert "agentspec_sim.engine.scheduler.run_steps" in normal  # the loop itself was compiled here
    assert "agentspec_sim.engine.kv.allocate_slots" in normal  # and its callees with it (a cold cache)
    assert not {d for d in normal if d.startswith("agentspec_sim.drafters.")}
    assert not {d for d in ngram if d.startswith(("agentspec_sim.drafters.suffix.", "agentspec_sim.drafters.agentspec.",
                                                  "agentspec_sim.drafters.model."))}
    # The registry loaded the two families the run asked for and no other (their packages' METHODS only).
    # (With a compiled-code cache other drafters' runs wrote, numba imports their state classes when it reads
    # the loop's cache index: here the cache is fresh.)
    modules = {m for m in result["loaded"] if m.count(".") >= 3}
    assert {m.split(".")[2] for m in modules} == {"normal", "ngram", "common"}, modules


def test_kernels_only_compiled_code_calls_build_no_python_wrapper():
    internal = [kv.node_of, kv.first_holder, kv.cache_block, kv.touch_blocks, kv.free_blocks, kv.ensure_hashes,
                kv.lookup, kv.allocate_slots, kv.free_call, scheduler.schedule_step, scheduler.update_step,
                scheduler.persistent_batch_update]
    for k in internal:
        assert k.targetoptions.get("no_cpython_wrapper") and k.targetoptions.get("no_cfunc_wrapper"), k.py_func.__name__
    # Python's entries into them build one.
    assert not kv.allocate_slots_from_python.targetoptions.get("no_cpython_wrapper")
    assert not scheduler.schedule_step_from_python.targetoptions.get("no_cpython_wrapper")
