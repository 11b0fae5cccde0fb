#!/usr/bin/env bash
# On-policy answers against teacher-forced text (ShareGPT's original answers: one target forward per sequence,
# no generation), at a fixed number of training steps, on one corpus of the target's own answers.
#
#   bash benchmarks/data_mix.sh ANSWERS_DIR [STEPS] [OUT]
#
# ANSWERS_DIR: a data folder made by `dspark-hf train` or `dspark-hf datagen` (at least 352 answers).
# Three drafts, each trained on 320 sequences after the same 32 held-out answers (calibration):
#   onpolicy  320 of the target's answers;  mix  160 answers + 160 texts;  text  320 texts.
# And the DFlash ablation of the first (no Markov head, no confidence head; same data, steps and seed).
# Then greedy tau of each on the bench sets (`dspark-hf evaluate`, full block verified) in OUT/tau.json.
# A sequence's data cost differs by kind: an answer costs its generation and a feature forward, a text
# only the forward; the stages.json of the run that made ANSWERS_DIR and the train logs here give both.
set -euo pipefail
answers=${1:?usage: data_mix.sh ANSWERS_DIR [STEPS] [OUT]}
steps=${2:-300}
out=${3:-runs/data_mix}
common=(--target smollm2 --corpus "$answers" --features cached --max-steps "$steps" --no-measure --seed 0)
dspark-hf train "${common[@]}" --max-sequences 352 --output "$out/onpolicy"
dspark-hf train "${common[@]}" --max-sequences 192 --reference-answers 160 --output "$out/mix"
dspark-hf train "${common[@]}" --max-sequences 32 --reference-answers 320 --output "$out/text"
dspark-hf train "${common[@]}" --max-sequences 352 --markov-rank 0 --no-confidence-head --output "$out/dflash"
dspark-hf evaluate --drafts "$out/onpolicy" "$out/mix" "$out/text" "$out/dflash" --modes greedy --num-prompts 5 \
    --max-new-tokens 128 --out "$out/tau.json"
