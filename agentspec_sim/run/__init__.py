"""Runs: one replay of a workload through the engine with a drafter (`simulate`), several against `normal`
(`compare`), their acceptance-model bands (`band`), and `replay`, all of it on one cost model — the layer above
the engine and the drafters that the command line, sweeps and capacity searches call."""

from agentspec_sim.run.entry import Replay, replay
from agentspec_sim.run.simulation import compare, simulate

__all__ = ["Replay", "compare", "replay", "simulate"]
