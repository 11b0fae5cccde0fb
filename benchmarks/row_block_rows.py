"""The row-block kernel on all of SmolLM2-135M's linear layers, per number of input rows.

    python benchmarks/row_block_rows.py                       # float32, the kernel as it is
    python benchmarks/row_block_rows.py --dtype bfloat16
    git show 839aef1:dspark_hf/kernels/csrc/cpu_row_block_linear.cpp > /tmp/old.cpp
    python benchmarks/row_block_rows.py --baseline-source /tmp/old.cpp   # an older kernel beside it

One pass runs every linear of a SmolLM2 decode step (30 layers x 7 projections and the LM head;
random weights of the real shapes, 540 MB in fp32) once on ``rows`` input rows, so weights stream
from memory as in a step. This isolates the linears from the rest of the step
(``benchmarks/verify_cost.py`` times whole forwards). ``--baseline-source`` builds another version
of the kernel's C++ source under a separate name and times it interleaved with the current one,
round by round (medians), so kernel changes compare on the same machine moment.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch.utils import cpp_extension

from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.kernels import cpu_row_block

SMOLLM2_LINEARS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [
    (49152, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 7, 8, 12, 16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--baseline-source", help="another cpu_row_block_linear.cpp to time beside the current one")
    args = parser.parse_args()

    try:
        cpu_row_block.load_kernel()
    except RuntimeError as error:  # names why (no AVX2, no compiler or ninja, a failed probe)
        raise SystemExit(str(error)) from error
    kernels = {"current": cpu_row_block.row_block_linear}
    if args.baseline_source:
        module = cpp_extension.load(name="dspark_hf_row_block_baseline", sources=[args.baseline_source],
                                    extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                    build_directory=tempfile.mkdtemp(prefix="row_block_baseline_"))
        kernels = {"baseline": module.row_block_linear, **kernels}

    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    weights = [(cpu_row_block.pack_row_blocks(torch.randn(n, k, generator=generator).to(dtype)), n, k)
               for n, k in SMOLLM2_LINEARS]
    inputs = {rows: {k: torch.randn(rows, k, generator=generator) for k in (576, 1536)} for rows in args.rows}
    seconds: dict[tuple[str, int], list[float]] = {(name, rows): [] for name in kernels for rows in args.rows}
    names = list(kernels)
    for round_index in range(args.rounds):
        for rows in args.rows:
            for name in names if round_index % 2 == 0 else names[::-1]:
                linear, x = kernels[name], inputs[rows]
                start = time.perf_counter()
                for packed, out_features, in_features in weights:
                    linear(x[in_features], packed, out_features, None)
                seconds[(name, rows)].append(time.perf_counter() - start)

    print(describe_environment(capture_environment()))
    flops_per_row = 2 * sum(n * k for n, k in SMOLLM2_LINEARS)
    print(f"SmolLM2 linears, {args.dtype}, {args.rounds} interleaved rounds (medians); ms, GFLOP/s, T(rows)/T(1)")
    for rows in args.rows:
        cells = []
        for name in names:
            median = statistics.median(seconds[(name, rows)])
            first = statistics.median(seconds[(name, args.rows[0])])
            cells.append(f"{name} {median * 1e3:6.1f} ms {flops_per_row * rows / median / 1e9:6.1f} GF/s "
                         f"{median / first:4.2f}")
        print(f"rows {rows:2d}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
