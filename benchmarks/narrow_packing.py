"""Float32 weights that a 16-bit dtype holds exactly, packed in float32, bfloat16 or float16, in one run.

    python benchmarks/narrow_packing.py                                  # SmolLM2 fp32 with bfloat16 values
    python benchmarks/narrow_packing.py --sizes 1 2 4 8 12 16 --out results/narrow_packing.json
    DSPARK_HF_ROW_BLOCK_ISA=avx2 python benchmarks/narrow_packing.py      # the kernel's AVX2 path

A float32 model loaded from a checkpoint stored in bfloat16 (most on the Hub) holds only bfloat16 values.
The local SmolLM2 is converted from a GGUF file and holds other values, so its float32 weights are first
rounded to ``--values`` (bfloat16 by default; SmolLM2's bfloat16 values also all fit float16). One model is
prepared by ``optimize_for_cpu`` with ``narrow_weights=False``; every row-block layer then gets one packed copy
per packing (float32, and each 16-bit dtype that holds its weight exactly), each packing's copies in its own
buffer on huge pages where Linux offers them (as ``optimize_for_cpu`` places them). Between timed forwards the
layers' packed copies are swapped (outside the timer): the same model and cache for every packing, so no
preparation-order bias. Each round times a forward of B new tokens on a cached 256-token context per packing,
in reverse order every other round; medians. Before timing, every packing's logits are checked equal to the
float32 packing's, bit for bit.
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
import dspark_cpu.huge_pages as cpu_huge_pages
import dspark_cpu.row_block as cpu_row_block
from dspark_cpu.fast_path import _KERNEL_ATTRIBUTE, _PACKED_ATTRIBUTE, PackedLinear
from dspark_cpu.packed_kernels import ROW_BLOCK


def _packings(model, dtypes: list[torch.dtype]) -> dict[str, list[tuple]]:
    """Per packing name, the packed entries of the model's row-block layers (in ``model.modules()`` order)."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.__dict__[_KERNEL_ATTRIBUTE] == ROW_BLOCK]
    packings = {"float32": [layer.__dict__[_PACKED_ATTRIBUTE] for layer in layers]}
    for dtype in dtypes:
        weights = [layer.weight.detach() for layer in layers]
        if not all(torch.equal(w.to(dtype).float(), w) for w in weights):
            raise SystemExit(f"not every weight holds only {dtype} values; nothing to compare for it")
        packings[str(dtype).removeprefix("torch.")] = [
            (*entry[:4], cpu_row_block.pack_row_blocks(w.to(dtype)), *entry[5:])
            for entry, w in zip(packings["float32"], weights)]
    if cpu_huge_pages.huge_pages_unavailable_reason() is None:
        for entries in packings.values():
            copies = [entry[4] for entry in entries]
            moved = {}
            cpu_huge_pages.copy_to_huge_pages(copies, lambda old, new: moved.__setitem__(id(old), new))
            entries[:] = [(*entry[:4], moved[id(entry[4])], *entry[5:]) for entry in entries]
    return {name: list(zip(layers, entries)) for name, entries in packings.items()}


def _use(packing: list[tuple]) -> None:
    for layer, entry in packing:
        object.__setattr__(layer, _PACKED_ATTRIBUTE, entry)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", choices=["bfloat16", "float16"], default="bfloat16",
                        help="round the float32 weights to this dtype's values first")
    parser.add_argument("--packings", nargs="+", choices=["bfloat16", "float16"], default=["bfloat16", "float16"],
                        help="16-bit packings to time beside float32 (each must hold every weight exactly)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    model, _ = load_smollm2(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(getattr(torch, args.values)))
    optimize_for_cpu(model, narrow_weights=False, huge_pages=False)
    packings = _packings(model, [getattr(torch, name) for name in args.packings])
    names = list(packings)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (1, args.context), generator=generator)
    new_ids = torch.randint(0, model.config.vocab_size, (1, max(args.sizes)), generator=generator)
    cache = DynamicCache(config=model.config)
    samples = {name: {size: [] for size in args.sizes} for name in names}
    with torch.inference_mode():
        model(input_ids=context, cache=cache)
        reference = None
        for name in names:
            _use(packings[name])
            logits = model(input_ids=new_ids, cache=cache).logits
            cache.crop(-new_ids.shape[1])
            if reference is None:
                reference = logits
            elif not torch.equal(logits.view(torch.int32), reference.view(torch.int32)):
                raise SystemExit(f"the {name} packing gives other logits than the float32 packing")
        for round_index in range(args.repeats + 1):  # round 0 warms up
            for size in args.sizes:
                for name in names if round_index % 2 == 0 else names[::-1]:
                    _use(packings[name])
                    start = time.perf_counter()
                    model(input_ids=new_ids[:, :size], cache=cache, logits_to_keep=size)
                    elapsed = time.perf_counter() - start
                    cache.crop(-size)
                    if round_index:
                        samples[name][size].append(elapsed)
    _use(packings["float32"])

    environment = capture_environment()
    medians = {name: {size: statistics.median(v) for size, v in per.items()} for name, per in samples.items()}
    print(f"{environment['cpu_model']}, row-block path {cpu_row_block.kernel_isa()}, float32 model holding "
          f"{args.values} values, context {args.context}, {environment['torch_threads']} threads, {args.repeats} "
          "rounds; logits equal bit for bit")
    print("B    " + "  ".join(f"{name:>9} ms" for name in names) + "  " + "  ".join(f"{n}/float32" for n in names[1:]))
    for size in args.sizes:
        base = medians["float32"][size]
        print(f"{size:<4} " + "  ".join(f"{1e3 * medians[name][size]:12.1f}" for name in names) + "  "
              + "  ".join(f"{medians[name][size] / base:{len(name) + 8}.3f}" for name in names[1:]))
    result = {"environment": environment, "isa": cpu_row_block.kernel_isa(), "values": args.values,
              "context": args.context, "median_seconds": medians, "args": vars(args)}
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
