#!/usr/bin/env bash
# 2026-12-05 (third session), last call on a fresh machine: the tier prefill with every multi-token chunk through
# MoE._tier_prefill (q32 --gpu-mem 4GiB --host-cache 16GiB, moestream alone twice, then beside llama.cpp -ncmoe once
# its build is done), and g30's decode step with _gemv32_kernel off and on (step_kernels, same machine).
# carry ["build/gpuL4"]; about 330 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
setsid nohup python3 tools/llamacpp_cuda.py build build/gpuL4/llama.cpp-cuda-slim.tar.xz /tmp/llb -j12 --targets llama-bench > /tmp/logs/llb.log 2>&1 < /dev/null &
python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > /tmp/logs/make.log 2>&1
t "q32 made"
setsid nohup bash -c "python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 30 -o /tmp/g30.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/g30.done" >> /tmp/logs/make.log 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/logs/gpu.txt 2>&1; cat /tmp/logs/gpu.txt | tail -1
for r in 1 2; do
  timeout 60 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream on --direct-io off \
    --gpu-mem 4GiB --host-cache 16GiB --json /tmp/logs/tier$r.json > /tmp/logs/tier$r.md 2> /tmp/logs/tier$r.err
  t "tier $r rc=$?"; grep -E "tg32|pp64" /tmp/logs/tier$r.md | cut -c1-150
done
for i in $(seq 1 40); do [ -e /tmp/g30.done ] && break; sleep 2; done
for g in 0 1; do
  MOESTREAM_GEMV32=$g timeout 60 python3 benchmarks/step_kernels.py /tmp/g30.gguf -n 8 --json /tmp/logs/g30_kern_gemv32_$g.json > /tmp/logs/g30_kern_gemv32_$g.txt 2>&1
  t "step_kernels GEMV32=$g rc=$?"; grep "== graphs" /tmp/logs/g30_kern_gemv32_$g.txt; sed -n 3,4p /tmp/logs/g30_kern_gemv32_$g.txt | cut -c1-60
done
LLB=/tmp/llb/build/bin/llama-bench
for i in $(seq 1 60); do [ -x $LLB ] && break; sleep 3; done
t "llama-bench $(ls $LLB 2>&1)"
timeout 90 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream on --direct-io off \
  --gpu-mem 4GiB --host-cache 16GiB --vs llama.cpp --llama-bench $LLB --json /tmp/logs/tier_vs.json > /tmp/logs/tier_vs.md 2> /tmp/logs/tier_vs.err
t "tier vs rc=$?"; grep -E "tg32|pp64" /tmp/logs/tier_vs.md | cut -c1-150
cd /tmp/logs && tar czf "$OUT/p4.tgz" .
