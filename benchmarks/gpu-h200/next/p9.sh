#!/usr/bin/env bash
# For the next lease: where the tier row's decode time goes (q32, --gpu-mem 4GiB --host-cache 16GiB: 109-115 tok/s
# on an H100 against ~340 with every expert in VRAM): the device-planned step's kernels (the gathers from the pinned
# tier, the promotions' copies), hit rate, misses and promotions per token, the host's CPU time; then the same with
# every expert in VRAM for the baseline. carry ["build/gpuL4"]; about 150 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
L=/tmp/l9; mkdir -p $L
[ -e /tmp/q32.gguf ] || python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > $L/make.log 2>&1
t made
timeout 150 python3 benchmarks/step_kernels.py /tmp/q32.gguf -n 16 --gpu-mem 4GiB --host-cache 16GiB --graphs-only --json $L/tier_kern.json > $L/tier_kern.txt 2>&1
t "tier rc=$?"; head -30 $L/tier_kern.txt | cut -c1-200
timeout 120 python3 benchmarks/step_kernels.py /tmp/q32.gguf -n 16 --graphs-only --json $L/vram_kern.json > $L/vram_kern.txt 2>&1
t "vram rc=$?"; head -12 $L/vram_kern.txt | cut -c1-200
cd $L && tar czf $OUT/p9.tgz .
