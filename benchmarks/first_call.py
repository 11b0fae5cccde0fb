"""First call against warm calls, per batch size, on prompts the bench never uses.

    python benchmarks/first_call.py --cache-dir /tmp/bench_cache --processes 3        # no step-rate curves cached
    python benchmarks/first_call.py --cache-dir /tmp/bench_cache --processes 3 --warm # the curves those calls cached

SmolLM2-135M-Instruct and the shipped draft, both prepared with ``optimize_for_cpu``, greedy. Per
batch size R (1 first, as a user's first call would be): on one batch of R held-out prompts the
target's own ``generate``, DSpark's first call with R rows in this process, the same DSpark call
again, and the target again; then ``--batches`` more held-out batches, target and DSpark
interleaved in alternating order. Prompts come from the shipped prompt sets past the ones the bench
and the training data use (math, code and questions mixed), left-padded; EOS is off, so every row
runs ``--max-new-tokens`` in both (batched DSpark drops finished rows, which the target does not).
Printed per R: the first call over the call again (the issue's bound: within 5%), and DSpark's
speed over the target's on the first batch and on the held-out batches (bound: >= 0.98x), outputs
checked identical. The CPU model is printed with the table.

A first call happens once per process, so ``--processes N`` runs the measurement in N processes
one after the other and prints the medians of the first-call ratios and the pooled held-out ratio.
Without ``--warm`` each process starts with no step-rate curve in the cache (``<cache>/sps`` is
removed; the compiled kernels and kernel choices stay, as they are made by ``optimize_for_cpu``,
not inside ``generate``); with it, from the curves the earlier calls cached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before dspark_hf reads it: the cache holding step-rate curves and kernel choices.
_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("--cache-dir", required=True, help="DSPARK_HF_CACHE for this run (a new folder: a fresh cache)")
_parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
_parser.add_argument("--max-new-tokens", type=int, default=64)
_parser.add_argument("--batches", type=int, default=2, help="held-out batches per R after the first")
_parser.add_argument("--draft", default=str(Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"))
_parser.add_argument("--out", default=None, help="write the rows as JSON here")
_parser.add_argument("--processes", type=int, default=1, help="repeat the whole measurement in this many processes")
_parser.add_argument("--warm", action="store_true", help="keep the step-rate curves already cached")

# Held-out: past the prompts `dspark-hf bench` takes from the front of each set.
HELD_OUT_FROM = {"gsm8k": 600, "humaneval": 100, "mt-bench": 40}


def held_out_prompt_ids(tokenizer) -> list[list[int]]:
    """The held-out prompts (past the bench's, :data:`HELD_OUT_FROM`), chat-formatted, the sets interleaved."""
    from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
    from dspark_hf.chat_text import chat_prompt_ids

    pools = [load_eval_prompts(name, start + 200)[start:] for name, start in HELD_OUT_FROM.items()]
    return [chat_prompt_ids(tokenizer, pool[i]) for i in range(200) for pool in pools if i < len(pool)]


def main(argv=None) -> dict:
    args = _parser.parse_args(argv)
    if args.processes > 1:
        return _in_processes(args, sys.argv[1:] if argv is None else list(argv))
    os.environ["DSPARK_HF_CACHE"] = str(Path(args.cache_dir).expanduser())
    if not args.warm:
        shutil.rmtree(Path(args.cache_dir).expanduser() / "sps", ignore_errors=True)
    import torch

    from dspark_hf import DSparkDraftModel, optimize_for_cpu
    from dspark_hf.benchmarks.environment import capture_environment
    from dspark_hf.benchmarks.acceptance import left_padded
    from dspark_hf.benchmarks.measuring import write_json_result
    from dspark_hf.demo_target import load_smollm2

    target, tokenizer = load_smollm2()
    draft = DSparkDraftModel.from_pretrained(args.draft).float().eval()
    optimize_for_cpu(target)
    optimize_for_cpu(draft)
    draft.bind_target(target)  # as the README shows: the reduced head is built here, not in the first call
    prompts = held_out_prompt_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target.generation_config.eos_token_id = None
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    env = capture_environment()
    print(f"CPU: {env.get('cpu_model')}; torch threads {torch.get_num_threads()}; cache {args.cache_dir}")

    def timed(ids, mask, **extra):
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=mask, **common, **extra)
        return time.perf_counter() - start, out.tolist()

    rows, used = [], 0
    print("R   target s  first s  again s  first/again  first-batch x  held-out x  identical")
    for size in args.batch_sizes:
        batches = [prompts[used + i * size: used + (i + 1) * size] for i in range(1 + args.batches)]
        used += size * (1 + args.batches)
        ids, mask = left_padded(batches[0], pad)
        target_a, expected = timed(ids, mask)
        first, got_first = timed(ids, mask, assistant_model=draft)
        again, got_again = timed(ids, mask, assistant_model=draft)
        target_b, _ = timed(ids, mask)
        identical = got_first == expected and got_again == expected
        seconds = {"target": 0.0, "dspark": 0.0}
        drafted = []  # the held-out calls' share of rounds that ran the draft (the gate's verdict)
        for index, batch in enumerate(batches[1:]):
            ids, mask = left_padded(batch, pad)
            outputs = {}
            for name in (("target", "dspark") if index % 2 == 0 else ("dspark", "target")):
                elapsed, outputs[name] = timed(ids, mask, **({"assistant_model": draft} if name == "dspark" else {}))
                seconds[name] += elapsed
                if name == "dspark":
                    drafted.append(draft.last_generation_stats.drafted_fraction)
            identical &= outputs["dspark"] == outputs["target"]
        target_first = (target_a + target_b) / 2
        row = {"batch_size": size, "target_seconds": target_first, "first_call_seconds": first,
               "again_seconds": again, "first_over_again": first / again,
               "first_batch_speedup": target_first / first, "again_speedup": target_first / again,
               "held_out_speedup": seconds["target"] / seconds["dspark"], "held_out_target_seconds": seconds["target"],
               "held_out_dspark_seconds": seconds["dspark"], "held_out_drafted_fraction": drafted,
               "identical": identical}
        rows.append(row)
        print(f"{size:<4}{target_first:<10.2f}{first:<9.2f}{again:<9.2f}{row['first_over_again']:<13.3f}"
              f"{row['first_batch_speedup']:<15.3f}{row['held_out_speedup']:<12.3f}{identical}")
    result = {"environment": env, "settings": vars(args), "rows": rows}
    write_json_result(result, args.out)
    return result


def _in_processes(args, argv: list[str]) -> dict:
    """Runs the measurement in ``args.processes`` processes; prints and returns the medians."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.processes):
            out = Path(folder) / f"run{index}.json"
            command = [sys.executable, __file__, *_without_options(argv, ("--processes", "--out")), "--out", str(out)]
            subprocess.run(command, check=True)
            runs.append(json.loads(out.read_text()))
    rows = []
    print(f"medians over {args.processes} processes ({'warm' if args.warm else 'no'} step-rate curves cached)")
    print("R   first/again  first-batch x  held-out x (pooled)  identical")
    for position, size in enumerate(args.batch_sizes):
        per_run = [run["rows"][position] for run in runs]
        row = {"batch_size": size,
               "first_over_again": statistics.median(r["first_over_again"] for r in per_run),
               "first_batch_speedup": statistics.median(r["first_batch_speedup"] for r in per_run),
               "held_out_speedup": (sum(r["held_out_target_seconds"] for r in per_run)
                                    / sum(r["held_out_dspark_seconds"] for r in per_run)),
               "identical": all(r["identical"] for r in per_run), "runs": per_run}
        rows.append(row)
        print(f"{size:<4}{row['first_over_again']:<13.3f}{row['first_batch_speedup']:<15.3f}"
              f"{row['held_out_speedup']:<21.3f}{row['identical']}")
    result = {"environment": runs[0]["environment"], "settings": vars(args), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` less the options ``names`` and their values."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in names:
            skip = True
        elif not item.startswith(tuple(name + "=" for name in names)):
            kept.append(item)
    return kept


if __name__ == "__main__":
    main()
