"""Single-op costs behind choices in the decoding path, on SmolLM2's shapes (micro-benchmarks).

    python benchmarks/op_costs.py

* scattering a 16,384-wide draft-vocabulary row into a 49,152-wide one: ``index_copy_`` against
  ``scatter_`` (``draft_vocab.scatter_to_vocab``), and the argmax over each width (the greedy serial
  loop draws over the narrow one);
* ``F.rms_norm`` at 1 and 8 rows of 576 against one elementwise add (the lean forward's norm);
* one layer's attention (9 query heads over 3 key/value heads, head dim 64, 256 cached tokens):
  one token without a mask, and 8 tokens with the boolean causal mask, with the same mask made
  additive, and without a mask;
* where the CPU extension builds: the lean decoder's compiled RMSNorm (8 rows of 576, fp32 and bf16)
  against transformers' ``LlamaRMSNorm`` and torch's ``rms_norm``, and its compiled rotation of one
  layer's queries and keys (8 tokens) against the rolled rotation's PyTorch ops.

fp32 unless named, medians of interleaved rounds of call loops; µs per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
import dspark_cpu.extension as cpu_extension
from dspark_cpu.decoder import rms_norm_kernel_lanes


def _cases() -> dict:
    generator = torch.Generator().manual_seed(0)
    vocab, narrow = 49_152, 16_384
    ids = torch.randperm(vocab, generator=generator)[:narrow].sort().values
    row = torch.randn(1, narrow, generator=generator)
    wide = torch.full((1, vocab), float("-inf")).index_copy_(-1, ids, row)
    expanded = ids.expand(row.shape)
    one, eight = torch.randn(1, 1, 576, generator=generator), torch.randn(1, 8, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    query1, query8 = torch.randn(1, 9, 1, 64, generator=generator), torch.randn(1, 9, 8, 64, generator=generator)
    key1, value1 = (torch.randn(1, 3, 257, 64, generator=generator) for _ in range(2))
    key8, value8 = (torch.randn(1, 3, 264, 64, generator=generator) for _ in range(2))
    mask = torch.ones(8, 264, dtype=torch.bool).tril(diagonal=256)[None, None]
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    sdpa = F.scaled_dot_product_attention
    return {
        "scatter row: index_copy_": lambda: torch.full((1, vocab), float("-inf")).index_copy_(-1, ids, row),
        "scatter row: scatter_": lambda: torch.full((1, vocab), float("-inf")).scatter_(-1, expanded, row),
        "argmax over 49,152": lambda: wide.argmax(-1),
        "argmax over 16,384": lambda: row.argmax(-1),
        "rms_norm, 1 row": lambda: F.rms_norm(one, (576,), weight, 1e-5),
        "rms_norm, 8 rows": lambda: F.rms_norm(eight, (576,), weight, 1e-5),
        "add, 1 row": lambda: one + one,
        "attention, 1 token, no mask": lambda: sdpa(query1, key1, value1, enable_gqa=True),
        "attention, 8 tokens, bool mask": lambda: sdpa(query8, key8, value8, attn_mask=mask, enable_gqa=True),
        "attention, 8 tokens, additive mask": lambda: sdpa(query8, key8, value8, attn_mask=additive, enable_gqa=True),
        "attention, 8 tokens, no mask": lambda: sdpa(query8, key8, value8, enable_gqa=True),
        **_kernel_cases(generator),
    }


def _kernel_cases(generator) -> dict:
    kernels = cpu_extension.load_extension()
    if kernels is None:
        return {}
    lanes = rms_norm_kernel_lanes(LlamaRMSNorm(576))
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
        rows = torch.randn(1, 8, 576, generator=generator).to(dtype)
        cases[f"RMSNorm {name}, 8 rows: transformers"] = lambda norm=norm, rows=rows: norm(rows)
        if dtype == torch.float32:
            cases["RMSNorm float32, 8 rows: torch rms_norm"] = lambda norm=norm, rows=rows: F.rms_norm(
                rows, (576,), norm.weight, 1e-5)
        if lanes:
            cases[f"RMSNorm {name}, 8 rows: kernel"] = lambda norm=norm, rows=rows: kernels.rms_norm(
                rows, norm.weight, 1e-5, lanes)
        query = torch.randn(1, 8, 9, 64, generator=generator).to(dtype).transpose(1, 2)
        key = torch.randn(1, 8, 3, 64, generator=generator).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(1, 8, 64, generator=generator).to(dtype) for _ in range(2))
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        cases[f"rotation {name}, 8 tokens: PyTorch ops"] = lambda q=query, k=key, c=c, s=s: (
            q * c + q.roll(32, -1) * s, k * c + k.roll(32, -1) * s)
        cases[f"rotation {name}, 8 tokens: kernel"] = lambda q=query, k=key, c=cos, s=sin: kernels.rotary_embedding(
            q, k, c, s)
    return cases


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="calls per loop")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    cases = _cases()
    names = list(cases)
    times = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:  # warm-up
            for _ in range(20):
                cases[name]()
        for turn in range(args.rounds):
            for name in names if turn % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                for _ in range(args.calls):
                    cases[name]()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    environment = capture_environment()
    print(f"{environment['cpu_model']}, {environment['torch_threads']} threads, fp32 unless named; µs per call")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:42s} {value:8.1f}")
    result = {"us_per_call": medians, "environment": environment, "args": vars(args)}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
