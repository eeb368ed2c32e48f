#!/usr/bin/env bash
# next GPU session, call G (after d.sh, whose llama.cpp build at /tmp/llb it uses): issue 25's CPU rows on the
# 16 Xeon cores beside llama.cpp's CPU backend (-ngl 0) in one lease: q32 (README row g), and the families that
# joined the fast C decode step on 2026-12-05: gpt-oss (gpt-oss-20b's config, 24 layers, MXFP4 experts) and gemma4
# (g30: the Gemma-4-26B-A4B shape, Q4_0)
set -uo pipefail
source "$(dirname "$0")/env.sh"
LLB=/tmp/llb/build/bin/llama-bench
[ -e /tmp/oss.done ] || { python3 tools/make_bench_model.py --arch gpt-oss --layers 24 -o /tmp/oss24.gguf \
  --tokenizer-from src/moestream/data/default.gguf > /tmp/logs/make_oss.log 2>&1 && touch /tmp/oss.done; }
t "gpt-oss file rc=$?"
for i in $(seq 1 60); do [ -x $LLB ] && [ -e /tmp/bm.done ] && break; sleep 3; done
for m in q32 oss24 g30; do
  timeout 170 python3 -m moestream bench -m /tmp/$m.gguf -p 128 -n 32 -r 1 -t 16 --device cpu --moe-stream off \
    --vs llama.cpp --llama-bench $LLB --json /tmp/logs/cpu_${m}.json > /tmp/logs/cpu_${m}.md 2> /tmp/logs/cpu_${m}.err
  t "cpu $m rc=$?"; grep -E "tg32|pp128" /tmp/logs/cpu_${m}.md | cut -c1-60,100-170
done
cd /tmp/logs && tar czf "$OUT/ng.tgz" . && ls | wc -l
