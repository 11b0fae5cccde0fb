#!/usr/bin/env bash
# GPU checks of dspark_hf's CUDA serial-sampling op: build the extension, run tests/gpu, run the
# benchmark, and write everything to tests/gpu/results/.
#
#   bash tests/gpu/run_gpu_checks.sh
#
# Needs: an NVIDIA GPU, a CUDA build of PyTorch, nvcc matching it (CUDA_HOME), ninja, a C++ compiler.
# Runs from a source checkout (PYTHONPATH, no install). About 6-9 minutes on an H200: build ~1 min,
# tests ~2 min, benchmark ~3-5 min (torch.compile dominates; QUICK=1 skips it).
#
# Results (fixed names, overwritten on each run; commit them):
#   tests/gpu/results/summary.txt   environment, per-stage status, test summary, benchmark table
#   tests/gpu/results/build.txt     compiler output of the extension build
#   tests/gpu/results/pytest.txt    verbose pytest output of tests/gpu
#   tests/gpu/results/bench.txt     benchmark output; bench.json the same numbers as JSON
# When $OUT names a folder (the device tool's output folder), the files are copied there too.
#
# Environment knobs:
#   PYTHON         interpreter (default python3)
#   RESULTS_DIR    where results go (default tests/gpu/results)
#   QUICK=1        benchmark without torch.compile and with fewer repeats
#   BENCH_ARGS     extra benchmark arguments (default: --round-share --compile-budget-s 150)
#   DSPARK_HF_EXTENSION_DIR  build cache shared by tests and benchmark (default /tmp/dspark_hf_torch_extensions)
#   WHEELS_DIR     wheels to install first, --no-deps, into a private folder (default tests/gpu/wheels).
#                  dspark_hf needs transformers>=5.24; where the GPU machine's is older and has no
#                  network, fetch it beforehand on a machine with PyPI access:
#                      pip download transformers==5.24.0 --no-deps -d tests/gpu/wheels
#                  (the wheel travels with the working tree; do not commit it)

set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
RESULTS=${RESULTS_DIR:-$ROOT/tests/gpu/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DSPARK_HF_EXTENSION_DIR=${DSPARK_HF_EXTENSION_DIR:-/tmp/dspark_hf_torch_extensions}
export HF_HUB_OFFLINE=1
SUMMARY=$RESULTS/summary.txt
: >"$SUMMARY"
FAILED=0

log() { echo "$*" | tee -a "$SUMMARY"; }
stage() {  # stage NAME LOGFILE TIMEOUT_S COMMAND...: runs COMMAND, output to LOGFILE, status to the summary
  local name=$1 logfile=$2 limit=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$logfile" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    log "[ok]     $name ($((SECONDS - start)) s)"
  else
    FAILED=1
    log "[FAILED] $name: exit $rc after $((SECONDS - start)) s$([ $rc -eq 124 ] && echo ' (timed out)'); see $(basename "$logfile")"
  fi
  return $rc
}

log "# dspark_hf CUDA serial-sampling op: GPU checks"
log "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
log "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- dspark_hf tests/gpu examples 2>/dev/null || echo ' + uncommitted changes')"
log "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
log "nvcc: $(nvcc --version 2>&1 | tail -1)"

WHEELS=${WHEELS_DIR:-$ROOT/tests/gpu/wheels}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  DEPS=/tmp/dspark_hf_pydeps
  if $PY -m pip install --quiet --no-index --no-deps --target "$DEPS" "$WHEELS"/*.whl >>"$SUMMARY" 2>&1; then
    export PYTHONPATH="$DEPS:$PYTHONPATH"
    log "wheels: installed $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')into $DEPS"
  else
    log "wheels: installing $WHEELS/*.whl failed"
  fi
fi
log "python: $($PY -c 'import sys, torch, transformers; print(sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda, "| transformers", transformers.__version__)' 2>&1 | tail -1)"

if ! $PY -c "import dspark_hf" >>"$SUMMARY" 2>&1; then
  log "[FAILED] import dspark_hf (see above). If transformers is older than 5.24, see WHEELS_DIR at the top of this script."
  FAILED=1
else
  stage "build the extension" "$RESULTS/build.txt" 900 \
    $PY -c "import time; from dspark_hf import cuda_ops; t = time.time(); cuda_ops.load_extension(verbose=True); print(f'extension ready in {time.time() - t:.1f} s at {cuda_ops.extension_dir()}')"
  tail -1 "$RESULTS/build.txt" | tee -a "$SUMMARY"

  stage "tests/gpu (pytest)" "$RESULTS/pytest.txt" 1200 \
    $PY -m pytest tests/gpu -v -rfEs --durations=10 -p no:cacheprovider
  log "pytest: $(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$RESULTS/pytest.txt" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$RESULTS/pytest.txt" | head -40 | tee -a "$SUMMARY"

  if [ "${QUICK:-0}" = "1" ]; then
    BENCH=(--quick ${BENCH_ARGS:-})
  else
    BENCH=(${BENCH_ARGS:---round-share --compile-budget-s 150})
  fi
  stage "benchmark (examples/bench_serial_op.py ${BENCH[*]})" "$RESULTS/bench.txt" 1200 \
    $PY examples/bench_serial_op.py --json "$RESULTS/bench.json" "${BENCH[@]}"
  log ""
  log "## benchmark (ms per block of gamma tokens; ratios measured in this run)"
  grep -E '^(V=|goal|round|op cost|round-share)' "$RESULTS/bench.txt" | tee -a "$SUMMARY"
fi

log ""
log "result: $([ $FAILED -eq 0 ] && echo 'all stages passed' || echo 'SOME STAGES FAILED')"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$RESULTS"/*.txt "$RESULTS"/*.json "$OUT"/ 2>/dev/null
fi
exit $FAILED
