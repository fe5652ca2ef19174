#!/usr/bin/env bash
# Live-GPU timing validation of the cost model, one command on a one-GPU machine (H100/H200 class):
#
#   bash validation/gpu_check.sh [OUT_DIR] [--quick]
#
# Replays the committed schedule samples of the bundled coding-agent trace (validation/schedules/:
# max_num_seqs 1, 32, 256) as real bf16 forward passes of Qwen3-8B- and GPT-OSS-20B-shaped models
# (random weights), timed with CUDA events after warm-up, CUDA graphs up to 512 tokens; compares
# with the roofline's predictions, fits a calibration per model and prints the MAPE table.
# Needs Python ≥ 3.11 with torch, numpy, scipy, matplotlib and pyarrow (or polars); runs from the
# source tree (no install, no package registry). Expected: under 4 min (full) / 90 s (--quick)
# on one H100/H200 (measured on an H200 with torch 2.11: 203 s / 56 s; see docs/validation.md).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="validation-out"
QUICK=()
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=(--quick) ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) OUT="$arg" ;;
  esac
done
PYTHON="${PYTHON:-python3}"
EXTRA=()
set +e
"$PYTHON" - <<'PY'
import importlib.util
import sys
missing = [m for m in ("torch", "numpy", "scipy", "matplotlib") if importlib.util.find_spec(m) is None]
if importlib.util.find_spec("pyarrow") is None and importlib.util.find_spec("polars") is None:
    missing.append("pyarrow (or polars)")
if missing:
    print(f"gpu_check: missing Python packages: {', '.join(missing)}", file=sys.stderr)
    sys.exit(2)
import torch
if not torch.cuda.is_available():
    print("gpu_check: no CUDA device visible to torch: running the tiny CPU configuration on 3 steps of the "
          "max_num_seqs=1 schedules (a smoke test, not a validation)", file=sys.stderr)
    sys.exit(3)
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", file=sys.stderr)
PY
rc=$?
set -e
if [ "$rc" -eq 3 ]; then
  EXTRA=(--steps 3 --repeats 1 --max-num-seqs 1)
elif [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
mkdir -p "$OUT"
start=$(date +%s)
"$PYTHON" "$HERE/launch.py" gpu-check --out "$OUT" "${QUICK[@]}" "${EXTRA[@]}"
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
