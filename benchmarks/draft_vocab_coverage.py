"""Coverage of a reduced draft vocabulary (issue 12): which share of held-out answer tokens the N most
frequent training answer tokens (plus SmolLM2's special ids and the mask token) hold.

    python benchmarks/draft_vocab_coverage.py --data data/smollm2-onpolicy --held-out 32

The first ``--held-out`` records are held out (training holds out its first 32 sequences the same
way); the ids are counted on the others. Tokens outside the subset can still be produced (the target
samples them from the residual); they are the positions where drafting the next token cannot succeed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_hf.demo_target import dense_dir
from dspark_hf.training.datagen import load_onpolicy_corpus
from dspark_hf.training.draft_vocab_training import COVERAGE_SIZES, answer_tokens, coverage_table

SMOLLM2_MASK_TOKEN_ID = 16  # <empty_output>, see dspark_hf.demo_target.MASK_TOKEN


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/smollm2-onpolicy"))
    parser.add_argument("--held-out", type=int, default=32, help="records held out (the first ones)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(COVERAGE_SIZES))
    args = parser.parse_args(argv)

    config = json.loads((dense_dir() / "config.json").read_text())  # vocabulary and special ids only
    required = {config.get("eos_token_id"), config.get("pad_token_id"), config.get("bos_token_id"),
                SMOLLM2_MASK_TOKEN_ID} - {None}
    records = load_onpolicy_corpus(args.data)
    held_out, train = records[: args.held_out], records[args.held_out :]
    print(f"{len(train)} training records ({answer_tokens(train).numel()} answer tokens), {len(held_out)} held out "
          f"({answer_tokens(held_out).numel()} answer tokens); vocabulary {config['vocab_size']}")
    print("| N | held-out coverage | training coverage |\n|---:|---:|---:|")
    for row in coverage_table(train, held_out, config["vocab_size"], args.sizes, sorted(required)):
        print(f"| {row['size']} | {row['held_out_coverage']:.2%} | {row['train_coverage']:.2%} |")


if __name__ == "__main__":
    main()
