# What the GPU lease scripts (bench/*_lease.sh) share; sourced, not run.  Needs OUT, STEPS and WHEELS set:
# the wheels the device's Python lacks go into /tmp/site once a machine, and `step SECONDS NAME` runs the
# exported function NAME when STEPS names it, its log under $OUT/logs/NAME.txt and the log's last STEP_TAIL lines
# (default 25) printed.  `q17_files MIX...` writes the random qwen3-1.7b files /tmp/q17-MIX.gguf with llama.cpp's
# vocabulary (VOCAB, an .xz) unless they are there.
mkdir -p "$OUT/logs"
export OUT
[[ -d /tmp/site ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$WHEELS"/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1

step() {
    local seconds=$1 name=$2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "== $name $(date -u +%H:%M:%S)"
    timeout "$seconds" bash -c "$name" > "$OUT/logs/$name.txt" 2>&1
    echo "   rc=$? $(date -u +%H:%M:%S)"; grep -v "^kestrel-stream" "$OUT/logs/$name.txt" | cut -c1-400 | tail -"${STEP_TAIL:-25}"
}

q17_files() {
    [[ -f /tmp/vocab.gguf ]] || xz -dc "$VOCAB" > /tmp/vocab.gguf
    for mix in "$@"; do
        [[ -f /tmp/q17-$mix.gguf ]] || { python3 -m bench.make_gguf --preset qwen3-1.7b --mix $mix \
            --vocab /tmp/vocab.gguf -o /tmp/q17-$mix.part && mv /tmp/q17-$mix.part /tmp/q17-$mix.gguf; }
    done
}
export -f q17_files
