"""Simulator speed per drafter and max_num_seqs: the `engine` section of benchmarks/run.py.

Usage: python benchmarks/engine_bench.py [same options as run.py]
Kept as a name for it: run.py measures the engine (this), scale runs on synthetic traces, the
Figure-1 sweep and suffix vs ArcticInference, and writes them all to benchmarks/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import main

if __name__ == "__main__":
    main(["--sections", "engine", *sys.argv[1:]])
