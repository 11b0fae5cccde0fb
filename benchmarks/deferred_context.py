"""The draft's context added only before a draft forward vs every round, A/B in one run.

    python benchmarks/deferred_context.py --dtype bfloat16 --datasets mt-bench copy-heavy --num-prompts 6

Every round the target's hidden states of the newly accepted tokens become draft context (the
draft's ``fc`` projection and each layer's keys and values). Rounds that do not draft (a plain step
the drafting gate chose, a context-lookup copy) now only keep those features, and the next draft
forward adds them in one call (``DSparkCandidateGenerator._flush_context``). ``every round`` sets
``MAX_PENDING_CONTEXT = 1``, which adds them at once as before.

Runs SmolLM2-135M-Instruct (``optimize_for_cpu``) with the shipped DSpark draft, per prompt in
rotating order: the target alone, DSpark deferred, DSpark every round. Prints tok/s per method and
the ratios of one run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import dspark_hf.decoding.candidate_generator as candidate_generator
from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.chat_text import encode_prompt
from dspark_hf.demo_target import load_smollm2

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"
DEFERRED = candidate_generator.MAX_PENDING_CONTEXT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--datasets", nargs="+", default=["mt-bench", "copy-heavy"])
    parser.add_argument("--mode", choices=("greedy", "sample"), default="sample")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_smollm2(dtype=dtype)
    draft = DSparkDraftModel.from_pretrained(DRAFT).to(dtype).eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    methods = {"target": (None, DEFERRED), "deferred": (draft, DEFERRED), "every round": (draft, 1)}

    def generate(name: str, ids: torch.Tensor) -> torch.Tensor:
        assistant, pending = methods[name]
        candidate_generator.MAX_PENDING_CONTEXT = pending
        kwargs = {} if assistant is None else {"assistant_model": assistant}
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                               do_sample=args.mode == "sample", temperature=1.0, top_k=None, top_p=None, **kwargs)

    warm = torch.tensor([encode_prompt(tokenizer, "Say hello.")])
    for name in methods:
        generate(name, warm)
    runs, turn = [], 0
    jobs = [(dataset, i, p) for dataset in args.datasets for i, p in enumerate(load_eval_prompts(dataset, args.num_prompts))]
    for dataset, index, prompt in tqdm(jobs, desc="prompts"):
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        names = list(methods)[turn % 3:] + list(methods)[: turn % 3]
        turn += 1
        for name in names:
            torch.manual_seed(index)
            start = time.perf_counter()
            out = generate(name, ids)
            runs.append({"method": name, "dataset": dataset, "prompt_index": index,
                         "new_tokens": out.shape[1] - ids.shape[1], "seconds": time.perf_counter() - start})
    candidate_generator.MAX_PENDING_CONTEXT = DEFERRED

    env = capture_environment()
    print(f"{describe_environment(env)} {args.dtype}, {args.mode}, {args.num_prompts} prompts per dataset, "
          f"{args.max_new_tokens} new tokens.")
    print("| dataset | target tok/s | deferred | every round | deferred / every round | deferred / target |")
    print("|---|---:|---:|---:|---:|---:|")
    summary = []
    for dataset in args.datasets:
        rate = {}
        for name in methods:
            done = [r for r in runs if r["method"] == name and r["dataset"] == dataset]
            rate[name] = sum(r["new_tokens"] for r in done) / sum(r["seconds"] for r in done)
        summary.append({"dataset": dataset, "tok_per_s": rate})
        print(f"| {dataset} | {rate['target']:.1f} | {rate['deferred']:.1f} | {rate['every round']:.1f} | "
              f"{rate['deferred'] / rate['every round']:.3f} | {rate['deferred'] / rate['target']:.2f} |")
    write_json_result({"environment": env, "settings": vars(args), "summary": summary, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
