#!/usr/bin/env bash
# session 7 (for the next GPU session), call F: issue 25's capped row on the 16 cores (q32 in a 6 GiB cgroup,
# O_DIRECT, 16 threads) with the C read threads, MOESTREAM_READ_SPLIT off and on, and the per-layer profile
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -e /tmp/q32.done ] || { python3 tools/make_bench_model.py --type Q4_K_M --layers 32 -o /tmp/q32.gguf --tokenizer-from src/moestream/data/default.gguf > /tmp/logs/make.log 2>&1 && touch /tmp/q32.done; }
for s in 0 1; do
  MOESTREAM_READ_SPLIT=$s timeout 150 python3 -m moestream bench -m /tmp/q32.gguf -p 64 -n 16 -r 1 -t 16 --device cpu --mem-cap 6G \
    --moe-stream on --direct-io on --cold --json /tmp/logs/cap6_split$s.json > /tmp/logs/cap6_split$s.md 2> /tmp/logs/cap6_split$s.err
  t "cap6 cpu split=$s rc=$?"; grep -E "tg16|pp64" /tmp/logs/cap6_split$s.md | cut -c1-40,100-260
done
timeout 150 python3 tools/profile_capped.py -m /tmp/q32.gguf --mem-cap 6G -t 16 -n 16 > /tmp/logs/profile_capped16.txt 2>&1
t "profile_capped rc=$?"; tail -30 /tmp/logs/profile_capped16.txt
cd /tmp/logs && tar czf "$OUT/l2f.tgz" . && ls | wc -l
