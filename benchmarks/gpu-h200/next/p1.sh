#!/usr/bin/env bash
# 2026-12-05 (third session), first call: where g30's all-VRAM decode step goes (benchmarks/step_kernels.py), the
# Gemma-shape GEMVs A/B (gemv_ab --old gemv1 at LPB32 1/2/4), and tests/test_cuda.py::test_cli_cuda (verify's
# device line). carry ["build/gpuL4"]; about 200 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -e /tmp/g30.done ] || setsid nohup bash -c "python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 30 -o /tmp/g30.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/g30.done" > /tmp/logs/make.log 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/logs/gpu.txt 2>&1
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py::test_cli_cuda > /tmp/logs/test_cli_cuda.log 2>&1
t "test_cli_cuda rc=$?"; tail -n1 /tmp/logs/test_cli_cuda.log
for l in 1 2 4; do
  MOESTREAM_GEMV2_LPB32=$l timeout 90 python3 benchmarks/gemv_ab.py --old gemv1 --json /tmp/logs/gemv_ab_b32_$l.json > /tmp/logs/gemv_ab_b32_$l.log 2>&1
  t "gemv_ab lpb32=$l rc=$?"; grep -E "gemma4" /tmp/logs/gemv_ab_b32_$l.log
done
for i in $(seq 1 60); do [ -e /tmp/g30.done ] && break; sleep 2; done
t "g30 $(ls -la /tmp/g30.gguf 2>&1)"
timeout 150 python3 benchmarks/step_kernels.py /tmp/g30.gguf -n 16 --json /tmp/logs/g30_kern.json > /tmp/logs/g30_kern.txt 2>&1
t "step_kernels rc=$?"; head -30 /tmp/logs/g30_kern.txt
cd /tmp/logs && tar czf "$OUT/p1.tgz" .
