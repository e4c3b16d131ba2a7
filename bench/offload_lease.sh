#!/usr/bin/env bash
# Mode offload's rows beside llama.cpp in one GPU lease, with llama.cpp built off the device
# (bench/h200_llama_prebuilt.md) and carried in: back-to-back device calls of at most 600 s each, /tmp kept
# between them while the machine stays warm.
#   OUT=DIR STEPS="files check" bash bench/offload_lease.sh        # then, in the next call:
#   OUT=DIR STEPS="rows" bash bench/offload_lease.sh               # and: STEPS="rows8b"
# carried (ignored paths, `carry` of the device tool): .llama/ (LLAMA_BIN, the binaries' .tar.xz, and VOCAB, an
# .xz of llama.cpp's models/ggml-vocab-qwen2.gguf: llama.cpp loads no file without a vocabulary) and WHEELS, the
# wheels the device's Python lacks (it has no network):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whlb gguf jsonschema jsonschema-specifications referencing rpds-py
# The tree, .llama/ and the wheels come to about 59 MiB of the 64 a call carries.
# STEPS picks some of (in this order):
#   files   random qwen3-1.7b Q8_0 and Q4_K_M with the vocabulary in /tmp (then qwen3-8b Q8_0, in the
#           background: ~9 GB), llama.cpp unpacked, a llama-bench smoke run
#   check   host kernels beside the link (bench/host_kernels_beside_link.py, 2 s samples) and the 16-session
#           choice among its neighbours (bench/offload_batch_homes.py) on the 1.7B Q4_K_M file
#   rows    bench/offload.py: the 1.7B files at 50 % and 25 %, batch 1 and 16 sessions, beside llama-bench and
#           llama-batched-bench (-ngl N), with the window alone
#   rows8b  the same for qwen3-8b Q8_0, batch 1
# Each step's log goes to $OUT/logs/ and its tail to stdout.
set -uo pipefail
OUT=${OUT:-/tmp/offload-lease}
LLAMA_BIN=${LLAMA_BIN:-.llama/llama_bin_sm90.tar.xz}
VOCAB=${VOCAB:-.llama/ggml-vocab-qwen2.gguf.xz}
WHEELS=${WHEELS:-.whlb}
STEPS=${STEPS:-files check}
BIN=/tmp/llama-bin/bin
source bench/lease_steps.sh
export LD_LIBRARY_PATH=$BIN:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}

files() {
    q17_files q8_0 q4_k_m
    [[ -f /tmp/q8b-q8_0.gguf ]] || setsid bash -c 'python3 -m bench.make_gguf --preset qwen3-8b --vocab /tmp/vocab.gguf \
        -o /tmp/q8b.part && mv /tmp/q8b.part /tmp/q8b-q8_0.gguf' > /tmp/make-8b.log 2>&1 < /dev/null &
    mkdir -p /tmp/llama-bin && tar xJf "$LLAMA_BIN" -C /tmp/llama-bin
    "$BIN/llama-bench" -m /tmp/q17-q8_0.gguf -ngl 14 -t 16 -p 0 -n 16 -r 1
}
export -f files; export VOCAB LLAMA_BIN BIN

check() {
    python3 -m bench.host_kernels_beside_link --tokens 1,4,8,16 --seconds 2 \
        && python3 -m bench.offload_batch_homes /tmp/q17-q4_k_m.gguf --thread-counts 12
}
export -f check

rows() {
    python3 -m bench.offload /tmp/q17-q8_0.gguf /tmp/q17-q4_k_m.gguf --fractions 0.5 0.25 --sessions 16 --repeats 3 \
        --llama-bench "$BIN/llama-bench" --llama-batched-bench "$BIN/llama-batched-bench" --out "$OUT"
}
export -f rows

rows8b() {
    while [[ ! -f /tmp/q8b-q8_0.gguf ]]; do sleep 2; done
    python3 -m bench.offload /tmp/q8b-q8_0.gguf --fractions 0.5 0.25 --repeats 2 --new-tokens 16 \
        --llama-bench "$BIN/llama-bench" --out "$OUT"
}
export -f rows8b

step 300 files
step 300 check
step 590 rows
step 590 rows8b
