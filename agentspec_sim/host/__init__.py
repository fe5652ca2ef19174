"""The machine the simulator runs on: its environment variables, its memory, and the compiled-code cache."""
