"""What a batched DSpark call costs when no round drafts: the floor under every batch where drafting never pays.

    python benchmarks/gate_floor.py --batch-size 8 --pairs 8

SmolLM2-135M-Instruct and the shipped draft, both prepared with ``optimize_for_cpu``, greedy, EOS off. One
batch of held-out prompts (the ones ``benchmarks/first_call.py`` draws from), left-padded. After one warm
call of each, ``--pairs`` times: the target's own ``generate``, then DSpark's with a drafting gate that never
drafts (every round a plain target step in DSpark's batched loop), the order alternating from pair to pair.
Prints each pair's DSpark / target time, their median and the ratio of the sums, with the CPU model:
the issue's bound is DSpark >= 0.98x the target, so the floor must be well under 1.02.
A timing: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--first-prompt", type=int, default=100, help="index into the held-out prompt list")
    args = parser.parse_args(argv)

    from dspark_hf import DraftingGate, DSparkDraftModel, optimize_for_cpu
    from dspark_hf.benchmarks.acceptance import left_padded
    from dspark_hf.benchmarks.environment import capture_environment
    from dspark_hf.demo_target import load_smollm2
    from first_call import held_out_prompt_ids

    class NeverDraft(DraftingGate):
        def should_draft(self) -> bool:
            return False

    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(SHIPPED_DRAFT).float().eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    draft.bind_target(target)
    batch = held_out_prompt_ids(tokenizer)[args.first_prompt: args.first_prompt + args.batch_size]
    ids, mask = left_padded(batch, tokenizer.pad_token_id)
    target.generation_config.eos_token_id = None
    common = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)

    def timed(**extra) -> float:
        start = time.perf_counter()
        target.generate(ids, **common, **extra)
        return time.perf_counter() - start

    never = dict(assistant_model=draft, dspark_adaptive_drafting=NeverDraft())
    timed(), timed(**never)  # warm-up: the shapes' one-off work
    ratios, target_seconds, floor_seconds = [], 0.0, 0.0
    for pair in range(args.pairs):
        if pair % 2 == 0:
            plain, floor = timed(), timed(**never)
        else:
            floor, plain = timed(**never), timed()
        ratios.append(floor / plain)
        target_seconds += plain
        floor_seconds += floor
    result = {"environment": capture_environment(), "settings": vars(args), "prompt_tokens": list(ids.shape),
              "ratios": ratios, "median": statistics.median(ratios), "sum_ratio": floor_seconds / target_seconds}
    print(f"CPU: {result['environment'].get('cpu_model')}; batch {tuple(ids.shape)} (rows x padded prompt), "
          f"{args.max_new_tokens} new tokens")
    print("DSpark never drafting / target, per pair:", " ".join(f"{r:.3f}" for r in ratios))
    print(f"median {result['median']:.3f}, summed {result['sum_ratio']:.3f}")
    return result


if __name__ == "__main__":
    main()
