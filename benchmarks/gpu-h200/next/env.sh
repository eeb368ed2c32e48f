# sourced by d.sh, e.sh, f.sh, g.sh: the repository root as working directory, $OUT and /tmp/logs, a timer t(),
# the gguf/transformers wheels of build/gpuL4 installed once into /tmp/site, PYTHONPATH
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT" /tmp/logs; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site build/gpuL4/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
