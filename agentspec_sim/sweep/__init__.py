"""Sweeps over drafter configurations and engine settings, run in worker processes and resumable;
capacity planning from their results."""
