"""The batch-size sweep of ``dspark-hf bench --batch-sizes``: batched DSpark against transformers'
batched generation and against DSpark one request at a time."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..chat_text import trim_after_eos
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.shared_cost import shared_cost_model
from .evaluation import left_padded


@torch.no_grad()
def run_batch_sweep(
    target: PreTrainedModel,
    draft: DSparkDraftModel,
    prompts: list[list[int]],
    batch_sizes: list[int],
    *,
    max_new_tokens: int = 64,
    pad_token_id: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Greedy tokens/s at each batch size R for: transformers' batched generation without
    speculation, batched DSpark (default policy: the scheduler on the live cost model, for up to
    R * (gamma + 1) tokens), and DSpark at R = 1 over the same R prompts one after another. The three run
    back to back per R, in a rotating order. Also reports the mean verified length per row and
    round, and whether every DSpark row equals the batched target's row."""
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    # One profile covering the largest batch; the smaller batches' tables are read from it.
    shared_cost_model(target, progress=progress)  # profiled once; larger batches extrapolate and learn live
    results = []
    for turn, size in enumerate(tqdm(batch_sizes, desc="batch sizes", disable=not progress)):
        batch = [prompts[i % len(prompts)] for i in range(size)]
        ids, mask = left_padded(batch, pad_token_id)
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
        # Untimed warm-up: profiles (or loads) the SPS table for this R.
        target.generate(ids[:, -4:], attention_mask=mask[:, -4:], max_new_tokens=2, do_sample=False,
                        pad_token_id=pad_token_id, assistant_model=draft)
        row = {"batch_size": size}
        outputs = {}

        def batched_target():
            return target.generate(ids, attention_mask=mask, **common)

        def batched_dspark():
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, **common)
            stats = draft.last_generation_stats
            row["mean_verified_per_row_round"] = stats.verified_tokens / max(stats.num_rounds, 1)
            row["tau_per_row"] = stats.mean_accepted_length
            return out

        def dspark_one_at_a_time():
            rows = []
            for p in batch:
                single = torch.tensor([p])
                out = target.generate(single, attention_mask=torch.ones_like(single), assistant_model=draft,
                                      **common)
                rows.append(out[0, len(p):].tolist())
            return rows

        runs = [("target_batched", batched_target), ("dspark_batched", batched_dspark),
                ("dspark_r1", dspark_one_at_a_time)]
        for name, run in runs[turn % 3:] + runs[: turn % 3]:
            start = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - start
            token_rows = out if name == "dspark_r1" else out[:, ids.shape[1]:].tolist()
            generated = [trim_after_eos(r, eos_ids) for r in token_rows]
            outputs[name] = generated
            row[f"{name}_tokens_per_s"] = sum(len(g) for g in generated) / seconds
        row["speedup_vs_batched_target"] = row["dspark_batched_tokens_per_s"] / row["target_batched_tokens_per_s"]
        row["speedup_vs_dspark_r1"] = row["dspark_batched_tokens_per_s"] / row["dspark_r1_tokens_per_s"]
        row["identical_to_target"] = outputs["dspark_batched"] == outputs["target_batched"]
        results.append(row)
    return results


__all__ = ["run_batch_sweep"]
