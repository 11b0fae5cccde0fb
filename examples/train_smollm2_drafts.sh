#!/usr/bin/env bash
# Reproduces the shipped SmolLM2-135M-Instruct drafts from scratch on a CPU machine:
# 320 ShareGPT prompts answered by the target (32 held out for calibration) plus 1700 ShareGPT
# conversations with their original answers, target features, then the DSpark draft and the
# DFlash ablation trained side by side (one thread each, same data, backbone and step budget),
# STS-calibrated (DSpark) and saved in fp16 without embedding/LM-head copies.
#   bash examples/train_smollm2_drafts.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-1400}
DATA=(--num-prompts 320 --reference-answers 1700)
mkdir -p drafts
python -m dspark_hf.training --prepare-only "${DATA[@]}" --threads 2
python -m dspark_hf.training --output drafts/smollm2-135m-dspark "${DATA[@]}" --max-steps "$STEPS" \
    --markov-rank 64 --threads 1 --fp16 > drafts/train_dspark.log 2>&1 &
python -m dspark_hf.training --output drafts/smollm2-135m-dflash "${DATA[@]}" --max-steps "$STEPS" \
    --markov-rank 0 --no-confidence-head --threads 1 --fp16 > drafts/train_dflash.log 2>&1 &
wait
