#!/usr/bin/env bash
# GPU checks of dspark_hf: build the CUDA serial-sampling op, check it against the PyTorch reference,
# time it, and time full DSpark rounds on a Qwen3-4B-shaped target. One command:
#
#   QUICK=1 bash tests/gpu/run_gpu_checks.sh        # at most BUDGET_S = 480 s (8 minutes), all stages
#   bash tests/gpu/run_gpu_checks.sh                # full: also all of tests/gpu and the long benchmark
#   DRY_RUN=1 QUICK=1 bash tests/gpu/run_gpu_checks.sh   # on CPU: the plumbing, tiny shapes, no build
#
# Results go to RESULTS_DIR (default: $OUT when set, the device tool's output folder, else
# tests/gpu/results), each stage's file written as the stage goes, so a run cut short keeps what it
# measured (at most 8 files, as the device tool brings back):
#   summary.md        rewritten after every stage: environment, stage status, tables, targets
#   env.json correctness.json speed.json round.json   per stage (see tests/gpu/gpu_checks.py)
#   build.log         compiler output of the extension build
#   run.log           every stage's console output (and, in full mode, pytest's)
#   bench.json        full mode only: examples/bench_serial_op.py
#
# The GPU machine has no network and may have an older transformers (5.17; dspark_hf needs >= 5.24):
# wheels in WHEELS_DIR (default tests/gpu/wheels) are installed first from those local files
# (--no-index --no-deps, into a private folder put first on PYTHONPATH). Prepare them beforehand on
# a machine with PyPI access with  bash tests/gpu/prepare_wheelhouse.sh  (the folder is git-ignored:
# pass it to the device tool as a carried path, e.g. carry=["tests/gpu/wheels"]).
#
# Knobs: PYTHON (default python3), RESULTS_DIR, QUICK=1, DRY_RUN=1, BUDGET_S (default 480 quick /
# 1500 full), STAGE_TIMEOUT_S (one limit for every stage after env; tests use it to cut stages short),
# WHEELS_DIR, DEPS_DIR (where wheels go, default /tmp/dspark_hf_pydeps), DSPARK_HF_EXTENSION_DIR
# (build cache, default /tmp/dspark_hf_torch_extensions). Every stage's limit is clipped to the time
# left in the budget; a stage over its limit is killed, marked 'timed out', and the next one runs.

set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
QUICK=${QUICK:-0}
DRY=${DRY_RUN:-0}
RESULTS=${RESULTS_DIR:-${OUT:-$ROOT/tests/gpu/results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
if [ "$QUICK" = "1" ]; then BUDGET=${BUDGET_S:-480}; else BUDGET=${BUDGET_S:-1500}; fi
START=$SECONDS
DEADLINE=$((START + BUDGET))
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export DSPARK_HF_EXTENSION_DIR=${DSPARK_HF_EXTENSION_DIR:-/tmp/dspark_hf_torch_extensions}
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
LOG=$RESULTS/run.log
STATUS=$(mktemp /tmp/dspark_hf_gpu_status.XXXXXX)  # the stage lines; summary.md carries them
: >"$LOG"
: >"$STATUS"
FAILED=0
DRYFLAG=()
[ "$DRY" = "1" ] && DRYFLAG=(--dry-run)

note() { echo "$*" | tee -a "$LOG"; }
summarize() {  # rewrites summary.md from the stage files, then appends the shell's stage lines
  timeout 60 "$PY" tests/gpu/gpu_checks.py summary --out "$RESULTS" >>"$LOG" 2>&1
  { echo; echo "## Stage log (run_gpu_checks.sh, budget ${BUDGET} s, quick=$QUICK, dry_run=$DRY)"; echo
    sed 's/^/    /' "$STATUS"; } >>"$RESULTS/summary.md"
}
stage() {  # stage NAME CAP_S LOGFILE COMMAND...: COMMAND within min(CAP_S, time left), output to LOGFILE
  local name=$1 cap=$2 logfile=$3
  shift 3
  [ -n "${STAGE_TIMEOUT_S:-}" ] && [ "$name" != "env" ] && cap=$STAGE_TIMEOUT_S
  local left=$((DEADLINE - SECONDS - 15))  # keep 15 s for the last summary
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 1 ]; then
    echo "[skipped] $name: no time left in the ${BUDGET} s budget" | tee -a "$LOG" >>"$STATUS"
    FAILED=1
    summarize
    return 1
  fi
  note "=== $name (limit ${limit} s) ==="
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >>"$logfile" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    echo "[ok]     $name ($((SECONDS - t0)) s)" | tee -a "$LOG" >>"$STATUS"
  else
    FAILED=1
    local why="exit $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after ${limit} s"
    echo "[FAILED] $name: $why after $((SECONDS - t0)) s; see $(basename "$logfile")" | tee -a "$LOG" >>"$STATUS"
  fi
  summarize
  return $rc
}

note "# dspark_hf GPU checks: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET} s, quick=$QUICK, dry_run=$DRY"
note "results: $RESULTS"

# 1. Wheels from local files (transformers >= 5.24 on a machine without network).
WHEELS=${WHEELS_DIR:-$ROOT/tests/gpu/wheels}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  DEPS=${DEPS_DIR:-/tmp/dspark_hf_pydeps}
  if timeout 120 "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$DEPS" "$WHEELS"/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH="$DEPS:$PYTHONPATH"
    echo "[ok]     wheels: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')installed into $DEPS" | tee -a "$LOG" >>"$STATUS"
  else
    FAILED=1
    echo "[FAILED] wheels: installing $WHEELS/*.whl failed; see run.log" | tee -a "$LOG" >>"$STATUS"
  fi
else
  echo "[none]   wheels: no $WHEELS/*.whl (fine where transformers >= 5.24 is installed)" | tee -a "$LOG" >>"$STATUS"
fi

# 2. Environment (versions, GPU, compiler); fails when transformers is too old to import dspark_hf.
if ! stage "env" 90 "$LOG" "$PY" tests/gpu/gpu_checks.py env --out "$RESULTS" "${DRYFLAG[@]}"; then
  note "stopping: the environment stage failed (see run.log; an old transformers needs tests/gpu/prepare_wheelhouse.sh)"
  summarize
  rm -f "$STATUS"
  exit 1
fi

# 3. Build the op (first use compiles it; later stages load the cached build).
if [ "$DRY" = "1" ]; then
  echo "[skipped] build: dry run (no CUDA)" | tee -a "$LOG" >>"$STATUS"
else
  stage "build the extension" 240 "$RESULTS/build.log" "$PY" -c "
import time; from dspark_hf.decoding import cuda_ops
t = time.time(); cuda_ops.load_extension(verbose=True)
print(f'extension ready in {time.time() - t:.1f} s at {cuda_ops.extension_dir()}')"
  tail -1 "$RESULTS/build.log" | tee -a "$LOG"
fi

# 4.-6. Measurements; each stage writes its JSON as it goes.
stage "correctness: op vs reference, V=151936 r=256 gamma 7/16 bf16" 150 "$LOG" \
  "$PY" tests/gpu/gpu_checks.py correctness --out "$RESULTS" "${DRYFLAG[@]}"
stage "speed: op vs eager loop at 1 and 64 rows" 120 "$LOG" \
  "$PY" tests/gpu/gpu_checks.py speed --out "$RESULTS" "${DRYFLAG[@]}"
stage "round: Qwen3-4B-shaped target, DeepSpec-4B-shaped draft" 200 "$LOG" \
  "$PY" tests/gpu/gpu_checks.py round --out "$RESULTS" "${DRYFLAG[@]}"

# 7. Full mode: the whole GPU test module and the long benchmark.
if [ "$QUICK" != "1" ] && [ "$DRY" != "1" ]; then
  stage "tests/gpu (pytest)" 600 "$LOG" "$PY" -m pytest tests/gpu -v -rfEs --durations=10 -p no:cacheprovider
  stage "benchmark (examples/bench_serial_op.py --round-share)" 600 "$LOG" \
    "$PY" examples/bench_serial_op.py --json "$RESULTS/bench.json" --round-share --compile-budget-s 150
fi

note "total $((SECONDS - START)) s; result: $([ $FAILED -eq 0 ] && echo 'all stages passed' || echo 'SOME STAGES FAILED')"
summarize
rm -f "$STATUS"
exit $FAILED
