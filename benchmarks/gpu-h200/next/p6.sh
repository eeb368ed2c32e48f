#!/usr/bin/env bash
# For the next lease, after p5.sh on the same machine: tests/test_cuda.py whole at main after f9441cb (the tier
# prefill for every multi-token chunk) and 3d49f4e (the tier's pread fill), on the embedded model and on the gemma4
# Q4_K_M fixture in parallel, nothing else running. carry ["build/gpuL4", "build/gpuF/gemma4-tiny-q4_k_m.gguf"];
# about 220 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
mkdir -p /tmp/fx/g4 && cp -f build/gpuF/gemma4-tiny-q4_k_m.gguf /tmp/fx/g4/
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py > /tmp/logs/test_cuda.log 2>&1 &
p1=$!
MOESTREAM_GPU_FIXTURES=/tmp/fx/g4 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k "not default" \
  --deselect tests/test_cuda.py::test_cli_cuda --deselect tests/test_cuda.py::test_cli_cuda_every_family > /tmp/logs/test_cuda_g4.log 2>&1 &
p2=$!
wait $p1; echo "test_cuda rc=$?"; wait $p2; echo "test_cuda_g4 rc=$?"
t tests; tail -qn1 /tmp/logs/test_cuda.log /tmp/logs/test_cuda_g4.log; grep -h -E "^(FAILED|ERROR)|illegal" /tmp/logs/test_cuda*.log | cut -c1-300 | head -20
cd /tmp/logs && tar czf "$OUT/p6.tgz" test_cuda.log test_cuda_g4.log
