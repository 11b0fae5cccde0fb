"""What verifying a sampled batch-1 round costs: transformers' draws against DSpark's.

    python benchmarks/sampled_verification.py --dtype float32 --out results/sampled_verification_zen4_float32.json
    python benchmarks/sampled_verification.py --baseline whole-vocabulary-draws --num-prompts 8

``step``: one verification at V = 49,152 (SmolLM2's vocabulary) with 0, 3 and 10 proposed tokens:
transformers' ``_assisted_decoding`` draws every position with ``torch.multinomial`` when the round
has no draft logits (a lookup copy, a plain step), and ``_speculative_sampling`` (one multinomial
row) when it has; DSpark's :func:`~dspark_hf.decoding.verification.verify_sampled_round` draws once.
Medians of interleaved repeats, ms.

``generate``: T = 1 generation of the prepared SmolLM2 target alone, DSpark as it is, and a
baseline DSpark (``--baseline``): ``previous-verification``, transformers' function with lookup
copies and plain steps handed over without logits; or ``whole-vocabulary-draws``, the serial loop
drawing over whole-vocabulary rows and the verification taking ``q`` as the softmax of the logits
(before the loop drew over the draft vocabulary's columns and handed its exact probabilities over).
Interleaved prompt by prompt in a rotating order; tokens per second per variant over the same
prompts. Sampled outputs differ between variants by design (other draws).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import transformers.generation.utils as generation_utils

import dspark_hf.decoding.candidate_generator as candidate_generator
from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.chat_text import chat_prompt_ids
from dspark_hf.decoding.candidate_generator import DSparkCandidateGenerator
from dspark_hf.decoding.sampling import serial_sample
from dspark_hf.decoding.verification import (dspark_sampled_verification, hand_over_drafted, point_mass_logits,
                                             verify_sampled_round)
from dspark_hf.demo_target import load_smollm2

VOCAB = 49152
BASELINES = {"previous-verification": "dspark, previous verification",
             "whole-vocabulary-draws": "dspark, whole-vocabulary draws"}


def _transformers_draws(proposed: torch.LongTensor, new_logits: torch.Tensor) -> torch.LongTensor:
    """What ``_assisted_decoding`` does for a round without draft logits: draw every position."""
    drawn = torch.multinomial(torch.softmax(new_logits[0], dim=-1), 1).view(1, -1)
    kept = int((proposed == drawn[:, :-1]).int().cumprod(dim=1).sum())
    return drawn[:, : kept + 1]


def _dspark_lookup_round(ids, proposed, new_logits, length):
    """A lookup copy (a plain step when ``length`` is 0) as a DSpark call verifies it: the candidate
    generator makes the point mass, the verification recognises it."""
    with dspark_sampled_verification():
        logits = point_mass_logits(proposed[0], VOCAB) if length else torch.empty(1, 0, VOCAB)
        return verify_sampled_round(ids, logits, length, new_logits)


def _dspark_drafted_round(ids, draft_logits, probabilities, new_logits, length):
    """A drafted round as a DSpark call verifies it: the loop's exact probabilities handed over with the logits."""
    with dspark_sampled_verification():
        return verify_sampled_round(ids, hand_over_drafted(draft_logits, probabilities), length, new_logits)


def step_costs(repeats: int) -> dict:
    """ms per verification, by number of proposed tokens and method."""
    generator = torch.Generator().manual_seed(0)
    times = defaultdict(list)
    stock = generation_utils._speculative_sampling.__wrapped_original__
    cases = {}
    for length in (0, 3, 10):
        new_logits = 3 * torch.randn(1, length + 1, VOCAB, generator=generator)
        proposed = torch.randint(VOCAB, (1, length), generator=generator)
        ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), proposed], dim=1)
        draft_logits = 3 * torch.randn(1, length, VOCAB, generator=generator)
        cases[f"{length} tokens, transformers: no logits (multinomial per position)"] = \
            lambda p=proposed, n=new_logits: _transformers_draws(p, n)
        cases[f"{length} tokens, dspark: point mass or none"] = \
            lambda i=ids, p=proposed, n=new_logits, k=length: _dspark_lookup_round(i, p, n, k)
        if length:
            cases[f"{length} tokens, transformers: _speculative_sampling"] = \
                lambda i=ids, q=draft_logits, n=new_logits, k=length: stock(i, q, k, n)
            cases[f"{length} tokens, dspark: drafted, q from the logits"] = \
                lambda i=ids, q=draft_logits, n=new_logits, k=length: verify_sampled_round(i, q, k, n)
            probabilities = torch.softmax(draft_logits, dim=-1)  # the serial loop has them already
            cases[f"{length} tokens, dspark: drafted, q handed over"] = \
                lambda i=ids, q=draft_logits, pq=probabilities, n=new_logits, k=length: \
                _dspark_drafted_round(i, q, pq, n, k)
    names = list(cases)
    for turn in range(repeats):
        for name in names if turn % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(5):
                cases[name]()
            times[name].append((time.perf_counter() - start) / 5 * 1000)
    ms = {name: statistics.median(values) for name, values in times.items()}
    for name, value in ms.items():
        print(f"{name:62s} {value:7.3f} ms")
    return ms


def _whole_vocabulary_draws(*args, **kwargs):
    """The serial loop as before it drew over the draft columns: whole-vocabulary rows, q from the logits."""
    kwargs["exact_probabilities"] = False
    return serial_sample(*args, **kwargs)


def generation_speed(dtype: torch.dtype, draft_path: str, datasets: list[str], num_prompts: int,
                     max_new_tokens: int, baseline: str = "previous-verification") -> dict:
    """Tokens per second at T = 1 of the target alone, DSpark, and the baseline DSpark."""
    target, tokenizer = load_smollm2(dtype)
    optimize_for_cpu(target)
    draft = optimize_for_cpu(DSparkDraftModel.from_pretrained(draft_path).to(dtype).eval())
    routed = generation_utils._speculative_sampling
    methods = {"lookup": DSparkCandidateGenerator._lookup_logits, "none": DSparkCandidateGenerator._no_candidate_logits}

    def generate(ids: torch.Tensor, variant: str, seed: int) -> tuple[float, int]:
        kwargs = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=max_new_tokens,
                      attention_mask=torch.ones_like(ids))
        if variant != "target":
            kwargs["assistant_model"] = draft
        previous = variant == "dspark, previous verification"
        candidate_generator.serial_sample = _whole_vocabulary_draws if variant == BASELINES[
            "whole-vocabulary-draws"] else serial_sample
        DSparkCandidateGenerator._lookup_logits = (lambda self, tokens: None) if previous else methods["lookup"]
        DSparkCandidateGenerator._no_candidate_logits = (lambda self: None) if previous else methods["none"]
        generation_utils._speculative_sampling = routed.__wrapped_original__ if previous else routed
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = target.generate(ids, **kwargs)
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    variants = ["target", "dspark", BASELINES[baseline]]
    per_set = {}
    try:
        warm = torch.tensor([chat_prompt_ids(tokenizer, "hello")])
        for variant in variants:
            generate(warm, variant, 0)
        for dataset in datasets:
            seconds, tokens = defaultdict(float), defaultdict(int)
            for turn, prompt in enumerate(load_eval_prompts(dataset, limit=num_prompts)):
                ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
                order = variants[turn % 3:] + variants[: turn % 3]
                for variant in order:
                    elapsed, new = generate(ids, variant, turn)
                    seconds[variant] += elapsed
                    tokens[variant] += new
            rates = {v: tokens[v] / seconds[v] for v in variants}
            per_set[dataset] = {"tokens_per_second": rates,
                                "vs_target": {v: rates[v] / rates["target"] for v in variants}}
            print(dataset, "  ".join(f"{v}: {rates[v]:.1f} tok/s ({rates[v] / rates['target']:.2f}x)"
                                     for v in variants))
    finally:
        DSparkCandidateGenerator._lookup_logits = methods["lookup"]
        DSparkCandidateGenerator._no_candidate_logits = methods["none"]
        generation_utils._speculative_sampling = routed
        candidate_generator.serial_sample = serial_sample
    return per_set


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--draft", default="drafts/smollm2-135m-dspark")
    parser.add_argument("--datasets", nargs="+", default=["copy-heavy", "mt-bench"])
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=21, help="step: interleaved repeats of 5 calls")
    parser.add_argument("--baseline", choices=sorted(BASELINES), default="previous-verification",
                        help="the DSpark variant generation is compared with (see above)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    environment = capture_environment()
    print(f"{environment['cpu_model']} {environment.get('cpu_isa_flags')}, {environment['torch_threads']} threads, "
          f"{args.dtype}")
    result = {"ms_per_verification": step_costs(args.repeats),
              "generation": generation_speed(getattr(torch, args.dtype), args.draft, args.datasets, args.num_prompts,
                                             args.max_new_tokens, args.baseline)}
    result.update(environment=environment, args=vars(args))
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
