#!/usr/bin/env bash
# second call (same warm machine as n1.sh): the capped rows of issues 24 and 25 (q32, --cold): the GPU row (8 GiB
# cgroup, --gpu-mem 4GiB, O_DIRECT) with the lean segments, the 16-core CPU row (6 GiB cgroup, O_DIRECT), then the
# 16-core uncapped CPU row beside llama.cpp's CPU backend (the CUDA build, -ngl 0). About 520 s.
set -uo pipefail
export MOESTREAM_LEAN_SEGMENTS=${MOESTREAM_LEAN_SEGMENTS:-1}
source "$(dirname "$0")/env.sh"
LLB=/tmp/llb/build/bin/llama-bench
for i in $(seq 1 40); do [ -e /tmp/q32.done ] && break; sleep 3; done
timeout 130 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 16 -r 1 -t 16 --device cuda --mem-cap 8G \
  --moe-stream on --gpu-mem 4GiB --direct-io on --cold --json /tmp/logs/cap8_lean.json > /tmp/logs/cap8_lean.md 2> /tmp/logs/cap8_lean.err
t "cap8 gpu lean rc=$?"; grep -E "tg16|pp64" /tmp/logs/cap8_lean.md | cut -c1-40,100-260
timeout 160 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 16 -r 1 -t 16 --device cpu --mem-cap 6G \
  --moe-stream on --direct-io on --cold --json /tmp/logs/cap6_cpu.json > /tmp/logs/cap6_cpu.md 2> /tmp/logs/cap6_cpu.err
t "cap6 cpu rc=$?"; grep -E "tg16|pp64" /tmp/logs/cap6_cpu.md | cut -c1-40,100-260
for i in $(seq 1 30); do [ -x $LLB ] && break; sleep 3; done
t "llama-bench: $(ls $LLB 2>&1)"
timeout 200 python3 -m moestream bench -m /tmp/q32.gguf -p 128 -n 32 -r 1 -t 16 --device cpu --moe-stream off --vs llama.cpp \
  --llama-bench $LLB --json /tmp/logs/cpu_q32.json > /tmp/logs/cpu_q32.md 2> /tmp/logs/cpu_q32.err
t "cpu q32 rc=$?"; grep -E "tg32|pp128" /tmp/logs/cpu_q32.md | cut -c1-60,100-170
cd /tmp/logs && tar czf "$OUT/n2.tgz" .
