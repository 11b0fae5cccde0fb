"""Keys and values written in place (``cpu_kv_cache.append_to_cache``) against transformers' ``torch.cat``.

    python benchmarks/kv_append.py                                   # SmolLM2-135M-Instruct, fp32
    python benchmarks/kv_append.py --dtype bfloat16 --contexts 256 2048 --out results/kv_append.json

One prepared model; the lean decoder's ``append_in_place`` switch is the only difference between the two
ways, so there is no preparation-order bias. Part 1: a forward of B new tokens on a cached context
(the verify forward's shape), then ``crop`` back, as a speculative round does; each context and size
alternates the two ways within a round, first one way then the other. Part 2: greedy ``generate`` from a
prompt of the largest context, both ways, checked token for token, timed from the first token's scores
(the end of the prefill) to the end. Medians; ratios are in-place / cat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from dspark_cpu import optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.demo_target import load_smollm2
from dspark_hf import DSparkDraftModel
import dspark_cpu.decoder as cpu_decoder
from dspark_hf import kv_buffers

WAYS = ("in_place", "cat")
SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated in part 2 (0: skip)")
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT), help="draft for part 3 ('' to skip)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    model, _ = load_smollm2(getattr(torch, args.dtype))
    optimize_for_cpu(model)
    plan = model.model.__dict__.get(cpu_decoder._INSTALLED_ATTRIBUTE)
    if plan is None or not plan.append_in_place:
        raise SystemExit("the lean decoder with in-place keys and values is not in use here; nothing to compare")
    generator = torch.Generator().manual_seed(0)
    environment = capture_environment()
    print(f"{environment['cpu_model']}, {args.dtype}, {environment['torch_threads']} threads, {args.repeats} rounds")

    steps = {}
    print("context  B   in place ms   cat ms   in place / cat")
    with torch.inference_mode():
        for context in args.contexts:
            ids = torch.randint(0, model.config.vocab_size, (1, context + max(args.sizes)), generator=generator)
            caches = {way: DynamicCache(config=model.config) for way in WAYS}
            for way in WAYS:
                plan.append_in_place = way == "in_place"
                model(input_ids=ids[:, :context], cache=caches[way])
            samples = {(size, way): [] for size in args.sizes for way in WAYS}
            for turn in range(args.repeats + 2):  # the first two rounds warm up
                for size in args.sizes:
                    for way in WAYS if turn % 2 == 0 else WAYS[::-1]:
                        plan.append_in_place = way == "in_place"
                        start = time.perf_counter()
                        model(input_ids=ids[:, context:context + size], cache=caches[way], logits_to_keep=size)
                        caches[way].crop(-size)
                        if turn >= 2:
                            samples[size, way].append(time.perf_counter() - start)
            for size in args.sizes:
                in_place, cat = (1000 * statistics.median(samples[size, way]) for way in WAYS)
                steps[f"{context}x{size}"] = {"context": context, "tokens": size, "in_place_ms": in_place,
                                              "cat_ms": cat, "ratio": in_place / cat}
                print(f"{context:7d} {size:2d} {in_place:11.2f} {cat:8.2f} {in_place / cat:13.3f}")

        generation = None
        if args.new_tokens:
            prompt = torch.randint(0, model.config.vocab_size, (1, max(args.contexts)), generator=generator)
            tokens, decode_seconds = {}, {way: [] for way in WAYS}
            for turn in range(3):
                for way in WAYS if turn % 2 == 0 else WAYS[::-1]:
                    plan.append_in_place = way == "in_place"
                    clock = _FirstScoresClock()
                    out = model.generate(prompt, do_sample=False, max_new_tokens=args.new_tokens,
                                         min_new_tokens=args.new_tokens, pad_token_id=0,
                                         logits_processor=LogitsProcessorList([clock]))
                    decode_seconds[way].append(time.perf_counter() - clock.first)
                    tokens.setdefault(way, out)
                    if not torch.equal(out, tokens[way]):
                        raise SystemExit(f"greedy output changed between runs ({way})")
            identical = torch.equal(tokens["in_place"], tokens["cat"])
            in_place, cat = (statistics.median(decode_seconds[way]) for way in WAYS)
            generation = {"prompt_tokens": prompt.shape[1], "new_tokens": args.new_tokens,
                          "in_place_decode_s": in_place, "cat_decode_s": cat, "ratio": in_place / cat,
                          "identical": identical}
            print(f"generate {args.new_tokens} greedy tokens after {prompt.shape[1]} (time from the first token on): "
                  f"in place {in_place:.2f} s, cat {cat:.2f} s, ratio {in_place / cat:.3f}, identical: {identical}")
            if not identical:
                raise SystemExit("greedy outputs differ between the two ways")
    plan.append_in_place = True
    draft_rounds = _draft_rounds(model, args, generator) if args.draft else None
    result = {"steps": steps, "generation": generation, "draft_rounds": draft_rounds, "environment": environment,
              "args": vars(args)}
    write_json_result(result, args.out)
    return result


class _FirstScoresClock(LogitsProcessor):
    """Notes when the first scores arrive (the prefill is done); passes them through unchanged."""

    def __init__(self) -> None:
        self.first = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def _draft_rounds(target, args, generator) -> dict:
    """Part 3: the draft's add_context (2 tokens) + block forward, its context cache in buffers or concatenated."""
    draft = DSparkDraftModel.from_pretrained(args.draft, dtype=getattr(torch, args.dtype)).eval()
    draft.bind_target(target)
    optimize_for_cpu(draft)
    config = draft.config
    width = len(config.target_layer_ids) * target.config.hidden_size
    joinable = kv_buffers.joinable
    concatenate = lambda stored, new: False  # noqa: E731 - every append and block takes torch.cat
    rounds = {}
    print("draft round: context   in place ms   cat ms   in place / cat")
    with torch.inference_mode():
        for context in args.contexts:
            features = torch.randn(1, context + 2 * (args.repeats + 2), width, generator=generator).to(draft.dtype)
            caches, outputs, seconds = {}, {way: [] for way in WAYS}, {way: [] for way in WAYS}
            for way in WAYS:
                kv_buffers.joinable = joinable if way == "in_place" else concatenate
                caches[way] = draft.new_cache()
                draft.add_context(caches[way], features[:, :context], torch.arange(context)[None])
            block = torch.full((1, config.block_size), config.mask_token_id)
            for turn in range(args.repeats + 2):
                for way in WAYS if turn % 2 == 0 else WAYS[::-1]:
                    kv_buffers.joinable = joinable if way == "in_place" else concatenate
                    cache, length = caches[way], caches[way].length
                    start = time.perf_counter()
                    draft.add_context(cache, features[:, length:length + 2], torch.arange(length, length + 2)[None])
                    out = draft(block, torch.arange(length + 2, length + 2 + config.block_size)[None], cache)
                    if turn >= 2:
                        seconds[way].append(time.perf_counter() - start)
                    outputs[way].append(out.logits)
            kv_buffers.joinable = joinable
            if not all(torch.equal(a, b) for a, b in zip(outputs["in_place"], outputs["cat"])):
                raise SystemExit("the draft's outputs differ between the two ways")
            in_place, cat = (1000 * statistics.median(seconds[way]) for way in WAYS)
            rounds[str(context)] = {"in_place_ms": in_place, "cat_ms": cat, "ratio": in_place / cat}
            print(f"{context:20d} {in_place:13.3f} {cat:8.3f} {in_place / cat:16.3f}")
    return rounds


if __name__ == "__main__":
    main()
