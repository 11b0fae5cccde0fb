#!/usr/bin/env bash
# Reproduces the shipped SmolLM2-135M-Instruct drafts from scratch on a CPU machine:
# ShareGPT prompts answered by the target, target features, then the DSpark draft and the DFlash
# ablation trained side by side (one thread each, same data, backbone and step budget),
# STS-calibrated (DSpark) and saved in fp16 without embedding/LM-head copies.
#   bash examples/train_smollm2_drafts.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-800}
mkdir -p drafts
python -m dspark_hf.training --prepare-only --num-prompts 320 --threads 2
python -m dspark_hf.training --output drafts/smollm2-135m-dspark --num-prompts 320 --max-steps "$STEPS" \
    --markov-rank 64 --threads 1 --fp16 > drafts/train_dspark.log 2>&1 &
python -m dspark_hf.training --output drafts/smollm2-135m-dflash --num-prompts 320 --max-steps "$STEPS" \
    --markov-rank 0 --no-confidence-head --threads 1 --fp16 > drafts/train_dflash.log 2>&1 &
wait
