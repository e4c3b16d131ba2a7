#!/usr/bin/env bash
# llama.cpp's llama-server (and llama-bench, llama-batched-bench) built on the GPU machine itself, in the
# background, from a source tarball carried in (the device has no network): the llama-server built off the
# device did not serve the staggered workload at its speed (bench/h200_llama_prebuilt.md), so #34's comparison
# needs this one.  About 8 minutes on 12 of its 16 cores; start it first and run other work meanwhile:
#   SRC=.llama/llama_src_0c1e570.tar.xz bash bench/llama_build_on_device.sh     # returns at once
#   ls /tmp/llama-dev/llama.cpp/build/bin/llama-server                         # there when done (log: build.log)
# The tarball: llama.cpp's tree without build/, .git, docs, media, benches, tests, models, gguf-py and the
# non-CUDA backends (6.5 MB for 0c1e570), e.g.
#   tar cJf llama_src.tar.xz --exclude=llama.cpp/build --exclude=llama.cpp/.git ... llama.cpp
set -euo pipefail
SRC=${SRC:-.llama/llama_src_0c1e570.tar.xz}
DIR=${DIR:-/tmp/llama-dev}
JOBS=${JOBS:-12}
mkdir -p "$DIR"
tar xJf "$SRC" -C "$DIR"
cd "$DIR/llama.cpp"
setsid nohup bash -c "cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build -j $JOBS --target llama-server llama-bench llama-batched-bench" \
    > "$DIR/build.log" 2>&1 < /dev/null &
echo "building in $DIR/llama.cpp/build (log $DIR/build.log)"
