#!/usr/bin/env bash
# One-shot check on a fresh machine with a GPU: create the environment (offline, from the
# machine's configured local wheel index), build the extension for the visible GPU, run the
# CUDA tests, run the GPU decode benchmark and the multi-token / fp8 rows. Everything lands in
# an output dir:
#   summary.txt  env.log  build.log  tests.log  bench.log  bench_cuda.csv  bench_mt.log
#   bench_cuda_mt.csv
#
#   benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT if set, else ./gpu_check_out
#
# The whole run is bounded by GPU_CHECK_BUDGET_S seconds (default 520, under 9 minutes): each
# step gets at most its own cap and what is left of the budget. Exit status is non-zero when any
# step failed; later steps still run so one call collects everything.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${1:-${OUT:-./gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
BUDGET="${GPU_CHECK_BUDGET_S:-520}"
START=$(date +%s)
export PY=.venv/bin/python
export PYTHONUNBUFFERED=1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
FAILED=0

say() { echo "$*" | tee -a "$SUMMARY"; }

# run_step NAME CAP_SECONDS COMMAND...: output to $OUT_DIR/NAME.log, one timing line in summary.
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  ((left < cap)) && cap=$left
  if ((cap < 10)); then
    say "$(printf '%-8s' "$name") SKIPPED: out of time budget (${BUDGET}s)"
    FAILED=1
    return 0
  fi
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" bash -euo pipefail -c '"$@"' bash "$@" >"$OUT_DIR/$name.log" 2>&1 \
    || rc=$?
  say "$(printf '%-8s' "$name") rc=$rc  $(($(date +%s) - t0)) s  (limit ${cap} s)  log: $name.log"
  if ((rc != 0)); then
    FAILED=1
    tail -n 40 "$OUT_DIR/$name.log" | sed 's/^/    | /'
  fi
  return 0
}

setup_env() {
  test -x "$PY" || python3 -m venv .venv
  "$PY" -m pip install -q --upgrade pip setuptools wheel ninja
  "$PY" -m pip install -q torch==2.14.1 numpy pytest hypothesis expecttest ninja
  "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
             'available', torch.cuda.is_available(),
             torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
}

build() {
  # No TORCH_CUDA_ARCH_LIST: torch builds for the visible GPU's architecture.
  env -u TORCH_CUDA_ARCH_LIST PAGED_OPS_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" \
    "$PY" -m pip install -v --no-build-isolation --no-deps -e .
  "$PY" -c "import paged_ops, torch, sys
ok = paged_ops.built_with_cuda() and torch.cuda.is_available()
print('built_with_cuda:', paged_ops.built_with_cuda(), 'cuda available:', torch.cuda.is_available())
sys.exit(0 if ok else 1)"
}

export -f setup_env build

say "gpu_check $(date -u +%FT%TZ)  host $(hostname)  out $OUT_DIR  budget ${BUDGET} s"
say "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
  2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY" || true
say "nvcc: $("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | tail -n 1 || echo "not found under $CUDA_HOME")"

run_step env 150 setup_env
run_step build 200 build
run_step tests 220 "$PY" -m pytest -m cuda tests -q -rfE -p no:cacheprovider --durations=10
run_step bench 120 "$PY" benchmarks/bench_attention.py --device cuda --csv "$OUT_DIR/bench_cuda.csv"
# Chunked prefill (8 x 512 new tokens over 4096 cached), decode tokens through the multi-token
# kernel, fp8 decode.
run_step bench_mt 60 "$PY" benchmarks/bench_attention.py --device cuda --multi-token \
  --csv "$OUT_DIR/bench_cuda_mt.csv"

grep -E "passed|failed|error" "$OUT_DIR/tests.log" 2>/dev/null | tail -n 1 | sed 's/^/tests: /' \
  | tee -a "$SUMMARY" || true
if [ -s "$OUT_DIR/bench.log" ]; then
  echo "--- bench ---" | tee -a "$SUMMARY"
  tee -a "$SUMMARY" <"$OUT_DIR/bench.log"
fi
if [ -s "$OUT_DIR/bench_mt.log" ]; then
  echo "--- bench_mt (multi-token, fp8) ---" | tee -a "$SUMMARY"
  tee -a "$SUMMARY" <"$OUT_DIR/bench_mt.log"
fi
say "total $(($(date +%s) - START)) s, $([ "$FAILED" = 0 ] && echo OK || echo FAILED)"
exit "$FAILED"
