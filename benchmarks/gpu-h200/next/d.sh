#!/usr/bin/env bash
# session 7, lease 2 call D: CUDA tests at main's head (GEMV2=all incl. Q4_0/Q8_0, tier prefill gather, lean
# segments): test_cuda whole (embedded model, Q8_0) + the gemma4 Q4_K_M fixture + test_tkernels -k gemv2;
# gemv_ab --check; the lean segmented step profiled. llama.cpp and the bench models built behind.
set -uo pipefail
export MOESTREAM_GEMV2_B32=${MOESTREAM_GEMV2_B32:-0} MOESTREAM_LEAN_SEGMENTS=${MOESTREAM_LEAN_SEGMENTS:-1}  # the lean segments under test alone (the B32 lanes faulted with them in session 8)
source "$(dirname "$0")/env.sh"
[ -x /tmp/llb/build/bin/llama-bench ] || setsid nohup python3 tools/llamacpp_cuda.py build build/gpuL4/llama.cpp-cuda-slim.tar.xz /tmp/llb -j10 --targets llama-bench > /tmp/logs/llb.log 2>&1 < /dev/null &
[ -e /tmp/bm.done ] || setsid nohup bash -c "python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/q32.done; python3 tools/make_bench_model.py --arch gemma4 --type Q4_0 --layers 30 -o /tmp/g30.gguf --tokenizer-from src/moestream/data/default.gguf; touch /tmp/bm.done" > /tmp/logs/make.log 2>&1 < /dev/null &
git log --oneline -1 > /tmp/logs/commit.txt 2>/dev/null
mkdir -p /tmp/fx/g4 && cp -f build/gpuF/gemma4-tiny-q4_k_m.gguf /tmp/fx/g4/
timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_tdense.py tests/test_tmoe.py > /tmp/logs/test_cuda.log 2>&1 &
p1=$!
MOESTREAM_GPU_FIXTURES=/tmp/fx/g4 timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k "not default" \
  --deselect tests/test_cuda.py::test_cli_cuda --deselect tests/test_cuda.py::test_cli_cuda_every_family > /tmp/logs/test_cuda_g4.log 2>&1 &
p2=$!
wait $p1; wait $p2
t tests; tail -qn1 /tmp/logs/test_cuda.log /tmp/logs/test_cuda_g4.log ; grep -h -E "^(FAILED|ERROR)" /tmp/logs/test_cuda*.log | cut -c1-400
for i in $(seq 1 30); do [ -e /tmp/q32.done ] && break; sleep 2; done
timeout 100 python3 benchmarks/gpu_profile.py /tmp/q32.gguf --gpu-mem 4GiB --direct-io on --streaming-only -n 16 --cprofile 30 > /tmp/logs/seg_prof_lean.txt 2>&1
t "lean profile rc=$?"; grep "^==" /tmp/logs/seg_prof_lean.txt
tail -1 /tmp/logs/llb.log; ls /tmp/*.done
cd /tmp/logs && tar czf "$OUT/l2d.tgz" . && ls | wc -l
# the thread pool's cost per job at 1-16 threads, the lock-free join (this tree) vs 2b2032f's mutex join
# (build/oldpool/src: `git archive 2b2032f src`, carried)
python3 benchmarks/pool_overhead.py --threads 1,2,4,8,16 --jobs 20000 > /tmp/logs/pool_new.txt 2>&1
[ -d build/oldpool/src ] && python3 benchmarks/pool_overhead.py --threads 1,2,4,8,16 --jobs 20000 --src build/oldpool/src > /tmp/logs/pool_old.txt 2>&1
paste /tmp/logs/pool_old.txt /tmp/logs/pool_new.txt | tail -6
cd /tmp/logs && tar czf "$OUT/l2d2.tgz" . 
