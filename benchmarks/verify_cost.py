"""T(B): one target forward of B new tokens on a cached context, stock vs optimize_for_cpu.

    python benchmarks/verify_cost.py                  # SmolLM2-135M-Instruct, 256-token context
    python benchmarks/verify_cost.py --context 1024 --sizes 1 2 4 8 16 --repeats 9
    python benchmarks/verify_cost.py --compile mlp+norms --sizes 1 2 4 8 16   # a third model: compiled parts
    python benchmarks/verify_cost.py --compare-lean --sizes 1 2 4 8 16       # prepared without its lean forward
    python benchmarks/verify_cost.py --compare-onednn --sizes 1 2 4 8 16     # prepared with oneDNN's kernel only
    python benchmarks/verify_cost.py --compare-sdpa --sizes 1 2 4 8 16       # prepared with SDPA's attention
    python benchmarks/verify_cost.py --attention-baseline /tmp/old --sizes 1 8  # another build's attention kernel
    python benchmarks/verify_cost.py --compare-lean-ops --sizes 1 8           # norms and rotation as PyTorch ops
    python benchmarks/verify_cost.py --compare-invariant --sizes 1 2 4 8 16  # prepared with batch_invariant=True
    python benchmarks/verify_cost.py --round-weights bfloat16                # fp32 model of a bf16 checkpoint

Both models run in one process, interleaved size by size and round by round, in reverse order every
other round (the machine's drift hits both alike); medians per size, and the ratios T(B)/T(1) and
stock/prepared are printed, with the float32 multiply-add rate of the moment before and after the rounds
(:func:`~dspark_hf.benchmarks.environment.multiply_add_rate`; on a shared VM the host's load moves it,
and the compute-bound part of a several-token step with it). The prepared model's T(B)/T(1) is also given paired: the ratio of the two
steps within each round (timed a few milliseconds apart, so slow spells of the machine cancel), its
median over rounds and the quartiles, which move less between runs than the ratio of medians.

``--round-weights DTYPE`` first rounds the model's weights to bfloat16 or float16 values (what loading a
checkpoint stored in that dtype in float32 gives; the local SmolLM2, converted from a GGUF file, holds other
values): ``optimize_for_cpu`` then packs them in 16 bits (``benchmarks/narrow_packing.py`` compares packings).

``--attention-baseline DIR`` builds the CPU extension from another version's sources (a folder such as
``git archive REV cpu_engine/dspark_cpu/csrc | tar -x -C DIR --strip-components 3`` makes) and times a
prepared model whose few-query attention runs that build's kernel (its linears stay this version's).

``--compile`` adds a third model, the trial of compiling the step's small ops away: the stock model
with the CPU grouped-query attention and ``torch.compile(..., dynamic=True)`` on each decoder
layer's MLP and/or RMSNorms (stock weights: dynamo cannot trace the packed layers' private oneDNN
op, so compiling on top of ``optimize_for_cpu`` fails). Its compile time is printed.
``--compile whole`` compiles the whole forward instead, with inductor's freezing (weights become
constants and inductor packs them for oneDNN itself): one step at a time on a cache that is only
cropped, as here, it compiles once per step shape; inside ``generate`` it recompiled on every new
cache stride, keyword set and 0/1 size (docs/performance.md), so it stays a trial.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_cpu import optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment, multiply_add_rate
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.demo_target import load_smollm2
import dspark_cpu.attention as cpu_attention
import dspark_cpu.decoder as cpu_decoder
import dspark_cpu.extension as cpu_extension
from dspark_cpu.attention import use_cpu_gqa_attention
from dspark_cpu.decoder import remove_lean_decoder


def _stepper(model, context, new_ids):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=context, cache=cache)

    def step(num_tokens: int) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=new_ids[:, :num_tokens], cache=cache, logits_to_keep=num_tokens)
            elapsed = time.perf_counter() - start
        cache.crop(-num_tokens)
        return elapsed

    return step


def _with_attention_kernel(step, module):
    """``step`` with the few-query attention kernel of ``module`` (an extension build) around each call;
    None switches the kernel off (SDPA attends instead)."""
    def run(num_tokens: int) -> float:
        saved = dict(cpu_attention._few_query_state)
        cpu_attention._few_query_state.update(module=module, problem=None if module else "switched off")
        try:
            return step(num_tokens)
        finally:
            cpu_attention._few_query_state.update(saved)

    return run


def _compiled_copy(stock, parts: str):
    """A copy of ``stock`` with the CPU GQA attention and the named parts of every decoder layer (or its whole forward) compiled."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model = copy.deepcopy(stock)
    use_cpu_gqa_attention(model)
    if parts == "whole":
        model.forward = torch.compile(model.forward, dynamic=True, options={"freezing": True})
        return model
    names = {"mlp": ["mlp"], "norms": ["input_layernorm", "post_attention_layernorm"]}
    for layer in model.model.layers:
        for part in parts.split("+"):
            for name in names[part]:
                setattr(layer, name, torch.compile(getattr(layer, name), dynamic=True))
    return model


def _paired_ratios(per_size: dict[int, list[float]], sizes: list[int]) -> dict[int, dict[str, float]]:
    """T(B)/T(first size) within each round, summarised over rounds by median and quartiles."""
    summary = {}
    for b in sizes[1:]:
        ratios = [t / t1 for t, t1 in zip(per_size[b], per_size[sizes[0]])]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        summary[b] = {"median": statistics.median(ratios), "lower_quartile": quartiles[0],
                      "upper_quartile": quartiles[2]}
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the target's dtype (both models are cast to it before optimize_for_cpu)")
    parser.add_argument("--compile", choices=["none", "mlp", "norms", "mlp+norms", "whole"], default="none",
                        help="also time a copy of the stock model with these parts of each layer compiled")
    parser.add_argument("--compare-lean", action="store_true",
                        help="also time the prepared model without its lean decoder forward (packed weights and "
                             "attention only), to show what the lean forward adds")
    parser.add_argument("--compare-onednn", action="store_true",
                        help="also time the prepared model with oneDNN's packed kernel in every layer (the fast path "
                             "before the row-block kernel), to show what the measured kernel choice adds")
    parser.add_argument("--compare-invariant", action="store_true",
                        help="also time the model prepared with batch_invariant=True (each verified token gets the "
                             "logits of a one-token step, bit for bit), to show what that costs")
    parser.add_argument("--compare-sdpa", action="store_true",
                        help="also time the prepared model with SDPA's attention instead of the few-query kernel, "
                             "to show what the kernel adds")
    parser.add_argument("--compare-lean-ops", action="store_true",
                        help="also time the prepared model with its lean forward's norms and rotation run as PyTorch "
                             "ops instead of the compiled calls, to show what those add")
    parser.add_argument("--round-weights", choices=["bfloat16", "float16"], default=None,
                        help="round the float32 weights to this dtype's values first (a half-precision checkpoint "
                             "loaded in float32)")
    parser.add_argument("--attention-baseline", metavar="DIR",
                        help="also time the prepared model with the few-query attention kernel built from this folder "
                             "of CPU extension sources (another version)")
    parser.add_argument("--out", default=None, help="write the medians as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    stock, _ = load_smollm2()
    stock = stock.to(getattr(torch, args.dtype))
    if args.round_weights:
        with torch.no_grad():
            for parameter in stock.parameters():
                parameter.copy_(parameter.to(getattr(torch, args.round_weights)))
    start = time.perf_counter()
    prepared = optimize_for_cpu(copy.deepcopy(stock))
    pack_seconds = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, stock.config.vocab_size, (1, args.context), generator=generator)
    new_ids = torch.randint(0, stock.config.vocab_size, (1, max(args.sizes)), generator=generator)
    steppers = {"stock": _stepper(stock, context, new_ids), "prepared": _stepper(prepared, context, new_ids)}
    if args.compare_lean:
        packed_only = optimize_for_cpu(copy.deepcopy(stock))
        remove_lean_decoder(packed_only)
        steppers["packed only"] = _stepper(packed_only, context, new_ids)
    if args.compare_onednn:
        steppers["oneDNN only"] = _stepper(optimize_for_cpu(copy.deepcopy(stock), packed_kernel="onednn"), context, new_ids)
    if args.compare_sdpa:
        steppers["SDPA attention"] = _with_attention_kernel(
            _stepper(optimize_for_cpu(copy.deepcopy(stock)), context, new_ids), None)
    if args.attention_baseline:
        baseline = cpu_extension.build_extension(Path(args.attention_baseline), "dspark_hf_cpu_kernels_baseline",
                                                 Path(tempfile.mkdtemp(prefix="attention_baseline_")))
        steppers["baseline attention"] = _with_attention_kernel(
            _stepper(optimize_for_cpu(copy.deepcopy(stock)), context, new_ids), baseline)
    if args.compare_lean_ops:
        lean_ops = optimize_for_cpu(copy.deepcopy(stock))
        plan = lean_ops.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE]
        plan.rotary_kernel, plan.norm_kernel_lanes = False, 0
        steppers["lean ops"] = _stepper(lean_ops, context, new_ids)
    if args.compare_invariant:
        steppers["invariant"] = _stepper(optimize_for_cpu(copy.deepcopy(stock), batch_invariant=True), context, new_ids)
    compile_seconds = None
    if args.compile != "none":
        start = time.perf_counter()
        steppers["compiled"] = _stepper(_compiled_copy(stock, args.compile), context, new_ids)
        for b in args.sizes:  # compiles for the dynamic token count
            steppers["compiled"](b)
        compile_seconds = time.perf_counter() - start
    samples = {name: {b: [] for b in args.sizes} for name in steppers}
    names = list(steppers)
    rates = [multiply_add_rate()]
    for round_index in range(args.repeats + 1):  # round 0 warms up
        for b in args.sizes:
            # Every other round in reverse, so no model is always timed right after the same other one.
            for name in names if round_index % 2 == 0 else names[::-1]:
                elapsed = steppers[name](b)
                if round_index:
                    samples[name][b].append(elapsed)
    rates.append(multiply_add_rate())
    medians = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in samples.items()}
    paired = _paired_ratios(samples["prepared"], args.sizes)
    env = capture_environment()
    print(f"{env.get('cpu_model')}, {args.dtype}, context {args.context} tokens, {torch.get_num_threads()} threads, "
          f"{args.repeats} interleaved rounds; packing took {pack_seconds:.2f} s"
          + (f"; compiling ({args.compile}) and its first steps took {compile_seconds:.1f} s" if compile_seconds else ""))
    print(f"float32 multiply-add rate (cache-resident matmul) before / after the rounds: {rates[0]:.0f} / "
          f"{rates[1]:.0f} GFLOP/s (it moves with the host's load, and T(B)/T(1) with it)")
    print("B    stock ms  prepared ms  stock T(B)/T(1)  prepared T(B)/T(1)  stock/prepared")
    for b in args.sizes:
        s, p = medians["stock"][b], medians["prepared"][b]
        print(f"{b:<4} {1e3 * s:8.1f}  {1e3 * p:11.1f}  {s / medians['stock'][args.sizes[0]]:15.2f}  "
              f"{p / medians['prepared'][args.sizes[0]]:18.2f}  {s / p:14.2f}")
    print("B    prepared T(B)/T(1) paired by round: median [quartiles]")
    for b in args.sizes[1:]:
        print(f"{b:<4} {paired[b]['median']:.3f} [{paired[b]['lower_quartile']:.3f}, {paired[b]['upper_quartile']:.3f}]")
    for name in ("packed only", "oneDNN only", "lean ops", "SDPA attention", "baseline attention", "invariant",
                 "compiled"):
        if name in medians:
            print(f"B    {name} ms  {name} T(B)/T(1)  stock/{name}  {name}/prepared")
            for b in args.sizes:
                c = medians[name][b]
                print(f"{b:<4} {1e3 * c:{len(name) + 3}.1f}  {c / medians[name][args.sizes[0]]:{len(name) + 9}.2f}  "
                      f"{medians['stock'][b] / c:{len(name) + 6}.2f}  {c / medians['prepared'][b]:{len(name) + 9}.2f}")
    result = {"environment": env, "dtype": args.dtype, "context": args.context, "threads": torch.get_num_threads(), "pack_seconds": pack_seconds,
              "compile": args.compile, "compile_seconds": compile_seconds, "median_seconds": medians,
              "prepared_paired_ratios": paired, "multiply_add_gflops_before_after": rates,
              "round_weights": args.round_weights,
              "packed_dtypes": sorted({str(m._packed_weight().dtype) for m in prepared.modules()
                                       if hasattr(m, "_packed_weight") and hasattr(m._packed_weight(), "dtype")})}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
