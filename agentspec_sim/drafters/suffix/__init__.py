"""Suffix decoding as vLLM 0.33 runs ArcticInference 0.3.0's cache (`suffix`): the rule (rule.py), its
depth-limited suffix trees (tree.py), the workload's prompt-tree drafts (tables.py) and the compiled path
(fastpath.py). docs/suffix-decoding.md works it out."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"suffix": "rule"}
