"""Offline analyses of a trace (no simulation): the repetition profile of paper Figure 5."""
