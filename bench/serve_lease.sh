#!/usr/bin/env bash
# #34's staggered serving pair in one GPU lease: llama-server built on the device (bench/llama_build_on_device.sh,
# in the background) and our daemon, on the same random 1.7B Q8_0 file, greedy and sampled, with an A/B tree.
#   OUT=DIR STEPS="build files gputests mixed" A=.ab/A bash bench/serve_lease.sh   # ~3 min; the build runs on (~8 min)
#   OUT=DIR STEPS="ours" A=.ab/A bash bench/serve_lease.sh           # meanwhile: ours, A and this tree alternated
#   OUT=DIR STEPS="policy" bash bench/serve_lease.sh                 # this tree under four step policies
#   OUT=DIR STEPS="llama traced" bash bench/serve_lease.sh           # once the build is done (it waits for it)
# carried (ignored paths): .llama/ (LLAMA_SRC, the source tarball; VOCAB, llama.cpp's qwen2 vocabulary .xz),
# WHEELS (the daemon's and the client's wheels the device's Python lacks) and A (an A tree: `git archive REV
# kestrel_stream scheduler kernels_ptx bench | tar x -C A`, optional).
# STEPS picks some of (in this order):
#   build  llama.cpp's llama-server from LLAMA_SRC, in the background (log /tmp/llama-dev/build.log)
#   files  /tmp/q17.gguf: random qwen3-1.7b Q8_0 with the vocabulary (llama.cpp loads no file without one)
#   gputests  tests/test_gpu_flash_attention.py (a serving step split between the attention kernels: 1b36c6f)
#   mixed  a prompt chunk of 64-2,048 tokens beside 64 decoding sessions in one step, against each alone
#          (bench/mixed_steps.py): the steps a staggered run is made of, and what a request arriving in one waits
#   ours   bench.http_serve's staggered workload on our daemon: A, this tree, A, this tree (A given), greedy
#          then --temperature 0.8
#   policy the workload on this tree's daemon, greedy, under four step policies: the defaults, --prompt-order
#          shortest, --step-tokens 512, and both (--serve-args): what a short prompt's first token waits for
#   llama  after waiting for the build: the workload on this tree's daemon and then on llama-server (-ngl 99
#          -np 64 -fa on --cache-ram 0), greedy then sampled (a request not done in 150 s counts as lost: the row
#          is written)
#   traced the workload once more on this tree's daemon, greedy, with its trace (--trace: a traced step can run
#          slower, so its figures are not the rows'): where a request's open and first step spend their time
# Each step's log goes to $OUT/logs/ and its tail to stdout; the rows to $OUT/<label>/.
set -uo pipefail
OUT=${OUT:-/tmp/serve-lease}
LLAMA_SRC=${LLAMA_SRC:-.llama/llama_src_0c1e570.tar.xz}
VOCAB=${VOCAB:-.llama/ggml-vocab-qwen2.gguf.xz}
WHEELS=${WHEELS:-.whl}
A=${A:-}
STEPS=${STEPS:-build files}
SERVER=/tmp/llama-dev/llama.cpp/build/bin/llama-server
export A SERVER LLAMA_SRC VOCAB
STEP_TAIL=12
source bench/lease_steps.sh

staggered() {      # staggered TREE LABEL [more flags]: one run of the workload from TREE's bench and package
    local tree=$1 label=$2; shift 2
    (cd "$tree" && PYTHONPATH=/tmp/site:. python3 -m bench.http_serve --workload staggered --model /tmp/q17.gguf \
        --device cuda --clients 64 --requests 200 --max-sessions 64 --prompt-range 32,2048 --new-range 16,256 \
        --client-processes 4 --out "$OUT/$label" --label "$label" "$@" | tail -2)
}
export -f staggered

build() {
    [[ -x $SERVER ]] || SRC=$LLAMA_SRC bash bench/llama_build_on_device.sh
}
export -f build

files() {
    xz -dc "$VOCAB" > /tmp/vocab.gguf
    [[ -f /tmp/q17.gguf ]] || { python3 -m bench.make_gguf --preset qwen3-1.7b --mix q8_0 --vocab /tmp/vocab.gguf \
        -o /tmp/q17.part && mv /tmp/q17.part /tmp/q17.gguf; }
}
export -f files

ours() {
    for temperature in 0 0.8; do
        for round in 1 2; do
            if [[ -n $A ]]; then
                rm -rf "$A/bench" && cp -r bench "$A/bench"      # the same load generator on both sides
                staggered "$A" "A-t$temperature-$round" --temperature "$temperature"
            fi
            staggered . "B-t$temperature-$round" --temperature "$temperature"
        done
    done
}
export -f ours

policy() {
    staggered . "policy-default" --temperature 0
    staggered . "policy-shortest" --temperature 0 --serve-args "--prompt-order shortest"
    staggered . "policy-512" --temperature 0 --serve-args "--step-tokens 512"
    staggered . "policy-shortest-512" --temperature 0 --serve-args "--prompt-order shortest --step-tokens 512"
}
export -f policy

llama() {
    while [[ ! -x $SERVER ]]; do
        grep -qE "CMake Error|\*\*\* \[|: error:" /tmp/llama-dev/build.log 2>/dev/null && { tail -20 /tmp/llama-dev/build.log; return 1; }
        sleep 5
    done
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    for temperature in 0 0.8; do        # ours, then llama-server on the device alone (bench.http_serve)
        staggered . "pair-t$temperature" --temperature "$temperature" --llama-server "$SERVER" --timeout-s 150
    done
}
export -f llama

mixed() {       # this tree (B), and the A tree first where one is given (its bench/ replaced by this one's)
    local side
    for side in ${A:+A} B; do
        local tree=.
        [[ $side == A ]] && { tree=$A; rm -rf "$A/bench" && cp -r bench "$A/bench"; }
        (cd "$tree" && PYTHONPATH=/tmp/site:. python3 -m bench.mixed_steps /tmp/q17.gguf --decodes 64 --context 512 \
            --chunks 64,256,512,1024,2048 --out "$OUT/mixed-$side") || return 1
    done
}
export -f mixed

gputests() {   # the GPU tests of the commits since the last lease
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_flash_attention.py
}
export -f gputests

traced() {
    staggered . "traced-t0" --temperature 0 --trace
}
export -f traced

step 120 build
step 240 files
step 120 gputests
step 240 mixed
step 590 ours
step 400 policy
step 590 llama
step 300 traced
