#!/usr/bin/env bash
# One GPU-machine lease after a GPU kernel or pinned-memory change, in two calls of the device tool:
#   BUNDLE=build/gpuF bash benchmarks/gpu_check.sh tests   # tests/test_cuda.py, one process per file at once
#                                                         # (gpu_run.sh ptests), the bench models made behind
#   bash benchmarks/gpu_check.sh bench                     # GEMV A/B; q32 every expert in VRAM with the new and
#                                                         # the old GEMV; the device-planned tier row; the
#                                                         # --pool host memory probe in an 8 GiB cgroup
# BUNDLE: as gpu_run.sh's (*.whl, tok.gguf.xz, fix/*.gguf). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-}" in
tests)
  OUT=$OUT bash benchmarks/gpu_run.sh ptests
  ;;
bench)
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
  for i in $(seq 1 60); do [ -e /tmp/bm.done ] && break; sleep 5; done
  if [ -f benchmarks/gemv_ab.py ]; then
    timeout 120 python3 benchmarks/gemv_ab.py --json "$OUT/gemv.json" > "$OUT/gemv.txt" 2>&1; cat "$OUT/gemv.txt"
  fi
  B="bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda"
  for w in 1 0; do
    MOESTREAM_GEMV_WIDE=$w timeout 150 python3 -m moestream $B --moe-stream off --json "$OUT/q32_wide$w.json" \
      > "$OUT/q32_wide$w.md" 2>"$OUT/q32_wide$w.err"
    echo "== q32 every expert in VRAM, MOESTREAM_GEMV_WIDE=$w"; grep -E "tg32|pp64" "$OUT/q32_wide$w.md"
  done
  timeout 150 python3 -m moestream $B --moe-stream on --direct-io off --gpu-mem 4GiB --host-cache 16GiB \
    --json "$OUT/tier_q32.json" > "$OUT/tier_q32.md" 2>"$OUT/tier_q32.err"
  echo "== q32 --gpu-mem 4GiB --host-cache 16GiB"; grep -E "tg32|pp64" "$OUT/tier_q32.md"
  timeout 150 python3 benchmarks/host_mem_probe.py /tmp/q32.gguf --pool host --mem 5GiB -n 32 --cap 8G \
    > "$OUT/probe.txt" 2>&1
  echo "== host_mem_probe --pool host --mem 5GiB --cap 8G"; grep -v "^JSON" "$OUT/probe.txt" | tail -8 | cut -c1-300
  ;;
*)
  echo "usage: benchmarks/gpu_check.sh tests|bench" >&2; exit 2
  ;;
esac
