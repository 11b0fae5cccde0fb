"""Prepared SmolLM2 steps with the packed weights on huge pages and on ordinary pages, in one run.

    python benchmarks/huge_pages.py                           # float32, B = 1 and 8
    python benchmarks/huge_pages.py --dtype bfloat16 --sizes 1 2 4 8 16 --out results/huge_pages.json

Two copies of SmolLM2-135M-Instruct prepared by ``optimize_for_cpu``, one with ``huge_pages=True`` (the
default: :mod:`dspark_cpu.huge_pages`) and one with ``huge_pages=False``, each stepping B new
tokens on its own cached 256-token context, interleaved size by size and round by round (in reverse order
every other round). In one process, the copy prepared second ran faster than an identical copy prepared
first (an A/A run of two identical copies: 2-6% on a 2-core Zen 4), so the comparison runs
twice, once with each copy prepared first; the ratio printed last is the geometric mean of the two
orders' ratios of medians, in which that bias cancels. Both copies' logits are checked to be equal.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import time

import torch
from transformers import DynamicCache

from dspark_cpu import optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.demo_target import load_smollm2

_CONTEXT = 256


def _anon_huge_pages_mb() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _time_order(stock, names: tuple[str, str], sizes: list[int], rounds: int) -> tuple[dict, float | None]:
    """Medians per (copy, size) with the copies prepared in the order of ``names``; and AnonHugePages then."""
    models = {name: optimize_for_cpu(copy.deepcopy(stock), huge_pages=name == "huge pages") for name in names}
    huge_mb = _anon_huge_pages_mb()
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, stock.config.vocab_size, (1, _CONTEXT), generator=generator)
    new_ids = torch.randint(0, stock.config.vocab_size, (1, max(sizes)), generator=generator)
    caches, logits = {}, {}
    seconds = {(name, size): [] for name in names for size in sizes}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = DynamicCache(config=model.config)
            model(input_ids=context, cache=caches[name])
            logits[name] = model(input_ids=new_ids, cache=caches[name]).logits
            caches[name].crop(-new_ids.shape[1])
        if not torch.equal(*logits.values()):
            raise SystemExit("the two copies gave different logits: the huge-page copy is not the same weights")
        for round_index in range(rounds + 1):  # the first round warms up
            for size in sizes:
                for name in names if round_index % 2 == 0 else names[::-1]:
                    start = time.perf_counter()
                    models[name](input_ids=new_ids[:, :size], cache=caches[name], logits_to_keep=size)
                    elapsed = time.perf_counter() - start
                    caches[name].crop(-size)
                    if round_index:
                        seconds[(name, size)].append(elapsed)
    del models, caches
    gc.collect()
    return {key: statistics.median(values) for key, values in seconds.items()}, huge_mb


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    stock, _ = load_smollm2(getattr(torch, args.dtype))
    orders = {}
    for names in (("huge pages", "ordinary pages"), ("ordinary pages", "huge pages")):
        medians, huge_mb = _time_order(stock, names, args.sizes, args.rounds)
        orders[f"{names[0]} prepared first"] = {"medians_ms": {f"{n} B={s}": 1e3 * t for (n, s), t in medians.items()},
                                                "anon_huge_pages_mb": huge_mb, "medians": medians}

    environment = capture_environment()
    print(describe_environment(environment))
    print(f"prepared SmolLM2, {args.dtype}, {_CONTEXT}-token context, {args.rounds} interleaved rounds per order; "
          "ms (medians) and huge/ordinary")
    ratios = {}
    for size in args.sizes:
        cells, per_order = [], []
        for order, record in orders.items():
            huge, ordinary = record["medians"][("huge pages", size)], record["medians"][("ordinary pages", size)]
            per_order.append(huge / ordinary)
            cells.append(f"{order}: {1e3 * huge:5.1f} vs {1e3 * ordinary:5.1f} ({huge / ordinary:.3f})")
        ratios[size] = math.sqrt(per_order[0] * per_order[1])
        print(f"B={size:<3d} " + " | ".join(cells) + f" | geometric mean {ratios[size]:.3f}")
    print("AnonHugePages while both copies were loaded (MB):",
          ", ".join(f"{order}: {record['anon_huge_pages_mb']}" for order, record in orders.items()))
    for record in orders.values():
        record.pop("medians")
    result = {"huge_over_ordinary": {str(size): ratio for size, ratio in ratios.items()}, "orders": orders,
              "environment": environment, "args": vars(args)}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
