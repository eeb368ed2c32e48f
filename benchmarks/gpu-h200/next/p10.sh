#!/usr/bin/env bash
# For the next lease: MOESTREAM_PROMOTE=inline (the step copies each miss straight into a victim slot: one PCIe
# crossing per miss, not two) against the default (scratch, then a promotion after the step), on the tier row
# (q32, --gpu-mem 4GiB --host-cache 16GiB), alternating, -r 3, no llama.cpp; the decode step's kernels in both
# modes (step_kernels.py); the device-planned identity tests in every mode. carry ["build/gpuL4"]; about 300 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
L=/tmp/l10; mkdir -p $L
[ -e /tmp/q32.gguf ] || python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > $L/make.log 2>&1
t made
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k device_planned > $L/t_dp.log 2>&1; t "tests rc=$?"; tail -n1 $L/t_dp.log
for r in 1 2; do for m in copy inline; do
  MOESTREAM_PROMOTE=$m timeout 80 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 3 -t 16 --device cuda --moe-stream on --direct-io off \
    --gpu-mem 4GiB --host-cache 16GiB --json $L/prom_${m}_$r.json > $L/prom_${m}_$r.md 2> $L/prom_${m}_$r.err
  t "promote=$m run $r rc=$?"; grep -E "tg32|pp64" $L/prom_${m}_$r.md | cut -c1-150
done; done
for m in copy inline; do
  MOESTREAM_PROMOTE=$m timeout 90 python3 benchmarks/step_kernels.py /tmp/q32.gguf -n 16 --gpu-mem 4GiB --host-cache 16GiB --graphs-only --json $L/kern_$m.json > $L/kern_$m.txt 2>&1
  t "kernels $m rc=$?"; head -14 $L/kern_$m.txt | cut -c1-160
done
cd $L && tar czf $OUT/p10.tgz .
