"""`validate bench` and `calibrate bench`: a user's own `vllm bench serve` run, replayed through the simulator.

A user with a GPU runs `vllm bench serve --save-result --save-detailed --seed S ...` against `vllm serve`. The
result file (vLLM 0.33's `vllm/benchmarks/serve.py`: one JSON object; `--append-result` appends one a line) holds
the protocol (`request_rate`, `burstiness`, `max_concurrency`), each request's prompt and output length
(`input_lens`, `output_lens`, the server's own counts) in send order, and what the client measured: `ttfts`,
`itls` (one gap a streamed chunk), `latencies` (E2EL), `errors`, `duration`. It does not hold the seed, the dataset
or the engine's flags: the seed is `--seed` here as it was there (vLLM's default 0), the engine's flags are the
replay's own options.

The replay sends the same requests at the same times: one single-call query per successful request, in the file's
order (send order: vLLM sends its dataset as listed, the random dataset unshuffled), with the file's lengths, at the
send times `vllm bench serve --seed S` drew (engine/load.py `request_rate_arrivals`: NumPy's legacy generator seeded
with S, one gamma gap a request, rescaled to end at N / rate), behind the same `--max-concurrency` semaphore. Prompt
ids are what vLLM's random dataset makes (consecutive ids from a random offset a request; prefix caching finds
nothing to share), outputs are forced to the recorded length (the random dataset sets ignore_eos). Without
`--save-detailed` the file has no per-request lengths: refused, naming the field.

Compared as `vllm bench serve` prints them: TTFT, TPOT ((E2EL − TTFT) / (output − 1), requests of more than one
token), ITL (every gap, pooled), E2EL — mean, median, p99 in ms — and request and output throughput over the run's
duration. `calibrate bench` fits the host terms the engine does not see, from one or more such files: the front
end's time a request and a prompt token (`Calibration.frontend_request_s`, `frontend_prompt_token_s`; TTFT and E2EL
move by exactly that, the engine does not), least squares on each request's relative TTFT error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentspec_sim.io import strict_json
from agentspec_sim.trace.schema import Call, Query, TraceMeta, Workload

STATS = ("mean", "median", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")


class BenchFileError(ValueError):
    """A result file that cannot be replayed: the message names the file and the field."""


@dataclass(frozen=True)
class BenchResult:
    """One `vllm bench serve` run as its result file holds it (times in seconds, per-request arrays in send order;
    the failed requests, which the replay does not send, dropped from every array)."""

    path: Path
    model_id: str | None
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    input_lens: np.ndarray
    output_lens: np.ndarray
    ttfts: np.ndarray
    latencies: np.ndarray
    itls: tuple[np.ndarray, ...]
    failed: int

    @property
    def num_requests(self) -> int:
        return int(self.input_lens.shape[0])


def read_bench_results(path: str | Path) -> list[BenchResult]:
    """Every run in a result file (one JSON object, or one a line as `--append-result` writes them)."""
    path = Path(path)
    try:
        text = strict_json.read_document(path)
    except strict_json.StrictJSONError as exc:
        raise BenchFileError(f"{path}: {exc.msg}") from None
    stripped = text.strip()
    if not stripped:
        raise BenchFileError(f"{path}: empty: expected a `vllm bench serve --save-result` JSON file")
    try:
        documents = [(None, strict_json.loads(stripped))]
    except strict_json.StrictJSONError:
        def refuse(number: int, exc: strict_json.StrictJSONError) -> BenchFileError:
            return BenchFileError(f"{path}:{number}: {exc.msg}")
        documents = list(strict_json.json_lines(text, refuse))
    return [_result(path, line, doc) for line, doc in documents]


def _result(path: Path, line: int | None, doc: Any) -> BenchResult:
    where = f"{path}:{line}" if line is not None else str(path)
    if not isinstance(doc, dict):
        raise BenchFileError(f"{where}: expected a JSON object (a `vllm bench serve --save-result` file)")

    def field(name: str, kinds: tuple[type, ...], required: bool = True) -> Any:
        if name not in doc:
            if required:
                hint = " (run vllm bench serve with --save-detailed)" if name in _DETAILED else ""
                raise BenchFileError(f"{where}: {name}: missing{hint}")
            return None
        value = doc[name]
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise BenchFileError(f"{where}: {name}: expected {names}, got {type(value).__name__}")
        return value

    rate = field("request_rate", (int, float, str))
    if isinstance(rate, str):
        if rate != "inf":
            raise BenchFileError(f"{where}: request_rate: expected a number or \"inf\", got {rate!r}")
        rate = math.inf
    if not rate > 0:
        raise BenchFileError(f"{where}: request_rate: must be > 0, got {rate}")
    burstiness = float(field("burstiness", (int, float)))
    if not burstiness > 0:
        raise BenchFileError(f"{where}: burstiness: must be > 0, got {burstiness}")
    concurrency = field("max_concurrency", (int,), required=False)
    if concurrency is not None and concurrency < 1:
        raise BenchFileError(f"{where}: max_concurrency: must be ≥ 1, got {concurrency}")
    duration = float(field("duration", (int, float)))
    if "ramp_up_strategy" in doc and doc["ramp_up_strategy"] is not None:
        raise BenchFileError(f"{where}: ramp_up_strategy: a ramp-up's send times are not replayed (run without "
                             "--ramp-up-strategy)")

    def numbers(name: str, integer: bool) -> np.ndarray:
        values = field(name, (list,))
        kinds = (int,) if integer else (int, float)
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, kinds) or v < 0:
                raise BenchFileError(f"{where}: {name}[{i}]: expected a {'count' if integer else 'time'} ≥ 0, "
                                     f"got {v!r}")
        return np.array(values, dtype=np.int64 if integer else np.float64)

    inputs, outputs = numbers("input_lens", True), numbers("output_lens", True)
    ttfts, latencies = numbers("ttfts", False), numbers("latencies", False)
    itls_raw = field("itls", (list,))
    errors = field("errors", (list,), required=False) or [""] * len(itls_raw)
    n = inputs.shape[0]
    for name, values in (("output_lens", outputs), ("ttfts", ttfts), ("latencies", latencies),
                         ("itls", itls_raw), ("errors", errors)):
        if len(values) != n:
            raise BenchFileError(f"{where}: {name}: {len(values)} entries for {n} requests (input_lens)")
    itls = []
    for i, gaps in enumerate(itls_raw):
        if not isinstance(gaps, list) or any(isinstance(g, bool) or not isinstance(g, (int, float)) or g < 0
                                             for g in gaps):
            raise BenchFileError(f"{where}: itls[{i}]: expected a list of times ≥ 0")
        itls.append(np.array(gaps, dtype=np.float64))
    ok = np.array([not e for e in errors], dtype=bool) & (outputs > 0)
    if not ok.any():
        raise BenchFileError(f"{where}: errors: no request succeeded: nothing to compare")
    keep = ok.nonzero()[0]
    return BenchResult(path=path, model_id=doc.get("model_id") if isinstance(doc.get("model_id"), str) else None,
                       request_rate=float(rate), burstiness=burstiness, max_concurrency=concurrency,
                       duration_s=duration, input_lens=inputs[keep], output_lens=outputs[keep], ttfts=ttfts[keep],
                       latencies=latencies[keep], itls=tuple(itls[i] for i in keep), failed=int(n - keep.shape[0]))


_DETAILED = frozenset(("input_lens", "output_lens", "ttfts", "itls", "errors", "start_times"))


# ---- what the client measured, and what the replay predicts ---------------------------------------------------


def _stats(values: np.ndarray) -> dict[str, float | None]:
    """mean, median, p99 in ms as `vllm bench serve` computes them (numpy, linear percentiles); None: no value."""
    if values.size == 0:
        return dict.fromkeys(STATS)
    return {"mean": float(np.mean(values)) * 1e3, "median": float(np.median(values)) * 1e3,
            "p99": float(np.percentile(values, 99)) * 1e3}


def client_metrics(ttft: np.ndarray, e2el: np.ndarray, outputs: np.ndarray, itl: np.ndarray,
                   duration_s: float) -> dict[str, Any]:
    """The metrics `vllm bench serve` prints, from per-request TTFT and E2EL (s), output lengths and the pooled
    ITL gaps: TPOT = (E2EL − TTFT) / (output − 1) over requests of more than one token."""
    many = outputs > 1
    tpot = (e2el[many] - ttft[many]) / (outputs[many] - 1)
    return {"ttft": _stats(ttft), "tpot": _stats(tpot), "itl": _stats(itl), "e2el": _stats(e2el),
            "request_throughput": ttft.shape[0] / duration_s if duration_s > 0 else None,
            "output_throughput": float(outputs.sum()) / duration_s if duration_s > 0 else None,
            "duration_s": duration_s}


def measured_metrics(result: BenchResult) -> dict[str, Any]:
    itl = np.concatenate(result.itls) if result.itls else np.zeros(0)
    return client_metrics(result.ttfts, result.latencies, result.output_lens, itl, result.duration_s)


# ---- the replay -------------------------------------------------------------------------------------------------


def bench_workload(result: BenchResult, seed: int, vocab_size: int) -> Workload:
    """One single-call query a request, in send order: prompt ids as vLLM's random dataset makes them (consecutive
    from a random offset), `output_lens` forced output ids (seeded)."""
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, vocab_size, result.num_requests)
    queries = []
    for i, (n_in, n_out) in enumerate(zip(result.input_lens.tolist(), result.output_lens.tolist(), strict=True)):
        prompt = (offsets[i] + i + np.arange(n_in, dtype=np.int64)) % vocab_size
        call = Call(id=f"bench-{i}", agent_id=0, query_id=f"bench-{i}", seq=0, prompt_tokens=prompt,
                    output_tokens=rng.integers(0, vocab_size, n_out))
        queries.append(Query(agent_id=0, query_id=f"bench-{i}", calls=(call,)))
    return Workload(meta=TraceMeta(tokenizer=None, vocab_size=vocab_size), queries=tuple(queries))


def bench_config(result: BenchResult, engine: Any, seed: int) -> Any:
    """`engine` (an EngineConfig: hardware, model, the server's flags) under the run's protocol and seed, its
    queries sent in file order (the file's arrays are already in send order)."""
    return dataclasses.replace(engine, arrival="request-rate", rate=result.request_rate,
                               burstiness=result.burstiness, max_concurrency=result.max_concurrency, seed=seed,
                               disable_shuffle=True, replicate=1, copies=1)


@dataclass(frozen=True)
class Replay:
    """The replay of one result file: per request (send order) its simulated TTFT and E2EL without the front end
    (engine only), its front-end time, the pooled ITL gaps and the run's duration."""

    ttft_engine: np.ndarray
    e2el_engine: np.ndarray
    frontend_s: np.ndarray
    itl: np.ndarray
    duration_s: float

    def metrics(self, outputs: np.ndarray, frontend_s: np.ndarray | None = None) -> dict[str, Any]:
        front = self.frontend_s if frontend_s is None else frontend_s
        return client_metrics(self.ttft_engine + front, self.e2el_engine + front, outputs, self.itl,
                              self.duration_s)


def replay_bench(result: BenchResult, engine: Any, cost_model: Any, seed: int = 0) -> Replay:
    """Simulate the run (drafter `normal`: `vllm serve` without speculative decoding)."""
    from agentspec_sim.metrics import summarize
    from agentspec_sim.run.simulation import simulate
    from agentspec_sim.slo import inter_token_latencies

    workload = bench_workload(result, seed, cost_model.model.vocab_size)
    run = simulate(workload, "normal", bench_config(result, engine, seed), cost_model=cost_model)
    calls = run.calls
    order = np.argsort(np.array([int(c.split("-")[1]) for c in calls["call_id"].to_list()]))
    calls = calls[order]
    if (calls["status"] != "finished").any():
        bad = calls.filter(calls["status"] != "finished")["call_id"][0]
        raise BenchFileError(f"{result.path}: request {bad.split('-')[1]} was not served by the replay "
                             "(max_model_len or KV cache: pass the server's flags)")
    front = cost_model.frontend_time(calls["prompt_len"].to_numpy())
    first = calls["first_token_s"].to_numpy() - front
    finish = calls["finish_s"].to_numpy() - front
    arrival = calls["arrival_s"].to_numpy()
    itl, _ = inter_token_latencies(run)
    return Replay(ttft_engine=first - arrival, e2el_engine=finish - arrival, frontend_s=front, itl=itl,
                  duration_s=summarize(run).duration_s)


def compare_rows(predicted: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row a metric and statistic: predicted, measured, predicted / measured − 1."""
    rows = []
    for metric in METRICS:
        for stat in STATS:
            p, m = predicted[metric][stat], measured[metric][stat]
            rows.append({"metric": f"{stat}_{metric}_ms", "predicted": p, "measured": m,
                         "error": (p / m - 1) if p is not None and m else None})
    for name in ("request_throughput", "output_throughput"):
        p, m = predicted[name], measured[name]
        rows.append({"metric": name, "predicted": p, "measured": m, "error": (p / m - 1) if p and m else None})
    return rows


# ---- calibrate bench --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontendFit:
    """The front end's time fitted on the files' requests: `frontend_request_s` + `frontend_prompt_token_s` a
    prompt token, and the median |relative TTFT error| before (the calibration's own terms) and after."""

    request_s: float
    prompt_token_s: float
    requests: int
    ttft_error_before: float
    ttft_error_after: float


def fit_frontend(results: Sequence[BenchResult], replays: Sequence[Replay], request_s: float,
                 prompt_token_s: float, fit_prompt_term: bool = True) -> FrontendFit:
    """Least squares (soft L1) on each request's relative TTFT error: the engine's TTFT does not move with the front
    end's terms, so one replay per file suffices. `fit_prompt_term` False keeps `prompt_token_s` (prompts of one
    length cannot tell a per-token term from a per-request one)."""
    from scipy.optimize import least_squares

    engine = np.concatenate([r.ttft_engine for r in replays])
    prompts = np.concatenate([res.input_lens for res in results]).astype(np.float64)
    measured = np.concatenate([res.ttfts for res in results])
    keep = measured > 0
    engine, prompts, measured = engine[keep], prompts[keep], measured[keep]

    def errors(request: float, per_token: float) -> np.ndarray:
        return (engine + request + per_token * prompts) / measured - 1

    before = float(np.median(np.abs(errors(request_s, prompt_token_s))))
    if fit_prompt_term:
        fit = least_squares(lambda x: errors(x[0] * 1e-3, x[1] * 1e-6), [request_s * 1e3, prompt_token_s * 1e6],
                            loss="soft_l1", f_scale=0.1, bounds=([0.0, 0.0], [np.inf, np.inf]))
        request, per_token = float(fit.x[0]) * 1e-3, float(fit.x[1]) * 1e-6
    else:
        fit = least_squares(lambda x: errors(x[0] * 1e-3, prompt_token_s), [request_s * 1e3], loss="soft_l1",
                            f_scale=0.1, bounds=([0.0], [np.inf]))
        request, per_token = float(fit.x[0]) * 1e-3, prompt_token_s
    return FrontendFit(request_s=request, prompt_token_s=per_token, requests=int(measured.shape[0]),
                       ttft_error_before=before, ttft_error_after=float(np.median(np.abs(errors(request, per_token)))))


def _tpots(ttft: np.ndarray, e2el: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    many = outputs > 1
    return np.where(many, (e2el - ttft) / np.maximum(outputs - 1, 1), np.nan)


@dataclass(frozen=True)
class StepHostFit:
    """The per-step host term fitted on the files' TPOTs: the factor (`step_overhead_s` with async scheduling,
    `sync_host_step_s` without), its value, and the median |relative TPOT error| before and after (replayed)."""

    factor: str
    value_s: float
    requests: int
    tpot_error_before: float
    tpot_error_after: float


def fit_step_host(results: Sequence[BenchResult], replays: Sequence[Replay], engine: Any, cost_model: Any,
                  seed: int, synchronous: bool) -> tuple[StepHostFit, Any]:
    """The host time a step pays beyond the kernels (`step_overhead_s`, or `sync_host_step_s` when the server ran
    without async scheduling), from the files' TPOTs: a decode step emits one token a request, so the median gap
    between measured and replayed TPOT is what each step misses. Moved by that much, replayed once more to report
    the result (the engine's batching moves with it: not a closed form). `replays`: the files' replays with
    `cost_model` (`replay_bench`), the TPOTs before. Returns the fit and the new cost model."""
    from agentspec_sim.cost.roofline import RooflineCostModel

    def errors(replayed: Sequence[Replay]) -> tuple[np.ndarray, np.ndarray]:
        measured, predicted = [], []
        for res, rep in zip(results, replayed, strict=True):
            measured.append(_tpots(res.ttfts, res.latencies, res.output_lens))
            predicted.append(_tpots(rep.ttft_engine, rep.e2el_engine, res.output_lens))
        m, p = np.concatenate(measured), np.concatenate(predicted)
        keep = np.isfinite(m) & np.isfinite(p) & (m > 0)
        return m[keep], p[keep]

    factor = "sync_host_step_s" if synchronous else "step_overhead_s"
    cal = cost_model.calibration
    measured, predicted = errors(replays)
    before = float(np.median(np.abs(predicted / measured - 1)))
    value = max(0.0, getattr(cal, factor) + float(np.median(measured - predicted)))
    fitted = RooflineCostModel(cost_model.hardware, cost_model.model, cost_model.tensor_parallel_size,
                               cal.replace(**{factor: value}), expert_parallel=cost_model.expert_parallel,
                               data_parallel_size=cost_model.data_parallel_size,
                               kv_dtype_bytes=cost_model.kv_dtype_bytes)
    measured, predicted = errors([replay_bench(res, engine, fitted, seed) for res in results])
    after = float(np.median(np.abs(predicted / measured - 1)))
    return StepHostFit(factor, value, int(measured.shape[0]), before, after), fitted
