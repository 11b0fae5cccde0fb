"""Batched DSpark variants against the target's own batched generate, interleaved, with round records.

    python benchmarks/batched_variants.py --batch-size 16 --mode sample --variants default plain --repeats 2
    python benchmarks/batched_variants.py --batch-size 16 --mode sample --variants gate-4-rounds gate-batches

SmolLM2 prepared with the shipped v3 draft; one left-padded batch of GSM8K, HumanEval and MT-Bench
prompts (every third of the first 8 per set, so the sets mix), 128 new tokens per row. Each repeat
runs the target, then every variant, on the same batch with the same seed, and prints tokens per
second, the time in each part of the rounds (draft forward, serial loop, decisions, verify
forwards), how many row-rounds drafted (``--trace``: which rounds), and per source (draft or lookup copy) the rounds, verified
and accepted tokens. The last line is each variant's total time against the target's, over all
repeats. Variants:

- ``default``: DSpark as shipped; ``no-lookup``: context lookup off;
- ``plain``: nothing proposed (``num_assistant_tokens=0``, lookup off): DSpark's loop of plain
  batched steps, the cost of a round that verifies nothing;
- ``gate-4-rounds``: the gate batch size 1 uses, with the batched 5% margin
  (``DraftingGate(margin=0.05)``); ``gate-batches``: ``DraftingGate.for_batches()`` (the batched default).
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from dspark_hf import DraftingGate, DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.acceptance import left_padded
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.chat_text import encode_prompt
from dspark_hf.demo_target import load_smollm2

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def variant_kwargs(name: str, draft: DSparkDraftModel) -> dict:
    """The generate() keywords of one variant."""
    table = {
        "target": {},
        "default": {"assistant_model": draft},
        "no-lookup": {"assistant_model": draft, "prompt_lookup_num_tokens": 0},
        "plain": {"assistant_model": draft, "num_assistant_tokens": 0, "prompt_lookup_num_tokens": 0},
        "gate-4-rounds": {"assistant_model": draft, "dspark_adaptive_drafting": DraftingGate(margin=0.05)},
        "gate-batches": {"assistant_model": draft, "dspark_adaptive_drafting": DraftingGate.for_batches()},
    }
    return table[name]


def describe_rounds(stats) -> str:
    rounds = stats.rounds
    parts = {k: sum(getattr(r, k) for r in rounds) for k in ("draft_time", "serial_time", "schedule_time", "verify_time")}
    by_source = collections.defaultdict(lambda: [0, 0, 0])
    for r in rounds:
        entry = by_source[r.source]
        entry[0] += 1
        entry[1] += r.verified
        entry[2] += r.accepted
    return (" ".join(f"{k.split('_')[0]} {v:.2f}s" for k, v in parts.items())
            + f"; drafted row-rounds {sum(r.drafted for r in rounds)} of {len(rounds)}; "
            + "; ".join(f"{k}: {v[0]} rounds, {v[1]} verified, {v[2]} accepted" for k, v in sorted(by_source.items())))


def round_trace(stats) -> str:
    """One character per batched round, in order: ``D`` some row verified drafted tokens, ``d`` the
    draft ran but nothing of it was verified, ``L`` only lookup copies were verified, ``.`` a plain step."""
    marks, rounds, i = [], stats.rounds, 0
    while i < len(rounds):
        group = rounds[i:i + rounds[i].batch_rows]
        i += len(group)
        drafted_verified = any(r.drafted and r.verified for r in group)
        marks.append("D" if drafted_verified else "d" if any(r.drafted for r in group)
                     else "L" if any(r.verified for r in group) else ".")
    return "".join(marks)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mode", choices=["greedy", "sample"], default="greedy")
    parser.add_argument("--variants", nargs="+", default=["default", "plain"],
                        choices=["default", "no-lookup", "plain", "gate-4-rounds", "gate-batches"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", default=str(DRAFT))
    parser.add_argument("--trace", action="store_true", help="print each call's rounds (see round_trace)")
    args = parser.parse_args(argv)
    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(args.draft).float().eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    prompts = [encode_prompt(tokenizer, p) for d in ("gsm8k", "humaneval", "mt-bench") for p in load_eval_prompts(d, 8)]
    batch = [prompts[(3 * i) % len(prompts)] for i in range(args.batch_size)]
    pad = tokenizer.pad_token_id
    ids, mask = left_padded(batch, pad)
    common = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, pad_token_id=pad,
                  do_sample=args.mode == "sample")
    print(f"CPU: {capture_environment().get('cpu_model')}; R = {args.batch_size}, {args.mode}")
    target.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=pad, assistant_model=draft)  # profiles
    totals: dict[str, float] = collections.defaultdict(float)
    for repeat in range(args.repeats):
        for name in ["target"] + args.variants:
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = target.generate(ids, **common, **variant_kwargs(name, draft))
            seconds = time.perf_counter() - start
            totals[name] += seconds
            tokens = int((out[:, ids.shape[1]:] != pad).sum())
            line = f"{name:14s} repeat {repeat}: {seconds:.2f} s, {tokens / seconds:.1f} tok/s"
            if name != "target":
                line += "; " + describe_rounds(draft.last_generation_stats)
                if args.trace:
                    line += "\n    rounds: " + round_trace(draft.last_generation_stats)
            print(line, flush=True)
    ratios = {name: totals["target"] / seconds for name, seconds in totals.items() if name != "target"}
    print("target time / variant time over all repeats: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ratios


if __name__ == "__main__":
    main()
