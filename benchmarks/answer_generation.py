"""What makes the answers stage of `dspark-hf train` fast on a CPU, measured in one run.

    python benchmarks/answer_generation.py --out results/answer_generation_zen4.json

Part 1: one draw from softmax over V = 262,144 (a Gemma 3 vocabulary) for 16 rows, torch.multinomial
against the inverse CDF that `datagen.InverseCdfSampling` uses (cumulative sum and binary search).
Part 2: a random model of Gemma 3 270M's shape (262k vocabulary, 18 layers, hidden 640, sliding
windows; random weights, so only the timings mean anything): one decode step of `generate` at 1 and
16 rows, stock and with `optimize_for_cpu`, the two interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import dspark_hf
from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.decoding.serial_block import draw_categorical


def time_draws(vocab: int, rows: int, repeats: int) -> dict:
    probs = torch.softmax(torch.randn(rows, vocab), -1)
    times = {"multinomial": [], "inverse_cdf": []}
    for _ in range(repeats):
        start = time.perf_counter()
        torch.multinomial(probs, 1)
        times["multinomial"].append(time.perf_counter() - start)
        start = time.perf_counter()
        draw_categorical(probs)
        times["inverse_cdf"].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def gemma_270m_shape() -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


@torch.no_grad()
def step_ms(model, rows: int, prompt_tokens: int, steps: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt_tokens), generator=torch.Generator().manual_seed(1))

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start

    return (run(1 + steps) - run(1)) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = capture_environment()
    print(describe_environment(env))
    draws = time_draws(262144, 16, 10)
    print(f"one draw, 16 rows over 262,144 ids: multinomial {draws['multinomial']:.1f} ms, "
          f"inverse CDF {draws['inverse_cdf']:.1f} ms")
    stock = gemma_270m_shape()
    prepared = gemma_270m_shape()
    dspark_hf.optimize_for_cpu(prepared)
    for model in (stock, prepared):
        step_ms(model, 1, 64, 2)  # warm-up
    results = {}
    for rows in (1, 16):
        runs = {"stock": [], "prepared": []}
        for _ in range(args.repeats):
            for name, model in (("stock", stock), ("prepared", prepared)):
                runs[name].append(step_ms(model, rows, 64, args.steps))
        results[rows] = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{rows:>2} rows: decode step stock {results[rows]['stock']:.0f} ms, prepared "
              f"{results[rows]['prepared']:.0f} ms ({results[rows]['stock'] / results[rows]['prepared']:.2f}x); "
              f"per row prepared {results[rows]['prepared'] / rows:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "settings": vars(args), "draw_ms": draws, "step_ms": results}, f, indent=2)


if __name__ == "__main__":
    main()
