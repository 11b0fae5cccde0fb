#!/usr/bin/env bash
# Drafts v3 for SmolLM2-135M-Instruct: a reduced draft vocabulary (16,384 ids, ~2.5x the training
# steps per CPU second of the full 49,152) and more steps, warm-started from the v2 drafts.
#   bash examples/train_smollm2_drafts_v3.sh [prompts] [steps]
# 1. on-policy data: the target's own answers (data/smollm2-onpolicy, resumable; see v2's script);
# 2. target features of the first PROMPTS records, with the target's log-normaliser per position
#    (what the reduced-vocabulary loss needs), cached under $DSPARK_HF_CACHE/features;
# 3. DSpark and the DFlash ablation side by side with the same data, backbone, vocabulary and steps,
#    each warm-started from its v2 draft (taken from git history, commit 344dacc, into runs/v2),
#    one thread each, resumable (--resume), with a loadable snapshot of each draft every 500 steps
#    (runs/v3/<name>/snapshots/step-N) so accepted length can be measured along the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-5120}
STEPS=${2:-2500}
V2=344dacc  # the commit that shipped the v2 drafts
# `dspark-hf train` (docs/training.md) on the committed corpus; features cached once, shared by both runs.
DATA=(--target smollm2 --corpus data/smollm2-onpolicy --max-sequences "$PROMPTS" --draft-vocab-size 16384
      --features cached)
COMMON=(--max-steps "$STEPS" --learning-rate 5e-4 --save-every 100 --snapshot-every 500 --threads 1 --fp16 --resume)
python -m dspark_hf.training.datagen --out data/smollm2-onpolicy --max-prompts "$PROMPTS" --threads 2
python -m dspark_hf.training --prepare-only "${DATA[@]}" --threads 2
mkdir -p runs/v3 runs/v2
git archive "$V2" drafts/smollm2-135m-dspark drafts/smollm2-135m-dflash | tar -x -C runs/v2
python -m dspark_hf.training --output runs/v3/dspark "${DATA[@]}" "${COMMON[@]}" --markov-rank 64 \
    --init-from-draft runs/v2/drafts/smollm2-135m-dspark > runs/v3/dspark.log 2>&1 &
python -m dspark_hf.training --output runs/v3/dflash "${DATA[@]}" "${COMMON[@]}" --markov-rank 0 \
    --no-confidence-head --init-from-draft runs/v2/drafts/smollm2-135m-dflash > runs/v3/dflash.log 2>&1 &
wait
