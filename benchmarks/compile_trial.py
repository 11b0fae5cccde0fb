"""The ``torch.compile`` trial: a compiled one-token step over a fixed-stride cache against the prepared step.

    python benchmarks/compile_trial.py --out results/compile_trial_zen4.json

gpt-fast's recipe on CPU: the stock SmolLM2 (float32) with a ``transformers.StaticCache`` (one fixed-stride
buffer per layer), its forward compiled once for a one-token input (``dynamic=False``: one signature,
positions passed as tensors), stepped over a 256-token context; beside it the same model prepared with
``optimize_for_cpu`` stepping on its own cache, and the stock model uncompiled on a static cache. Each
step appends one token; the three are timed interleaved, round by round, and their first steps' logits
compared. The compile time is printed apart.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache, StaticCache

from dspark_hf import optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.demo_target import load_smollm2


def _static_stepper(model, context: torch.Tensor, forward, steps: int):
    cache = StaticCache(config=model.config, max_cache_len=context.shape[1] + steps)
    model(context, cache=cache, use_cache=True)
    token = torch.tensor([[11]])

    def step():  # each step appends one token, as decoding does
        return forward(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return step


def _dynamic_stepper(model, context: torch.Tensor):
    cache = DynamicCache(config=model.config)
    model(context, cache=cache, use_cache=True)
    token = torch.tensor([[11]])

    def step():
        return model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    stock, _ = load_smollm2()
    prepared = optimize_for_cpu(copy.deepcopy(stock))
    context = torch.randint(0, stock.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        start = time.perf_counter()
        compiled_forward = torch.compile(stock.forward, dynamic=False, fullgraph=False)
        steps = args.repeats + 4
        steppers = {"compiled static": _static_stepper(stock, context, compiled_forward, steps)}
        first = steppers["compiled static"]()  # compiles
        compile_seconds = time.perf_counter() - start
        steppers["stock static"] = _static_stepper(stock, context, stock.forward, steps)
        steppers["prepared"] = _dynamic_stepper(prepared, context)
        logits = {name: step() for name, step in steppers.items()}
        logits["compiled static"] = first  # the first step of each is at the same position
        gap = {name: float((value - logits["stock static"]).abs().max()) for name, value in logits.items()}
        times = {name: [] for name in steppers}
        for round_index in range(args.repeats):
            names = list(steppers) if round_index % 2 == 0 else list(steppers)[::-1]
            for name in names:
                begin = time.perf_counter()
                steppers[name]()
                times[name].append(time.perf_counter() - begin)
    medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    env = capture_environment()
    print(f"CPU: {env.get('cpu_model')}; compile {compile_seconds:.1f} s; max |logit gap| vs stock: "
          + ", ".join(f"{name} {value:.2e}" for name, value in gap.items()))
    for name, value in medians.items():
        print(f"{name:16s} {value:6.1f} ms/step  ({value / medians['prepared']:.2f}x the prepared step)")
    result = {"environment": env, "compile_seconds": compile_seconds, "ms_per_step": medians, "logit_gap": gap}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
