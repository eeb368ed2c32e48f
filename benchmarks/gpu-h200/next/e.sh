#!/usr/bin/env bash
# session 7, lease 2 call E: the README's GPU rows beside llama.cpp in one lease (q32 and g30 every expert in VRAM;
# the tier's prefill batch A/B; the 8 GiB capped row with the lean segments on and off)
set -uo pipefail
export MOESTREAM_GEMV2_B32=${MOESTREAM_GEMV2_B32:-0} MOESTREAM_LEAN_SEGMENTS=${MOESTREAM_LEAN_SEGMENTS:-1}  # the lean segments under test alone (the B32 lanes faulted with them in session 8)
source "$(dirname "$0")/env.sh"
LLB=/tmp/llb/build/bin/llama-bench
for i in $(seq 1 60); do [ -x $LLB ] && [ -e /tmp/bm.done ] && break; sleep 3; done
t "llama-bench $(ls $LLB 2>&1)"
for m in ${MODELS-q32 g30}; do
  timeout 150 python3 -m moestream bench -m /tmp/$m.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream off --vs llama.cpp \
    --llama-bench $LLB --json /tmp/logs/${m}_vs.json > /tmp/logs/${m}_vs.md 2> /tmp/logs/${m}_vs.err
  t "$m vs rc=$?"; grep -E "tg32|pp64" /tmp/logs/${m}_vs.md | cut -c1-60,100-170
done
for b in ${BATCHES-8 16}; do
  MOESTREAM_TIER_PREFILL_BATCH=$b timeout 100 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda \
    --moe-stream on --direct-io off --gpu-mem 4GiB --host-cache 16GiB --json /tmp/logs/tierg_b$b.json > /tmp/logs/tierg_b$b.md 2> /tmp/logs/tierg_b$b.err
  t "tier gather batch $b rc=$?"; grep -E "tg32|pp64" /tmp/logs/tierg_b$b.md | cut -c1-40,100-190
done
for l in 1 0; do
  MOESTREAM_LEAN_SEGMENTS=$l timeout 120 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 16 -r 1 -t 16 --device cuda --mem-cap 8G \
    --moe-stream on --gpu-mem 4GiB --direct-io on --cold --json /tmp/logs/cap8_lean$l.json > /tmp/logs/cap8_lean$l.md 2> /tmp/logs/cap8_lean$l.err
  t "cap8 lean=$l rc=$?"; grep -E "tg16|pp64" /tmp/logs/cap8_lean$l.md | cut -c1-40,100-260
done
cd /tmp/logs && tar czf "$OUT/l2e.tgz" . && ls | wc -l
