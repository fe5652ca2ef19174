"""Live-GPU validation: torch forward passes timed against the cost model, cost calibration, and
runs through real vLLM."""
