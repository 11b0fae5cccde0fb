"""What a batched DSpark round that verifies nothing costs, against the target's own batched step.

    python benchmarks/batched_overhead.py                          # SmolLM2 prepared, R = 2 4 8 16
    python benchmarks/batched_overhead.py --batch-sizes 16 --max-new-tokens 64 --repeats 3

A round that verifies nothing (the drafting gate off, no context-lookup copy) is a plain batched
target step wrapped in DSpark's own loop: source choice, bookkeeping, the draft's context update,
emitting and stopping. Here every round is one (``num_assistant_tokens=0``, lookup off), so the
whole generation measures that wrapper. Both run on the same left-padded batch, interleaved
repeat by repeat, each timed for 1 and for N new tokens so the prefill drops out; the printed ratio is DSpark's time per step over the target's (the issue's
bound: within 2%), with the outputs checked identical. The CPU model is printed with the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.acceptance import left_padded
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.benchmarks.prompt_sets import DATASETS, load_eval_prompts
from dspark_hf.chat_text import chat_prompt_ids
from dspark_hf.demo_target import load_smollm2

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft", default=str(DRAFT))
    parser.add_argument("--stock", action="store_true", help="leave the target unprepared (no optimize_for_cpu)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(args.draft).float().eval()
    if not args.stock:
        optimize_for_cpu(target)
        optimize_for_cpu(draft)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [chat_prompt_ids(tokenizer, p) for d in DATASETS for p in load_eval_prompts(d, 6)]
    env = capture_environment()
    print(f"CPU: {env.get('cpu_model')}; torch threads {torch.get_num_threads()}; "
          f"target {'stock' if args.stock else 'prepared'}")
    # No EOS: every row runs the full length in both (batched DSpark drops finished rows, which the
    # target's own loop does not, and would look cheaper for it).
    target.generation_config.eos_token_id = None
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    result = {"environment": env, "rows": []}
    print("R   target ms/step  empty-round ms/step  ratio")
    for size in args.batch_sizes:
        ids, mask = left_padded([prompts[i % len(prompts)] for i in range(size)], pad)
        times = {"target": [], "dspark": []}
        for repeat in range(args.repeats + 1):  # the first repeat warms up, untimed
            for name in (("target", "dspark") if repeat % 2 else ("dspark", "target")):
                extra = ({} if name == "target" else
                         dict(assistant_model=draft, num_assistant_tokens=0, prompt_lookup_num_tokens=0))
                seconds = {}
                for new_tokens in (1, args.max_new_tokens):  # the prefill and first token, then the whole
                    start = time.perf_counter()
                    out = target.generate(ids, attention_mask=mask, **{**common, "max_new_tokens": new_tokens},
                                          **extra)
                    seconds[new_tokens] = time.perf_counter() - start
                if repeat:  # per decoding step, the prefill taken out
                    times[name].append((seconds[args.max_new_tokens] - seconds[1]) / (args.max_new_tokens - 1))
                if name == "target":
                    reference = out
                else:
                    generated = out
            assert generated.tolist() == reference.tolist(), f"R={size}: outputs differ"
        t_target, t_dspark = statistics.median(times["target"]), statistics.median(times["dspark"])
        row = {"batch_size": size, "target_ms_per_step": 1e3 * t_target, "empty_round_ms_per_step": 1e3 * t_dspark,
               "ratio": t_dspark / t_target}
        result["rows"].append(row)
        print(f"{size:<3} {row['target_ms_per_step']:14.1f} {row['empty_round_ms_per_step']:20.1f} {row['ratio']:6.3f}")
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
