#!/usr/bin/env bash
# Every GPU check and H200 bench of the project in one device call (about 10 minutes: split it with STEPS
# across calls of at most 600 s):
#   OUT=/some/dir KESTREL_COMMIT=<hash> [STEPS="tests decode ..."] bash bench/h200_checks.sh
# STEPS picks some of: tests decode variants modes kernels window traces daemon serve http search kv prefill
# blocks splits fewtok f16mma blockgemv (default: all, in that order; f16mma = the fp16 prefill GEMM's GPU tests and bench.mma_prefill's sweep; search = the gate against all 32 group choices, ~2 minutes; kv = the
# KV pool's benches: 32 sessions at 1k context with f16 and f32 KV, prefix reuse; prefill = pp512 with the
# split and the flash attention kernel, qwen3-1.7b shapes; blocks = the 4-bit kernels' GPU tests and
# bench.block_decode on random Q4_K_M and Q8_0 files of the qwen3-1.7b shape; needs the gguf wheel; splits =
# the split-K GPU tests and bench.mma's split sweep at 9..64 tokens, 1.7B and 8B shapes; fewtok = the pipelined
# few-token tiles' GPU tests, the 1.7B split sweep and bench.fewtok_decode on its winners vs the default;
# blockgemv = every 4/6-bit GEMV layout's GPU tests and bench.block_gemv at the qwen3-1.7b and 8b shapes;
# dp4a = the one-token dp4a layouts' GPU tests and their bench.block_gemv sweep beside the default layouts;
# steps = the block-format steps of 1..70 tokens' GPU tests, bench.block_mma's tile/split sweep at the
# qwen2.5-1.5b shapes and bench.steps on random qwen3-1.7b Q4_K_M and Q8_0 files, LLAMA_BENCH=PATH beside;
# moe = the routed layer's GPU tests (GEMVs and the grouped tensor-core GEMM) and bench.moe_experts at the
# qwen3-30b-a3b layer shape, routing near uniform and skewed).
# Result files (md/json/traces/html) and every step's log (logs/*.txt) land in $OUT/h200-results.tgz, since
# the device tool returns at most 8 files; each log's last lines also go to stdout.  The device copy of the tree has no .git: KESTREL_COMMIT names the commit.
set -uo pipefail
OUT=${OUT:-bench/results}
RESULTS=$(mktemp -d)
mkdir -p "$OUT" "$RESULTS/logs"
export PYTHONPATH=. PYTHONUNBUFFERED=1
# each step's log, then the archive again: a call cut short still returns what finished
STEPS=${STEPS:-tests decode variants modes kernels window traces daemon serve http search kv prefill blocks splits fewtok f16mma blockgemv dp4a steps moe}
run() {
    local seconds=$1 log=$2; shift 2
    [[ " $STEPS " == *" ${log%.txt} "* ]] || return 0
    timeout "$seconds" "$@" 2>&1 | tail -60 > "$RESULTS/logs/$log"; tail -8 "$RESULTS/logs/$log"
    tar czf "$OUT/h200-results.tgz" -C "$RESULTS" .
}
run 150 tests.txt python3 -m pytest -m gpu -q tests/test_gpu_kernels.py tests/test_gpu_model.py \
    tests/test_gpu_modes.py tests/test_gpu_window.py tests/test_gpu_trace.py tests/test_gpu_flash_attention.py
run 60 decode.txt python3 -m bench.gpu_decode --out "$RESULTS"
run 90 variants.txt python3 -m bench.gpu_step_variants --out "$RESULTS"
run 150 modes.txt python3 -m bench.modes --new-tokens 64 --skip-search --out "$RESULTS"
run 150 kernels.txt python3 -m bench.gpu_kernels --out "$RESULTS"
run 150 window.txt python3 -m bench.window --out "$RESULTS"
run 90 traces.txt python3 -m bench.trace_gpu --preset qwen3-1.7b --modes gated,gpu --vram-budget 1GiB \
    --steps 8 --out "$RESULTS"
run 150 daemon.txt python3 -m bench.daemon_latency --preset qwen3-1.7b --device cuda --mode gpu --label h200 \
    --steps 200 --tokens 50 --out "$RESULTS"
run 300 serve.txt python3 -m bench.serve --preset qwen3-1.7b --device cuda --mode gpu --label h200 \
    --step-tokens 256,65536 --out "$RESULTS"
run 300 http.txt python3 -m bench.http_serve --preset qwen3-1.7b --device cuda --mode gpu --label h200 \
    --out "$RESULTS"
run 240 search.txt python3 -m bench.modes --search-only --search-steps 2 --out "$RESULTS"
run 240 kv.txt bash -c "python3 -m bench.gpu_decode --batches 32 --prompt-len 1000 --new-tokens 32 --kv-dtype f16 \
    --out $RESULTS/kv-f16 && python3 -m bench.gpu_decode --batches 32 --prompt-len 1000 --new-tokens 32 \
    --kv-dtype f32 --out $RESULTS/kv-f32 && python3 -m bench.prefix_reuse --model qwen3-1.7b --device cuda \
    --mode gpu --out $RESULTS"
run 300 prefill.txt bash -c "for shape in qwen3-1.7b; do for a in split flash; do python3 -m bench.prefill \
    --shape \$shape --attention \$a --sessions 16,32 --ops --out $RESULTS/prefill-\$a || exit 1; done; done"
run 420 blocks.txt bash -c "python3 -m pytest -m gpu -q tests/test_block_kernels.py tests/test_block_models_emulated.py \
    && python3 -m bench.make_gguf --preset qwen3-1.7b --mix q4_k_m -o /tmp/q17-q4km.gguf \
    && python3 -m bench.make_gguf --preset qwen3-1.7b -o /tmp/q17-q8.gguf \
    && python3 -m bench.block_decode /tmp/q17-q4km.gguf /tmp/q17-q8.gguf --out $RESULTS"
run 420 splits.txt bash -c "python3 -m pytest -m gpu -q tests/test_gpu_splitk.py \
    && python3 -m bench.mma --sweep splits --out $RESULTS"
run 590 fewtok.txt bash -c "python3 -m pytest -m gpu -q -x tests/test_gpu_splitk.py -k 'pipelined or replays or p3c or p4c' \
    && python3 -m bench.mma --sweep splits --repeats 10 --models qwen3-1.7b --out $RESULTS/fewtok \
    && python3 -m bench.fewtok_decode --winners \$(ls $RESULTS/fewtok/*-split-winners.json) --ops --out $RESULTS"
run 540 f16mma.txt bash -c "python3 -m pytest -m gpu -q -x tests/test_gpu_f16mma.py \
    && python3 -m bench.mma_prefill --only prefill --out $RESULTS"
run 420 blockgemv.txt bash -c "python3 -m pytest -m gpu -q tests/test_block_gemv_variants.py \
    && python3 -m bench.block_gemv --out $RESULTS"
run 420 dp4a.txt bash -c "python3 -m pytest -m gpu -q tests/test_dp4a_gemv.py \
    && python3 -m pytest -m gpu -q tests/test_block_gemv_variants.py -k 'gpu and (d32 or d64 or d128 or d256 or d512)' \
    && python3 -m bench.block_gemv --tokens 1 --layouts d --out $RESULTS"
run 590 steps.txt bash -c "python3 -m pytest -m gpu -q -x tests/test_block_steps.py tests/test_block_kernels.py \
    && python3 -m bench.block_mma --models qwen2.5-1.5b --formats Q4_K,Q6_K --out $RESULTS \
    && python3 -m bench.make_gguf --preset qwen3-1.7b --mix q4_k_m -o /tmp/q17-q4km.gguf \
    && python3 -m bench.make_gguf --preset qwen3-1.7b -o /tmp/q17-q8.gguf \
    && python3 -m bench.steps /tmp/q17-q4km.gguf /tmp/q17-q8.gguf \${LLAMA_BENCH:+--llama-bench \$LLAMA_BENCH} --out $RESULTS"
run 420 moe.txt bash -c "python3 -m pytest -m gpu -q -x tests/test_moe_kernels.py tests/test_gpu_moe.py \
    && python3 -m bench.moe_experts --out $RESULTS \
    && python3 -m bench.moe_experts --hot 3 --tokens 128,512 --out $RESULTS/hot"
