"""What a wrong cached SPS profile costs once the live cost model corrects it.

    python benchmarks/wrong_profile.py                       # SmolLM2 + shipped DSpark draft, prepared for CPU
    python benchmarks/wrong_profile.py --num-prompts 3 --max-new-tokens 256 --factors 1 3 0.333

The target's profile is measured once; copies with every step time multiplied by each factor are
written as cache files. Each generation starts a fresh cost model from one of them (as a new
process would), so the profile misleads it until live rounds correct it. Factors run interleaved
prompt by prompt; tokens/s per factor, relative to factor 1 (the correct profile), is printed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf import DSparkDraftModel, PrefixScheduler, optimize_for_cpu, shared_cost_model
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.benchmarks.prompt_sets import DATASETS, load_eval_prompts
from dspark_hf.chat_text import chat_prompt_ids
from dspark_hf.demo_target import load_smollm2
from dspark_hf.scheduling.shared_cost import _shared_cost_models
from dspark_hf.scheduling.step_rates import profile_sps, sps_cache_key

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 3.0, 1 / 3])
    parser.add_argument("--draft", default=str(DRAFT))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(args.draft).float().eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    block = draft.config.block_size
    root = Path(tempfile.mkdtemp(prefix="wrong_profile_"))
    correct = profile_sps(target, 16, cache_dir=root / "correct", use_cache=False)
    key = sps_cache_key(target, 16)
    for factor in args.factors:
        folder = root / f"x{factor:g}" / "sps"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.json").write_text(json.dumps({"sps": [r / factor for r in correct]}))
    prompts = [chat_prompt_ids(tokenizer, p) for d in DATASETS for p in load_eval_prompts(d, args.num_prompts)]
    totals = {factor: [0, 0.0] for factor in args.factors}
    drift = {}
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        order = args.factors[index % len(args.factors):] + args.factors[: index % len(args.factors)]
        for factor in order:
            _shared_cost_models.clear()  # a fresh process: the cost model starts from the cached file
            cost_model = shared_cost_model(target, cache_dir=root / f"x{factor:g}")
            draft.generation_config.dspark_verify_policy = PrefixScheduler(cost_model=cost_model, max_tokens=block + 1)
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=draft)
            totals[factor][1] += time.perf_counter() - start
            totals[factor][0] += out.shape[1] - ids.shape[1]
            drift[factor] = cost_model.drift()
    base = totals[args.factors[0]][0] / totals[args.factors[0]][1]
    result = {}
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy; profile factors interleaved")
    print("factor  tok/s   vs correct  live/prior drift at the end")
    for factor, (tokens, seconds) in totals.items():
        rate = tokens / seconds
        result[f"{factor:g}"] = {"tokens_per_s": rate, "relative": rate / base, "final_drift": drift[factor]}
        print(f"{factor:<7.3g} {rate:6.2f}  {rate / base:10.3f}  x{drift[factor]:.2f}")
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
