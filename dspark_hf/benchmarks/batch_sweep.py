"""The batch-size sweep of ``dspark-hf bench --batch-sizes``: batched DSpark against transformers'
own batched generation, greedy and sampled, with the limit the measured step curve allows.

For each batch size R and mode, at least ``min_prompts`` prompts run as batches of R left-padded
rows (the prompts taken in turn from the shared sets), target and DSpark back to back per batch in
an order that alternates, so the machine's drift hits both alike. The first DSpark call with R rows
and that mode in the process is timed apart from the others (``first_call_*``: the first batch,
against the target's time on the same batch), then the warm calls run. Per R and mode the row gives both
throughputs (every row's tokens up to its EOS, over the wall time), their ratio, whether greedy
outputs are identical, and from DSpark's rounds: tokens per row and round ``tau_batch``, the mean
verified tokens ``sum_r (1 + k_r)`` and padded forward ``R x W`` per round, the draft's time per
round, the share of rounds that drafted, and the cost model's drift at the end. The limit

    limit = tau_batch * T(R) / (T(sum_r (1 + k_r)) + T_draft(R))

evaluates the speed-up those rounds could give with no overhead at all, ``T`` read from the live
cost model of batches of R rows (its curve as the rounds corrected it) and ``T_draft`` measured;
``limit_padded``
puts the padded forward ``T(R x W)`` in place of ``T(sum)``, which is what the batched forward costs.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..chat_text import trim_after_eos
from ..decoding.settings import DEFAULT_LOOKUP_TOKENS
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.shared_cost import cost_model_covering
from .acceptance import left_padded

MODES = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)}


def _round_figures(stats) -> dict:
    """Per-round means over one batched call's :class:`RoundStats` (one per row and round)."""
    rounds = sum(1.0 / r.batch_rows for r in stats.rounds)
    if not rounds:
        return {"rounds": 0.0}
    return {
        "rounds": rounds,
        "row_rounds": len(stats.rounds),
        "produced": stats.accepted_tokens + len(stats.rounds),
        "verified_tokens": sum(1 + r.verified for r in stats.rounds),  # sum over rounds of sum_r (1 + k_r)
        "padded_tokens": sum(r.batch_width for r in stats.rounds),  # sum over rounds of R x W
        "draft_seconds": sum(r.draft_time + r.serial_time for r in stats.rounds),
        "drafted_row_rounds": sum(r.drafted for r in stats.rounds),
    }


def _combine(parts: list[dict]) -> dict:
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


@torch.no_grad()
def run_batch_sweep(
    target: PreTrainedModel,
    draft: DSparkDraftModel,
    prompts: list[list[int]],
    batch_sizes: list[int],
    *,
    max_new_tokens: int = 128,
    min_prompts: int = 8,
    modes: tuple[str, ...] = ("greedy", "sample"),
    pad_token_id: int = 0,
    progress: bool = True,
) -> list[dict]:
    """One row per (R, mode): see the module docstring. Sampled runs draw from seeds fixed per
    batch (the same for target and DSpark; their outputs differ, as their random draws do)."""
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    block = draft.config.block_size
    width = 1 + max(block, DEFAULT_LOOKUP_TOKENS)
    results = []
    jobs = [(size, mode) for size in batch_sizes for mode in modes]
    for turn, (size, mode) in enumerate(tqdm(jobs, desc="batch sweep", disable=not progress)):
        count = max(min_prompts, size)
        count = math.ceil(count / size) * size
        batches = [[prompts[(start + i) % len(prompts)] for i in range(size)] for start in range(0, count, size)]
        seconds = {"target": 0.0, "dspark": 0.0}
        tokens = {"target": 0, "dspark": 0}
        identical, figures = True, []
        first = _first_call(target, draft, batches[0], mode, seed=1000 * turn, max_new_tokens=max_new_tokens,
                            pad_token_id=pad_token_id, eos_ids=eos_ids)
        for index, batch in enumerate(batches):
            ids, mask = left_padded(batch, pad_token_id)
            outputs = {}
            order = ("target", "dspark") if (turn + index) % 2 == 0 else ("dspark", "target")
            for name in order:
                extra = {"assistant_model": draft} if name == "dspark" else {}
                torch.manual_seed(1000 * turn + index)
                start = time.perf_counter()
                out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      pad_token_id=pad_token_id, **MODES[mode], **extra)
                seconds[name] += time.perf_counter() - start
                outputs[name] = [trim_after_eos(row, eos_ids) for row in out[:, ids.shape[1]:].tolist()]
                tokens[name] += sum(len(row) for row in outputs[name])
                if name == "dspark":
                    figures.append(_round_figures(draft.last_generation_stats))
            identical &= outputs["dspark"] == outputs["target"]
        rates = {name: tokens[name] / seconds[name] for name in seconds}
        total = _combine(figures)
        rounds = total.get("rounds") or 1.0
        tau = total.get("produced", 0) / max(total.get("row_rounds", 0), 1)
        mean_verified = total.get("verified_tokens", 0) / rounds
        mean_padded = total.get("padded_tokens", 0) / rounds
        draft_per_round = total.get("draft_seconds", 0.0) / rounds
        # The cost model batches of this size use (the generate calls above built it and taught it).
        cost_model = cost_model_covering(target, size * width, rows=size)
        step_r = cost_model.seconds(size)
        row = {
            "batch_size": size, "mode": mode, "prompts": count, "max_new_tokens": max_new_tokens,
            "target_batched_tokens_per_s": rates["target"], "dspark_batched_tokens_per_s": rates["dspark"],
            "speedup_vs_batched_target": rates["dspark"] / rates["target"],
            "identical_to_target": identical if mode == "greedy" else None,
            "tau_batch": tau, "mean_verified_tokens_per_round": mean_verified,
            "mean_padded_tokens_per_round": mean_padded, "draft_ms_per_round": 1e3 * draft_per_round,
            "drafted_share": total.get("drafted_row_rounds", 0) / max(total.get("row_rounds", 0), 1),
            "limit": tau * step_r / (cost_model.seconds(max(1, round(mean_verified))) + draft_per_round),
            "limit_padded": tau * step_r / (cost_model.seconds(max(1, round(mean_padded))) + draft_per_round),
            "cost_model_drift": cost_model.drift(),
            **first,
        }
        results.append(row)
    return results


def _first_call(target: PreTrainedModel, draft: DSparkDraftModel, batch: list[list[int]], mode: str, *, seed: int,
                max_new_tokens: int, pad_token_id: int, eos_ids: set) -> dict:
    """Times DSpark's first call with this batch size and mode in the process (the cost model of its
    rows, the draft's shapes and the settings are new) and the target alone on the same batch."""
    ids, mask = left_padded(batch, pad_token_id)
    seconds, tokens = {}, {}
    for name in ("dspark", "target"):
        extra = {"assistant_model": draft} if name == "dspark" else {}
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                              **MODES[mode], **extra)
        seconds[name] = time.perf_counter() - start
        tokens[name] = sum(len(trim_after_eos(row, eos_ids)) for row in out[:, ids.shape[1]:].tolist())
    return {"first_call_seconds": seconds["dspark"], "first_call_target_seconds": seconds["target"],
            "first_call_speedup": (tokens["dspark"] / seconds["dspark"]) / (tokens["target"] / seconds["target"])}


__all__ = ["MODES", "run_batch_sweep"]
