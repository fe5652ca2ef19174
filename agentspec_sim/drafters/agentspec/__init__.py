"""AgentSpec (the paper, §4) and its ablations: the drafters and their settings (rule.py), the history cache
H(agent, query, block) (history.py; its n-gram index over the suffix family's tree arena, block_index.py),
the redundancy-aware budget allocation (allocation.py), the workload's lookup table (tables.py) and the
compiled path (fastpath.py). docs/agentspec.md works the rules out."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"agentspec": "rule", "agentspec-s": "rule", "agentspec-n": "rule", "agentspec-paper": "rule",
           "agentspec-r": "rule"}
# Built on: the suffix family's tree arena (block_index.py indexes blocks in it; agentspec-n is suffix decoding
# over the query's history).
BUILDS_ON = ("suffix",)
