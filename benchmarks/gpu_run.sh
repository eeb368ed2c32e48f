#!/usr/bin/env bash
# The GPU machine's checks and benchmark table, in two parts that fit the device tool's 10-minute calls. The
# machine cannot reach a package index, so what it needs travels in build/gpu/ (made here):
#   .venv/bin/python tools/gpu_fixtures.py build/gpu/fix --only qwen3moe-tiny gemma4-tiny qwen35moe-tiny
#   .venv/bin/python tools/llamacpp_cuda.py slim build/gpu/llama.cpp-cuda-slim.tar.xz
#   xz -c ~/.cache/moestream/tokenizers/qwen2-*/header.gguf > build/gpu/tok.gguf.xz   (a real Qwen2 tokenizer)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d build/gpu gguf==0.19.0 transformers==5.24.0
#     (the machine's own transformers 5.17 lacks the GGUF tokenizer mapping that `moestream run` uses)
# Everything that travels is at most 64 MiB (the tracked tree is ~25 MB): three families' fixtures per bundle.
# then, on the GPU machine (logs and JSON under $OUT):
#   bash benchmarks/gpu_run.sh tests   # llama.cpp's CUDA build started behind; bench model; tests/test_cuda.py;
#                                      # gpu_profile.py (graphs on, then off)
#   bash benchmarks/gpu_run.sh ptests  # the same tests, one process per fixture file at once (NO_DEFAULT=1: not the
#                                      # embedded model); llama.cpp's build and both bench models behind them
#   bash benchmarks/gpu_run.sh bench   # the GPU table of docs/benchmarks.md (the same machine, right after: /tmp kept)
#   bash benchmarks/gpu_run.sh ab      # streaming and resident rows with CUDA graphs on and off, side by side
#   bash benchmarks/gpu_run.sh runner  # every expert in VRAM, graphs on and off, beside llama.cpp all-GPU and
#                                      # -ncmoe: the Qwen3-30B-A3B 32-layer and Gemma-4-26B-A4B 6-layer shapes
# PYTEST_ARGS / TEST_TIMEOUT pass to the test run. BUNDLE=DIR uses another folder than build/gpu (its *.whl are installed; tests read DIR/fix; a missing
# llama.cpp tarball skips that build).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUNDLE=${BUNDLE:-build/gpu}
if ls "$BUNDLE"/*.whl >/dev/null 2>&1; then  # once per machine: later calls may carry fixtures only
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$BUNDLE"/*.whl || exit 1
fi
[ -d /tmp/site ] || { echo "no wheels installed on this machine: carry a bundle with *.whl first" >&2; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
M=/tmp/q32.gguf
LLB=/tmp/llb/build/bin/llama-bench

bench_model() {
  [ -f $M ] && return
  xz -dc "$BUNDLE"/tok.gguf.xz > /tmp/tok.gguf
  ( time python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o $M --tokenizer-from /tmp/tok.gguf ) \
    > "$OUT/make_bench_model.log" 2>&1
}

case "${1:-}" in
tests)
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  # llama.cpp with CUDA, behind everything else (its own session: it outlives this call, for the bench part)
  if [ -f "$BUNDLE"/llama.cpp-cuda-slim.tar.xz ] && [ ! -e /tmp/llb.log ]; then  # once per machine
    setsid nohup python3 tools/llamacpp_cuda.py build "$BUNDLE"/llama.cpp-cuda-slim.tar.xz /tmp/llb -j10 \
      > /tmp/llb.log 2>&1 < /dev/null &
  fi
  bench_model
  MOESTREAM_GPU_FIXTURES="$BUNDLE"/fix timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/test_cuda.log" | tail -40
  [ -n "${NO_PROFILE:-}" ] && exit 0
  timeout 100 python3 benchmarks/gpu_profile.py $M -n 32 > "$OUT/profile-graphs.txt" 2>&1
  grep "^==" "$OUT/profile-graphs.txt"
  MOESTREAM_CUDA_GRAPHS=0 timeout 80 python3 benchmarks/gpu_profile.py $M -n 32 > "$OUT/profile-eager.txt" 2>&1
  grep "^==" "$OUT/profile-eager.txt"
  tail -3 /tmp/llb.log
  ;;
ptests)
  # tests/test_cuda.py with one pytest process per file of $BUNDLE/fix (and one for the embedded model), all at
  # once on the one GPU: Triton's compiles and the CPU references are what takes the time, and 16 cores share them
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  if [ -f "$BUNDLE"/llama.cpp-cuda-slim.tar.xz ] && [ ! -e /tmp/llb.log ]; then  # once per machine
    setsid nohup python3 tools/llamacpp_cuda.py build "$BUNDLE"/llama.cpp-cuda-slim.tar.xz /tmp/llb -j6 \
      > /tmp/llb.log 2>&1 < /dev/null &
  fi
  if [ -f "$BUNDLE"/tok.gguf.xz ] && [ ! -e /tmp/bm.log ]; then  # the bench models, behind the tests
    xz -dc "$BUNDLE"/tok.gguf.xz > /tmp/tok.gguf
    setsid nohup bash -c "python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf \
      --tokenizer-from /tmp/tok.gguf; python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 6 \
      -o /tmp/g6.gguf --tokenizer-from /tmp/tok.gguf; touch /tmp/bm.done" > /tmp/bm.log 2>&1 < /dev/null &
  fi
  pids=""
  if [ -z "${NO_DEFAULT:-}" ]; then
    timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py ${PYTEST_ARGS:-} \
      > "$OUT/test_cuda-default.log" 2>&1 &
    pids="$pids $!"
  fi
  for f in "$BUNDLE"/fix/*.gguf; do
    n=$(basename "$f" .gguf); d=/tmp/fx/$n; mkdir -p $d; cp -f "$f" $d/
    MOESTREAM_GPU_FIXTURES=$d timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -rs -p no:cacheprovider \
      tests/test_cuda.py -k "not default" --deselect tests/test_cuda.py::test_cli_cuda ${PYTEST_ARGS:-} \
      > "$OUT/test_cuda-$n.log" 2>&1 &
    pids="$pids $!"
  done
  for p in $pids; do wait $p; done
  for l in "$OUT"/test_cuda-*.log; do echo "== $l"; grep -E "passed|failed|error" "$l" | tail -2; done
  grep -h -E "^(FAILED|ERROR)" "$OUT"/test_cuda-*.log | cut -c1-300
  tail -2 /tmp/llb.log /tmp/bm.log 2>/dev/null
  ;;
bench)
  for i in $(seq 1 60); do [ -x $LLB ] && break; sleep 5; done
  tail -2 /tmp/llb.log
  B="bench -m $M -p 64 -n 16 -r 1 -t 16 --device cuda"
  timeout 240 python3 -m moestream $B --moe-stream on,off --direct-io off --gpu-mem 2GiB,4GiB --vs llama.cpp --llama-bench $LLB \
    --json "$OUT/b_uncapped.json" > "$OUT/b_uncapped.md" 2>"$OUT/b_uncapped.err"; cat "$OUT/b_uncapped.md"
  timeout 90 python3 -m moestream $B --moe-stream on --direct-io off --gpu-mem 4GiB --host-cache 12GiB \
    --json "$OUT/b_tier.json" > "$OUT/b_tier.md" 2>"$OUT/b_tier.err"; cat "$OUT/b_tier.md"
  timeout 80 python3 -m moestream $B --moe-stream on --direct-io off --pool host \
    --json "$OUT/b_host.json" > "$OUT/b_host.md" 2>"$OUT/b_host.err"; cat "$OUT/b_host.md"
  timeout 150 python3 -m moestream $B --mem-cap 8G --moe-stream on --gpu-mem 4GiB --cold --vs llama.cpp --llama-bench $LLB \
    --json "$OUT/b_cap8.json" > "$OUT/b_cap8.md" 2>"$OUT/b_cap8.err"; cat "$OUT/b_cap8.md"
  tail -5 "$OUT"/*.err
  ;;
runner)
  if [ -e /tmp/bm.log ]; then  # ptests is making them
    for i in $(seq 1 60); do [ -e /tmp/bm.done ] && break; sleep 5; done
  fi
  [ "${RUNNER_MODELS:-q32 g6}" != "g6" ] && bench_model
  G=/tmp/g6.gguf
  [ -f /tmp/tok.gguf ] || xz -dc "$BUNDLE"/tok.gguf.xz > /tmp/tok.gguf
  [ -f $G ] || ( time python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 6 -o $G \
    --tokenizer-from /tmp/tok.gguf ) > "$OUT/make_g6.log" 2>&1
  for i in $(seq 1 60); do [ -x $LLB ] && break; sleep 5; done
  tail -2 /tmp/llb.log
  for n in ${RUNNER_MODELS:-q32 g6}; do
    m=/tmp/$n.gguf
    for g in 1 0; do
      vs=""; [ $g = 1 ] && vs="--vs llama.cpp --llama-bench $LLB"
      MOESTREAM_CUDA_GRAPHS=$g timeout 200 python3 -m moestream bench -m $m -p 64 -n 32 -r 1 -t 16 --device cuda \
        --moe-stream off $vs --json "$OUT/runner_${n}_graphs$g.json" > "$OUT/runner_${n}_graphs$g.md" \
        2>"$OUT/runner_${n}_graphs$g.err"
      echo "== $n MOESTREAM_CUDA_GRAPHS=$g"; grep "tg32\|pp64" "$OUT/runner_${n}_graphs$g.md"; tail -2 "$OUT/runner_${n}_graphs$g.err"
    done
  done
  ;;
ab)
  bench_model
  for g in 1 0; do
    MOESTREAM_CUDA_GRAPHS=$g timeout 150 python3 -m moestream bench -m $M -p 64 -n 32 -r 2 --device cuda \
      --moe-stream on,off --direct-io off --gpu-mem 2GiB,4GiB --json "$OUT/ab_graphs$g.json" \
      > "$OUT/ab_graphs$g.md" 2>"$OUT/ab_graphs$g.err"
    echo "== MOESTREAM_CUDA_GRAPHS=$g"; grep "tg32" "$OUT/ab_graphs$g.md"
  done
  ;;
*)
  echo "usage: benchmarks/gpu_run.sh tests|ptests|bench|ab|runner" >&2; exit 2
  ;;
esac
