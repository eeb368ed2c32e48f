#!/usr/bin/env bash
# llama.cpp's llama-bench inside a cgroup v2 memory cap (page cache included, swap off), file evicted first:
# the baseline of `moestream bench --mem-cap` on machines without llama-cpp-python (e.g. the GPU machine).
#   sudo benchmarks/llama_capped.sh 1.6G MODEL.gguf path/to/llama-bench [llama-bench args...]
# Prints llama-bench's markdown table and the group's memory.peak. Needs root and cgroup v2 with memory.
set -euo pipefail
cap=$1 model=$2 bench=$3; shift 3
root=$(awk '$9 == "cgroup2" {print $5; exit}' /proc/self/mountinfo)
[ -n "$root" ] && grep -qw memory "$root/cgroup.controllers" || { echo "no cgroup v2 memory controller" >&2; exit 2; }
grep -qw memory "$root/cgroup.subtree_control" || echo +memory > "$root/cgroup.subtree_control"
g="$root/llama-capped-$$"
mkdir "$g"
trap 'rmdir "$g" 2>/dev/null || true' EXIT
# memory.max takes integer bytes (or K/M/G suffixes, no decimals): convert 1.6G, 800MiB, ... to bytes
bytes=$(python3 -c 'import re, sys; m = re.fullmatch(r"([0-9.]+)([KMGT]?)(i?B)?", sys.argv[1], re.I); print(int(float(m[1]) * 1024 ** "_KMGT".index((m[2] or "_").upper())))' "$cap")
echo "$bytes" > "$g/memory.max"
[ -e "$g/memory.swap.max" ] && echo 0 > "$g/memory.swap.max"
python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$model"
sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$g" "$bench" -m "$model" "$@" || echo "llama-bench exit $? (oom_kill: $(grep oom_kill "$g/memory.events"))"
echo "memory.peak $(awk '{printf "%.3f GiB", $1 / 2^30}' "$g/memory.peak")"
