#!/usr/bin/env bash
# The residency window on a GPU: its tests, then the H200 bench (well under 5 minutes together).
#   OUT=/some/dir bash bench/window_smoke.sh
set -euo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PYTHONPATH=. python3 -m pytest -m gpu -q tests/test_gpu_window.py 2>&1 | tee "$OUT/gpu-window-tests.txt"
PYTHONPATH=. python3 -m bench.window --out "$OUT" 2>&1 | tee "$OUT/window-bench.txt"
