"""Where a prepared target's step goes: the packed linears, the LM head, the attention kernel, and the rest.

    python benchmarks/step_split.py                      # SmolLM2-135M-Instruct, fp32, B = 1 and 8
    python benchmarks/step_split.py --dtype bfloat16 --sizes 1 2 4 8 16 --repeats 15

One forward of B new tokens on a cached 256-token context (the verify forward's shape), with every
packed linear layer and each call of the few-query attention kernel (where it runs) timed from
Python around it; "rest" is the step minus those: the norms, rotary, cache update, activations,
residual adds and the loop itself. The per-call timer adds about a microsecond to each of the ~211
linear and 30 attention calls, counted in them. Sizes are interleaved,
in reverse order every other round; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from dspark_cpu import optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.demo_target import load_smollm2
import dspark_cpu.attention as cpu_attention
from dspark_cpu.fast_path import PackedLinear


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    model, _ = load_smollm2(getattr(torch, args.dtype))
    optimize_for_cpu(model)
    head = model.get_output_embeddings()
    seconds = {"linears": 0.0, "lm_head": 0.0, "attention": 0.0}
    packed_forward = PackedLinear.forward

    def timed_forward(self, x):
        start = time.perf_counter()
        y = packed_forward(self, x)
        seconds["lm_head" if self is head else "linears"] += time.perf_counter() - start
        return y

    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (1, args.context), generator=generator)
    new_ids = torch.randint(0, model.config.vocab_size, (1, max(args.sizes)), generator=generator)
    cache = DynamicCache(config=model.config)
    samples = {size: [] for size in args.sizes}
    attention_state = cpu_attention._few_query_state
    kernels = attention_state["module"]

    class TimedKernels:  # the extension module with its attention call timed
        def few_query_attention(self, *args):
            start = time.perf_counter()
            out = kernels.few_query_attention(*args)
            seconds["attention"] += time.perf_counter() - start
            return out

    PackedLinear.forward = timed_forward
    if kernels is not None:
        attention_state["module"] = TimedKernels()
    try:
        with torch.inference_mode():
            model(input_ids=context, cache=cache)
            for turn in range(args.repeats + 2):  # the first two rounds warm up
                for size in args.sizes if turn % 2 == 0 else args.sizes[::-1]:
                    seconds.update(linears=0.0, lm_head=0.0, attention=0.0)
                    start = time.perf_counter()
                    model(input_ids=new_ids[:, :size], cache=cache, logits_to_keep=size)
                    whole = time.perf_counter() - start
                    cache.crop(-size)
                    if turn >= 2:
                        samples[size].append((whole, seconds["linears"], seconds["lm_head"], seconds["attention"]))
    finally:
        PackedLinear.forward = packed_forward
        attention_state["module"] = kernels

    environment = capture_environment()
    print(f"{environment['cpu_model']}, {args.dtype}, context {args.context}, {environment['torch_threads']} threads, "
          f"{args.repeats} rounds; ms")
    print("B    step  linears  lm_head  attention   rest  rest share")
    table = {}
    for size in args.sizes:
        whole, linears, lm_head, attention = (1000 * statistics.median(s[i] for s in samples[size]) for i in range(4))
        rest = whole - linears - lm_head - attention
        table[size] = {"step_ms": whole, "linears_ms": linears, "lm_head_ms": lm_head, "attention_ms": attention,
                       "rest_ms": rest}
        print(f"{size:<4d} {whole:5.1f}  {linears:7.1f}  {lm_head:7.1f}  {attention:9.1f}  {rest:5.1f}  "
              f"{rest / whole:10.0%}")
    result = {"split_ms": table, "environment": environment, "args": vars(args)}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
