"""Capacity: the highest steady request rate a configuration sustains under latency SLOs, with its interval.

`search` runs the search (probes, lengthening, seeds, interval); `steady` judges one probe on its steady
window (stability and attainment there).
"""

from agentspec_sim.capacity.search import (
    Capacity,
    CapacitySearch,
    Probe,
    SeedCapacity,
    find_capacity,
    probe_config,
    search_capacity,
    summary_probe,
    throughput_ceiling,
)
from agentspec_sim.capacity.steady import CRITERIA, SteadyState, steady_state

__all__ = ["CRITERIA", "Capacity", "CapacitySearch", "Probe", "SeedCapacity", "SteadyState", "find_capacity",
           "probe_config", "search_capacity", "steady_state", "summary_probe", "throughput_ceiling"]
