"""What a DSpark round costs beyond the target's forward: rounds that draft nothing, and the serial loop.

    python benchmarks/round_overhead.py plain --num-prompts 3 --max-new-tokens 96 --feed-every-round
    python benchmarks/round_overhead.py serial --dtype bfloat16

``plain``: greedy generation of the prepared SmolLM2 target alone against DSpark with drafting
forced off and no context lookup, so every round is one plain target step (outputs are checked
equal). The difference is the per-round cost of DSpark's side: choosing, recording, and collecting
the target's features for the draft. ``--feed-every-round`` adds a third variant that feeds the
draft its context every round, as dspark_hf did before the features were kept until the draft
next runs. Interleaved prompt by prompt, in reverse order every other prompt; ms per token.

``serial``: one 7-position greedy block of the shipped draft through the serial loop (LM head
included), drawn over the draft vocabulary's columns (what generation does) against the same loop
handed whole-vocabulary logits (what it did before), and the same for a sampled block: over the
columns with the exact probabilities returned (what generation does where DSpark verifies) against
whole-vocabulary rows (what it did before, and still does where transformers verifies); interleaved,
medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.chat_text import chat_prompt_ids
from dspark_hf.decoding import candidate_generator, rounds
from dspark_hf.decoding.sampling import serial_sample
from dspark_hf.demo_target import load_smollm2


def _models(dtype: torch.dtype, draft_path: str):
    target, tokenizer = load_smollm2(dtype)
    optimize_for_cpu(target)
    draft = optimize_for_cpu(DSparkDraftModel.from_pretrained(draft_path).to(dtype).eval())
    return target, tokenizer, draft


def plain_rounds(target, tokenizer, draft, num_prompts: int, max_new_tokens: int, feed_every_round: bool) -> dict:
    """ms per token of the target alone and of DSpark rounds that never draft."""
    generator_class = candidate_generator.DSparkCandidateGenerator
    collect = generator_class._collect_context

    def collect_and_feed(self, *args, **kwargs):  # the draft fed every round, as before
        collect(self, *args, **kwargs)
        self._update_draft_context()

    variants = ["target", "dspark"] + (["dspark-fed-every-round"] if feed_every_round else [])
    saved_rows = rounds.RoundDecisions.drafting_rows
    rounds.RoundDecisions.drafting_rows = lambda self, plan: []  # drafting forced off
    try:
        def generate(ids: torch.Tensor, variant: str):
            kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids))
            if variant != "target":
                generator_class._collect_context = collect_and_feed if variant.endswith("round") else collect
                kwargs.update(assistant_model=draft, prompt_lookup_num_tokens=0)
            start = time.perf_counter()
            out = target.generate(ids, **kwargs)
            return time.perf_counter() - start, out

        prompts = [p for dataset in ("gsm8k", "mt-bench") for p in load_eval_prompts(dataset, limit=num_prompts)]
        warm = torch.tensor([chat_prompt_ids(tokenizer, "hello")])
        for variant in variants:
            generate(warm, variant)
        seconds, tokens = defaultdict(float), defaultdict(int)
        for turn, prompt in enumerate(prompts * 2):
            ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
            outputs = {}
            for variant in variants if turn % 2 == 0 else variants[::-1]:
                elapsed, outputs[variant] = generate(ids, variant)
                seconds[variant] += elapsed
                tokens[variant] += outputs[variant].shape[1] - ids.shape[1]
            if any(not torch.equal(outputs[v], outputs["target"]) for v in variants):
                raise SystemExit("a DSpark output differs from the target's: stop and investigate")
    finally:
        rounds.RoundDecisions.drafting_rows = saved_rows
        generator_class._collect_context = collect
    ms = {v: 1000 * seconds[v] / tokens[v] for v in variants}
    for v in variants:
        print(f"{v:24s} {ms[v]:7.2f} ms/token  x{ms[v] / ms['target']:.3f} of the target")
    return {"ms_per_token": ms}


def serial_loop(target, draft, dtype: torch.dtype, repeats: int) -> dict:
    """ms per 7-position block of the serial loop, greedy over the draft columns or the vocabulary, and sampled."""
    draft.bind_target(target)
    cache = draft.new_cache()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 256, draft.fc.in_features, generator=generator).to(dtype)
    block = torch.full((1, draft.config.block_size), draft.config.mask_token_id)
    block[0, 0] = anchor = 42
    anchors = torch.tensor([anchor])
    with torch.inference_mode():
        draft.add_context(cache, features, torch.arange(256)[None])
        hidden = draft(block, torch.arange(256, 256 + block.shape[1])[None], cache, compute_logits=False).hidden_states
    admit_all = lambda c: True  # noqa: E731
    variants = {
        "greedy, draft columns": lambda: serial_sample(draft, None, hidden, anchors, do_sample=False, admission=admit_all),
        "greedy, whole vocabulary": lambda: serial_sample(draft, draft.base_logits(hidden), hidden, anchors,
                                                          do_sample=False, admission=admit_all),
        "sampled, whole vocabulary": lambda: serial_sample(draft, None, hidden, anchors, do_sample=True,
                                                           admission=admit_all),
        "sampled, draft columns": lambda: serial_sample(draft, None, hidden, anchors, do_sample=True,
                                                        admission=admit_all, exact_probabilities=True),
    }
    times = defaultdict(list)
    with torch.inference_mode():
        first, second = variants["greedy, draft columns"](), variants["greedy, whole vocabulary"]()
        if not (torch.equal(first.tokens, second.tokens) and torch.equal(first.logits, second.logits)):
            raise SystemExit("the two greedy loops disagree: stop and investigate")
        names = list(variants)
        for turn in range(repeats):
            for name in names if turn % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                for _ in range(10):
                    variants[name]()
                times[name].append((time.perf_counter() - start) / 10 * 1000)
    ms = {name: statistics.median(values) for name, values in times.items()}
    for name, value in ms.items():
        print(f"{name:26s} {value:6.2f} ms per block")
    return {"ms_per_block": ms}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["plain", "serial"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--draft", default="drafts/smollm2-135m-dspark")
    parser.add_argument("--num-prompts", type=int, default=3, help="plain: prompts from each of GSM8K and MT-Bench")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--feed-every-round", action="store_true", help="plain: add the fed-every-round variant")
    parser.add_argument("--repeats", type=int, default=15, help="serial: interleaved rounds of 10 blocks")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    target, tokenizer, draft = _models(dtype, args.draft)
    environment = capture_environment()
    print(f"{environment['cpu_model']}, {environment['torch_threads']} threads, {args.dtype}")
    if args.what == "plain":
        result = plain_rounds(target, tokenizer, draft, args.num_prompts, args.max_new_tokens, args.feed_every_round)
    else:
        result = serial_loop(target, draft, dtype, args.repeats)
    result.update(environment=environment, args=vars(args))
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
