"""How often greedy DSpark output differs from the target alone in bf16 (and what transformers'
prompt lookup does on the same prompts), and by how small a logit gap.

Verifying k tokens in one forward can round differently in bf16 from k one-token steps, so at a
near-tie the two can pick different tokens; in float32 they agree (tests/test_generation.py). This
script counts it on the shipped prompt sets: per prompt, the target alone, DSpark (shipped draft,
defaults) and prompt lookup generate greedily in bf16; a method "differs" when its tokens are not
the target's, and the gap is the target's top-2 logit margin at the first differing position,
recomputed with one full forward over the target's own output (bf16).

    python benchmarks/bf16_identity.py --per-set 20 --max-new-tokens 128 --out results/bf16_identity.json
    python benchmarks/bf16_identity.py --prepare batch-invariant --out results/bf16_identity_invariant.json

``--prepare fast`` runs target and draft through ``optimize_for_cpu``; ``--prepare batch-invariant``
through ``optimize_for_cpu(target, batch_invariant=True)``, where a verify forward gives every token
the logits of a one-token step bit for bit, so no method should differ.

It measures agreement, not speed, so other jobs on the machine do not change its numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.benchmarks.shipped_drafts import shipped_drafts_dir
from dspark_hf.chat_text import chat_prompt_ids
from dspark_hf.demo_target import load_smollm2


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(target, sequence: list[int], position: int) -> float:
    """The target's top-1 minus top-2 logit predicting ``sequence[position]`` (one forward)."""
    with torch.no_grad():
        logits = target(torch.tensor([sequence[:position]])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-set", type=int, default=20, help="prompts per set (GSM8K, HumanEval, MT-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prepare", choices=["none", "fast", "batch-invariant"], default="none",
                        help="the target as loaded (default), through optimize_for_cpu, or with batch_invariant=True")
    parser.add_argument("--out", default="results/bf16_identity.json")
    args = parser.parse_args()

    target, tokenizer = load_smollm2(dtype=torch.bfloat16)
    draft = DSparkDraftModel.from_pretrained(shipped_drafts_dir(None) / "smollm2-135m-dspark").to(torch.bfloat16).eval()
    if args.prepare != "none":
        optimize_for_cpu(target, batch_invariant=args.prepare == "batch-invariant")
        optimize_for_cpu(draft)
    rows = []
    jobs = [(s, p) for s in ("gsm8k", "humaneval", "mt-bench") for p in load_eval_prompts(s, limit=args.per_set)]
    for dataset, text in tqdm(jobs, desc="prompts"):
        ids = torch.tensor([chat_prompt_ids(tokenizer, text)])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
        alone = target.generate(ids, **kwargs)[0].tolist()
        outputs = {"dspark": target.generate(ids, assistant_model=draft, **kwargs)[0].tolist(),
                   "prompt-lookup": target.generate(ids, prompt_lookup_num_tokens=10, **kwargs)[0].tolist()}
        row = {"dataset": dataset, "prompt_tokens": ids.shape[1], "target_tokens": len(alone) - ids.shape[1]}
        for method, out in outputs.items():
            at = first_difference(alone, out)
            row[method] = {"identical": at is None,
                           "first_difference": None if at is None else at - ids.shape[1],
                           "gap": None if at is None or at >= len(alone) else top2_gap(target, alone, at)}
        rows.append(row)
    summary = {}
    for method in ("dspark", "prompt-lookup"):
        differing = [r[method] for r in rows if not r[method]["identical"]]
        summary[method] = {"prompts": len(rows), "differ": len(differing),
                           "gaps": sorted(d["gap"] for d in differing if d["gap"] is not None),
                           "first_differences": sorted(d["first_difference"] for d in differing)}
    result = {"environment": capture_environment(), "settings": vars(args), "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
