#!/usr/bin/env bash
# For the next lease (not yet run): the tier prefill after f9441cb (every multi-token chunk of a device-planned store
# through MoE._tier_prefill) beside llama.cpp -ncmoe, twice, with nothing else running: llama.cpp's build (-j16) and
# the bench file first, then the rows; then the host work per layer (tier_prefill_profile) and the newcomer's run
# (prompt and decode lines, peak RSS after 3d49f4e's pread fill). carry ["build/gpuL4"]; about 420 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -x /tmp/llb/build/bin/llama-bench ] || python3 tools/llamacpp_cuda.py build build/gpuL4/llama.cpp-cuda-slim.tar.xz /tmp/llb -j16 --targets llama-bench > /tmp/logs/llb.log 2>&1 &
[ -e /tmp/q32.gguf ] || python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > /tmp/logs/make.log 2>&1
wait; t "built $(ls /tmp/llb/build/bin/llama-bench 2>&1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/logs/gpu.txt 2>&1
LLB=/tmp/llb/build/bin/llama-bench
for r in 1 2; do
  timeout 120 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream on --direct-io off \
    --gpu-mem 4GiB --host-cache 16GiB --vs llama.cpp --llama-bench $LLB --json /tmp/logs/tier_vs$r.json > /tmp/logs/tier_vs$r.md 2> /tmp/logs/tier_vs$r.err
  t "tier vs $r rc=$?"; grep -E "tg32|pp64" /tmp/logs/tier_vs$r.md | cut -c1-150
done
timeout 90 python3 benchmarks/tier_prefill_profile.py /tmp/q32.gguf -p 64 --gpu-mem 4GiB --host-cache 16GiB > /tmp/logs/tpp64.txt 2>&1
t "tpp64 rc=$?"; sed -n 2,3p /tmp/logs/tpp64.txt | cut -c1-300
/usr/bin/time -v timeout 90 python3 -m moestream run -m /tmp/q32.gguf --device cuda --gpu-mem 4GiB --host-cache 16GiB -n 64 -p "Once upon a time" > /tmp/logs/run.out 2> /tmp/logs/run.err
t "run rc=$?"; grep -E "prompt|decode|Maximum resident" /tmp/logs/run.err | head
cd /tmp/logs && tar czf "$OUT/p5.tgz" .
