#!/usr/bin/env bash
# 2026-12-05 (third session), third call (after p2.sh on the same machine): g30 every expert in VRAM beside
# llama.cpp all-GPU with _gemv32_kernel (the default), tests/test_cuda.py whole (embedded model; gemma4 Q4_K_M
# fixture), then the q32 tier row beside -ncmoe twice. carry ["build/gpuL4", "build/gpuF/gemma4-tiny-q4_k_m.gguf"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
LLB=/tmp/llb/build/bin/llama-bench
mkdir -p /tmp/fx/g4 && cp -f build/gpuF/gemma4-tiny-q4_k_m.gguf /tmp/fx/g4/
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py > /tmp/logs/test_cuda.log 2>&1 &
p1=$!
MOESTREAM_GPU_FIXTURES=/tmp/fx/g4 timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k "not default" \
  --deselect tests/test_cuda.py::test_cli_cuda --deselect tests/test_cuda.py::test_cli_cuda_every_family > /tmp/logs/test_cuda_g4.log 2>&1 &
p2=$!
wait $p1; echo "test_cuda rc=$?"; wait $p2; echo "test_cuda_g4 rc=$?"
t tests; tail -qn1 /tmp/logs/test_cuda.log /tmp/logs/test_cuda_g4.log; grep -h -E "^(FAILED|ERROR)|illegal" /tmp/logs/test_cuda*.log | cut -c1-300 | head -20
for i in $(seq 1 100); do [ -x $LLB ] && [ -e /tmp/g30.done ] && break; sleep 3; done
t "llama-bench $(ls $LLB 2>&1)"
timeout 150 python3 -m moestream bench -m /tmp/g30.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream off --vs llama.cpp \
  --llama-bench $LLB --json /tmp/logs/g30_vs.json > /tmp/logs/g30_vs.md 2> /tmp/logs/g30_vs.err
t "g30 vs rc=$?"; grep -E "tg32|pp64" /tmp/logs/g30_vs.md | cut -c1-200
for r in 1; do
  timeout 100 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream on --direct-io off \
    --gpu-mem 4GiB --host-cache 16GiB --vs llama.cpp --llama-bench $LLB --json /tmp/logs/tier_vs$r.json > /tmp/logs/tier_vs$r.md 2> /tmp/logs/tier_vs$r.err
  t "tier vs $r rc=$?"; grep -E "tg32|pp64" /tmp/logs/tier_vs$r.md | cut -c1-200
done
cd /tmp/logs && tar czf "$OUT/p3.tgz" .
