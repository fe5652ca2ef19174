"""What several drafter families share: the structure automaton (structure.py) and the disk cache of
workload tables (table_cache.py)."""
