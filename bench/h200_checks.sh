#!/usr/bin/env bash
# Every GPU check and H200 bench of the project in one device call (about 8 minutes), results under $OUT:
#   OUT=/some/dir KESTREL_COMMIT=<hash> bash bench/h200_checks.sh
# The device copy of the tree has no .git: KESTREL_COMMIT names the commit in the result files.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
run() { local seconds=$1 log=$2; shift 2; timeout "$seconds" "$@" 2>&1 | tail -40 > "$OUT/$log"; tail -6 "$OUT/$log"; }
run 150 gpu-tests.txt python3 -m pytest -m gpu -q tests/test_gpu_kernels.py tests/test_gpu_model.py \
    tests/test_gpu_modes.py tests/test_gpu_window.py tests/test_gpu_trace.py
run 150 window-bench.txt python3 -m bench.window --out "$OUT"
run 60 gpu-decode.txt python3 -m bench.gpu_decode --out "$OUT"
run 90 traces.txt python3 -m bench.trace_gpu --preset qwen3-1.7b --modes gated,gpu --vram-budget 1GiB \
    --steps 8 --out "$OUT"
run 300 daemon.txt python3 -m bench.daemon_latency --preset qwen3-1.7b --device cuda --mode gpu --label h200 \
    --steps 200 --tokens 50 --out "$OUT"
