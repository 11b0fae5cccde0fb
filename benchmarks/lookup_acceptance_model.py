"""The context-lookup acceptance model, A/B: one rate for every copied token vs first token and later tokens.

    python benchmarks/lookup_acceptance_model.py --dtype bfloat16 --num-prompts 12 --out results/lookup_model_bf16.json
    python benchmarks/lookup_acceptance_model.py --dtype float32 --datasets copy-heavy gsm8k --modes greedy

The chooser (:class:`dspark_hf.decoding.context_lookup.SourceChooser`) values a lookup copy by the
tokens it expects the target to accept. It estimates, per match length and per state (fresh match or
copy in progress), the chance that the copy's first token is accepted and the chance that each later
one is, given the ones before (``two-rate``, the shipped model). Before, one rate stood for every
position (``one-rate``), which made a long copy look as doubtful as its first token.

This script runs SmolLM2-135M-Instruct (prepared with ``optimize_for_cpu``) with the shipped DSpark
draft, per prompt and mode in rotating order: the target alone, transformers' prompt lookup
(``prompt_lookup_num_tokens=10``), DSpark with the two-rate model and DSpark with the one-rate model
(a subclass below that keeps the old estimate). Prints tok/s per method, DSpark over prompt lookup
for both models, and (greedy) whether each output equals the target's. Ratios come from one run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import dspark_hf.decoding.settings as settings
from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.chat_text import encode_prompt
from dspark_hf.decoding.context_lookup import ContextLookup
from dspark_hf.demo_target import load_smollm2

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


class OneRateLookup(ContextLookup):
    """The earlier estimate: one Beta-estimated rate per (state, match length) for every position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._one_rate = [[[0, 0] for _ in range(self.max_ngram + 1)] for _ in range(2)]

    def acceptances(self, ngram: int, continuing: bool = False) -> tuple[float, float]:
        accepted, rejected = self._one_rate[continuing][ngram]
        a, b = self._prior[continuing]
        rate = (accepted + a) / (accepted + rejected + a + b)
        return rate, rate

    def record(self, ngram: int, verified: int, accepted: int, continuing: bool = False) -> None:
        counts = self._one_rate[continuing][ngram]
        counts[0] += accepted
        counts[1] += int(accepted < verified)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--datasets", nargs="+", default=["copy-heavy"])
    parser.add_argument("--modes", nargs="+", choices=("greedy", "sample"), default=["greedy", "sample"])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_smollm2(dtype=dtype)
    draft = DSparkDraftModel.from_pretrained(DRAFT).to(dtype).eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    methods = {
        "target": {},
        "prompt-lookup": {"prompt_lookup_num_tokens": 10},
        "dspark two-rate": {"assistant_model": draft, "lookup_class": ContextLookup},
        "dspark one-rate": {"assistant_model": draft, "lookup_class": OneRateLookup},
    }

    def generate(name: str, ids: torch.Tensor, mode: str) -> torch.Tensor:
        kwargs = dict(methods[name])
        settings.ContextLookup = kwargs.pop("lookup_class", ContextLookup)
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                               do_sample=mode == "sample", temperature=1.0, top_k=None, top_p=None, **kwargs)

    warm = torch.tensor([encode_prompt(tokenizer, "Say hello.")])
    for name in methods:
        generate(name, warm, "greedy")
    runs, turn = [], 0
    jobs = [(mode, dataset, i, prompt) for mode in args.modes for dataset in args.datasets
            for i, prompt in enumerate(load_eval_prompts(dataset, args.num_prompts))]
    for mode, dataset, index, prompt in tqdm(jobs, desc="prompts"):
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        names = list(methods)
        names = names[turn % len(names):] + names[: turn % len(names)]
        turn += 1
        outputs = {}
        for name in names:
            torch.manual_seed(index)
            start = time.perf_counter()
            out = generate(name, ids, mode)
            seconds = time.perf_counter() - start
            outputs[name] = out[0, ids.shape[1]:].tolist()
            runs.append({"method": name, "dataset": dataset, "mode": mode, "prompt_index": index,
                         "new_tokens": len(outputs[name]), "seconds": seconds})
        if mode == "greedy":
            for run in runs[-len(names):]:
                run["identical"] = outputs[run["method"]] == outputs["target"]
    settings.ContextLookup = ContextLookup

    env = capture_environment()
    print(f"{describe_environment(env)} {args.dtype}, {args.num_prompts} prompts per dataset, "
          f"{args.max_new_tokens} new tokens.")
    summary = []
    print("| dataset | mode | target tok/s | prompt lookup | DSpark two-rate | DSpark one-rate | two-rate / lookup | "
          "one-rate / lookup | identical (two / one / lookup) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for mode in args.modes:
        for dataset in args.datasets:
            rate, same = {}, {}
            for name in methods:
                done = [r for r in runs if r["method"] == name and r["dataset"] == dataset and r["mode"] == mode]
                rate[name] = sum(r["new_tokens"] for r in done) / sum(r["seconds"] for r in done)
                same[name] = f"{sum(r.get('identical', False) for r in done)}/{len(done)}" if mode == "greedy" else "-"
            row = {"dataset": dataset, "mode": mode, "tok_per_s": rate,
                   "two_rate_over_lookup": rate["dspark two-rate"] / rate["prompt-lookup"],
                   "one_rate_over_lookup": rate["dspark one-rate"] / rate["prompt-lookup"], "identical": same}
            summary.append(row)
            print(f"| {dataset} | {mode} | {rate['target']:.1f} | {rate['prompt-lookup']:.1f} | "
                  f"{rate['dspark two-rate']:.1f} | {rate['dspark one-rate']:.1f} | {row['two_rate_over_lookup']:.2f} | "
                  f"{row['one_rate_over_lookup']:.2f} | {same['dspark two-rate']} / {same['dspark one-rate']} / "
                  f"{same['prompt-lookup']} |")
    write_json_result({"environment": env, "settings": vars(args), "summary": summary, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
