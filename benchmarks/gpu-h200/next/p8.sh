#!/usr/bin/env bash
# The tier row's decode (q32, --gpu-mem 4GiB --host-cache 16GiB): every miss promoted (default) against
# MOESTREAM_ADMIT=freq (a miss promoted only when needed more often than its victim: half the PCIe bytes per miss
# when it is not), alternating, -r 3 each, no llama.cpp; then the device-planned step's identity tests in both
# modes. carry ["build/gpuL4"]; about 200 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
L=/tmp/l8; mkdir -p $L
[ -e /tmp/q32.gguf ] || python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > $L/make.log 2>&1
t made
timeout 60 python3 -m moestream run -m /tmp/q32.gguf --device cuda --gpu-mem 4GiB --host-cache 16GiB -n 32 -p "Once upon a time" > $L/run.out 2> $L/run.err
t "run (a fresh Triton cache) rc=$?"; grep -E "^prompt" $L/run.err
for r in ${ROUNDS:-1 2}; do for a in all freq; do
  MOESTREAM_ADMIT=$a timeout 80 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 3 -t 16 --device cuda --moe-stream on --direct-io off \
    --gpu-mem 4GiB --host-cache 16GiB --json $L/adm_${a}_$r.json > $L/adm_${a}_$r.md 2> $L/adm_${a}_$r.err
  t "admit=$a run $r rc=$?"; grep -E "tg32|pp64" $L/adm_${a}_$r.md | cut -c1-150
done; done
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k device_planned > $L/t_dp.log 2>&1; t "tests rc=$?"; tail -n1 $L/t_dp.log
cd $L && tar czf $OUT/p8.tgz .
