"""How close one-row linear kernels come to this CPU's memory bandwidth, on SmolLM2's weight shapes.

    python benchmarks/gemv_bandwidth.py                 # float32, 1 and 8 rows
    python benchmarks/gemv_bandwidth.py --dtype bfloat16 --rows 1

A decode step of a small model at one token reads every weight once from memory, so its linear
layers can at best run at the memory bandwidth. For each of SmolLM2-135M's weight shapes this times,
with weights read from memory as a step reads them (each timing batch cycles through copies of the
weight totalling ``--megabytes``, past the last-level cache): a plain reduction over the weight
(``w.sum()``, a bandwidth reference), ``F.linear`` (MKL) and the packed oneDNN kernel exactly as
``optimize_for_cpu`` runs it (its own packing and call; for bf16 on a CPU without oneDNN bf16
kernels, the float32 copy). Each time is the fastest of five batches, as the fast path's crossover
probe takes it. Prints microseconds and GB/s per call (GB/s of the weight's own bytes).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.kernels.cpu_packed_kernels import _best_seconds, _pack, _run_packed

# (out_features, in_features): attention q/o, k/v, MLP gate/up, MLP down, LM head.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))


def cold_seconds(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Seconds per call of ``fn(weight, x)``, cycling through ``weights`` (read from memory)."""
    for weight in weights[:2]:
        fn(weight, x)
    return _best_seconds([functools.partial(fn, weight, x) for weight in weights])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--megabytes", type=int, default=256, help="weight copies cycled per timing batch")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(describe_environment(capture_environment()), f"{args.dtype}, {torch.get_num_threads()} threads.")
    print("| shape | rows | sum µs (GB/s) | F.linear µs (GB/s) | packed µs (GB/s) |")
    print("|---|---:|---:|---:|---:|")
    for out_features, in_features in SHAPES:
        nbytes = out_features * in_features * torch.finfo(dtype).bits // 8
        copies = max(2, min(100, (args.megabytes << 20) // nbytes))
        weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
        packed = [_pack(w) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, in_features).to(dtype)
            timings = (cold_seconds(lambda w, x: w.sum(), weights, x),
                       cold_seconds(lambda w, x: F.linear(x, w), weights, x),
                       cold_seconds(lambda p, x: _run_packed(x, p, None), packed, x))
            cells = " | ".join(f"{t * 1e6:.0f} ({nbytes / t / 1e9:.1f})" for t in timings)
            print(f"| {out_features}x{in_features} | {rows} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
