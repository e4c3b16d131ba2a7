#!/usr/bin/env bash
# kestrel-stream beside llama.cpp on the same GGUF files, in one GPU machine's lease (back-to-back device
# calls of at most 600 s each; /tmp survives between them while the machine stays warm):
#   OUT=DIR KESTREL_COMMIT=<hash> STEPS="build models ours" bash bench/side_by_side.sh
#   OUT=DIR KESTREL_COMMIT=<hash> STEPS="llama serve load" bash bench/side_by_side.sh
# STEPS picks some of (in this order):
#   build   unpack the llama.cpp source (LLAMA_SRC, a .tgz holding llama.cpp/, and LLAMA_MODELS_SRC, its
#           src/models and tools/mtmd/models folders where the first left them out) to /tmp/llama and start its
#           CUDA build in the background (setsid: it outlives the call; ~8 minutes on 12 jobs)
#   models  random GGUFs of the qwen3-1.7b and qwen3-8b shapes, Q8_0 and Q4_K_M, in /tmp (bench/make_gguf.py)
#   ours    pp512 and batched decode (bench/prefill.py), 4-bit vs Q8_0 decode and window (bench/block_decode.py)
#   llama   waits for the build, then llama-bench (pp512, tg128) on every file and llama-batched-bench
#   serve   32 / 16 / 1 streaming clients over HTTP: our daemon, then llama-server (bench/http_serve.py)
#   staggered  64 clients, 200 staggered mixed-length requests (prompts of 32..2,048 tokens, 16..256 new
#           tokens) against --max-sessions 64: our daemon, then llama-server -np 64 -fa on, one row each with
#           throughput, TTFT p50/p99, refused and lost (bench/http_serve.py --workload staggered)
#   load    load to first token: ours (bench/load_time.py), llama-server's (bench/llama_load.py)
#   kv      f16 vs float32 KV at 32 sessions x 1k context, prefix reuse
# Each step's log goes to $OUT/logs.tgz (the device tool returns at most 8 files) and its tail to stdout.
set -uo pipefail
OUT=${OUT:-/tmp/side-by-side}
LLAMA_SRC=${LLAMA_SRC:-.llama/llama_src.tgz}
LLAMA_MODELS_SRC=${LLAMA_MODELS_SRC:-.llama/llama_models_src.tgz}
LLAMA=/tmp/llama/llama.cpp
BIN=$LLAMA/build/bin
STEPS=${STEPS:-build models ours llama serve staggered load kv}
LOGS=/tmp/side-by-side-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1

step() {
    local seconds=$1 name=$2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "== $name $(date -u +%H:%M:%S)"
    timeout "$seconds" bash -c "$name" > "$LOGS/$name.txt" 2>&1
    echo "   rc=$? $(date -u +%H:%M:%S)"; tail -25 "$LOGS/$name.txt"
    tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

build() {
    [[ -x $BIN/llama-server ]] && { echo "already built"; return 0; }
    pgrep -f "cmake --build" > /dev/null && { echo "build running"; return 0; }
    mkdir -p /tmp/llama && tar xzf "$LLAMA_SRC" -C /tmp/llama
    # src/models/ and tools/mtmd/models/ where the source archive left out its models/ folders
    [[ -f $LLAMA_MODELS_SRC ]] && tar xzf "$LLAMA_MODELS_SRC" -C /tmp/llama
    cd "$LLAMA" && setsid nohup bash -c 'cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build -j 12 --target llama-bench llama-batched-bench llama-server' \
        > /tmp/llama/build.log 2>&1 < /dev/null &
    echo "build started"
}

models() {
    local vocab=() f
    [[ -f /tmp/llama/llama.cpp/models/ggml-vocab-qwen2.gguf ]] && vocab=(--vocab /tmp/llama/llama.cpp/models/ggml-vocab-qwen2.gguf)
    for f in "qwen3-1.7b q17 q8_0" "qwen3-1.7b q17 q4_k_m" "qwen3-8b q8b q8_0" "qwen3-8b q8b q4_k_m"; do
        set -- $f
        [[ -f /tmp/$2-$3.gguf ]] || python3 -m bench.make_gguf --preset "$1" --mix "$3" "${vocab[@]}" -o "/tmp/$2-$3.gguf" || return 1
    done
    ls -la /tmp/*.gguf
}

ours() {
    python3 -m bench.prefill --model /tmp/q17-q8_0.gguf --shape qwen3-1.7b --sessions 1,4,8,16,32 --ops \
        --out "$OUT/prefill-q17" || return 1
    python3 -m bench.prefill --model /tmp/q8b-q8_0.gguf --shape qwen3-8b --sessions 16,32 \
        --out "$OUT/prefill-q8b" || return 1
    python3 -m bench.block_decode /tmp/q17-q4_k_m.gguf /tmp/q17-q8_0.gguf --out "$OUT/blocks-q17" || return 1
    python3 -m bench.block_decode /tmp/q8b-q4_k_m.gguf /tmp/q8b-q8_0.gguf --out "$OUT/blocks-q8b"
}

wait_build() {
    local i
    for i in $(seq 1 "${1:-300}"); do [[ -x $BIN/llama-server && -x $BIN/llama-batched-bench ]] && return 0; sleep 1; done
    echo "llama.cpp build not finished:"; tail -5 /tmp/llama/build.log; return 1
}

llama() {
    wait_build 400 || return 1
    local f
    for f in q17-q8_0 q17-q4_k_m q8b-q8_0 q8b-q4_k_m; do
        echo "# llama-bench -m /tmp/$f.gguf -ngl 99 -p 512 -n 128 -r 3"
        "$BIN/llama-bench" -m "/tmp/$f.gguf" -ngl 99 -p 512 -n 128 -r 3 || return 1
    done
    echo "# llama-batched-bench -m /tmp/q17-q8_0.gguf -ngl 99 -c 16384 -npp 128 -ntg 64 -npl 1,4,8,16,32"
    "$BIN/llama-batched-bench" -m /tmp/q17-q8_0.gguf -ngl 99 -c 16384 -npp 128 -ntg 64 -npl 1,4,8,16,32
}

serve() {
    python3 -m bench.http_serve --model /tmp/q17-q8_0.gguf --device cuda --clients 1,16,32 --label h200 \
        --out "$OUT/serve" || return 1
    wait_build 60 || return 1
    "$BIN/llama-server" -m /tmp/q17-q8_0.gguf -ngl 99 -np 32 -c 32768 --cache-ram 0 --port 8080 > /tmp/llama/server.log 2>&1 &
    local pid=$! i
    for i in $(seq 1 120); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 1; done
    python3 -m bench.http_serve --base-url http://127.0.0.1:8080/v1 --vocab-size 151936 --clients 1,16,32 \
        --label h200-llama-server --out "$OUT/serve"
    local rc=$?
    kill $pid; wait $pid 2> /dev/null
    return $rc
}

staggered() {
    wait_build 300 || return 1
    python3 -m bench.http_serve --workload staggered --model /tmp/q17-q8_0.gguf --device cuda --clients 64 \
        --requests 200 --max-sessions 64 --prompt-range 32,2048 --new-range 16,256 --rate 16 \
        --llama-server "$BIN/llama-server" --label h200 --out "$OUT/staggered"
}

load() {
    python3 -m bench.load_time --model /tmp/q17-q8_0.gguf --device cuda --repeats 3 --out "$OUT/load-q17" || return 1
    python3 -m bench.load_time --model /tmp/q8b-q8_0.gguf --device cuda --repeats 3 --out "$OUT/load-q8b" || return 1
    wait_build 60 || return 1
    python3 -m bench.llama_load --server "$BIN/llama-server" --model /tmp/q17-q8_0.gguf --repeats 3 --out "$OUT/load-q17" \
        && python3 -m bench.llama_load --server "$BIN/llama-server" --model /tmp/q8b-q8_0.gguf --repeats 3 --out "$OUT/load-q8b"
}

kv() {
    python3 -m bench.gpu_decode --batches 32 --prompt-len 1000 --new-tokens 32 --kv-dtype f16 --out "$OUT/kv-f16" \
        && python3 -m bench.gpu_decode --batches 32 --prompt-len 1000 --new-tokens 32 --kv-dtype f32 --out "$OUT/kv-f32" \
        && python3 -m bench.prefix_reuse --model qwen3-1.7b --device cuda --mode gpu --out "$OUT/prefix"
}

export OUT LLAMA_SRC LLAMA_MODELS_SRC LLAMA BIN
export -f build models ours wait_build llama serve staggered load kv
step 60 build
step 300 models
step 500 ours
step 500 llama
step 400 serve
step 500 staggered
step 300 load
step 300 kv
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv 2> /dev/null | tail -1
