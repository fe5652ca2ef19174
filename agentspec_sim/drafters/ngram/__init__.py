"""The n-gram family: vLLM's prompt-lookup proposers, V1 (`ngram`, rule.py) and Model Runner V2 (`ngram-v2`,
v2.py), token for token, and `ngram-adaptive` (adaptive.py: each call's draft length follows its acceptance).
index.py is the incremental index every row's lookup uses, tables.py the workload's table of matches,
fastpath.py the compiled path the engine drafts through."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"ngram": "rule", "ngram-v2": "v2", "ngram-adaptive": "adaptive"}
