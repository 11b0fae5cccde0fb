"""The row-block kernel on all of SmolLM2-135M's linear layers, per number of input rows.

    python benchmarks/row_block_rows.py                       # float32, the kernel as it is
    python benchmarks/row_block_rows.py --dtype bfloat16
    git show 0d2978d:dspark_hf/kernels/csrc/cpu_row_block_linear.cpp > /tmp/old.cpp
    python benchmarks/row_block_rows.py --baseline-source /tmp/old.cpp   # an older kernel beside it
    mkdir /tmp/old && git archive REV dspark_hf/kernels/csrc | tar -x -C /tmp/old --strip-components 3
    python benchmarks/row_block_rows.py --baseline-source /tmp/old        # a multi-file (later) version
    python benchmarks/row_block_rows.py --baseline-source /tmp/old.cpp --whole-step --rows 1 4 8
    python benchmarks/row_block_rows.py --compare-isa avx2    # the kernel's AVX2 path beside its widest

One pass runs every linear of a SmolLM2 decode step (30 layers x 7 projections and the LM head;
random weights of the real shapes, 540 MB in fp32) once on ``rows`` input rows, so weights stream
from memory as in a step. This isolates the linears from the rest of the step
(``benchmarks/verify_cost.py`` times whole forwards). ``--baseline-source`` builds another version
of the kernel's C++ source (one file, as until the CPU extension had several, or a folder holding the
extension's sources) under a separate name and times it interleaved with the current one,
round by round (medians), so kernel changes compare on the same machine moment.

``--whole-step`` times instead whole forwards of the real SmolLM2 prepared by ``optimize_for_cpu``
(``rows`` new tokens on a cached 256-token context), one copy per kernel, and checks that both give
the same logits. Kernels up to 0d2978d stored bfloat16 blocks in plain column order
(``--baseline-layout plain``, the default); later ones interleave them (``--baseline-layout current``).
A baseline with instruction-set paths (it has ``isa()``) gets the layout of the path it runs.

``--compare-isa`` times the current kernel a second time restricted to another of its instruction-set
paths (``avx2``, ``avx512``; the kernel otherwise uses the widest the CPU offers), each variant with
the weight layout its path reads. Inputs are in the weights' dtype, as in a model.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.utils import cpp_extension
from transformers import DynamicCache

from dspark_hf import optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment, describe_environment
from dspark_hf.demo_target import load_smollm2
from dspark_hf.kernels import cpu_extension, cpu_row_block

SMOLLM2_LINEARS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [
    (49152, 576)]


_PACK_CURRENT = cpu_row_block.pack_row_blocks  # the original, also while --whole-step patches the module's name


def pack_plain(weight: torch.Tensor) -> torch.Tensor:
    """``pack_row_blocks`` with every dtype's columns in plain order (kernels up to 0d2978d)."""
    packed = cpu_row_block._pack_for_isa(weight, "avx2")
    if weight.dtype != torch.bfloat16:
        return packed
    return packed[..., cpu_row_block._BFLOAT16_COLUMN_ORDER.argsort()].contiguous()


def _select(isas: dict, name: str) -> None:
    """Switches the current kernel to the variant's instruction-set path (variants of other kernels have none)."""
    if isas[name] is not None:
        cpu_row_block._state["module"].set_isa(isas[name])


def _linears_pass(kernels: dict, packers: dict, isas: dict, dtype: torch.dtype, rows_list: list[int], rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=generator).to(dtype), n, k) for n, k in SMOLLM2_LINEARS]
    packed = {name: [(packers[name](w), n, k) for w, n, k in weights] for name in kernels}
    del weights
    inputs = {rows: {k: torch.randn(rows, k, generator=generator).to(dtype) for k in (576, 1536)} for rows in rows_list}
    seconds: dict[tuple[str, int], list[float]] = {(name, rows): [] for name in kernels for rows in rows_list}
    names = list(kernels)
    for round_index in range(rounds):
        for rows in rows_list:
            for name in names if round_index % 2 == 0 else names[::-1]:
                linear, x = kernels[name], inputs[rows]
                _select(isas, name)
                start = time.perf_counter()
                for weight, out_features, in_features in packed[name]:
                    linear(x[in_features], weight, out_features, None)
                seconds[(name, rows)].append(time.perf_counter() - start)
    return seconds


def _whole_steps(modules: dict, packers: dict, isas: dict, dtype: torch.dtype, rows_list: list[int], rounds: int) -> dict:
    stock, _ = load_smollm2(dtype)
    models = {}
    for name, module in modules.items():
        with mock.patch.dict(cpu_row_block._state, module=module), \
                mock.patch.object(cpu_row_block, "pack_row_blocks", packers[name]):
            _select(isas, name)
            model = optimize_for_cpu(copy.deepcopy(stock))
            with torch.inference_mode():
                model(input_ids=torch.tensor([[1, 2, 3]]))  # packs every layer with this kernel's layout
        models[name] = model
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, stock.config.vocab_size, (1, 256), generator=generator)
    new_ids = torch.randint(0, stock.config.vocab_size, (1, max(rows_list)), generator=generator)
    caches, logits = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            _select(isas, name)
            caches[name] = DynamicCache(config=model.config)
            model(input_ids=context, cache=caches[name])
            logits[name] = model(input_ids=new_ids, cache=caches[name]).logits
            caches[name].crop(-new_ids.shape[1])
        first = next(iter(logits.values()))
        print("logits equal across kernels:", all(torch.equal(first, other) for other in logits.values()))
        seconds = {(name, rows): [] for name in models for rows in rows_list}
        names = list(models)
        for round_index in range(rounds + 1):  # the first round warms up
            for rows in rows_list:
                for name in names if round_index % 2 == 0 else names[::-1]:
                    _select(isas, name)
                    start = time.perf_counter()
                    models[name](input_ids=new_ids[:, :rows], cache=caches[name], logits_to_keep=rows)
                    elapsed = time.perf_counter() - start
                    caches[name].crop(-rows)
                    if round_index:
                        seconds[(name, rows)].append(elapsed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 7, 8, 12, 16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--baseline-source", help="another cpu_row_block_linear.cpp, or folder of the CPU "
                        "extension's sources, to time beside the current one")
    parser.add_argument("--baseline-layout", choices=("plain", "current"), default="plain",
                        help="how the baseline kernel stores bfloat16 blocks (see above)")
    parser.add_argument("--compare-isa", choices=cpu_row_block.ISAS[:-1],
                        help="also time the current kernel restricted to this instruction-set path")
    parser.add_argument("--whole-step", action="store_true", help="time prepared SmolLM2 forwards instead")
    args = parser.parse_args()

    try:
        cpu_row_block.load_kernel()
    except RuntimeError as error:  # names why (no AVX2, no compiler or ninja, a failed probe)
        raise SystemExit(str(error)) from error
    current = cpu_row_block._state["module"]
    modules = {"current": current}
    packers = {"current": _PACK_CURRENT}
    isas = {"current": current.isa()}
    if args.compare_isa:
        name = f"current {args.compare_isa}"
        modules = {name: current, **modules}
        packers[name] = functools.partial(cpu_row_block._pack_for_isa, isa=args.compare_isa)
        isas[name] = args.compare_isa
    if args.baseline_source:
        build_dir = Path(tempfile.mkdtemp(prefix="row_block_baseline_"))
        if Path(args.baseline_source).is_dir():
            module = cpu_extension.build_extension(Path(args.baseline_source), "dspark_hf_cpu_kernels_baseline", build_dir)
        else:
            module = cpp_extension.load(name="dspark_hf_row_block_baseline", sources=[args.baseline_source],
                                        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                        build_directory=str(build_dir))
        modules = {"baseline": module, **modules}
        if hasattr(module, "isa"):  # a kernel with instruction-set paths: the layout of the path it runs
            packers["baseline"] = functools.partial(cpu_row_block._pack_for_isa, isa=module.isa())
        else:
            packers["baseline"] = pack_plain if args.baseline_layout == "plain" else functools.partial(
                cpu_row_block._pack_for_isa, isa="avx2")
        isas["baseline"] = None

    dtype = getattr(torch, args.dtype)
    if args.whole_step:
        seconds = _whole_steps(modules, packers, isas, dtype, args.rows, args.rounds)
    else:
        kernels = {name: module.row_block_linear for name, module in modules.items()}
        seconds = _linears_pass(kernels, packers, isas, dtype, args.rows, args.rounds)
    current.set_isa(isas["current"])

    print(describe_environment(capture_environment()))
    flops_per_row = 2 * sum(n * k for n, k in SMOLLM2_LINEARS)
    what = "prepared SmolLM2 forwards, 256-token context" if args.whole_step else "SmolLM2 linears"
    print(f"{what}, {args.dtype}, {args.rounds} interleaved rounds (medians); ms, linear GFLOP/s, T(rows)/T(1)")
    for rows in args.rows:
        cells = []
        for name in modules:
            median = statistics.median(seconds[(name, rows)])
            first = statistics.median(seconds[(name, args.rows[0])])
            cells.append(f"{name} {median * 1e3:6.1f} ms {flops_per_row * rows / median / 1e9:6.1f} GF/s "
                         f"{median / first:4.2f}")
        print(f"rows {rows:2d}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
