#!/usr/bin/env bash
# 2026-12-05 (second session), first call of a lease: tests/test_cuda.py whole with the lean segments on
# (MOESTREAM_LEAN_SEGMENTS=1, the store-object-keyed tables of 7c6cb86), on the embedded model and on the gemma4
# Q4_K_M fixture, in parallel; the 32-layer bench model, g30 and llama.cpp's CUDA build start behind for n2.sh.
# carry ["build/gpuL4", "build/gpuF/gemma4-tiny-q4_k_m.gguf"]; about 340 s.
set -uo pipefail
export MOESTREAM_LEAN_SEGMENTS=${MOESTREAM_LEAN_SEGMENTS:-1}
source "$(dirname "$0")/env.sh"
[ -x /tmp/llb/build/bin/llama-bench ] || setsid nohup python3 tools/llamacpp_cuda.py build build/gpuL4/llama.cpp-cuda-slim.tar.xz /tmp/llb -j10 --targets llama-bench > /tmp/logs/llb.log 2>&1 < /dev/null &
[ -e /tmp/bm.done ] || setsid nohup bash -c "python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/q32.done; python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 30 -o /tmp/g30.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/bm.done" > /tmp/logs/make.log 2>&1 < /dev/null &
mkdir -p /tmp/fx/g4 && cp -f build/gpuF/gemma4-tiny-q4_k_m.gguf /tmp/fx/g4/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/logs/gpu.txt 2>&1
timeout 320 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py > /tmp/logs/test_cuda.log 2>&1 &
p1=$!
MOESTREAM_GPU_FIXTURES=/tmp/fx/g4 timeout 320 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k "not default" \
  --deselect tests/test_cuda.py::test_cli_cuda --deselect tests/test_cuda.py::test_cli_cuda_every_family > /tmp/logs/test_cuda_g4.log 2>&1 &
p2=$!
wait $p1; echo "test_cuda rc=$?"; wait $p2; echo "test_cuda_g4 rc=$?"
t tests; tail -qn1 /tmp/logs/test_cuda.log /tmp/logs/test_cuda_g4.log; grep -h -E "^(FAILED|ERROR)|illegal" /tmp/logs/test_cuda*.log | cut -c1-300 | head -20
tail -1 /tmp/logs/llb.log; ls /tmp/*.done 2>&1
cd /tmp/logs && tar czf "$OUT/n1.tgz" .
