#!/usr/bin/env bash
# p5.sh and p6.sh in one call (device time was short: a lease taken back, failed starts), most needed first, each
# log written under $OUT as it goes (a call past its limit still brings back what is there): llama.cpp's build and
# the bench file; the tier row beside -ncmoe once; tests/test_cuda.py whole on both fixtures; then the tier row
# again, the host work per layer and the newcomer's run with peak RSS while time is left.
# carry ["build/gpuL4", "build/gpuF/gemma4-tiny-q4_k_m.gguf"]; about 550 s.
set -uo pipefail
source "$(dirname "$0")/env.sh"
L=$OUT/logs; mkdir -p $L
[ -x /tmp/llb/build/bin/llama-bench ] || python3 tools/llamacpp_cuda.py build build/gpuL4/llama.cpp-cuda-slim.tar.xz /tmp/llb -j16 --targets llama-bench > $L/llb.log 2>&1 &
[ -e /tmp/q32.gguf ] || python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > $L/make.log 2>&1
mkdir -p /tmp/fx/g4 && cp -f build/gpuF/gemma4-tiny-q4_k_m.gguf /tmp/fx/g4/
wait; t "built $(ls /tmp/llb/build/bin/llama-bench 2>&1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $L/gpu.txt 2>&1
LLB=/tmp/llb/build/bin/llama-bench
tier() {
  timeout 110 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 32 -r 1 -t 16 --device cuda --moe-stream on --direct-io off \
    --gpu-mem 4GiB --host-cache 16GiB --vs llama.cpp --llama-bench $LLB --json $L/tier_vs$1.json > $L/tier_vs$1.md 2> $L/tier_vs$1.err
  t "tier vs $1 rc=$?"; grep -E "tg32|pp64" $L/tier_vs$1.md | cut -c1-150
}
tier 1
timeout 250 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py > $L/test_cuda.log 2>&1 &
p1=$!
MOESTREAM_GPU_FIXTURES=/tmp/fx/g4 timeout 250 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k "not default" \
  --deselect tests/test_cuda.py::test_cli_cuda --deselect tests/test_cuda.py::test_cli_cuda_every_family > $L/test_cuda_g4.log 2>&1 &
p2=$!
wait $p1; echo "test_cuda rc=$?"; wait $p2; echo "test_cuda_g4 rc=$?"
t tests; tail -qn1 $L/test_cuda.log $L/test_cuda_g4.log; grep -h -E "^(FAILED|ERROR)|illegal" $L/test_cuda*.log | cut -c1-300 | head -20
timeout 60 python3 benchmarks/tier_prefill_profile.py /tmp/q32.gguf -p 64 --gpu-mem 4GiB --host-cache 16GiB > $L/tpp64.txt 2>&1
t "tpp64 rc=$?"; sed -n 2,3p $L/tpp64.txt | cut -c1-300
/usr/bin/time -v timeout 60 python3 -m moestream run -m /tmp/q32.gguf --device cuda --gpu-mem 4GiB --host-cache 16GiB -n 64 -p "Once upon a time" > $L/run.out 2> $L/run.err
t "run rc=$?"; grep -E "prompt|decode|Maximum resident" $L/run.err | head
tier 2
