#!/usr/bin/env bash
# which switch the illegal memory access of tests/test_cuda.py::test_oracle_vs_cpu follows (session 9): the test
# alone under CUDA_LAUNCH_BLOCKING=1 with each GPU switch off in its own process, in parallel
set -uo pipefail
source "$(dirname "$0")/env.sh"
export CUDA_LAUNCH_BLOCKING=1
T="tests/test_cuda.py::test_oracle_vs_cpu"
run() { name=$1; shift; env "$@" timeout 230 python3 -m pytest -q -x -p no:cacheprovider "$T" --tb=long > /tmp/logs/diag_$name.log 2>&1; echo "$name rc=$?" >> /tmp/logs/diag_rc.txt; }
run default A=1 &
run gemv2off MOESTREAM_GEMV2=0 &
run graphsoff MOESTREAM_CUDA_GRAPHS=0 &
run tstepoff MOESTREAM_TSTEP=0 &
run tdenseoff MOESTREAM_TDENSE=0 &
run fusedoff MOESTREAM_MOE_FUSED=0 &
run wideoff MOESTREAM_GEMV_WIDE=0 &
run devplanoff MOESTREAM_DEVICE_PLAN=0 &
wait
t done; sort /tmp/logs/diag_rc.txt
for f in /tmp/logs/diag_*.log; do echo "== $f"; tail -n 2 $f | cut -c1-200; grep -m3 -E "^src/moestream.*: in |moestream/.*py:[0-9]+: " $f | tail -3 | cut -c1-200; done
cd /tmp/logs && tar czf "$OUT/diag.tgz" diag_*
