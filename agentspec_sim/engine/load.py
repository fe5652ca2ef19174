"""Load protocols: when each query is sent to the engine, as serving benchmarks send requests.

Three protocols, named as vLLM 0.33's `vllm bench serve` names them (vllm/benchmarks/serve.py), plus the
offline one of published per-request speedup measurements:

- request rate (`--request-rate R --burstiness b`): `get_request` draws each inter-arrival gap from a
  gamma distribution of shape b and scale 1 / (R·b) (b = 1: a Poisson process), takes the cumulative sum
  (the first query is sent after the first gap, not at 0), then rescales every time so the last query is
  sent at exactly N / R: the throughput of one seed does not drift 1–2 % from the rate asked for.
  R = inf sends everything at 0; b = inf spaces queries exactly 1 / R apart. Because of the rescaling
  the send times at rate R are (N / R)·u with u independent of R: one seed's arrivals at two rates are
  the same pattern stretched, which keeps a capacity search's attainment curve free of resampling noise.
- max concurrency (`--max-concurrency N`): an asyncio semaphore around each request; a query waits for a
  slot in the order it arrived, holds it for all its calls and think times, and its latencies are
  measured from when it got the slot (vLLM's `start_time`; the wait is its client queue time). With an
  infinite rate this is a closed loop of N agents.
- copies (`--copies B`): each query alone, as B identical copies submitted together (`LLM.generate(
  [prompt] * B)`); the next query's copies when all B have finished. Each copy drafts with its own
  drafter state and the model-based drafters draw the same acceptance for every copy, so greedy copies
  draft and accept identically (only the token budget can set one apart).

- send order: `vllm bench serve` shuffles its dataset before sending (vllm/benchmarks/datasets/datasets.py,
  `random.seed(random_seed); random.shuffle(self.data)` unless `--disable-shuffle`): under a request rate or
  max concurrency the query instances (tenants included) go out in that order (`send_order`), the i-th
  send time to the i-th query of the shuffled list. Python's own `random` with the run's seed, so the order
  is the one vLLM's client draws for a dataset of the same length.

`agent think time` between a query's calls applies under every protocol (the trace's think_s, or
`think_time`).
"""

from __future__ import annotations

import math
import random

import numpy as np

from agentspec_sim.engine.config import EngineConfig


def request_rate_arrivals(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (seconds from the benchmark's start) of `n` queries at `rate` per second, as
    `vllm bench serve --seed seed` computes them (module docstring), from the same random stream: its `main_async`
    seeds NumPy's legacy global generator (`np.random.seed(args.seed)`) and `get_request` draws the n gaps from it
    in order (`np.random.gamma`), so the same seed sends at the same times. Pre: n ≥ 0, rate > 0, burstiness > 0."""
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


def send_order(n: int, seed: int, shuffle: bool) -> np.ndarray:
    """The query instances in the order the client sends them (module docstring): position i of the result is
    the instance sent i-th."""
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)  # vLLM: random.seed(seed); random.shuffle(data)
    return np.array(order, dtype=np.int64)


def shuffles(config: EngineConfig) -> bool:
    """Whether the run sends its queries in vLLM's shuffled dataset order: a request rate or max concurrency
    (vLLM's client) without disable_shuffle."""
    return (not config.disable_shuffle and not config.copies_protocol
            and (config.arrival == "request-rate" or config.max_concurrency is not None))


def protocol(config: EngineConfig, varied_rate: bool = False) -> str:
    """The load protocol of a run in a few words, for tables and plot titles; `varied_rate`: a capacity search's,
    whose request rate R is what varies."""
    think = "" if config.think_time is None else f", think {config.think_time:g} s"
    if config.copies_protocol:
        return f"copies {config.copies} (each query alone, offline batch){think}"
    if config.arrival == "request-rate" or varied_rate:
        shape = ("Poisson" if config.burstiness == 1 else
                 "evenly spaced" if math.isinf(config.burstiness) else f"gamma, burstiness {config.burstiness:g}")
        if varied_rate:
            text = f"request rate R ({shape})"
        elif math.isinf(config.rate):
            text = "request rate inf (all at once)"
        else:
            text = f"request rate {config.rate:g}/s ({shape})"
    elif config.arrival == "poisson":
        text = f"Poisson {config.rate:g}/s, first at 0"
    elif config.arrival == "zero":
        text = "all queries at t = 0"
    else:
        text = "the trace's arrival times (none: all at t = 0)"
    if config.max_concurrency is not None:
        text += f", max concurrency {config.max_concurrency}"
    if shuffles(config):
        text += ", shuffled"
    elif config.disable_shuffle and (config.arrival == "request-rate" or config.max_concurrency is not None):
        text += ", in trace order"
    if config.replicate > 1:
        text += f", ×{config.replicate} tenants"
    return text + think


def is_gated(config: EngineConfig) -> bool:
    """Whether queries wait for a slot (max concurrency) or for the previous query (copies)."""
    return config.max_concurrency is not None or config.copies_protocol
