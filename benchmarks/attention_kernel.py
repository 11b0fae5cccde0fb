"""The few-query attention kernel alone, on one SmolLM2-135M layer's shapes, against SDPA or another build.

    python benchmarks/attention_kernel.py                                   # fp32 and bf16, 1-16 tokens
    python benchmarks/attention_kernel.py --baseline-source /tmp/old        # another version's kernel beside it
    python benchmarks/attention_kernel.py --kv-heads 9                      # one key/value head per query head

One call per case: 9 query heads over 3 key/value heads (``--kv-heads``), head dim 64, ``--context`` cached tokens plus
the new ones, the causal boolean mask a verify forward gets (none for one token), transformers' query
strides. Compared with PyTorch's SDPA as ``cpu_attention`` would call it (grouped heads broadcast) and,
with ``--baseline-source``, with the kernel built from another folder of the CPU extension's sources
(``git archive REV dspark_hf/kernels/csrc | tar -x -C DIR --strip-components 3``). Interleaved rounds,
in reverse order every other round; medians in µs per call, and each contender's time over this build's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.kernels import cpu_extension


def _case(module, dtype, tokens: int, context: int, kv_heads: int):
    generator = torch.Generator().manual_seed(tokens)
    keys = context + tokens
    query = torch.randn(1, tokens, 9, 64, generator=generator).to(dtype).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, keys, 64, generator=generator).to(dtype) for _ in range(2))
    mask = torch.ones(tokens, keys, dtype=torch.bool).tril(diagonal=context)[None, None] if tokens > 1 else None
    return lambda: module.few_query_attention(query, key, value, mask, 0.125), \
        lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                        default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--kv-heads", type=int, choices=[1, 3, 9], default=3, help="key/value heads for the 9 query heads")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--baseline-source", metavar="DIR", help="a folder of another version's CPU extension sources")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    module = cpu_extension.load_extension()
    if module is None:
        raise SystemExit(f"The CPU extension is not available here: {cpu_extension.extension_problem()}")
    contenders = {"kernel": module}
    if args.baseline_source:
        contenders["baseline"] = cpu_extension.build_extension(
            Path(args.baseline_source), "dspark_hf_cpu_kernels_baseline", Path(tempfile.mkdtemp(prefix="attention_")))
    calls = {}
    for dtype_name in args.dtypes:
        for tokens in args.tokens:
            for name, contender in contenders.items():
                kernel_call, sdpa_call = _case(contender, getattr(torch, dtype_name), tokens, args.context,
                                               args.kv_heads)
                calls[(dtype_name, tokens, name)] = kernel_call
            calls[(dtype_name, tokens, "sdpa")] = sdpa_call
    names = list(calls)
    times = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:
            for _ in range(20):
                calls[name]()
        for turn in range(args.rounds):
            for name in names if turn % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                for _ in range(args.calls):
                    calls[name]()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    medians = {name: statistics.median(values) for name, values in times.items()}
    environment = capture_environment()
    print(f"{environment['cpu_model']}, {environment['torch_threads']} threads, context {args.context}, "
          f"9 query heads over {args.kv_heads} key/value heads; "
          f"µs per call (ratio: over this build's kernel)")
    others = [name for name in ("baseline", "sdpa") if any(key[2] == name for key in medians)]
    print("dtype     tokens  kernel  " + "  ".join(f"{name:>8s}  ratio" for name in others))
    table = {}
    for dtype_name in args.dtypes:
        for tokens in args.tokens:
            mine = medians[(dtype_name, tokens, "kernel")]
            row = {"kernel": mine, **{name: medians[(dtype_name, tokens, name)] for name in others}}
            table[f"{dtype_name}/{tokens}"] = row
            print(f"{dtype_name:9s} {tokens:6d}  {mine:6.1f}  "
                  + "  ".join(f"{row[name]:8.1f}  {row[name] / mine:5.2f}" for name in others))
    result = {"us_per_call": table, "environment": environment, "args": vars(args)}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
