#!/usr/bin/env bash
# session 9's short lease (little device time left): the thread pool's cost per job at 1-16 threads (this tree's
# lock-free join vs 2b2032f's mutex join, build/oldpool/src carried), then tests/test_cuda.py on the embedded model
# with the lean segments on (MOESTREAM_LEAN_SEGMENTS=1; the store-keyed graphs and tables of 7c6cb86)
set -uo pipefail
export MOESTREAM_GEMV2_B32=0 MOESTREAM_LEAN_SEGMENTS=1
source "$(dirname "$0")/env.sh"
git log --oneline -1 > /tmp/logs/commit.txt 2>/dev/null
timeout 230 python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_cuda.py -k "default" > /tmp/logs/test_cuda.log 2>&1 &
p1=$!
python3 benchmarks/pool_overhead.py --threads 1,2,4,8,16 --jobs 5000 > /tmp/logs/pool_new.txt 2>&1
python3 benchmarks/pool_overhead.py --threads 1,2,4,8,16 --jobs 5000 --src build/oldpool/src > /tmp/logs/pool_old.txt 2>&1
t pool; paste /tmp/logs/pool_old.txt /tmp/logs/pool_new.txt | tail -6
wait $p1; echo "test_cuda rc=$?"; t tests
tail -n3 /tmp/logs/test_cuda.log; grep -h -E "^(FAILED|ERROR)" /tmp/logs/test_cuda.log | cut -c1-300
cd /tmp/logs && tar czf "$OUT/m.tgz" .
