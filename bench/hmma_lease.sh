#!/usr/bin/env bash
# The tensor-core GEMVs' pipelined layouts (q8_gemv_hmma.cu, q4k_ / q6k_gemv_hmma.cu: two steps' loads in flight a
# warp) against the defaults in one GPU lease: back-to-back device calls of at most 600 s each, /tmp kept between
# them while the machine stays warm.
#   OUT=DIR STEPS="files tests kernels" bash bench/hmma_lease.sh     # then, in the next call:
#   OUT=DIR STEPS="steps" bash bench/hmma_lease.sh
# carried: VOCAB (an .xz of llama.cpp's models/ggml-vocab-qwen2.gguf) and WHEELS (gguf and what it needs, as
# bench/offload_lease.sh names them).
# STEPS picks some of (in this order):
#   files    random qwen3-1.7b Q8_0 and Q4_K_M in /tmp (qwen3-8b Q4_K_M in the background)
#   tests    every layout against numpy on the GPU (tests/test_hmma_emulated.py -m gpu), and the device-drawn
#            samples' and mode offload's GPU tests (sampling, drawn decodes, gpu model, offload emulated)
#   kernels  each layout alone at the 1.7B's shapes (bench/gpu_kernels.py --multi-only: Q8_0) and the K-quants'
#            at the 1.7B's and 8B's (bench/block_mma.py)
#   steps    bench/steps.py on the three files with --hmma-layouts default, pipelined, half, alternated twice
set -uo pipefail
OUT=${OUT:-/tmp/hmma-lease}
VOCAB=${VOCAB:-.llama/ggml-vocab-qwen2.gguf.xz}
WHEELS=${WHEELS:-.whlb}
STEPS=${STEPS:-files tests kernels}
export VOCAB
source bench/lease_steps.sh

files() {
    q17_files q8_0 q4_k_m
    [[ -f /tmp/q8b-q4_k_m.gguf ]] || setsid bash -c 'python3 -m bench.make_gguf --preset qwen3-8b --mix q4_k_m \
        --vocab /tmp/vocab.gguf -o /tmp/q8b.part && mv /tmp/q8b.part /tmp/q8b-q4_k_m.gguf' > /tmp/make-8b.log 2>&1 < /dev/null &
    ls -la /tmp/*.gguf
}
export -f files

tests() {
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hmma_emulated.py tests/test_sampling_device.py \
        tests/test_serve_drawn_decodes.py tests/test_gpu_model.py tests/test_offload_emulated.py
}
export -f tests

kernels() {
    python3 -m bench.gpu_kernels --multi-only --out "$OUT/kernels" \
        && python3 -m bench.block_mma --formats Q4_K,Q6_K --models qwen3-1.7b,qwen3-8b --tokens 4,8,16 --splits 1 \
            --out "$OUT/block"
}
export -f kernels

steps() {
    while [[ ! -f /tmp/q8b-q4_k_m.gguf ]]; do sleep 2; done
    for round in 1 2; do
        for layouts in default pipelined half; do
            python3 -m bench.steps /tmp/q17-q8_0.gguf /tmp/q17-q4_k_m.gguf /tmp/q8b-q4_k_m.gguf \
                --tokens 1,3,4,8,11,16 --logits last --repeats 5 --pp '' --hmma-layouts $layouts \
                --out "$OUT/steps-$round" || return 1
        done
    done
}
export -f steps

step 300 files
step 300 tests
step 290 kernels
step 590 steps
