#!/usr/bin/env bash
# 2026-12-05 (third session), second call: _gemv32_kernel (Q4_0/Q8_0, lanes along a row's bytes) on the GPU: its
# tests (test_tkernels -k "gemv32 or alignment"), gemv_ab --check against _gemv_kernel at its default and variants
# (VW 2, 8 rows per program, U 4), then g30's all-VRAM decode step (step_kernels) with it. llama.cpp's CUDA build
# (-j6) and g30 start behind for p3.sh. carry ["build/gpuL4"]; about 300 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -x /tmp/llb/build/bin/llama-bench ] || setsid nohup python3 tools/llamacpp_cuda.py build build/gpuL4/llama.cpp-cuda-slim.tar.xz /tmp/llb -j6 --targets llama-bench > /tmp/logs/llb.log 2>&1 < /dev/null &
[ -e /tmp/g30.done ] || setsid nohup bash -c "python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 30 -o /tmp/g30.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/g30.done; python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/q32.done" > /tmp/logs/make.log 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/logs/gpu.txt 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tkernels.py -k "gemv32 or alignment" > /tmp/logs/tk32.log 2>&1
t "test_tkernels gemv32 rc=$?"; tail -n3 /tmp/logs/tk32.log; grep -E "^(FAILED|ERROR)|illegal" /tmp/logs/tk32.log | head
for v in "def" "VW=2" "ROWS=8" "U=4"; do
  env $( [ $v = def ] || echo MOESTREAM_GEMV32_$v ) timeout 90 python3 benchmarks/gemv_ab.py --old gemv1 --check --json /tmp/logs/g32_ab_$v.json > /tmp/logs/g32_ab_$v.log 2>&1
  t "gemv_ab $v rc=$?"; grep -E "gemma4|everywhere" /tmp/logs/g32_ab_$v.log | cut -c1-150
done
for i in $(seq 1 60); do [ -e /tmp/g30.done ] && break; sleep 2; done
timeout 150 python3 benchmarks/step_kernels.py /tmp/g30.gguf -n 16 --json /tmp/logs/g30_kern32.json > /tmp/logs/g30_kern32.txt 2>&1
t "step_kernels rc=$?"; head -12 /tmp/logs/g30_kern32.txt | cut -c1-160
tail -2 /tmp/logs/llb.log
cd /tmp/logs && tar czf "$OUT/p2.tgz" .
