#!/usr/bin/env bash
# #42's rows in one GPU lease: the Qwen3-30B-A3B shape written on the device, the routed layers' GPU tests, our
# decode in VRAM with an A tree's kernels against this tree's (alternated), then the rows beside llama.cpp built
# on the device (bench/llama_build_on_device.sh, started by serve_lease.sh's `build` or here).
#   OUT=DIR STEPS="build files tests ab" A=.ab/A bash bench/moe_lease.sh    # ~6 min
#   OUT=DIR STEPS="rows" bash bench/moe_lease.sh                           # once the build is done (it waits)
# carried (ignored paths): .llama/ (LLAMA_SRC, VOCAB: llama.cpp's qwen2 vocabulary .xz), WHEELS (gguf and its
# dependencies: .whlb) and A (an A tree: `git archive REV kestrel_stream scheduler kernels_ptx | tar x -C A`).
# STEPS picks some of (in this order):
#   build  llama.cpp from LLAMA_SRC in the background (log /tmp/llama-dev/build.log), unless it is there
#   files  /tmp/q30a3b.gguf: random qwen3-30b-a3b Q8_0 with the vocabulary (32.5 GB, ~45 s)
#   tests  the routed layers' GPU tests (tests/test_moe_kernels.py, tests/test_gpu_moe.py)
#   ab     bench.moe_offload --budgets all (gpu mode: batch-1 decode, a 512-token prefill, 16 sessions), A, this
#          tree, A, this tree (A given; its bench/ replaced by this one's; ROUNDS=1: A, this tree)
#   gemv   this tree's steps of a few tokens (16 sessions) on 8 experts a block (KESTREL_MOE_GEMV=g4, the default)
#          against one expert a block (m8), alternated ROUNDS times: bench.moe_offload --budgets all
#   rows   after waiting for the build: all in VRAM and experts:0.1 (BUDGETS) beside llama-bench -ngl 99 (-ncmoe 48:
#          NCMOE, " " for none) and llama-batched-bench
# Each step's log goes to $OUT/logs/ and its tail to stdout; rows to $OUT/<label>/.
set -uo pipefail
OUT=${OUT:-/tmp/moe-lease}
LLAMA_SRC=${LLAMA_SRC:-.llama/llama_src_0c1e570.tar.xz}
VOCAB=${VOCAB:-.llama/ggml-vocab-qwen2.gguf.xz}
WHEELS=${WHEELS:-.whlb}
A=${A:-}
STEPS=${STEPS:-build files tests ab}
BIN=/tmp/llama-dev/llama.cpp/build/bin
export A BIN LLAMA_SRC VOCAB
source bench/lease_steps.sh

build() {
    [[ -x $BIN/llama-bench || -d /tmp/llama-dev/llama.cpp ]] || SRC=$LLAMA_SRC bash bench/llama_build_on_device.sh
}
export -f build

files() {
    [[ -f /tmp/vocab.gguf ]] || xz -dc "$VOCAB" > /tmp/vocab.gguf
    [[ -f /tmp/q30a3b.gguf ]] || { python3 -m bench.make_gguf --preset qwen3-30b-a3b --mix q8_0 \
        --vocab /tmp/vocab.gguf -o /tmp/q30a3b.part && mv /tmp/q30a3b.part /tmp/q30a3b.gguf; }
}
export -f files

tests() {
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_moe_kernels.py tests/test_gpu_moe.py
}
export -f tests

ab() {
    local round side tree
    [[ -n $A ]] && { rm -rf "$A/bench" && cp -r bench "$A/bench"; }
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for side in ${A:+A} B; do
            tree=.; [[ $side == A ]] && tree=$A
            (cd "$tree" && PYTHONPATH=/tmp/site:. python3 -m bench.moe_offload /tmp/q30a3b.gguf --budgets all \
                --repeats 3 --out "$OUT/ab-$side-$round") | tail -3
        done
    done
}
export -f ab

gemv() {
    local round layout
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for layout in m8 g4; do
            KESTREL_MOE_GEMV=$layout python3 -m bench.moe_offload /tmp/q30a3b.gguf --budgets all --repeats 3 \
                --prompt 64 --out "$OUT/gemv-$layout-$round" | tail -1
        done
    done
}
export -f gemv

rows() {
    while [[ ! -x $BIN/llama-batched-bench ]]; do
        grep -qE "CMake Error|\*\*\* \[|: error:" /tmp/llama-dev/build.log 2>/dev/null && { tail -20 /tmp/llama-dev/build.log; return 1; }
        sleep 5
    done
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    python3 -m bench.moe_offload /tmp/q30a3b.gguf --budgets ${BUDGETS:-all experts:0.1} --stream off --repeats 3 \
        --llama-bench "$BIN/llama-bench" --llama-batched-bench "$BIN/llama-batched-bench" ${NCMOE:---ncmoe 48} \
        --out "$OUT/rows"
}
export -f rows

step 60 build
step 240 files
step 240 tests
step 590 ab
step 590 gemv
step 590 rows
