"""Drafters: one family per package (normal, ngram, suffix, agentspec, agentspec_plus, agspec, model), each its
rule and its compiled path over the engine's drafter API (engine/drafting.py); what families share in
`common`; the registry and `--speculative-config` parsing in registry.py, which loads a family when one of its
methods is first asked for."""
