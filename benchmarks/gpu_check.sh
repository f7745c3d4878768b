#!/usr/bin/env bash
# One-shot check on a machine with a GPU, offline: build the extension with the machine's own
# python and torch (nothing is installed, no network is used), run the CUDA tests, run the GPU
# decode benchmark and the multi-token / fp8 rows. One PASS / FAIL / SKIP line per step, then a
# summary; every step's log and the benchmark CSVs land in the output dir:
#   summary.txt  env.log  build.log  tests.log  bench.log  bench_cuda.csv  bench_mt.log
#   bench_cuda_mt.csv
#
#   benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]   # OUT_DIR default: $OUT if set, else
#                                                   # ./gpu_check_out
#
# Environment: PY (default python3; it needs torch with CUDA, setuptools, ninja, pytest,
# hypothesis, numpy), CUDA_HOME (default /usr/local/cuda), MAX_JOBS (default: the core count),
# GPU_CHECK_BUDGET_S (default 470; 1500 for --dry-run).
#
# The build is `setup.py build_ext --inplace` (the package is used from this tree through
# PYTHONPATH): no pip, no install into the machine's python, no build isolation. pip is still
# told to stay offline, and the proxies point at a closed local port, so anything that tries
# the network fails at once instead of hanging.
#
# --dry-run (no GPU needed; CI runs it): every step but the GPU ones. The build step builds a
# CPU-only copy of the tree in a temporary dir against the installed torch (CPU-capability
# variants left out, to bound the time), imports it and runs one attention call against the
# reference; the tests step collects the CUDA tests; the benchmark steps parse their arguments.
#
# Time: the whole run is bounded by GPU_CHECK_BUDGET_S seconds. Each step runs under its own cap
# and what is left of the budget (the tests get all that is left but what the benchmarks need);
# a step with too little time left is reported as SKIP, not as a failure. The CUDA tests stop
# starting new tests near their cap (pytest reports the rest as skipped for time). Exit status 1
# when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

DRY_RUN=0
OUT_ARG=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) OUT_ARG="$arg" ;;
  esac
done

OUT_DIR="${OUT_ARG:-${OUT:-./gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
# The dry run's CPU-only build takes a few minutes on an idle 2-core machine, many more on a
# loaded one: a budget of its own.
BUDGET="${GPU_CHECK_BUDGET_S:-$([ "$DRY_RUN" = 1 ] && echo 1500 || echo 470)}"
START=$(date +%s)
PY="${PY:-python3}"
# The python's own bin dir first: torch's build calls the `ninja` binary a venv may hold there.
if PY_PATH="$(command -v "$PY")"; then
  PATH="$(dirname "$PY_PATH"):$PATH"
fi
export PY ROOT OUT_DIR DRY_RUN PATH
export PYTHONUNBUFFERED=1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}"
# Offline: pip may not reach an index, and any HTTP(S) request goes to a closed local port.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9
export HTTP_PROXY=$http_proxy HTTPS_PROXY=$https_proxy
unset no_proxy NO_PROXY

say() { echo "$*" | tee -a "$SUMMARY"; }

STEPS=()     # "STATUS name detail" per step
NFAIL=0

record() {  # record STATUS NAME DETAIL
  STEPS+=("$1 $2")
  [ "$1" = FAIL ] && NFAIL=$((NFAIL + 1))
  say "$(printf '%-4s  %-8s %s' "$1" "$2" "$3")"
}

# run_step NAME CAP_SECONDS COMMAND...: runs COMMAND with output to $OUT_DIR/NAME.log under
# min(CAP, budget left) seconds and records PASS / FAIL. STEP_DEADLINE (epoch seconds) is
# exported so that a step can stop starting new work in time.
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  ((left < cap)) && cap=$left
  if ((cap < 15)); then
    record SKIP "$name" "out of time: ${left} s of the ${BUDGET} s budget left"
    return 0
  fi
  local t0 rc=0
  t0=$(date +%s)
  export STEP_DEADLINE=$((t0 + cap))
  timeout --kill-after=10 "$cap" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
  local dt=$(($(date +%s) - t0))
  if ((rc == 0)); then
    record PASS "$name" "${dt} s (limit ${cap} s)  log: $name.log"
  else
    local why="rc=$rc"
    ((rc == 124 || rc == 137)) && why="timed out"
    record FAIL "$name" "$why after ${dt} s (limit ${cap} s)  log: $name.log"
    tail -n 30 "$OUT_DIR/$name.log" | sed 's/^/    | /' | tee -a "$SUMMARY"
  fi
  return 0
}

# Whether step NAME passed (later steps need the build).
passed() { printf '%s\n' "${STEPS[@]}" | grep -qx "PASS $1"; }

env_step() {
  "$PY" - <<'EOF' || return 1
import importlib, os, shutil, sys
print("python", sys.version.split()[0], sys.executable)
mods = {}
for name in ("torch", "setuptools", "ninja", "numpy", "pytest", "hypothesis"):
    try:
        mods[name] = importlib.import_module(name)
        print(f"{name:11s}", getattr(mods[name], "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(f"{name:11s} MISSING ({e})")
torch = mods.get("torch")
missing = [n for n in ("torch", "setuptools", "ninja", "pytest", "hypothesis", "numpy")
           if n not in mods]
nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
print("nvcc       ", nvcc if os.path.exists(nvcc) else "not found", "| ninja binary:",
      shutil.which("ninja"))
if torch is not None:
    print("torch CUDA ", torch.version.cuda, "| cuda available:", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device     ", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
if missing:
    sys.exit(f"missing: {', '.join(missing)}")
if os.environ["DRY_RUN"] != "1":
    if torch.version.cuda is None:
        sys.exit("torch is not a CUDA build: the CUDA kernels cannot be built")
    if not torch.cuda.is_available():
        sys.exit("torch sees no GPU")
EOF
  "$CUDA_HOME/bin/nvcc" --version 2>/dev/null | tail -n 2 || true
}

# The machine's GPU architecture, e.g. 9.0 (nvidia-smi, else torch).
gpu_arch() {
  local cc
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')
  [ -n "$cc" ] ||
    cc=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || return 1
  [ -n "$cc" ] && echo "$cc"
}

build_step() {
  if [ "$DRY_RUN" = 1 ]; then
    # A CPU-only build of a copy of the tree: the CI's own build (CUDA included) stays as is.
    local tmp
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/paged_ops_dry.XXXXXX")
    echo "$tmp" >"$OUT_DIR/dry_build_dir"  # removed at the end, whatever happens
    cp -r setup.py pyproject.toml README.md csrc "$tmp/"
    mkdir "$tmp/paged_ops"
    cp paged_ops/*.py "$tmp/paged_ops/"
    echo "CPU-only build of a copy in $tmp (MAX_JOBS=$MAX_JOBS)"
    (cd "$tmp" && PAGED_OPS_BUILD_CUDA=0 PAGED_OPS_CPU_VARIANTS=none "$PY" setup.py build_ext \
      --inplace) || return 1
    # From the copy (python puts the working directory first on sys.path).
    (cd "$tmp" && PYTHONPATH="$tmp" "$PY" - <<'EOF') || return 1
import torch
import paged_ops
from paged_ops import reference as ref
print("paged_ops from", paged_ops.__file__, "| torch", torch.__version__,
      "| CPU kernel", paged_ops.cpu_kernel_variant())
g = torch.Generator().manual_seed(0)
kc, vc = paged_ops.allocate_kv_cache(4, 2, 64, 16, torch.float32)
kc.copy_(torch.randn(kc.shape, generator=g))
vc.copy_(torch.randn(vc.shape, generator=g))
q = torch.randn(2, 4, 64, generator=g)
bt = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32)
sl = torch.tensor([20, 32], dtype=torch.int32)
got = paged_ops.paged_attention(q, kc, vc, bt, sl)
torch.testing.assert_close(got, ref.attention(q, kc, vc, bt, sl, 64 ** -0.5), atol=2e-5,
                           rtol=1e-4)
print("CPU attention of the fresh build agrees with the reference")
EOF
    return 0
  fi
  local arch
  arch=$(gpu_arch) || return 1
  # No CPU-capability variants: they are one long compile each, built one after the other,
  # and the CUDA tests compare with the reference, not with the CPU kernels.
  echo "build for sm_${arch/./} with MAX_JOBS=$MAX_JOBS"
  PAGED_OPS_BUILD_CUDA=1 PAGED_OPS_CPU_VARIANTS=none TORCH_CUDA_ARCH_LIST="$arch" "$PY" setup.py \
    build_ext --inplace || return 1
  PYTHONPATH="$ROOT" "$PY" -c "import paged_ops, torch, sys
ok = paged_ops.built_with_cuda() and torch.cuda.is_available()
print('built_with_cuda:', paged_ops.built_with_cuda(), '| cuda available:',
      torch.cuda.is_available(), '| CPU kernel:', paged_ops.cpu_kernel_variant())
sys.exit(0 if ok else 1)"
}

tests_step() {
  if [ "$DRY_RUN" = 1 ]; then
    local tmp
    tmp=$(cat "$OUT_DIR/dry_build_dir")
    (cd "$tmp" && PYTHONPATH="$tmp" "$PY" -m pytest -m cuda "$ROOT/tests" -q -p no:cacheprovider \
      --collect-only)
    return
  fi
  # Leave 20 s after the last test start for it to finish and pytest to report.
  PAGED_OPS_TEST_DEADLINE=$((STEP_DEADLINE - 20)) PYTHONPATH="$ROOT" "$PY" -m pytest -m cuda \
    tests -q -rfE -p no:cacheprovider --durations=15
}

bench_step() {  # bench_step CSV_NAME ARGS...
  local csv=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    local tmp
    tmp=$(cat "$OUT_DIR/dry_build_dir")
    (cd "$tmp" && PYTHONPATH="$tmp" "$PY" "$ROOT/benchmarks/bench_attention.py" --help >/dev/null)
    return
  fi
  PYTHONPATH="$ROOT" "$PY" benchmarks/bench_attention.py --device cuda "$@" \
    --csv "$OUT_DIR/$csv"
}

export -f env_step gpu_arch build_step tests_step bench_step

say "gpu_check $(date -u +%FT%TZ)  host $(hostname)  out $OUT_DIR  budget ${BUDGET} s$(
  [ "$DRY_RUN" = 1 ] && echo '  DRY RUN (no GPU steps)')"
if REV=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet 2>/dev/null || REV="$REV (with uncommitted changes)"
else
  REV="? (not a git checkout)"
fi
say "git $REV  python: $PY  MAX_JOBS=$MAX_JOBS"
if [ "$DRY_RUN" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
    2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
fi

# Caps: env 40 s, build 300 s, the benchmarks 30 + 30 s, the tests what is left but those 60 s
# (at least 70 s of the default budget of 470 s): the whole run, build included, fits 8 minutes.
# The dry run's caps are larger: CI machines may be slow or loaded.
cap() { if [ "$DRY_RUN" = 1 ]; then echo "$2"; else echo "$1"; fi; }
run_step env "$(cap 40 90)" bash -c env_step
if passed env; then
  run_step build "$(cap 300 1200)" bash -c build_step
else
  record SKIP build "the env step failed"
fi
if passed build; then
  run_step tests $((BUDGET - ($(date +%s) - START) - $(cap 60 180))) bash -c tests_step
  # Decode grid: bf16, 32 query heads over 8 and 32 kv heads, head size 128, block size 16.
  run_step bench "$(cap 30 90)" bash -c 'bench_step bench_cuda.csv'
  # Chunked prefill (8 x 512 new tokens over 4096 cached), decode tokens through the
  # multi-token kernel, fp8 decode.
  run_step bench_mt "$(cap 30 90)" bash -c 'bench_step bench_cuda_mt.csv --multi-token'
else
  for s in tests bench bench_mt; do record SKIP "$s" "needs the build"; done
fi

if [ "$DRY_RUN" = 1 ] && [ -s "$OUT_DIR/dry_build_dir" ]; then
  rm -rf "$(cat "$OUT_DIR/dry_build_dir")" "$OUT_DIR/dry_build_dir"
fi
if [ -s "$OUT_DIR/tests.log" ]; then
  say "tests: $(grep -E '(passed|failed|error|tests? collected)' "$OUT_DIR/tests.log" | tail -n 1)"
fi
for f in bench bench_mt; do
  if [ "$DRY_RUN" = 0 ] && [ -s "$OUT_DIR/$f.log" ]; then
    echo "--- $f ---" | tee -a "$SUMMARY"
    tee -a "$SUMMARY" <"$OUT_DIR/$f.log"
  fi
done
count() { printf '%s\n' "${STEPS[@]}" | grep -c "^$1 "; }
say "summary: $(count PASS) PASS, $(count FAIL) FAIL, $(count SKIP) SKIP in $(($(date +%s) - START)) s: $(
  [ "$NFAIL" = 0 ] && echo OK || echo FAILED)"
[ "$NFAIL" = 0 ]
