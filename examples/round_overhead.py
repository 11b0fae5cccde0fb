"""Per-round cost of DSpark's generator on CPU, split by part, for a small local model (no network).

    python examples/round_overhead.py [--threads 2] [--new-tokens 200]

Rounds verify the full block (FixedLengthPolicy(block)) so every part runs each round. Parts:
draft forward (context ingest + backbone + LM head), serial sampling loop (Markov bias, processors,
confidences), scheduler (policy + EOS check), target verify (target forward plus transformers'
acceptance and bookkeeping, measured between generator calls), and the rest of generate's wall time.
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark_hf import DSparkDraftModel, FixedLengthPolicy, PrefixScheduler
from generate import random_llama


def measure(target, draft, new_tokens: int, do_sample: bool) -> dict[str, float]:
    prompt = torch.randint(3, 4096, (1, 64), generator=torch.Generator().manual_seed(1))
    target.generate(prompt, max_new_tokens=8, do_sample=do_sample, assistant_model=draft)  # warm-up
    torch.manual_seed(0)
    start = time.perf_counter()
    target.generate(prompt, max_new_tokens=new_tokens, do_sample=do_sample, min_new_tokens=new_tokens,
                    assistant_model=draft)
    wall = time.perf_counter() - start
    stats = draft.last_generation_stats
    parts = {k: v / stats.num_rounds * 1e3 for k, v in stats.timings().items()}
    parts["other (prefill, setup)"] = wall / stats.num_rounds * 1e3 - sum(parts.values())
    parts["round total"] = wall / stats.num_rounds * 1e3
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = random_llama()
    draft = DSparkDraftModel.from_target(target, block_size=args.block_size, markov_rank=256).eval()
    print(f"target: Llama 8 layers, hidden 256, vocab 4096, fp32, {args.threads} threads; draft: 1 layer, "
          f"rank 256, block {args.block_size}; ms per round (mean over one generate of {args.new_tokens} tokens)")
    policies = {"fixed": FixedLengthPolicy(args.block_size),
                "scheduler": PrefixScheduler([1.0] * (args.block_size + 1))}  # flat table: verifies the block
    rows = {}
    for mode in ("greedy", "sample"):
        for name, policy in policies.items():
            draft.generation_config.dspark_verify_policy = policy
            rows[f"{mode}/{name}"] = measure(target, draft, args.new_tokens, mode == "sample")
    keys = list(next(iter(rows.values())))
    print("| part | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{r[key]:.2f}" for r in rows.values()) + " |")
    for name, r in rows.items():
        overhead = (r["serial_sampling"] + r["scheduler"]) / r["round total"] * 100
        print(f"{name}: serial loop + scheduler = {overhead:.1f}% of the round; "
              f"draft forward = {r['draft_forward'] / r['round total'] * 100:.1f}%")


if __name__ == "__main__":
    main()
