#!/usr/bin/env bash
# Issue 26's GPU rows: the 2-core machine's streamed chat load (docs/serving.md: 128 generated tokens per request,
# one request per client, --temperature 1 with request i seeded 1000 + i) at 1, 4 and 8 concurrent clients against
#   moestream-vram   moestream serve --device cuda --moe-stream off -np 8   (every expert in GPU memory)
#   moestream-tier   moestream serve --device cuda --moe-stream on --direct-io off --gpu-mem 4GiB --host-cache 16GiB -np 8
#   llama-ncmoe      llama-server -ngl 99 -ncmoe 99 -np 8 -fa off            (experts on the CPU, the rest on the GPU)
# on the same file, each server with 8 slots of 1,024 tokens (moestream -c 1024 per slot; llama-server -c 8192
# shared by its 8 slots). Aggregate tok/s and TTFT p50/p95 per run come from tools/serve_load.py through
# benchmarks/serve_targets.sh (servers and client counts alternating), the table from benchmarks/serve_tables.py.
#
#   bash benchmarks/serve_gpu.sh          # on the GPU machine, from the repo root (or build/gpuS/serve.sh)
#
# Everything is bounded: the three servers start at once, each under `timeout` (they die on their own if this
# script is killed), a warm-up load per server (Triton compiles, CUDA graphs, the tier's caches), then the runs
# until DEADLINE; the servers are killed at the end. Logs and JSON under $LOGS. Environment (defaults for the
# GPU machine; the CPU dry run sets them):
#   M=/tmp/q32.gguf LLS=/tmp/llb/build/bin/llama-server LOGS=/tmp/logs DEVICE=cuda TOKENS=128 CLIENTS="1 4 8 1 4 8"
#   BUDGET=300 (seconds from start to the last run's start; loading gets half of it, loading and warm-up 60%)
#   RUN_TIMEOUT=60 (seconds per run) WARM_TOKENS=16 TIER=1 (0: no tier server) MS_ARGS (more moestream serve flags,
#   both servers) LLS_ARGS (more llama-server flags) LLS_WAIT=0 (seconds to wait for $LLS to appear: a build behind)
#   WHEELS=build/gpuS/wheels: fastapi/uvicorn/httpx wheels installed (no index) into /tmp/site-serve when the
#   machine's Python lacks them.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
M=${M:-/tmp/q32.gguf}
LLS=${LLS:-/tmp/llb/build/bin/llama-server}
LOGS=${LOGS:-/tmp/logs}
DEVICE=${DEVICE:-cuda}
TOKENS=${TOKENS:-128}
CLIENTS=${CLIENTS:-1 4 8 1 4 8}
BUDGET=${BUDGET:-300}
RUN_TIMEOUT=${RUN_TIMEOUT:-60}
WARM_TOKENS=${WARM_TOKENS:-16}
TIER=${TIER:-1}
NP=${NP:-8}
CTX=${CTX:-1024}
WHEELS=${WHEELS:-build/gpuS/wheels}
PY=${PYTHON:-python3}
# moestream's tier server: every expert fits in its host cache (11.66 GiB file), 4 GiB of GPU pools
TIER_ARGS=${TIER_ARGS:---moe-stream on --direct-io off --gpu-mem 4GiB --host-cache 16GiB}
P_VRAM=18961 P_TIER=18962 P_LLS=18963
SERVER_LIFE=$((BUDGET + RUN_TIMEOUT + 60))  # seconds: no server outlives the script by much
export PYTHONUNBUFFERED=1
mkdir -p "$LOGS"
[ -d "$LOGS/serve" ] && mv "$LOGS/serve" "$LOGS/serve.before-$T0"  # an earlier run's JSON stays out of this table
say() { echo "[serve_gpu +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOGS/serve_gpu.log"; }

if ! "$PY" -c "import fastapi, uvicorn, httpx" 2>/dev/null; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    say "installing fastapi/uvicorn/httpx from $WHEELS into /tmp/site-serve"
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-serve "$WHEELS"/*.whl > "$LOGS/pip.log" 2>&1 || say "pip failed: see $LOGS/pip.log"
    export PYTHONPATH=/tmp/site-serve:${PYTHONPATH:-}
  fi
  "$PY" -c "import fastapi, uvicorn, httpx" 2>>"$LOGS/serve_gpu.log" || { say "no fastapi/uvicorn/httpx: stop"; exit 1; }
fi
[ -f "$M" ] || { say "no model file $M: stop"; exit 1; }
{ command -v nvidia-smi >/dev/null && nvidia-smi -L; nproc; free -g | head -2; } > "$LOGS/machine.txt" 2>&1

pids=()
start() {  # NAME PORT CMD...: the server in its own session under timeout, its log in $LOGS/NAME.log
  local name=$1 port=$2
  shift 2
  say "start $name on :$port: $*"
  setsid timeout -k 10 "$SERVER_LIFE" "$@" > "$LOGS/$name.log" 2>&1 < /dev/null &
  pids+=("$!")
  echo "$name $port $!" >> "$LOGS/servers.txt"
}
stop_all() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
  sleep 3
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap stop_all EXIT
: > "$LOGS/servers.txt"

MS=("$PY" -m moestream serve -m "$M" --device "$DEVICE" -np "$NP" -c "$CTX" --host 127.0.0.1)
# shellcheck disable=SC2086
start moestream-vram "$P_VRAM" "${MS[@]}" --port "$P_VRAM" --moe-stream off ${MS_ARGS:-}
if [ "$TIER" = 1 ]; then
  # shellcheck disable=SC2086
  start moestream-tier "$P_TIER" "${MS[@]}" --port "$P_TIER" $TIER_ARGS ${MS_ARGS:-}
fi
for _ in $(seq 1 "${LLS_WAIT:-0}"); do [ -x "$LLS" ] && break; sleep 1; done
LLS_CMD=()
if [ -x "$LLS" ]; then
  ngl=(-ngl 99 -ncmoe 99)
  [ "$DEVICE" = cuda ] || ngl=(-ngl 0)
  # shellcheck disable=SC2206
  LLS_CMD=("$LLS" -m "$M" --host 127.0.0.1 --port "$P_LLS" "${ngl[@]}" -np "$NP" -c $((NP * CTX)) -fa off --no-ui
           ${LLS_ARGS:-})
  start llama-ncmoe "$P_LLS" "${LLS_CMD[@]}"
else
  say "no llama-server at $LLS: moestream rows only"
fi

healthy() { "$PY" - "$1" <<'EOF'
import sys, httpx
try:
    sys.exit(0 if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5).status_code == 200 else 1)
except httpx.HTTPError:
    sys.exit(1)
EOF
}
wait_healthy() {  # NAME PORT PID: 0 once /health answers 200; 1 when the server exits or loading passes BUDGET/2
  until healthy "$2"; do
    if ! kill -0 "$3" 2>/dev/null; then
      wait "$3"
      say "$1 exited while loading (status $?): tail of its log:"
      tail -5 "$LOGS/$1.log" | tee -a "$LOGS/serve_gpu.log"
      return 1
    fi
    if (( $(date +%s) - T0 > BUDGET / 2 )); then say "$1 not healthy after $(( $(date +%s) - T0 )) s: left out"; return 1; fi
    sleep 1
  done
  say "$1 healthy"
}
ready=()
mapfile -t started < "$LOGS/servers.txt"
for entry in "${started[@]}"; do
  read -r name port pid <<< "$entry"
  if wait_healthy "$name" "$port" "$pid"; then
    ready+=("$name:$port")
  elif [ "$name" = llama-ncmoe ]; then
    # a native ggml-cpu build on a CPU with AMX died on the 2-core machine (2026-12-04: SIGSEGV or SIGILL) in ggml's
    # AMX kernels (ggml_backend_amx_mul_mat: the CPU weights' repacked buffers) at its warm-up decode; --no-repack
    # (no extra CPU buffer types) avoided it: once more so
    start llama-ncmoe-norepack "$P_LLS" "${LLS_CMD[@]}" --no-repack
    read -r name port pid <<< "$(tail -1 "$LOGS/servers.txt")"
    wait_healthy "$name" "$port" "$pid" && ready+=("$name:$port")
  fi
done
(( ${#ready[@]} )) || { say "no server up: stop"; exit 1; }

# warm-up, not counted, the servers at once (Triton's compiles on the CPU cores): one request alone (the
# single-sequence CUDA graph), then NP at once (the batched step's shapes, every batch size from NP down as they
# finish; the tier's caches)
WARM_UNTIL=$((T0 + BUDGET * 6 / 10))
warm() {  # NAME PORT
  local left
  for c in 1 "$NP"; do
    left=$((WARM_UNTIL - $(date +%s)))
    (( left > 5 )) || { say "$1 warm-up c=$c skipped: past +$((BUDGET * 6 / 10))s"; continue; }
    timeout -k 5 "$left" "$PY" tools/serve_load.py --port "$2" --clients "$c" --requests "$c" \
      --max-tokens "$WARM_TOKENS" --temperature 1 --seed 7000 > "$LOGS/warmup-$1-c$c.txt" 2>&1 \
      || say "$1 warm-up c=$c failed (exit $?)"
  done
  say "$1 warmed: $(tail -1 "$LOGS/warmup-$1-c$NP.txt" 2>/dev/null)"
}
wpids=()
for sp in "${ready[@]}"; do
  warm "${sp%%:*}" "${sp##*:}" &
  wpids+=("$!")
done
wait "${wpids[@]}"

servers=$(IFS=,; echo "${ready[*]}")
say "runs: $servers, clients $CLIENTS, $TOKENS tokens, until +${BUDGET}s"
# shellcheck disable=SC2086
DEADLINE=$((T0 + BUDGET)) RUN_TIMEOUT=$RUN_TIMEOUT PYTHON=$PY LOAD_ARGS="--temperature 1" \
  bash benchmarks/serve_targets.sh "$LOGS/serve" "$TOKENS" "$servers" $CLIENTS
for sp in "${ready[@]}"; do
  name=${sp%%:*} port=${sp##*:}
  [[ $name == moestream* ]] && timeout 10 "$PY" -c "import httpx, sys; print(httpx.get(sys.argv[1], timeout=5).text)" \
    "http://127.0.0.1:$port/metrics" > "$LOGS/$name-metrics.txt" 2>&1
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu \
  --format=csv > "$LOGS/nvidia-smi-end.txt" 2>&1
stop_all
trap - EXIT
timeout 30 "$PY" benchmarks/serve_tables.py "$LOGS/serve" > "$LOGS/serve-table.md" 2>&1
cat "$LOGS/serve-table.md"
for sp in "${ready[@]}"; do name=${sp%%:*}; echo "== $name.log (tail)"; tail -4 "$LOGS/$name.log"; done
say "done"
