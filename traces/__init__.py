"""Bundled real agent traces (data only; see README.md for provenance)."""
