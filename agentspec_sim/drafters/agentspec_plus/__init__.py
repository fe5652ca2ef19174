"""`agentspec+`: AgentSpec's structure-isolated drafting and budget with AgSpec's corpora (docs/agentspec.md §10)."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"agentspec+": "rule"}
# Built on: AgentSpec's history and budget, AgSpec's corpora.
BUILDS_ON = ("agentspec", "agspec")
