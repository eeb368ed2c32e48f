#!/usr/bin/env bash
# Remakes, on a CPU machine with the package index, the ignored folders the calls here carry to the GPU machine
# (which reaches no network): build/gpuL4 (the gguf and transformers wheels at pyproject.toml's pins; llama.cpp's
# slim CUDA source from tools/llamacpp_cuda.py), build/gpuF/gemma4-tiny-q4_k_m.gguf (tools/gpu_fixtures.py) and
# build/oldpool/src (2b2032f's src, the thread pool before the lock-free join, for m.sh's A/B). A fresh checkout
# has none of them. Needs .venv with llama-cpp-python (`.venv/bin/python tools/llamacpp.py install`).
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p build/gpuL4 build/gpuF
.venv/bin/python -m pip download -q --no-deps -d build/gpuL4 \
  "$(grep -o '"gguf==[^"]*"' pyproject.toml | tr -d '"')" "$(grep -o '"transformers==[^"]*"' pyproject.toml | tr -d '"')"
[ -f build/gpuL4/llama.cpp-cuda-slim.tar.xz ] || .venv/bin/python tools/llamacpp_cuda.py slim build/gpuL4/llama.cpp-cuda-slim.tar.xz
[ -f build/gpuF/gemma4-tiny-q4_k_m.gguf ] || .venv/bin/python tools/gpu_fixtures.py build/gpuF --only gemma4-tiny
rm -rf build/oldpool && mkdir -p build/oldpool && git archive 2b2032f src | tar -x -C build/oldpool
rm -f build/oldpool/src/moestream/data/default.gguf
du -sh build/gpuL4 build/gpuF build/oldpool
