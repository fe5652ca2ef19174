"""Drafters: one drafter family per module (ngram, suffix, model-based, AgentSpec, AgSpec) and the
structure automaton AgentSpec drafts with (`structure.py`)."""
