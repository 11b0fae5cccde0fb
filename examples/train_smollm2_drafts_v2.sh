#!/usr/bin/env bash
# Drafts v2 for SmolLM2-135M-Instruct (issue: ten times the training signal).
#   bash examples/train_smollm2_drafts_v2.sh [prompts] [steps]
# 1. on-policy data: the target's own answers to the prompt plan in data/smollm2-onpolicy (ShareGPT
#    first turns, DeepMind mathematics, CHAMP, code docstrings; half greedy, half at T=1), resumable:
#    finished shards are kept, so the command continues where it stopped;
# 2. target features of the first PROMPTS records (cached under $DSPARK_HF_CACHE/data);
# 3. DSpark and the DFlash ablation trained side by side with the same data, backbone and steps,
#    each warm-started from its v1 draft (taken from git history, commit 29be359, into runs/v1), one
#    thread each, resumable (--resume) from runs/v2/<name>/checkpoint (accelerate state, not
#    committed: ~150 MB). The shipped v2 drafts are `bash examples/train_smollm2_drafts_v2.sh 4864 2000`.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-4864}
STEPS=${2:-2000}
V1=29be359  # the commit that shipped the v1 drafts
DATA=(--corpus data/smollm2-onpolicy --max-sequences "$PROMPTS")
COMMON=(--max-steps "$STEPS" --learning-rate 5e-4 --save-every 100 --threads 1 --fp16 --resume)
python -m dspark_hf.training.datagen --out data/smollm2-onpolicy --max-prompts "$PROMPTS" --threads 2
python -m dspark_hf.training --prepare-only "${DATA[@]}" --threads 2
mkdir -p runs/v2 runs/v1
git archive "$V1" drafts/smollm2-135m-dspark drafts/smollm2-135m-dflash | tar -x -C runs/v1
python -m dspark_hf.training --output runs/v2/dspark "${DATA[@]}" "${COMMON[@]}" --markov-rank 64 \
    --init-from-draft runs/v1/drafts/smollm2-135m-dspark > runs/v2/dspark.log 2>&1 &
python -m dspark_hf.training --output runs/v2/dflash "${DATA[@]}" "${COMMON[@]}" --markov-rank 0 \
    --no-confidence-head --init-from-draft runs/v1/drafts/smollm2-135m-dflash > runs/v2/dflash.log 2>&1 &
wait
