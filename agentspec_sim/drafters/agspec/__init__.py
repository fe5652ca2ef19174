"""AgSpec's retrieval drafting for coding agents (rule.py) over its token-level n-gram corpora
(corpus_index.py). docs/agspec.md has the rules with the article's words."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"agspec": "rule"}
