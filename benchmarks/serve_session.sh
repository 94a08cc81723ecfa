#!/usr/bin/env bash
# The served-model benchmark on a GPU machine, in one call (the device tool's machine: jax with
# CUDA, torch, nvcc; nothing to download). From the repository root:
#   OUT=/some/folder [DEMO=1] bash benchmarks/serve_session.sh PRESET[,PRESET...] [serve args]
# Builds the FFI launcher in place (once) and, where the reduced FlashMLA tree is in
# .peers/flashmla (benchmarks/README.md), FlashMLA for the peer, in the background; with DEMO=1
# runs `python -m jax_mla demo` (its exit status goes to $OUT/demo.txt) meanwhile. Each preset
# runs in its own process (a fresh device memory pool each) and adds its entry to
# $OUT/serve.json (at most PRESET_TIMEOUT seconds each, default 900); the console output goes to
# $OUT/serve.log.
set -uo pipefail
OUT=${OUT:-/tmp/jax_mla_serve}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/.peers/flashmla${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Room for torch (the peer, CUPTI) beside JAX's pool.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/serve.log"
fm=""
if [ -d .peers/flashmla ] && ! python3 -c "import flash_mla.cuda" 2>/dev/null; then
  (cd .peers/flashmla && MAX_JOBS=8 python3 flashmla_setup.py build_ext --inplace \
     > "$OUT/flashmla_build.log" 2>&1; echo "flashmla build rc=$?" >> "$OUT/flashmla_build.log") &
  fm=$!
fi
if ! ls jax_mla/_triton_launch*.so > /dev/null 2>&1; then
  python3 setup.py -q build_ext --inplace > "$OUT/launcher_build.log" 2>&1 || echo "launcher build failed"
fi
if [ "${DEMO:-0}" = 1 ]; then
  { time timeout 150 python3 -m jax_mla demo --no-progress; echo "demo rc=$?"; } \
    > "$OUT/demo.txt" 2>&1
  tail -5 "$OUT/demo.txt"
fi
[ -n "$fm" ] && { wait $fm; tail -1 "$OUT/flashmla_build.log"; }
presets=${1:-tiny}
shift || true
for p in ${presets//,/ }; do
  timeout "${PRESET_TIMEOUT:-900}" python3 -m jax_mla.bench serve --preset "$p" \
    --out "$OUT/serve.json" --no-progress "$@" 2>&1 | tee -a "$OUT/serve.log"
done
exit 0
