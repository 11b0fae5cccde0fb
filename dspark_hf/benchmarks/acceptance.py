"""Draft quality on real prompts: mean accepted length tau and per-position acceptance.

Runs ``target.generate(..., assistant_model=draft)`` with the full block verified (scheduler off,
as in the paper's Table 1) on the evaluation prompts (GSM8K, HumanEval, MT-Bench first turns, with
the chat template when the tokenizer has one, else as plain text) and aggregates the per-round
statistics of every generation.

The command line is :mod:`dspark_hf.benchmarks.evaluate_cli` (``dspark-hf evaluate``);
``python -m dspark_hf.benchmarks.evaluation`` runs it too. Both import this library, which imports neither.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..chat_text import encode_prompt, trim_after_eos
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.policies import FixedLengthPolicy
from .prompt_sets import DATASETS
from .summary import merge_stats


def left_padded(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of prompts padded on the left to one length."""
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


@torch.no_grad()
def measure_acceptance(target, tokenizer, draft: DSparkDraftModel, prompts: list[str], *, do_sample: bool,
                       max_new_tokens: int = 256, seed: int = 0, desc: str = "", batch_size: int = 1) -> dict:
    """tau, verify efficiency and per-position conditional acceptance over ``prompts``, full block verified.

    ``batch_size`` > 1 generates that many prompts at once (left-padded; each row stops at its own
    EOS, as alone). Every row's rounds are its own, so the statistics measure the same thing; greedy
    rows agree with batch 1 up to float32 rounding in batched matrix products, and sampled rows draw
    from other random streams than batch 1's per-prompt seeds.
    """
    full_block = FixedLengthPolicy(draft.config.block_size)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collected, tokens, start = [], 0, time.perf_counter()
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for i, batch in enumerate(tqdm(batches, desc=desc or "prompts", leave=False)):
        ids, attention_mask = left_padded([encode_prompt(tokenizer, prompt) for prompt in batch], pad_token_id)
        torch.manual_seed(seed + i)
        out = target.generate(ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=do_sample, temperature=1.0, top_k=None, top_p=None,
                              pad_token_id=pad_token_id, assistant_model=draft, dspark_verify_policy=full_block)
        new = out[:, ids.shape[1]:]
        # a finished row is padded after its EOS; its new tokens end at the first EOS
        eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        tokens += sum(len(trim_after_eos(row.tolist(), eos_ids)) for row in new)
        collected.append(draft.last_generation_stats)
    stats = merge_stats(collected)
    return {
        "tau": stats.mean_accepted_length,
        "verify_efficiency": stats.verify_efficiency,
        "per_position_acceptance": stats.per_position_acceptance(),
        "rounds": stats.num_rounds,
        "new_tokens": tokens,
        "seconds": time.perf_counter() - start,
    }


def tau_table(result_files: list[str | Path], first: str = "smollm2-135m-dspark",
              second: str = "smollm2-135m-dflash") -> str:
    """Markdown table comparing two drafts' tau and per-position acceptance from result JSON files."""
    results = {}
    for path in result_files:
        results.update(json.loads(Path(path).read_text())["results"])

    def positions(values):
        return "[" + ", ".join("–" if v is None else f"{v:.2f}" for v in values) + "]"

    lines = ["| dataset | mode | DSpark τ | DFlash τ | ratio | DSpark per-position acceptance | "
             "DFlash per-position acceptance |", "|---|---|---:|---:|---:|---|---|"]
    for mode in ("greedy", "sample"):
        for dataset in DATASETS:
            a, b = results.get(f"{first}/{dataset}/{mode}"), results.get(f"{second}/{dataset}/{mode}")
            if a is None or b is None:
                continue
            lines.append(f"| {dataset} | {mode} | {a['tau']:.2f} | {b['tau']:.2f} | {a['tau'] / b['tau']:.3f} | "
                         f"{positions(a['per_position_acceptance'])} | {positions(b['per_position_acceptance'])} |")
    return "\n".join(lines) + "\n"


__all__ = ["left_padded", "measure_acceptance", "tau_table"]

