"""``dspark-hf evaluate``: tau and per-position acceptance of drafts on the shipped prompt sets.

Runs ``target.generate(..., assistant_model=draft)`` with the full block verified (scheduler off,
as in the paper's Table 1) on the evaluation prompts (GSM8K, HumanEval, MT-Bench first turns, with
the target's chat template, or as plain text for a tokenizer without one) and writes the
aggregated per-round statistics of every draft, set and mode
(:func:`~dspark_hf.benchmarks.acceptance.measure_acceptance`) to ``--out``; ``--table FILES``
prints the markdown table of two drafts' results instead.

    dspark-hf evaluate --drafts drafts/smollm2-135m-dspark drafts/smollm2-135m-dflash \
        --num-prompts 20 --max-new-tokens 256 --out results/tau.json
    dspark-hf evaluate --table results/tau_dspark.json results/tau_dflash.json

(``python -m dspark_hf.benchmarks.evaluate_cli`` and ``python -m dspark_hf.benchmarks.evaluation``
are the same command.) ``--target`` is what ``dspark-hf train --target`` takes: a preset (default
``smollm2``: SmolLM2-135M-Instruct, :mod:`dspark_hf.demo_target`), a local folder or a Hub id.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..model.modeling_dspark import DSparkDraftModel
from .environment import capture_environment
from .acceptance import measure_acceptance, tau_table
from .prompt_sets import DATASETS, load_eval_prompts


def main(argv: list[str] | None = None) -> None:
    """CLI: measure tau per draft, set and mode into ``--out``, or print ``--table`` of result files."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--table"]:  # dspark-hf evaluate --table results/tau_*.json
        print(tau_table(argv[1:]), end="")
        return
    from ..training.target_loading import resolve_target  # imported here: `--table` loads no model code

    parser = argparse.ArgumentParser(prog="dspark-hf evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafts", nargs="+", required=True)
    parser.add_argument("--target", default="smollm2",
                        help="the drafts' target: a preset (smollm2), a local folder or a Hub id (default: smollm2)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts generated at once (left-padded); 1 is the protocol of the published tables")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = resolve_target(args.target, dtype=torch.float32)
    target, tokenizer = loaded.model, loaded.tokenizer
    results = {"environment": capture_environment(), "settings": vars(args), "results": {}}
    for draft_path in args.drafts:
        draft = DSparkDraftModel.from_pretrained(draft_path).float().eval()
        for mode in args.modes:  # greedy over every dataset first: partial runs still compare datasets
            for dataset in args.datasets:
                prompts = load_eval_prompts(dataset, args.num_prompts)
                key = f"{Path(draft_path).name}/{dataset}/{mode}"
                results["results"][key] = measure_acceptance(
                    target, tokenizer, draft, prompts, do_sample=mode == "sample",
                    max_new_tokens=args.max_new_tokens, desc=key, batch_size=args.batch_size)
                r = results["results"][key]
                per_position = [round(x, 2) if x is not None else None for x in r["per_position_acceptance"]]
                print(f"{key}: tau={r['tau']:.2f} per-position={per_position}", flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
