#!/usr/bin/env bash
# Issue 26's serving targets: tools/serve_load.py against servers already listening on loopback.
#   [LOAD_ARGS="--temperature 1"] benchmarks/serve_targets.sh OUTDIR TOKENS NAME:PORT[,NAME:PORT...] CLIENTS...
# For each CLIENTS value in turn, and within it for each server in turn (so that servers and batch sizes
# alternate under the same load), sends CLIENTS concurrent streamed chat requests (one each) of TOKENS tokens;
# with --metrics where NAME starts with "moestream". Writes OUTDIR/NAME-cCLIENTS-rREP.json (REP counts repeats of
# the same CLIENTS value) and one line per run to OUTDIR/runs.txt with the 1-minute load average before and after.
set -euo pipefail
out=$1 tokens=$2 servers=$3
shift 3
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
declare -A rep
for c in "$@"; do
  rep[$c]=$(( ${rep[$c]:-0} + 1 ))
  for sp in ${servers//,/ }; do
    name=${sp%%:*} port=${sp##*:}
    extra=()
    [[ $name == moestream* ]] && extra=(--metrics)
    f="$out/$name-c$c-r${rep[$c]}.json"
    l0=$(cut -d' ' -f1 /proc/loadavg)
    line=$("$py" "$here/tools/serve_load.py" --port "$port" --clients "$c" --requests "$c" --max-tokens "$tokens" \
           "${extra[@]}" ${LOAD_ARGS:-} --json "$f" | grep -E "aggregate|steady decode" | tr '\n' ' ')
    l1=$(cut -d' ' -f1 /proc/loadavg)
    echo "$(date -u +%H:%M:%S) $name c=$c load $l0 -> $l1: $line" | tee -a "$out/runs.txt"
  done
done
