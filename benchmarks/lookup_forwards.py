"""Target forwards per prompt: DSpark's default against transformers' prompt lookup, greedy.

How many target forwards each method needs for the same greedy output is a count, not a timing, so
it shows where rounds are lost on a noisy machine (the chooser reads live step times, so counts
still move by a few percent between runs). With ``--trace`` each DSpark round is printed as
``<source><accepted>/<verified>`` (L: a context-lookup copy, D: drafted, p: a plain step).

    python benchmarks/lookup_forwards.py --dataset copy-heavy --num-prompts 8 --trace
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.prompt_sets import BENCH_DATASETS, load_eval_prompts
from dspark_hf.chat_text import chat_prompt_ids
from dspark_hf.demo_target import load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=BENCH_DATASETS, default="copy-heavy")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", default="drafts/smollm2-135m-dspark")
    parser.add_argument("--methods", nargs="+", choices=["prompt-lookup", "dspark"], default=["prompt-lookup", "dspark"])
    parser.add_argument("--trace", action="store_true", help="print DSpark's rounds")
    args = parser.parse_args()

    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(args.draft).eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    forwards: list[int] = []
    target.register_forward_hook(lambda *_: forwards.append(1))
    totals = {name: [0, 0, 0.0] for name in args.methods}  # tokens, forwards (prefill excluded), seconds
    for i, text in enumerate(load_eval_prompts(args.dataset, args.num_prompts)):
        ids = torch.tensor([chat_prompt_ids(tokenizer, text)])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
        per_prompt = {}
        for name in args.methods:
            forwards.clear()
            start = time.perf_counter()
            if name == "prompt-lookup":
                out = target.generate(ids, prompt_lookup_num_tokens=10, **kwargs)
            else:
                out = target.generate(ids, assistant_model=draft, **kwargs)
            seconds = time.perf_counter() - start
            new_tokens = out.shape[1] - ids.shape[1]
            for j, value in enumerate((new_tokens, len(forwards) - 1, seconds)):
                totals[name][j] += value
            per_prompt[name] = len(forwards) - 1
        print(f"prompt {i}: forwards {per_prompt}")
        if args.trace and "dspark" in args.methods:
            rounds = draft.last_generation_stats.rounds
            print("   ", " ".join(f"{'L' if r.source == 'lookup' else 'D' if r.drafted else 'p'}{r.accepted}/{r.verified}"
                                  for r in rounds))
    for name, (tokens, count, seconds) in totals.items():
        print(f"{name}: {tokens} tokens, {count} forwards, {tokens / max(count, 1):.2f} tokens per forward, "
              f"{tokens / seconds:.1f} tok/s")


if __name__ == "__main__":
    main()
