#!/usr/bin/env bash
# Issue 26's serving targets: tools/serve_load.py against servers already listening on loopback.
#   [LOAD_ARGS="--temperature 1"] benchmarks/serve_targets.sh OUTDIR TOKENS NAME:PORT[,NAME:PORT...] CLIENTS...
# For each CLIENTS value in turn, and within it for each server in turn (so that servers and batch sizes
# alternate under the same load), sends CLIENTS concurrent streamed chat requests (one each) of TOKENS tokens;
# with --metrics where NAME starts with "moestream". Writes OUTDIR/NAME-cCLIENTS-rREP.json (REP counts repeats of
# the same CLIENTS value), serve_load's output beside it (.txt), and one line per run to OUTDIR/runs.txt with the
# 1-minute load average before and after.
# Bounded runs (benchmarks/serve_gpu.sh): RUN_TIMEOUT=S stops a run after S seconds; DEADLINE=EPOCH_S starts no run
# after that time (date +%s), the rest logged as skipped. A run that fails or times out is logged as such and the
# next one goes on.
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
    if (( ${DEADLINE:-0} > 0 && $(date +%s) >= ${DEADLINE:-0} )); then
      echo "$(date -u +%H:%M:%S) $name c=$c skipped: past DEADLINE" | tee -a "$out/runs.txt"
      continue
    fi
    l0=$(cut -d' ' -f1 /proc/loadavg)
    rc=0
    timeout -k 5 "${RUN_TIMEOUT:-0}" "$py" "$here/tools/serve_load.py" --port "$port" --clients "$c" --requests "$c" \
      --max-tokens "$tokens" "${extra[@]}" ${LOAD_ARGS:-} --json "$f" > "${f%.json}.txt" || rc=$?
    line=$(grep -E "aggregate|steady decode" "${f%.json}.txt" | tr '\n' ' ' || true)
    (( rc == 0 )) || line="FAILED (exit $rc${RUN_TIMEOUT:+, RUN_TIMEOUT=$RUN_TIMEOUT s}) $line"
    l1=$(cut -d' ' -f1 /proc/loadavg)
    echo "$(date -u +%H:%M:%S) $name c=$c load $l0 -> $l1: $line" | tee -a "$out/runs.txt"
  done
done
