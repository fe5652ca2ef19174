"""Predicted vs measured TTFT and TPOT on real vLLM serving runs: AIConfigurator's silicon rows.

NVIDIA AIConfigurator ships its accuracy ground truth with the `aic` extra
(`aiconfigurator_core/systems/silicon_sample.csv`): vLLM V1 serving runs with fixed lengths. This script replays
the aggregated vLLM rows of two sets through the simulator under the protocol they were measured with
(SemiAnalysis InferenceX's: 10·C requests of seeded lengths at 80–100 % of nominal, outputs forced, closed loop at
concurrency C, max_num_seqs C, an 8,192-token budget, prefix caching off) and prints the error per row and the
medians:

- fitted: gpt-oss-120b, vLLM 0.18, H100 TP 2/4/8 and H200 TP 1/2/4/8 (the rows `frontend_request_s` was fitted on);
- held out: Qwen3-32B BF16, vLLM 0.12, H100 TP 2/4/8 (never fitted on).

    pip install -e '.[aic]'          # or --csv PATH to the file
    python reports/serving_ttft.py                 # the tables
    python reports/serving_ttft.py --fit           # refit frontend_request_s on the fitted set
    python reports/serving_ttft.py --tokenizer     # time the tokenizer (frontend_prompt_token_s)
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import numpy as np

from agentspec_sim import EngineConfig, simulate
from agentspec_sim.cost.build import cost_model_for
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload

SETS = {  # AIC model path → (profile, vLLM version, precision column, role)
    "openai/gpt-oss-120b": ("gpt-oss-120b", "0.18.0", "fp4", "fitted"),
    "Qwen/Qwen3-32B": ("qwen3-32b", "0.12.0", "", "held out"),
}
# Whether the version scheduled asynchronously by default: vLLM 0.12's SchedulerConfig.async_scheduling is False
# (vllm/config/scheduler.py; its VllmConfig notes "we won't reach here until async scheduling is enabled by
# default"); by 0.18 the default is on (None → on for a plain model).
ASYNC_BY_DEFAULT = {"0.12.0": False, "0.18.0": True}
SYSTEMS = {"h100_sxm": "h100-80g", "h200_sxm": "h200"}
LOW = 0.8  # lengths drawn in [80 %, 100 %] of nominal


def silicon_csv() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the aic extra (pip install -e '.[aic]') or pass --csv")
    return Path(next(iter(spec.submodule_search_locations))) / "systems" / "silicon_sample.csv"


def silicon_rows(path: Path) -> list[tuple[tuple, float, float, str]]:
    """((profile, hardware, tp, isl, osl, concurrency, async scheduling), TTFT ms, TPOT ms, role), one per
    distinct setting."""
    out, seen = [], set()
    with path.open(newline="") as f:
        for x in csv.DictReader(f):
            if x["backend"] != "vllm" or x["mode"] != "agg" or x["system"] not in SYSTEMS:
                continue
            if x["model_path"] not in SETS:
                continue
            model, version, precision, role = SETS[x["model_path"]]
            if x["backend_version"] != version or x["precision"] != precision:
                continue
            key = (model, SYSTEMS[x["system"]], int(x["tp_size"]), int(x["isl"]), int(x["osl"]), int(x["batch_size"]),
                   ASYNC_BY_DEFAULT[version])
            if key not in seen:
                seen.add(key)
                out.append((key, float(x["silicon_ttft_ms"]), float(x["silicon_tpot_ms"]), role))
    return out


def fixed_length_workload(isl: int, osl: int, n: int, seed: int) -> Workload:
    """n single-call requests, lengths uniform in [LOW·nominal, nominal], random token ids (no prefix shared)."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(int(isl * LOW), isl + 1, n)
    outs = rng.integers(int(osl * LOW), osl + 1, n)
    queries = []
    for i in range(n):
        call = Call(id=f"r{i}", agent_id=0, query_id=f"r{i}", seq=0, prompt_tokens=rng.integers(1000, 100000, ins[i]),
                    output_tokens=rng.integers(1000, 100000, outs[i]))
        queries.append(Query(agent_id=0, query_id=f"r{i}", calls=(call,)))
    return Workload(meta=TraceMeta(tokenizer=None, vocab_size=151000), queries=tuple(queries))


def replay(key: tuple, seed: int = 0) -> tuple[float, float, float]:
    """Mean TTFT and mean TPOT (ms) of the replay, as `vllm bench serve` computes them, and the bundled
    `frontend_request_s` (ms) it includes (TTFT moves by exactly that much with it: the engine does not)."""
    model, hardware, tp, isl, osl, c, async_scheduling = key
    config = EngineConfig(hardware=hardware, model=model, tensor_parallel_size=tp, max_num_seqs=c,
                          max_num_batched_tokens=8192, enable_prefix_caching=False, max_concurrency=c, seed=seed,
                          max_model_len=isl + osl + 64, async_scheduling=async_scheduling)
    cost = cost_model_for(config)
    calls = simulate(fixed_length_workload(isl, osl, 10 * c, seed), "normal", config, cost_model=cost).calls
    ttft = (calls["first_token_s"] - calls["arrival_s"]).to_numpy()
    tpot = ((calls["finish_s"] - calls["first_token_s"]).to_numpy() / (calls["output_len"].to_numpy() - 1))
    return float(ttft.mean() * 1e3), float(tpot.mean() * 1e3), cost.calibration.frontend_request_s * 1e3


def table(rows) -> dict[str, tuple[float, float, float]]:
    errors: dict[str, list[tuple[float, float]]] = {}
    for key, ttft, tpot, role in rows:
        pt, pp, _ = replay(key)
        errors.setdefault(role, []).append((pt / ttft - 1, pp / tpot - 1))
        print(f"{role:8} {key[0]:12} {key[1]:8} tp {key[2]} {key[3]:>5}/{key[4]:<5} c {key[5]:>3}  "
              f"TTFT {pt:8.1f} / {ttft:8.1f} ms {pt / ttft - 1:+6.1%}   TPOT {pp:6.2f} / {tpot:6.2f} ms "
              f"{pp / tpot - 1:+6.1%}")
    out = {}
    for role, e in errors.items():
        out[role] = (statistics.median(abs(a) for a, _ in e), statistics.median(abs(b) for _, b in e),
                     max(abs(b) for _, b in e))
        print(f"{role}: {len(e)} rows  TTFT median |err| {out[role][0]:.1%}  TPOT median {out[role][1]:.1%}, "
              f"max {out[role][2]:.1%}")
    return out


def fit_request_s(rows) -> float:
    """frontend_request_s minimising the fitted set's TTFT error (soft-L1 on relative error), the rest as bundled."""
    from scipy.optimize import least_squares

    fitted = [r for r in rows if r[3] == "fitted"]
    zero = [ttft - request for ttft, _, request in (replay(key) for key, *_ in fitted)]
    meas = np.array([r[1] for r in fitted])
    result = least_squares(lambda x: (np.array(zero) + x[0]) / meas - 1, [10.0], loss="soft_l1", f_scale=0.1)
    return float(result.x[0]) / 1e3


def time_tokenizer() -> None:
    """Tokenization of random-token text (as vLLM's random dataset makes prompts) with Qwen3's tokenizer."""
    import lzma

    from tokenizers import Tokenizer

    data = Path(__file__).resolve().parents[1] / "agentspec_sim" / "trace" / "data" / "qwen3" / "tokenizer.json.xz"
    with lzma.open(data) as f:
        tok = Tokenizer.from_str(f.read().decode())
    rng = np.random.default_rng(0)
    for n in (1024, 4096, 8192):
        text = tok.decode(rng.integers(0, 150000, n).tolist())
        start = time.perf_counter()
        for _ in range(5):
            ids = tok.encode(text).ids
        dt = (time.perf_counter() - start) / 5
        print(f"{n} tokens: {dt * 1e3:.1f} ms, {dt / len(ids) * 1e6:.2f} us a token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--tokenizer", action="store_true")
    args = parser.parse_args()
    if args.tokenizer:
        time_tokenizer()
        return
    rows = silicon_rows(args.csv or silicon_csv())
    if args.fit:
        print(f"frontend_request_s = {fit_request_s(rows):.4g}")
        return
    table(rows)


if __name__ == "__main__":
    main()
