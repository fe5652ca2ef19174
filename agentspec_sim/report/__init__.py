"""Markdown reports with PNG plots from sweep results, and `check`: regression checks against a recorded baseline."""
