"""What finding a context-lookup match costs per round, next to what the round costs.

    python benchmarks/lookup_match_cost.py                      # SmolLM2-135M + shipped DSpark draft, CPU
    python benchmarks/lookup_match_cost.py --context 2000 --repeat 500 --new-tokens 64
    python benchmarks/lookup_match_cost.py --tiny --repeat 20   # a small random model (no SmolLM2 needed)

Each round, with context lookup on, DSpark generation searches the sequence so far for the
longest recent n-gram match and values the copy against the draft
(:func:`dspark_hf.decoding.rounds.choose_lookup`); batched generation does this once per running row. The
issue's target: at 2,000 tokens of context this costs at most 1% of a round.

The context is a code-like text (numbered functions that repeat their shape, as small models'
outputs do), cut to ``--context`` tokens. Two searches are timed: on that text, where a match is
usually found at the longest n-gram, and on the same length of text whose last token occurs
nowhere earlier, which runs every n-gram size and finds nothing (the most the search costs). A
round is timed by generating ``--new-tokens`` tokens with DSpark from that context (greedy; the
per-round time is the generation's decode time over its rounds). Prints both and their ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.decoding.context_lookup import ContextLookup, SourceChooser
from dspark_hf.decoding.rounds import choose_lookup

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def code_like_text(lines: int) -> str:
    """Functions that repeat a few shapes with different names and numbers."""
    shapes = ["    total = total + values[{i}] * {k}\n", "    if total > {k}:\n        return total - {i}\n",
              "    values.append(total % {k})\n"]
    text = []
    for i in range(lines):
        text.append(f"def step_{i}(values, total={i % 5}):\n")
        text.extend(shapes[(i + j) % 3].format(i=i, k=(i * 7) % 13 + 2) for j in range(2))
        text.append("    return total\n\n")
    return "".join(text)


def load_models(tiny: bool, draft_path: str):
    """SmolLM2-135M-Instruct and the shipped draft, prepared for CPU; or a small random pair."""
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        # Its step-rate profile is of no use later: keep it out of the user's cache.
        os.environ["DSPARK_HF_CACHE"] = tempfile.mkdtemp(prefix="lookup_match_cost_")

        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        target = LlamaForCausalLM(config).eval()
        draft = DSparkDraftModel.from_target(target, block_size=8).eval()
        return target, draft, None
    from dspark_hf.demo_target import load_smollm2

    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(draft_path).float().eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    return target, draft, tokenizer


def context_ids(tokenizer, length: int, vocab_size: int) -> torch.LongTensor:
    if tokenizer is None:  # a random model: tokens of a repeating code-like pattern
        pattern = torch.arange(length) * 7 % 97 + (torch.arange(length) // 40) % 5
        return pattern.clamp(max=vocab_size - 1)
    ids = tokenizer(code_like_text(400), return_tensors="pt").input_ids[0]
    if ids.numel() < length:
        raise ValueError(f"The context text has {ids.numel()} tokens, fewer than --context {length}.")
    return ids[:length]


def time_search(sequence: torch.LongTensor, repeat: int, max_tokens: int) -> float:
    """Seconds per call of the whole per-row choice (search + valuation) on ``sequence``."""
    chooser = SourceChooser(ContextLookup(max_tokens=max_tokens))
    sps = tuple(100.0 - b for b in range(max_tokens + 1))
    for _ in range(chooser.min_rounds):  # a DSpark history, so the proposal is valued every call
        chooser.record_dspark(3, 4, 1.5, sps)
    choose_lookup(chooser, sequence, max_tokens, sps, None)  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        choose_lookup(chooser, sequence, max_tokens, sps, None)
    return (time.perf_counter() - start) / repeat


@torch.no_grad()
def time_round(target, draft, context: torch.LongTensor, new_tokens: int) -> tuple[float, int]:
    """Seconds per DSpark round decoding after ``context``: the default policy (the prefix
    scheduler on the target's live cost model), lookup off so that every round drafts."""
    ids = context[None]
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                    assistant_model=draft, prompt_lookup_num_tokens=0)  # warm-up
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                    assistant_model=draft, prompt_lookup_num_tokens=0)
    stats = draft.last_generation_stats
    return sum(stats.timings().values()) / stats.num_rounds, stats.num_rounds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2000, help="tokens of context searched")
    parser.add_argument("--repeat", type=int, default=500, help="timed searches per case")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated to time a round")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="longest proposal (prompt_lookup_num_tokens)")
    parser.add_argument("--tiny", action="store_true", help="a small random model instead of SmolLM2-135M")
    parser.add_argument("--draft", default=str(DRAFT))
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    target, draft, tokenizer = load_models(args.tiny, args.draft)
    context = context_ids(tokenizer, args.context, target.config.vocab_size)
    no_match = context.clone()
    no_match[-1] = int(context.max()) + 1 if int(context.max()) + 1 < target.config.vocab_size else 0
    no_match[:-1][no_match[:-1] == no_match[-1]] = 1  # the last token occurs nowhere earlier
    found = time_search(context, args.repeat, args.lookup_tokens)
    worst = time_search(no_match, args.repeat, args.lookup_tokens)
    round_seconds, rounds = time_round(target, draft, context, args.new_tokens)
    result = {"context_tokens": args.context, "search_with_match_s": found, "search_no_match_s": worst,
              "round_s": round_seconds, "rounds_timed": rounds, "ratio_with_match": found / round_seconds,
              "ratio_no_match": worst / round_seconds, "threads": torch.get_num_threads()}
    print(f"context {args.context} tokens, {torch.get_num_threads()} threads, {'tiny model' if args.tiny else 'SmolLM2-135M'}")
    print(f"  lookup search + choice, a match found: {found * 1e6:8.1f} us  ({found / round_seconds:.2%} of a round)")
    print(f"  lookup search + choice, no match:      {worst * 1e6:8.1f} us  ({worst / round_seconds:.2%} of a round)")
    print(f"  one DSpark round (mean of {rounds}):     {round_seconds * 1e3:8.2f} ms   target: search <= 1% of a round")
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
